"""Tests of clu_ckpt.migration.orbax_target: listing steps, the private API,
and parsing each `.flax` once per migration."""

import asyncio
import collections
import inspect
import os
import subprocess
import sys
from importlib import metadata

import numpy as np
import orbax.checkpoint as ocp
import pytest
from clu import checkpoint as clu_checkpoint

from clu_ckpt import errors
from clu_ckpt import flax_format
from clu_ckpt import migration
from clu_ckpt.migration import orbax_target


def _state(step, scale=1.0):
  return {"step": np.int64(step),
          "params": {"w": np.arange(6, dtype=np.float32) * scale},
          "opt": {"lr": 0.1, "name": "sgd"}}


def _orbax_find_all(root):
  name_format = ocp.path.step.standard_name_format()
  return sorted(m.step for m in name_format.find_all(root))


# --------------------------------------------------------------------------
# list_steps.
# --------------------------------------------------------------------------


def test_list_steps_equals_orbax_find_all(tmp_path):
  root = tmp_path / "orbax"
  assert orbax_target.list_steps(str(root)) == ([], [])
  with ocp.CheckpointManager(root) as mngr:
    for step in (0, 3, 12):
      mngr.save(step, args=ocp.args.StandardSave({"a": np.ones(2)}))
  # What Orbax does not count: temporary steps, padded and prefixed names.
  (root / "7.orbax-checkpoint-tmp-1234").mkdir()
  (root / "007").mkdir()
  (root / "step_9").mkdir()
  (root / "notes.txt").write_text("x")
  (root / "5").write_text("a file, not a step")
  steps, partial = orbax_target.list_steps(str(root))
  assert steps == _orbax_find_all(root) == [0, 3, 12]
  assert partial == ["7.orbax-checkpoint-tmp-1234"]
  # And on a migrated root.
  src = tmp_path / "src"
  ckpt = clu_checkpoint.Checkpoint(str(src))
  for step in (1, 2):
    ckpt.save(_state(step))
  assert migration.migrate(str(src), str(tmp_path / "dst")).ok
  assert (orbax_target.list_steps(str(tmp_path / "dst"))[0] ==
          _orbax_find_all(tmp_path / "dst") == [1, 2])


def test_list_steps_does_not_import_orbax(tmp_path):
  script = ("import sys\n"
            "from clu_ckpt.migration import orbax_target\n"
            f"print(orbax_target.list_steps({str(tmp_path)!r}))\n"
            "assert 'orbax.checkpoint' not in sys.modules\n")
  subprocess.run([sys.executable, "-c", script], check=True,
                 capture_output=True, text=True)


# --------------------------------------------------------------------------
# The private Orbax API, pinned.
# --------------------------------------------------------------------------


def test_private_api_is_pinned():
  assert metadata.version("orbax-checkpoint") in (
      orbax_target.CHECKED_ORBAX_VERSIONS)
  method = ocp.type_handlers.NumpyHandler._background_serialize  # pylint: disable=protected-access
  assert tuple(inspect.signature(method).parameters) == (
      orbax_target.PRIVATE_API_PARAMETERS)
  assert inspect.iscoroutinefunction(method)
  assert orbax_target.check_private_api() is method


def test_missing_private_api_raises_a_clear_error(monkeypatch, tmp_path):
  monkeypatch.delattr(ocp.type_handlers.NumpyHandler, "_background_serialize")
  with pytest.raises(errors.PrivateApiError) as e:
    orbax_target.check_private_api()
  message = str(e.value)
  assert "NumpyHandler._background_serialize" in message
  assert "0.12.8" in message
  assert metadata.version("orbax-checkpoint") in message
  assert isinstance(e.value, ImportError)
  # A migration reports it for the step, and leaves no partial step.
  src = tmp_path / "src"
  clu_checkpoint.Checkpoint(str(src)).save(_state(1))
  summary = migration.migrate(str(src), str(tmp_path / "dst"))
  assert not summary.ok
  assert "_background_serialize" in summary.steps[0].error
  assert orbax_target.list_steps(str(tmp_path / "dst")) == ([], [])


def test_private_api_with_another_signature_is_refused():
  class Changed:
    async def _background_serialize(self, values, infos):  # pylint: disable=unused-argument
      pass
  with pytest.raises(errors.PrivateApiError, match="takes"):
    orbax_target.check_private_api(Changed)


def test_private_api_is_used_in_one_module_only():
  package = os.path.dirname(orbax_target.__file__)
  root = os.path.dirname(package)
  users = []
  for directory in (root, package):
    for name in os.listdir(directory):
      if name.endswith(".py"):
        with open(os.path.join(directory, name)) as f:
          if "_background_serialize" in f.read():
            users.append(os.path.relpath(os.path.join(directory, name), root))
  assert users == [os.path.join("migration", "orbax_target.py")]


# --------------------------------------------------------------------------
# One parse per `.flax` per checkpoint.
# --------------------------------------------------------------------------


