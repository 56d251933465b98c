"""Tests for `Checkpoint(layout="orbax")` (`clu_ckpt.orbax_layout`).

Oracles: Flax's own serialization (what a CLU-layout save would hold), the
real `clu` 0.0.12 writing the CLU checkpoints a run switches from, stock
Orbax 0.12.8 (`CheckpointManager`) reading the steps, and `clu-ckpt migrate`
writing the same checkpoint for a layout comparison.

Groups: the switch; round trips and stock Orbax; the migrated layout;
resuming across the switch; `max_to_keep` over both layouts; crash safety
and containment; multi-host with real `jax.distributed` processes.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import textwrap
from typing import Any

from clu import checkpoint as clu_checkpoint
import flax
from flax import serialization
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorflow as tf

from clu_ckpt import checkpoint
from clu_ckpt import errors
from clu_ckpt import orbax_items
from clu_ckpt import orbax_layout
from clu_ckpt import orbax_root
from clu_ckpt.migration import run as migration_run

from migration_helpers import same_tree  # pylint: disable=g-bad-import-order

REPO = pathlib.Path(__file__).resolve().parents[1]


@flax.struct.dataclass
class TrainState:
  params: Any
  opt_state: Any
  step: Any


def make_state(step: int) -> TrainState:
  """Arrays of several dtypes (bfloat16 too), python scalars, str, None."""
  rng = np.random.default_rng(step)
  return TrainState(
      params={"Dense_0": {"kernel": jnp.asarray(rng.normal(size=(4, 3)),
                                                jnp.float32),
                          "bias": jnp.full((3,), step, jnp.float32)},
              "Embed_0": {"embedding": jnp.asarray(rng.normal(size=(5, 2)),
                                                   jnp.bfloat16)}},
      opt_state={"count": jnp.int32(step),
                 "mu": np.arange(6, dtype=np.int64).reshape(2, 3) * step,
                 "hyper": {"lr": 1e-3 * (step + 1), "name": "adam",
                           "betas": [0.9, 0.999], "flag": None}},
      step=step)


def model_state(step: int) -> TrainState:
  """A state the new Orbax loop would build: arrays and an int step only
  (strings and None would need stand-ins, which a template form refuses)."""
  rng = np.random.default_rng(step)
  return TrainState(
      params={"Dense_0": {"kernel": jnp.asarray(rng.normal(size=(4, 3)),
                                                jnp.float32)},
              "Embed_0": {"embedding": jnp.asarray(rng.normal(size=(5, 2)),
                                                   jnp.bfloat16)}},
      opt_state={"count": jnp.int32(step),
                 "mu": np.arange(6, dtype=np.int64).reshape(2, 3) * step},
      step=step)


def flax_state_dict(state: Any) -> Any:
  """What a CLU-layout checkpoint of `state` restores to (Flax's own)."""
  return serialization.msgpack_restore(serialization.to_bytes(state))


def dataset_iterator():
  return iter(tf.data.Dataset.range(10_000).batch(4))


def batch(it) -> list[int]:
  return next(it).numpy().tolist()


def orbax_ckpt(base, tf_state=None, **kwargs) -> checkpoint.Checkpoint:
  return checkpoint.Checkpoint(str(base), tf_state, layout="orbax", **kwargs)


def clu_files(directory) -> list[str]:
  return sorted(n for n in os.listdir(directory) if n.startswith("ckpt-"))


# ---------------------------------------------------------------------------
# The switch.
# ---------------------------------------------------------------------------


def test_layout_argument_and_environment(tmp_path, monkeypatch):
  monkeypatch.delenv(orbax_layout.LAYOUT_ENV, raising=False)
  assert checkpoint.Checkpoint(str(tmp_path / "a")).layout == "clu"
  monkeypatch.setenv(orbax_layout.LAYOUT_ENV, "orbax")
  assert checkpoint.Checkpoint(str(tmp_path / "a")).layout == "orbax"
  # The argument wins over the environment.
  assert checkpoint.Checkpoint(str(tmp_path / "a"),
                               layout="clu").layout == "clu"
  monkeypatch.setenv(orbax_layout.LAYOUT_ENV, "zarr")
  with pytest.raises(errors.UsageError, match=r"\$CLU_CKPT_LAYOUT 'zarr'"):
    checkpoint.Checkpoint(str(tmp_path / "a"))
  with pytest.raises(errors.UsageError, match="layout argument 'tf'"):
    checkpoint.Checkpoint(str(tmp_path / "a"), layout="tf")


def test_environment_switches_a_save(tmp_path, monkeypatch):
  monkeypatch.setenv(orbax_layout.LAYOUT_ENV, "orbax")
  ckpt = checkpoint.Checkpoint(str(tmp_path / "ck"))
  assert ckpt.save(make_state(1)) == f"{tmp_path}/ck/ckpt-1"
  assert os.listdir(tmp_path / "ck") == ["1"]
  assert orbax_root.list_steps(str(tmp_path / "ck"))[0] == [1]


# ---------------------------------------------------------------------------
# Round trips; stock Orbax reads the steps.
# ---------------------------------------------------------------------------


def test_round_trip_state_and_iterator(tmp_path):
  it = dataset_iterator()
  ckpt = orbax_ckpt(tmp_path / "ck", dict(ds_iter=it), max_to_keep=10)
  state = ckpt.restore_or_initialize(make_state(0))
  assert ckpt.latest_checkpoint == f"{tmp_path}/ck/ckpt-1"
  expected = {}
  for step in range(1, 4):
    batch(it)
    state = make_state(step)
    path = ckpt.save(state)
    expected[path] = (flax_state_dict(state), batch(it))
    it = it  # the batch after the save is what a restore must give next
  assert path == f"{tmp_path}/ck/ckpt-4"
  assert ckpt.current_checkpoint == ckpt.latest_checkpoint == path
  for path, (state_dict, next_batch) in expected.items():
    fresh = dataset_iterator()
    reader = orbax_ckpt(tmp_path / "ck", dict(ds_iter=fresh))
    assert reader.current_checkpoint == f"{tmp_path}/ck/ckpt-0"
    assert same_tree(reader.restore_dict(path), state_dict)
    assert batch(fresh) == next_batch
    assert reader.current_checkpoint == path
    assert reader.restored_from == path
  # Into a template: the dataclass comes back, leaves equal to Flax's.
  fresh = dataset_iterator()
  restored = orbax_ckpt(tmp_path / "ck", dict(ds_iter=fresh)
                        ).restore_or_initialize(make_state(0))
  assert isinstance(restored, TrainState)
  assert same_tree(flax_state_dict(restored), expected[path][0])
  assert batch(fresh) == expected[path][1]
  # load_state reads the state only; a step directory is accepted too.
  assert same_tree(orbax_ckpt(tmp_path / "ck").load_state(
      None, str(tmp_path / "ck" / "2")), expected[f"{tmp_path}/ck/ckpt-2"][0])


def test_stock_orbax_restores_every_item(tmp_path):
  it = dataset_iterator()
  ckpt = orbax_ckpt(tmp_path / "ck", dict(ds_iter=it))
  batch(it)
  state = model_state(7)
  ckpt.save(state)
  expected_next = batch(it)
  abstract = jax.eval_shape(lambda: model_state(0))
  with ocp.CheckpointManager(
      tmp_path / "ck",
      handler_registry=orbax_items.handler_registry()) as mngr:
    assert mngr.all_steps() == [1]
    fresh = dataset_iterator()
    out = mngr.restore(1, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract),
        dataset=orbax_items.TfStateRestore(dict(ds_iter=fresh)),
        metadata=ocp.args.JsonRestore()))
  assert isinstance(out["state"], TrainState)
  # StandardRestore casts to the abstract state's dtypes (int64 -> int32
  # without jax_enable_x64); the values are the saved ones.
  for got, want in zip(jax.tree_util.tree_leaves(out["state"]),
                       jax.tree_util.tree_leaves(state)):
    assert np.shape(got) == np.shape(want)
    np.testing.assert_array_equal(np.asarray(got, np.float64),
                                  np.asarray(want, np.float64))
  assert batch(fresh) == expected_next
  assert out["metadata"]["writer"] == orbax_layout.WRITER
  assert out["metadata"]["clu_checkpoint_number"] == 1
  assert out["metadata"]["state_step"] == 7
  # Without arguments, as a plain CheckpointManager sees the root.
  with ocp.CheckpointManager(tmp_path / "ck") as mngr:
    plain = mngr.restore(1)
  assert sorted(plain) == ["dataset", "metadata", "state"]
  assert sorted(plain["dataset"]) == ["process_0"]


