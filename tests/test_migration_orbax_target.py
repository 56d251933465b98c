"""Tests of clu_ckpt.migration.orbax_target: listing steps, the private API,
and parsing each `.flax` once per migration."""

import asyncio
import collections
import datetime
import inspect
import json
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
from clu_ckpt.migration import memory
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


# --------------------------------------------------------------------------
# The orbax-checkpoint the migration needs.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.12.5", "0.12.8", "0.13.0", "1.0"])
def test_orbax_versions_the_migration_writes_with(version):
  orbax_target.check_orbax_version(version)


@pytest.mark.parametrize("version", ["0.12.4", "0.11.24", "0.11.40", "0.6.4",
                                     None, "unknown"])
def test_too_old_or_missing_orbax_is_one_line_naming_versions_and_remedy(
    version):
  with pytest.raises(errors.MigrationError) as e:
    orbax_target.check_orbax_version(version)
  message = str(e.value)
  assert "\n" not in message
  assert f">= {orbax_target.MIN_ORBAX_VERSION}" in message
  assert (f"is {version}" if version else "not installed") in message
  assert "python -m venv" in message and "[orbax]" in message
  assert "nothing was written" in message


def test_the_installed_orbax_passes_and_is_read_without_importing_it():
  script = ("import sys\n"
            "from clu_ckpt.migration import orbax_target\n"
            "orbax_target.require_orbax()\n"
            "print(orbax_target.installed_orbax_version())\n"
            "assert 'orbax.checkpoint' not in sys.modules\n")
  done = subprocess.run([sys.executable, "-c", script], check=True,
                        capture_output=True, text=True)
  assert done.stdout.strip() == metadata.version("orbax-checkpoint")


def test_the_minimum_is_where_orbax_takes_deepcopy_host_arrays():
  # What the bounded handler passes exists in the installed Orbax (checked by
  # `check_private_api`), which is at least the minimum.
  assert "deepcopy_host_arrays" in inspect.signature(
      ocp.type_handlers.NumpyHandler.__init__).parameters

  class Old(ocp.type_handlers.NumpyHandler):
    def __init__(self, metadata_key=None):  # pylint: disable=super-init-not-called
      pass
  with pytest.raises(errors.PrivateApiError, match="deepcopy_host_arrays"):
    orbax_target.check_private_api(Old)


@pytest.mark.parametrize("version", ["0.11.24", None])
def test_migrate_with_too_old_orbax_stops_before_writing_anything(
    tmp_path, monkeypatch, version):
  src = tmp_path / "src"
  ckpt = clu_checkpoint.Checkpoint(str(src))
  for step in (1, 2):
    ckpt.save(_state(step))
  # Only the version number is simulated; Orbax itself is the real one.
  monkeypatch.setattr(orbax_target, "installed_orbax_version",
                      lambda: version)
  for dry_run in (False, True):
    with pytest.raises(errors.MigrationError, match="orbax-checkpoint >= "):
      migration.migrate(str(src), str(tmp_path / "dst"), dry_run=dry_run)
  assert not (tmp_path / "dst").exists()
  # A target used directly refuses too, before writing.
  target = orbax_target.OrbaxTarget(str(tmp_path / "dst"))
  with pytest.raises(errors.MigrationError):
    target.write_step(1, {"state": {"a": np.ones(2)}, "metadata": {}},
                      lambda n: None)
  assert not (tmp_path / "dst").exists()


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
    budget = memory.ByteBudget(limit)
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


# --------------------------------------------------------------------------
# Step names, save times, custom metadata, roots.
# --------------------------------------------------------------------------


def _items(step):
  return {orbax_target.STATE_ITEM: {"w": np.arange(4.0) * step,
                                    "step": np.int64(step)},
          orbax_target.METADATA_ITEM: {"clu_checkpoint": f"ckpt-{step}"}}


def _manager(root, prefix=None, length=None):
  return ocp.CheckpointManager(
      str(root), options=ocp.CheckpointManagerOptions(
          step_prefix=prefix, step_format_fixed_length=length))