@pytest.fixture
def parses(monkeypatch):
  counts = collections.Counter()
  init = flax_format._Reader.__init__  # pylint: disable=protected-access

  def counting(self, data, name, *args, **kwargs):
    counts[name] += 1
    init(self, data, name, *args, **kwargs)

  monkeypatch.setattr(flax_format._Reader, "__init__", counting)  # pylint: disable=protected-access
  return counts


def test_single_host_migration_parses_each_flax_once(tmp_path, parses):
  src = tmp_path / "src"
  ckpt = clu_checkpoint.Checkpoint(str(src))
  for step in (1, 2, 3):
    ckpt.save(_state(step))
  parses.clear()
  summary = migration.migrate(str(src), str(tmp_path / "dst"), verify=True)
  assert summary.ok and all(s.verified for s in summary.steps)
  flax_files = sorted(str(p) for p in src.glob("ckpt-*.flax"))
  assert len(flax_files) == 3
  assert dict(parses) == {f: 1 for f in flax_files}
  # Resuming (steps skipped, verified again): once more each.
  parses.clear()
  assert migration.migrate(str(src), str(tmp_path / "dst"), verify=True).ok
  assert dict(parses) == {f: 1 for f in flax_files}


def test_multihost_migration_parses_each_flax_once(tmp_path, parses):
  base = tmp_path / "src" / "ckpts"
  for host in (0, 1):
    ckpt = clu_checkpoint.MultihostCheckpoint(str(base), host_id=host)
    for step in (1, 2):
      ckpt.save(_state(step))
  parses.clear()
  summary = migration.migrate(str(base), str(tmp_path / "dst"), verify=True)
  assert summary.ok, summary.failed
  # Identical hosts are compared byte for byte: host 1's files are not parsed.
  host0 = sorted(str(p) for p in (tmp_path / "src").glob("ckpts-0/*.flax"))
  assert len(host0) == 2
  assert dict(parses) == {f: 1 for f in host0}


def test_differing_hosts_parse_each_file_once(tmp_path, parses):
  base = tmp_path / "src" / "ckpts"
  for host in (0, 1):
    ckpt = clu_checkpoint.MultihostCheckpoint(str(base), host_id=host)
    ckpt.save(_state(1, scale=1.0 + host))
  parses.clear()
  summary = migration.migrate(str(base), str(tmp_path / "dst"), verify=True)
  assert not summary.ok and "hosts 0 and 1" in summary.steps[0].error
  files = sorted(str(p) for p in (tmp_path / "src").glob("ckpts-*/*.flax"))
  assert dict(parses) == {f: 1 for f in files}


# --------------------------------------------------------------------------
# The byte budget of the bounded numpy handler.
# --------------------------------------------------------------------------


def _peak_admitted(limit, sizes):
  """Runs jobs of `sizes` bytes through a budget; returns the most at once."""

  async def scenario():
    budget = orbax_target._ByteBudget(limit)  # pylint: disable=protected-access
    active, peak = [0], [0]

    async def job(n):
      await budget.acquire(n)
      active[0] += n
      peak[0] = max(peak[0], active[0])
      await asyncio.sleep(0.001)
      active[0] -= n
      await budget.release(n)

    await asyncio.gather(*(job(n) for n in sizes))
    return peak[0]

  return asyncio.run(scenario())


def test_byte_budget_admits_at_most_the_limit():
  assert 8 <= _peak_admitted(10, [4, 4, 4, 3, 2, 6, 5]) <= 10
  assert _peak_admitted(10, [3] * 8) == 9
  # A job larger than the limit runs, alone.
  assert _peak_admitted(10, [4, 25, 4]) == 25


def test_handles_beyond_the_kept_limit_are_reopened(tmp_path, parses,
                                                    monkeypatch):
  from clu_ckpt.migration import run  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(run, "_KEPT_HANDLES", 1)
  src = tmp_path / "src"
  ckpt = clu_checkpoint.Checkpoint(str(src))
  for step in (1, 2, 3):
    ckpt.save(_state(step))
  parses.clear()
  summary = migration.migrate(str(src), str(tmp_path / "dst"), verify=True)
  assert summary.ok and [s.step for s in summary.steps] == [1, 2, 3]
  counts = [parses[str(src / f"ckpt-{n}.flax")] for n in (1, 2, 3)]
  assert counts == [1, 2, 2]


def test_remove_partial_unlinks_a_symlink_and_spares_its_target(tmp_path):
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "keep").write_text("x")
  root = tmp_path / "root"
  (root / "3.orbax-checkpoint-tmp-1").mkdir(parents=True)
  (root / "3.orbax-checkpoint-tmp-1" / "part").write_text("x")
  os.symlink(outside, root / "3.orbax-checkpoint-tmp-2")
  orbax_target.OrbaxTarget(str(root)).remove_partial(3)
  assert sorted(os.listdir(root)) == []
  assert (outside / "keep").read_text() == "x"