def test_dict_state_keeps_its_state_dict_form(tmp_path):
  # Leaves only a stand-in can hold (bytes, complex, zero-size, unicode).
  state = {"b": b"\x00raw", "c": 1 + 2j, "z": np.zeros((0, 3), np.float32),
           "n": np.float16(2.5),
           "nested": {"z": {}, "l": [1, 2.5, "x"]}, "step": 3}
  ckpt = orbax_ckpt(tmp_path / "ck")
  ckpt.save(state)
  assert same_tree(ckpt.restore_dict(), flax_state_dict(state))
  meta = migration_run.orbax_target.OrbaxTarget(
      str(tmp_path / "ck")).read_metadata(1)
  assert "structure" not in meta and meta["state_step"] == 3


def test_dataclass_with_stand_ins_falls_back_to_state_dict(tmp_path):
  state = TrainState(params={"w": np.ones(2)}, opt_state=b"bytes", step=1)
  ckpt = orbax_ckpt(tmp_path / "ck")
  ckpt.save(state)
  restored = ckpt.restore(TrainState(params={"w": np.zeros(2)},
                                     opt_state=b"", step=0))
  assert restored.opt_state == b"bytes" and restored.step == 1


def test_restore_tf_state_missing_from_step_is_named(tmp_path):
  orbax_ckpt(tmp_path / "ck").save(make_state(1))
  reader = orbax_ckpt(tmp_path / "ck", dict(ds_iter=dataset_iterator()))
  with pytest.raises(errors.InvalidCheckpointError,
                     match=r"ck/1: has no dataset item"):
    reader.restore_or_initialize(make_state(0))