@pytest.mark.parametrize("prefix,length,names", [
    ("step", 4, ["step_0003", "step_0040", "step_12345"]),
    (None, 5, ["00003", "00040", "12345"]),
    ("ckpt", None, ["ckpt_12345", "ckpt_3", "ckpt_40"]),
])
def test_steps_are_named_and_listed_as_orbax_names_them(tmp_path, prefix,
                                                        length, names):
  target = orbax_target.OrbaxTarget(str(tmp_path / "dst"), step_prefix=prefix,
                                    step_format_fixed_length=length)
  for step in (3, 40, 12345):
    target.write_step(step, _items(step), on_bytes=lambda n: None)
  assert sorted(os.listdir(tmp_path / "dst")) == names
  assert target.steps() == [3, 40, 12345]
  with _manager(tmp_path / "dst", prefix, length) as mngr:
    assert mngr.all_steps() == [3, 40, 12345]
    restored = mngr.restore(40, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(), metadata=ocp.args.JsonRestore()))
  np.testing.assert_array_equal(restored["state"]["w"], np.arange(4.0) * 40)
  assert restored["metadata"] == {"clu_checkpoint": "ckpt-40"}
  state, meta = target.restore(12345)
  np.testing.assert_array_equal(state["w"], np.arange(4.0) * 12345)
  assert meta == {"clu_checkpoint": "ckpt-12345"}
  assert orbax_target.read_metadata(
      str(tmp_path / "dst"), 3, step_prefix=prefix,
      step_format_fixed_length=length) == {"clu_checkpoint": "ckpt-3"}
  # A default target lists what a default manager lists ("12345" only).
  with _manager(tmp_path / "dst") as mngr:
    assert orbax_target.OrbaxTarget(str(tmp_path / "dst")).steps() == (
        mngr.all_steps()) == ([] if prefix else [12345])


def test_remove_partial_removes_the_prefixed_temporary_name(tmp_path):
  root = tmp_path / "dst"
  for name in ("step_0003.orbax-checkpoint-tmp", "3.orbax-checkpoint-tmp",
               "step_0004.orbax-checkpoint-tmp", "step_0003"):
    (root / name).mkdir(parents=True)
  target = orbax_target.OrbaxTarget(str(root), step_prefix="step",
                                    step_format_fixed_length=4)
  target.remove_partial(3)
  assert sorted(os.listdir(root)) == [
      "3.orbax-checkpoint-tmp", "step_0003", "step_0004.orbax-checkpoint-tmp"]


def test_a_failed_prefixed_write_leaves_nothing(tmp_path, monkeypatch):
  # Fails at the commit, when every item is written under the temporary name.
  def failing_update(self, file_path, **kwargs):
    if orbax_target.COMMIT_TIME_FIELD in kwargs:
      assert os.path.basename(os.path.dirname(file_path)) == (
          "s_005.orbax-checkpoint-tmp")
      raise OSError("disk gone")
  monkeypatch.setattr(orbax_target._CommitTimeStore, "update", failing_update)  # pylint: disable=protected-access
  target = orbax_target.OrbaxTarget(str(tmp_path / "dst"), step_prefix="s",
                                    step_format_fixed_length=3)
  with pytest.raises(OSError, match="disk gone"):
    target.write_step(5, _items(5), on_bytes=lambda n: None, saved_at=1.0)
  assert os.listdir(tmp_path / "dst") == []


def test_naming_options_are_checked_at_construction(tmp_path):
  with pytest.raises(errors.UsageError, match="may not contain"):
    orbax_target.OrbaxTarget(str(tmp_path), step_prefix="a/b")
  with pytest.raises(errors.UsageError, match="fixed length"):
    orbax_target.OrbaxTarget(str(tmp_path), step_format_fixed_length=-2)