# ---------------------------------------------------------------------------
# The migrated layout: the same items, handlers and metadata as `migrate`.
# ---------------------------------------------------------------------------


def _step_description(step_dir: pathlib.Path) -> dict:
  meta = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())
  items = json.loads((step_dir / "metadata" / "metadata").read_text())
  return {"item_handlers": meta["item_handlers"],
          "entries": sorted(p.name for p in step_dir.iterdir()
                            if p.name != "commit_success.txt"),
          "state_files": sorted(p.name for p in (step_dir / "state").iterdir()
                                if not p.name.startswith("ocdbt.process")),
          "metadata_keys": sorted(items),
          "leaves": items["leaves"], "encoded": items["encoded"],
          "dataset": items["dataset"], "structure": items.get("structure"),
          "step_naming": items["step_naming"],
          "compression": items["compression"]}


@pytest.mark.parametrize("with_template", [False, True])
def test_same_layout_as_migrate(tmp_path, with_template):
  state = model_state(3) if with_template else make_state(3)
  # The CLU layout, migrated by `clu-ckpt migrate` (real clu writes it).
  it = dataset_iterator()
  batch(it)
  clu_checkpoint.Checkpoint(str(tmp_path / "clu"), dict(ds_iter=it)).save(
      state)
  migration_run.migrate(str(tmp_path / "clu"), str(tmp_path / "migrated"),
                        step_naming="number", compression="none",
                        template=state if with_template else None)
  # The same state saved in the Orbax layout.
  it = dataset_iterator()
  batch(it)
  saved = state if with_template else flax_state_dict(state)
  orbax_ckpt(tmp_path / "ck", dict(ds_iter=it)).save(saved)
  migrated = _step_description(tmp_path / "migrated" / "1")
  ours = _step_description(tmp_path / "ck" / "1")
  extra = {"writer", "state_step", "saved_at"}
  assert set(ours.pop("metadata_keys")) - extra == set(
      migrated.pop("metadata_keys")) - {"migrated_at", "step_mapping"}
  assert ours == migrated
  # Both restore to the same state dict through the migration's reader.
  assert same_tree(migration_run.restore_state(str(tmp_path / "ck"), 1),
                   migration_run.restore_state(str(tmp_path / "migrated"), 1))


def test_inspect_and_verify_read_the_root(tmp_path):
  from clu_ckpt import inspection  # pylint: disable=g-import-not-at-top
  ckpt = orbax_ckpt(tmp_path / "ck", max_to_keep=3)
  for step in range(1, 3):
    ckpt.save(make_state(step))
  report = orbax_root.inspect_orbax_root(str(tmp_path / "ck"))
  assert [row["step"] for row in report["steps"]] == [1, 2]
  assert report["steps"][1]["clu_checkpoint"] == "ckpt-2"
  assert [l["path"] for l in report["tree"]["leaves"]] == [
      l.path for l in __import__("clu_ckpt").flax_format.inspect(
          serialization.to_bytes(make_state(2)))]
  result = orbax_root.verify_orbax_root(str(tmp_path / "ck"))
  assert result["ok"], result["problems"]
  assert inspection is not None


# ---------------------------------------------------------------------------
# Resuming across the switch.
# ---------------------------------------------------------------------------


def _clu_run(base, steps, max_to_keep=5):
  """A CLU run (the real clu): one batch per step, a save per step."""
  it = dataset_iterator()
  ckpt = clu_checkpoint.Checkpoint(str(base), dict(ds_iter=it),
                                   max_to_keep=max_to_keep)
  ckpt.restore_or_initialize(make_state(0))
  for step in range(1, steps + 1):
    batch(it)
    ckpt.save(make_state(step))
  return batch(it)


def test_resumes_from_the_newest_clu_checkpoint(tmp_path):
  base = tmp_path / "ck"
  next_batch = _clu_run(base, 3)  # ckpt-1 (initial) .. ckpt-4
  it = dataset_iterator()
  ckpt = orbax_ckpt(base, dict(ds_iter=it))
  assert ckpt.latest_checkpoint == f"{base}/ckpt-4"
  state = ckpt.restore_or_initialize(make_state(0))
  assert same_tree(flax_state_dict(state), flax_state_dict(make_state(3)))
  assert batch(it) == next_batch
  assert ckpt.save(make_state(4)) == f"{base}/ckpt-5"
  assert orbax_root.list_steps(str(base))[0] == [5]
  assert clu_files(base)[-2:] == ["ckpt-4.flax", "ckpt-4.index"]
  # The newest across both layouts: the Orbax step.
  for reader in (orbax_ckpt(base), checkpoint.Checkpoint(str(base),
                                                         layout="orbax")):
    assert reader.latest_checkpoint == f"{base}/ckpt-5"
  fresh = dataset_iterator()
  resumed = orbax_ckpt(base, dict(ds_iter=fresh))
  state = resumed.restore_or_initialize(make_state(0))
  assert same_tree(flax_state_dict(state), flax_state_dict(make_state(4)))
  assert batch(fresh) == [n + 4 for n in next_batch]
  # The CLU layout's own reader still sees its checkpoints, untouched.
  assert checkpoint.Checkpoint(str(base)).latest_checkpoint == (
      f"{base}/ckpt-4")


def test_restoring_older_then_saving_removes_newer_in_both_layouts(tmp_path):
  base = tmp_path / "ck"
  _clu_run(base, 3)  # ckpt-1 .. ckpt-4
  ckpt = orbax_ckpt(base, max_to_keep=10)
  ckpt.restore_or_initialize(make_state(0))
  ckpt.save(make_state(4))
  ckpt.save(make_state(5))  # Orbax 5, 6
  older = orbax_ckpt(base, max_to_keep=10)
  older.restore(None, f"{base}/ckpt-2")
  assert older.save(make_state(20)) == f"{base}/ckpt-3"
  assert orbax_root.list_steps(str(base))[0] == [3]
  assert not any(n.startswith(("ckpt-3.", "ckpt-4.")) for n in clu_files(base))
  assert orbax_ckpt(base).latest_checkpoint == f"{base}/ckpt-3"
  assert checkpoint.Checkpoint(str(base)).latest_checkpoint == (
      f"{base}/ckpt-2")
  # Saving without restoring starts over, as in CLU.
  fresh = orbax_ckpt(base, max_to_keep=10)
  assert fresh.save(make_state(1)) == f"{base}/ckpt-1"
  assert orbax_root.list_steps(str(base))[0] == [1]
  assert clu_files(base) == []


def test_max_to_keep_counts_both_and_keeps_only_copies(tmp_path):
  base = tmp_path / "ck"
  _clu_run(base, 2)  # ckpt-1 .. ckpt-3
  ckpt = orbax_ckpt(base, max_to_keep=2)
  ckpt.restore_or_initialize(make_state(0))
  ckpt.save(make_state(3))
  ckpt.save(make_state(4))
  ckpt.save(make_state(5))  # 4, 5, 6
  # Window {5, 6}: Orbax 4 went; CLU 1-3 are the only copies: kept.
  assert orbax_root.list_steps(str(base))[0] == [5, 6]
  assert {n.split(".")[0] for n in clu_files(base)} == {
      "ckpt-1", "ckpt-2", "ckpt-3"}
  # Migrate what the switch left behind into the same root.
  summary = migration_run.migrate(str(base), str(base), step_naming="number")
  assert summary.ok, summary.failed
  assert orbax_root.list_steps(str(base))[0] == [1, 2, 3, 5, 6]
  assert same_tree(orbax_ckpt(base).restore_dict(f"{base}/ckpt-2"),
                   flax_state_dict(make_state(1)))
  # Now they have copies: outside the window, both go (CLU files first).
  ckpt.save(make_state(6))
  assert orbax_root.list_steps(str(base))[0] == [6, 7]
  assert clu_files(base) == []
  assert checkpoint.Checkpoint(str(base)).latest_checkpoint is None