def test_save_time_and_custom_metadata_as_a_stock_manager_sees_them(tmp_path):
  root = tmp_path / "dst"
  target = orbax_target.OrbaxTarget(str(root), step_prefix="step")
  custom = {"clu_ckpt": {"source": "/runs/a/ckpts", "checkpoint": "ckpt-3"}}
  saved_at = 1_600_000_000.654321
  target.write_step(3, _items(3), on_bytes=lambda n: None,
                    saved_at=saved_at, custom_metadata=custom)
  target.write_step(4, _items(4), on_bytes=lambda n: None,
                    saved_at=1_500_000_000)
  name_format = ocp.path.step.standard_name_format(step_prefix="step")
  times = {m.step: m.commit_timestamp for m in name_format.find_all(root)}
  want = datetime.datetime.fromtimestamp(saved_at, datetime.timezone.utc)
  assert times[3] == want  # microseconds: what Orbax keeps
  assert times[4].timestamp() == 1_500_000_000
  with _manager(root, "step") as mngr:
    assert mngr.all_steps() == [3, 4]
    # What its policies use (the list it keeps of its steps' infos).
    infos = {i.step: i.time for i in mngr._checkpoints}  # pylint: disable=protected-access
    assert infos == times
    assert mngr.metadata(3).custom_metadata == custom
    assert mngr.metadata(3).commit_timestamp_nsecs == round(saved_at * 1e9)
    assert mngr.metadata(4).custom_metadata == {}


def test_the_time_is_the_saved_one_before_the_step_is_listed(tmp_path,
                                                             monkeypatch):
  # Orbax renames the temporary directory into place after setting the commit
  # time; at that moment the metadata must already hold the source's time.
  seen = {}
  rename = os.rename

  def spying_rename(src, dst, *args, **kwargs):
    if os.path.dirname(os.fspath(dst)) == str(tmp_path / "dst"):
      with open(os.path.join(src, "_CHECKPOINT_METADATA")) as f:
        seen[os.path.basename(os.fspath(dst))] = json.load(f)
    return rename(src, dst, *args, **kwargs)

  monkeypatch.setattr(os, "rename", spying_rename)
  target = orbax_target.OrbaxTarget(str(tmp_path / "dst"))
  target.write_step(2, _items(2), on_bytes=lambda n: None, saved_at=1234.5,
                    custom_metadata={"source": "x"})
  assert seen["2"]["commit_timestamp_nsecs"] == 1_234_500_000_000
  assert seen["2"]["custom_metadata"] == {"source": "x"}


def test_without_a_save_time_the_step_gets_the_time_of_writing(tmp_path):
  before = datetime.datetime.now(datetime.timezone.utc)
  orbax_target.OrbaxTarget(str(tmp_path / "dst")).write_step(
      1, _items(1), on_bytes=lambda n: None)
  with _manager(tmp_path / "dst") as mngr:
    meta = mngr.metadata(1)
  assert meta.commit_timestamp_nsecs / 1e9 >= before.timestamp() - 1
  assert meta.custom_metadata == {}


@pytest.mark.parametrize("saved_at", [float("nan"), float("inf"), -1.0, "1"])
def test_unusable_save_times_are_refused(tmp_path, saved_at):
  with pytest.raises(errors.UsageError, match="saved_at"):
    orbax_target.OrbaxTarget(str(tmp_path / "dst")).write_step(
        1, _items(1), on_bytes=lambda n: None, saved_at=saved_at)
  assert not (tmp_path / "dst").exists() or not os.listdir(tmp_path / "dst")


def test_an_orbax_that_sets_the_time_otherwise_is_refused(tmp_path,
                                                          monkeypatch):
  monkeypatch.setattr(orbax_target, "COMMIT_TIME_FIELD", "no_such_field")
  target = orbax_target.OrbaxTarget(str(tmp_path / "dst"))
  with pytest.raises(errors.PrivateApiError) as e:
    target.write_step(1, _items(1), on_bytes=lambda n: None, saved_at=5.0)
  assert "commit_timestamp_nsecs" in str(e.value)
  assert metadata.version("orbax-checkpoint") in str(e.value)
  assert os.listdir(tmp_path / "dst") == []