def test_migrating_what_the_switch_left_names_steps_by_number(tmp_path):
  base = tmp_path / "ck"
  _clu_run(base, 2)  # ckpt-1 .. ckpt-3, states of step 0 .. 2
  ckpt = orbax_ckpt(base, max_to_keep=5)
  ckpt.restore_or_initialize(make_state(0))
  ckpt.save(make_state(3))  # Orbax step 4
  # The state's steps (0, 1, 2) would sit beside checkpoint numbers.
  with pytest.raises(errors.MigrationError, match="step-naming number"):
    migration_run.migrate(str(base), str(base), step_naming="state")
  assert orbax_root.list_steps(str(base))[0] == [4]
  summary = migration_run.migrate(str(base), str(base))  # "auto"
  assert summary.ok, summary.failed
  assert summary.step_naming == "number"
  assert orbax_root.list_steps(str(base))[0] == [1, 2, 3, 4]
  assert orbax_ckpt(base).latest_checkpoint == f"{base}/ckpt-4"
  assert same_tree(orbax_ckpt(base).restore_dict(f"{base}/ckpt-2"),
                   flax_state_dict(make_state(1)))


# ---------------------------------------------------------------------------
# Crash safety and containment.
# ---------------------------------------------------------------------------


def test_every_file_is_fsynced_before_the_step_is_renamed(tmp_path,
                                                          monkeypatch):
  events = []
  real_fsync, real_rename = os.fsync, os.rename

  def fsync(fd):
    events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
    return real_fsync(fd)

  def rename(src, dst, *args, **kwargs):
    events.append(("rename", str(src), str(dst)))
    return real_rename(src, dst, *args, **kwargs)

  monkeypatch.setattr(os, "fsync", fsync)
  monkeypatch.setattr(os, "rename", rename)
  ckpt = orbax_ckpt(tmp_path / "ck", dict(ds_iter=dataset_iterator()))
  ckpt.save(make_state(1))
  step = tmp_path / "ck" / "1"
  renames = [e for e in events if e[0] == "rename" and e[2] == str(step)]
  assert len(renames) == 1, events
  tmp = renames[0][1]
  before = {e[1] for e in events[:events.index(renames[0])]
            if e[0] == "fsync"}
  written = [str(p.relative_to(step)) for p in step.rglob("*")
             if p.is_file() and p.name != "commit_success.txt"]
  assert written
  missing = [p for p in written if os.path.join(tmp, p) not in before]
  assert not missing
  # The rename itself is made durable: the root is fsynced after it.
  after = [e for e in events[events.index(renames[0]):] if e[0] == "fsync"]
  assert ("fsync", str(tmp_path / "ck")) in after


def test_leftovers_of_a_killed_save_are_removed(tmp_path):
  base = tmp_path / "ck"
  ckpt = orbax_ckpt(base)
  ckpt.save(make_state(1))
  (base / "2.orbax-checkpoint-tmp-123" / "state").mkdir(parents=True)
  (base / "9.orbax-checkpoint-tmp-5").mkdir()
  # A removal killed after it took step 0 out of the listing.
  (base / "0.clu_ckpt-discarded" / "state").mkdir(parents=True)
  (base / "notes.clu_ckpt-discarded").mkdir()  # not a step's: left alone
  assert orbax_ckpt(base).latest_checkpoint == f"{base}/ckpt-1"
  ckpt.save(make_state(2))
  assert sorted(os.listdir(base)) == ["1", "2", "notes.clu_ckpt-discarded"]


def test_removal_never_follows_symlinks(tmp_path):
  base = tmp_path / "ck"
  outside = tmp_path / "outside"
  (outside / "keep").mkdir(parents=True)
  (outside / "keep" / "file").write_text("precious")
  ckpt = orbax_ckpt(base, max_to_keep=2)
  ckpt.save(make_state(1))
  # A step name, and a temporary name, that lead out of the root.
  os.symlink(outside / "keep", base / "0")
  os.symlink(outside, base / "5.orbax-checkpoint-tmp-1")
  for step in range(2, 5):
    ckpt.save(make_state(step))
  assert (outside / "keep" / "file").read_text() == "precious"
  assert sorted(os.listdir(base)) == ["3", "4"]


# ---------------------------------------------------------------------------
# Signatures.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("cls", ["Checkpoint", "MultihostCheckpoint"])
def test_layout_is_a_keyword_only_extension(cls):
  import inspect  # pylint: disable=g-import-not-at-top
  ours = inspect.signature(getattr(checkpoint, cls).__init__).parameters
  theirs = inspect.signature(getattr(clu_checkpoint, cls).__init__).parameters
  assert list(ours)[:len(theirs)] == list(theirs)
  assert list(ours)[len(theirs):] == ["layout"]
  assert ours["layout"].kind is inspect.Parameter.KEYWORD_ONLY
  assert ours["layout"].default is None


# ---------------------------------------------------------------------------
# Multi-host: real `jax.distributed` processes on localhost.
# ---------------------------------------------------------------------------

_HOST_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=sys.argv[2],
                               num_processes=2, process_id=int(sys.argv[1]))
    import numpy as np
    import tensorflow as tf
    from clu_ckpt import checkpoint

    def iterator():
      return iter(tf.data.Dataset.range(10_000).batch(4))

    def state(step):
      return {"w": np.full((3,), step, np.float32), "step": step}

    me, base = jax.process_index(), sys.argv[3]
    out = {"host": me}
    it = iterator()
    ckpt = checkpoint.MultihostCheckpoint(base, dict(ds_iter=it),
                                          layout="orbax", max_to_keep=3)
    out["latest"] = ckpt.get_latest_checkpoint_to_restore_from()
    restored = ckpt.restore_or_initialize(state(0))
    out["restored_step"] = int(restored["step"])
    out["after_restore"] = next(it).numpy().tolist()
    for step in (out["restored_step"] + 1, out["restored_step"] + 2):
      for _ in range(1 + me):  # each host reads its own amount of data
        next(it)
      out.setdefault("saved", []).append(ckpt.save(state(step)))
    out["next_after_save"] = next(it).numpy().tolist()
    # A restart: fresh objects and iterators restore the newest step.
    fresh = iterator()
    again = checkpoint.MultihostCheckpoint(base, dict(ds_iter=fresh),
                                           layout="orbax", max_to_keep=3)
    out["resumed_step"] = int(again.restore_or_initialize(state(0))["step"])
    out["resumed_next"] = next(fresh).numpy().tolist()
    print("RESULT " + json.dumps(out))