def test_relative_and_file_url_roots(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  target = orbax_target.OrbaxTarget("runs/dst")
  assert target.root == str(tmp_path / "runs" / "dst")
  target.write_step(1, _items(1), on_bytes=lambda n: None)
  url = orbax_target.OrbaxTarget(f"file://{tmp_path}/runs/url/")
  assert url.root == str(tmp_path / "runs" / "url")
  url.write_step(2, _items(2), on_bytes=lambda n: None)
  assert sorted(os.listdir(tmp_path)) == ["runs"]  # no `file:` directory
  assert os.listdir(tmp_path / "runs" / "dst") == ["1"]
  assert os.listdir(tmp_path / "runs" / "url") == ["2"]
  monkeypatch.chdir(tmp_path / "runs")
  assert orbax_target.OrbaxTarget("dst").steps() == [1]
  assert orbax_target.OrbaxTarget("./url").restore(2)[1] == {
      "clu_checkpoint": "ckpt-2"}
  assert orbax_target.read_metadata(f"file://{tmp_path}/runs/dst", 1) == {
      "clu_checkpoint": "ckpt-1"}
  with _manager(tmp_path / "runs" / "url") as mngr:
    assert mngr.all_steps() == [2]


# --------------------------------------------------------------------------
# A stock CheckpointManager restoring a migrated root.
# --------------------------------------------------------------------------

_NO_HANDLER_WARNING = "could not be restored"


def _migrated_root(tmp_path):
  """A root migrated from a real clu run with an iterator: three items."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  it = iter(tf.data.Dataset.range(100).batch(4))
  next(it)
  src = tmp_path / "src"
  ckpt = clu_checkpoint.Checkpoint(str(src), {"ds": it})
  states = [_state(10), _state(20, scale=2.0)]
  for state in states:
    ckpt.save(state)
  assert migration.migrate(str(src), str(tmp_path / "dst")).ok
  return tmp_path / "dst", states


def _orbax_warnings(caplog):
  return [r.getMessage() for r in caplog.records
          if _NO_HANDLER_WARNING in r.getMessage()]


def test_item_handlers_make_a_plain_restore_silent_and_exact(tmp_path,
                                                             caplog):
  root, states = _migrated_root(tmp_path)
  caplog.set_level("INFO")
  with ocp.CheckpointManager(
      root, item_handlers=migration.item_handlers()) as mngr:
    restored = mngr.restore(20)
  assert _orbax_warnings(caplog) == []
  assert sorted(restored.keys()) == ["dataset", "metadata", "state"]
  meta = restored["metadata"]
  state = migration.decode_state(restored["state"], meta["encoded"],
                                 [leaf["path"] for leaf in meta["leaves"]])
  expected = states[1]
  assert state["step"] == expected["step"]
  assert state["params"]["w"].dtype == np.float32
  assert state["params"]["w"].tobytes() == expected["params"]["w"].tobytes()
  assert state["opt"] == expected["opt"]
  assert restored["dataset"]["process_0"]["index"].dtype == np.uint8
  # The guard of the assertion above: without them, this Orbax warns.
  caplog.clear()
  with ocp.CheckpointManager(root) as mngr:
    plain = mngr.restore(20)
  assert len(_orbax_warnings(caplog)) == 6
  assert plain["state"]["params"]["w"].tobytes() == (
      restored["state"]["params"]["w"].tobytes())


def test_steps_record_item_handlers_exactly_as_orbax_records_its_own(
    tmp_path, caplog):
  # A plain `CheckpointManager(root).restore(step)` picks each item's handler
  # from what the step records; Orbax's own steps with the same items record
  # the same, and a plain restore of them warns the same.
  root, _ = _migrated_root(tmp_path)
  own = tmp_path / "own"
  with ocp.CheckpointManager(own) as mngr:
    mngr.save(20, args=ocp.args.Composite(
        state=ocp.args.PyTreeSave({"a": np.arange(3)}),
        dataset=ocp.args.PyTreeSave({"b": np.arange(2)}),
        metadata=ocp.args.JsonSave({"c": 1})))
  def recorded(r):
    return json.loads((r / "20" / "_CHECKPOINT_METADATA").read_text())[
        "item_handlers"]
  assert recorded(root) == recorded(own)
  caplog.set_level("INFO")
  counts = []
  for r in (root, own):
    caplog.clear()
    with ocp.CheckpointManager(r) as mngr:
      assert sorted(mngr.restore(20).keys()) == [
          "dataset", "metadata", "state"]
    counts.append(len(_orbax_warnings(caplog)))
  assert counts[0] == counts[1]