""")


def _run_hosts(tmp_path, base, count=2, timeout=300, script=_HOST_SCRIPT,
               args=()) -> dict:
  """Runs `script` in `count` jax.distributed processes on localhost
  (argv: process id, coordinator, `base`, *args); each prints RESULT json."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  path = tmp_path / "host.py"
  path.write_text(script)
  env = dict(os.environ, PYTHONPATH=f"{REPO}:{REPO / 'tests'}",
             JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
  procs = [subprocess.Popen(
      [sys.executable, str(path), str(i), f"127.0.0.1:{port}", str(base),
       *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      env=env, cwd=tmp_path) for i in range(count)]
  results = {}
  for proc in procs:
    try:
      out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      for p in procs:
        p.kill()
      pytest.fail("the processes timed out (a save waiting forever?)")
    assert proc.returncode == 0, err[-3000:]
    line = [l for l in out.splitlines() if l.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT "):])
    results[result["host"]] = result
  return results


def test_multihost_single_process_resumes_into_the_base_root(tmp_path):
  """The quick representative of the next test, in this process (one host):
  the newest CLU number the host directories share, then Orbax steps in
  the multihost base itself."""
  base = tmp_path / "checkpoints"
  it = dataset_iterator()
  clu = clu_checkpoint.MultihostCheckpoint(str(base), dict(ds_iter=it),
                                           host_id=0)
  for step in range(1, 3):
    batch(it)
    clu.save({"w": np.full((3,), step, np.float32), "step": step})
  expected_next = batch(it)
  fresh = dataset_iterator()
  ckpt = checkpoint.MultihostCheckpoint(str(base), dict(ds_iter=fresh),
                                        host_id=0, layout="orbax")
  assert ckpt.get_latest_checkpoint_to_restore_from() == f"{base}-0/ckpt-2"
  restored = ckpt.restore_or_initialize({"w": np.zeros(3, np.float32),
                                         "step": 0})
  assert restored["step"] == 2 and batch(fresh) == expected_next
  assert ckpt.save({"w": np.full((3,), 3, np.float32), "step": 3}) == (
      f"{base}-0/ckpt-3")
  assert orbax_root.list_steps(str(base))[0] == [3]
  assert not (base.parent / "checkpoints-0" / "ckpt-3.flax").exists()
  again = checkpoint.MultihostCheckpoint(str(base), dict(
      ds_iter=dataset_iterator()), host_id=0, layout="orbax")
  assert again.get_latest_checkpoint_to_restore_from() == f"{base}-0/ckpt-3"
  with ocp.CheckpointManager(base) as mngr:
    assert sorted(mngr.restore(3)["dataset"]) == ["process_0"]
  # Every host saves into the one root under its process index.
  with pytest.raises(errors.UsageError, match="jax.process_index"):
    checkpoint.MultihostCheckpoint(str(base), host_id=1, layout="orbax")


_PLAIN_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=sys.argv[2],
                               num_processes=2, process_id=int(sys.argv[1]))
    import numpy as np
    from clu_ckpt import checkpoint, errors

    me = jax.process_index()
    out = {"host": me}
    # CLU's pattern: a plain Checkpoint saved by process 0 alone, and one
    # per host in its own directory.
    ckpt = checkpoint.Checkpoint(f"{sys.argv[3]}/{me}", layout="orbax")
    if me == 0 or sys.argv[4] == "each":
      try:
        ckpt.save({"w": np.ones(3, np.float32)})
        out["saved"] = True
      except errors.UsageError as e:
        out["refused"] = str(e)
    # A restore by one process of the job is a read: no collective.
    from jax.experimental import multihost_utils
    restored = checkpoint.Checkpoint(sys.argv[5], layout="orbax")
    init = {"w": np.zeros(3, np.float32), "step": 0}
    if me == 0:
      out["alone"] = restored.restore_or_initialize(init)["w"].tolist()
    multihost_utils.sync_global_devices("restored alone")
    out["each"] = restored.restore(init)["w"].tolist()
    print("RESULT " + json.dumps(out), flush=True)
""")


@pytest.mark.parametrize("who", ["first", "each"])
def test_plain_checkpoint_in_a_multi_process_job_is_refused_not_hung(
    tmp_path, who):
  """Saving is refused; restoring by process 0 alone used to wait at Orbax's
  barrier of every process until the collectives timed out (30 s)."""
  saved = tmp_path / "saved"
  checkpoint.Checkpoint(str(saved), layout="orbax").save(
      {"w": np.arange(3, dtype=np.float32), "step": 7})
  results = _run_hosts(tmp_path, tmp_path / "ck", timeout=120,
                       script=_PLAIN_SCRIPT, args=(who, str(saved)))
  assert results[0]["alone"] == [0.0, 1.0, 2.0] and "alone" not in results[1]
  assert results[0]["each"] == results[1]["each"] == [0.0, 1.0, 2.0]
  savers = [0, 1] if who == "each" else [0]
  for host in savers:
    assert "saved" not in results[host]
    assert "MultihostCheckpoint" in results[host]["refused"]
    assert str(tmp_path / "ck" / str(host)) in results[host]["refused"]
  assert not any((tmp_path / "ck").glob("*/*"))  # nothing written


@pytest.mark.thorough
def test_multihost_resumes_across_the_switch_with_each_hosts_iterator(
    tmp_path):
  base = tmp_path / "checkpoints"
  # Before the switch: the real clu, one directory per host; host 1 saved
  # one checkpoint more (it was preempted after host 0's last save).
  for host, saves in ((0, 3), (1, 4)):
    it = dataset_iterator()
    ckpt = clu_checkpoint.MultihostCheckpoint(str(base), dict(ds_iter=it),
                                              host_id=host, max_to_keep=5)
    for step in range(1, saves + 1):
      for _ in range(1 + host):
        batch(it)
      ckpt.save({"w": np.full((3,), step, np.float32), "step": step})
  results = _run_hosts(tmp_path, base)
  for host in (0, 1):
    r = results[host]
    # The highest number every host has: 3 (host 1's ckpt-4 is newer).
    assert r["latest"] == f"{base}-{host}/ckpt-3"
    assert r["restored_step"] == 3
    # Each host's own iterator, where its CLU checkpoint left it.
    position = 3 * (1 + host)
    assert r["after_restore"] == list(range(4 * position, 4 * position + 4))
    assert r["saved"] == [f"{base}-{host}/ckpt-4", f"{base}-{host}/ckpt-5"]
    assert r["resumed_step"] == 5
    assert r["resumed_next"] == r["next_after_save"]
  assert results[0]["resumed_next"] != results[1]["resumed_next"]
  # One root for all hosts, the state written once; host 1's stale CLU
  # ckpt-4 is gone (the save after restoring 3 removes newer ones).
  assert orbax_root.list_steps(str(base))[0] == [4, 5]
  assert not (base.parent / "checkpoints-1" / "ckpt-4.flax").exists()
  with ocp.CheckpointManager(base) as mngr:
    out = mngr.restore(5)
  assert sorted(out["dataset"]) == ["process_0", "process_1"]
  np.testing.assert_array_equal(out["state"]["w"], np.full((3,), 5,
                                                           np.float32))
  assert out["metadata"]["host_ids"] == [0, 1]


# ---------------------------------------------------------------------------
# Kills in real processes (tests/soak/soak_kill_orbax_layout.py).
# ---------------------------------------------------------------------------


def _soak_module():
  sys.path.insert(0, str(REPO / "tests" / "soak"))
  import soak_kill_orbax_layout  # pylint: disable=g-import-not-at-top
  return soak_kill_orbax_layout


@pytest.mark.thorough
def test_kills_in_the_orbax_save_restore_the_last_committed(tmp_path):
  """The quick version of the soak: a CLU-layout run, then SIGKILLs before
  the commit (among the step's fsyncs) and while pruning; each fresh process
  restores exactly the last committed checkpoint of either layout."""
  soak = _soak_module()
  points = {p[1]: p for p in soak.KILL_POINTS}
  chain = soak.Chain(tmp_path / "ckpts")
  chain.start()  # CLU checkpoints 1..4
  # Saves 5 and 6 complete; the third save dies among the fsyncs of 7.
  r = chain.round(points["c:os.fsync@clu_ckpt.orbax_layout:fsync_tree"], 2,
                  save=3)
  assert (r["restored"], r["returncode"], r["saves"]) == (4, -9, 2)
  # 7 was never renamed into place: 6 is restored. Saving 7 removes nothing
  # (5, 6, 7 are the newest three; CLU 2-4 are only copies); saving 8
  # removes step 5 and dies there, after its commit: 8 is restored next.
  r = chain.round(points[f"py:{soak._DISCARD}"], 1, save=2)
  assert (r["restored"], r["returncode"], r["saves"]) == (6, -9, 1)
  assert soak.final_check(chain) == []
  assert chain.rounds[-1]["restored"] == 8


@pytest.mark.soak
def test_soak_kill_orbax_layout(tmp_path):
  assert _soak_module().main(["--rounds", "60", "--workdir",
                              str(tmp_path)]) == 0


def test_failed_save_leaves_nothing_listed_and_reuses_the_number(
    tmp_path, monkeypatch):
  # In-process: the step's fsync fails (a full disk), after all its files
  # are written but before the rename.
  it = dataset_iterator()
  ckpt = orbax_ckpt(tmp_path / "ck", dict(ds_iter=it))
  ckpt.save(make_state(1))
  real = orbax_layout.fsync_tree

  def failing(directory):
    raise OSError(28, "No space left on device", directory)

  monkeypatch.setattr(orbax_layout, "fsync_tree", failing)
  ckpt._orbax._target.before_commit = failing  # pylint: disable=protected-access
  with pytest.raises(OSError, match="No space left"):
    ckpt.save(make_state(2))
  assert sorted(os.listdir(tmp_path / "ck")) == ["1"]
  assert orbax_ckpt(tmp_path / "ck").latest_checkpoint == (
      f"{tmp_path}/ck/ckpt-1")
  ckpt._orbax._target.before_commit = real  # pylint: disable=protected-access
  assert ckpt.save(make_state(2)) == f"{tmp_path}/ck/ckpt-2"
  assert same_tree(orbax_ckpt(tmp_path / "ck").restore_dict(),
                   flax_state_dict(make_state(2)))
