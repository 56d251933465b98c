"""Tests of clu_ckpt.migration.plan: a state's step, save times."""

import os
import re

import numpy as np
import pytest
from clu import checkpoint as clu_checkpoint

from clu_ckpt import flax_format
from clu_ckpt import migration
from clu_ckpt.migration import plan


@pytest.mark.parametrize("step,want", [
    (7, 7), (np.int64(7), 7), (np.uint8(3), 3), (np.asarray(5, np.int32), 5),
    (1.5, None), (np.float32(2), None), (np.arange(2), None), ("7", None),
])
def test_state_step_from_a_path_or_a_handle(step, want, tmp_path):
  path = str(tmp_path / "ckpt-1.flax")
  flax_format.save_file({"step": step, "w": np.ones(3)}, path)
  assert plan.state_step(path) == want
  with flax_format.FlaxFile(path) as handle:
    assert migration.state_step(handle) == want


def test_state_step_without_a_step(tmp_path):
  path = str(tmp_path / "ckpt-1.flax")
  flax_format.save_file({"w": np.ones(3), "nested": {"step": 3}}, path)
  assert plan.state_step(path) is None


def test_state_step_of_a_corrupt_file_raises(tmp_path):
  path = tmp_path / "ckpt-1.flax"
  path.write_bytes(flax_format.save({"step": 1, "w": np.ones(3)})[:-2])
  with pytest.raises(flax_format.FlaxFormatError):
    plan.state_step(str(path))


# --------------------------------------------------------------------------
# discover: each checkpoint's save time.
# --------------------------------------------------------------------------


def _clu_source(directory, steps=(1, 2)):
  ckpt = clu_checkpoint.Checkpoint(str(directory))
  for step in steps:
    ckpt.save({"step": np.int64(step), "w": np.ones(2)})
  return directory


def _write_state(directory, paths, stamps, last=None):
  lines = [f'model_checkpoint_path: "{paths[-1]}"']
  lines += [f'all_model_checkpoint_paths: "{p}"' for p in paths]
  lines += [f"all_model_checkpoint_timestamps: {t!r}" for t in stamps]
  if last is not None:
    lines.append(f"last_preserved_timestamp: {last!r}")
  (directory / "checkpoint").write_text("\n".join(lines) + "\n")


def test_saved_at_is_the_timestamp_tensorflow_recorded(tmp_path):
  src = _clu_source(tmp_path / "src")
  text = (src / "checkpoint").read_text()
  recorded = [float(v) for v in re.findall(
      r"all_model_checkpoint_timestamps: (\S+)", text)]
  assert len(recorded) == 2
  found = plan.discover(str(src)).checkpoints
  assert [c.saved_at for c in found] == recorded
  # Not the files' times: set them apart, and the recorded ones still count.
  for n in (1, 2):
    os.utime(src / f"ckpt-{n}.flax", (1e9, 1e9))
  _write_state(src, ["ckpt-1", "ckpt-2"], [1000.25, 2000.5], last=1.0)
  found = plan.discover(str(src)).checkpoints
  assert [(c.number, c.saved_at) for c in found] == [(1, 1000.25),
                                                     (2, 2000.5)]


def test_saved_at_falls_back_to_the_flax_modification_time(tmp_path):
  src = _clu_source(tmp_path / "src")
  os.utime(src / "ckpt-1.flax", (5e8, 500000000.25))
  os.utime(src / "ckpt-2.flax", (6e8, 600000000.75))
  # Timestamps pair with paths by position (as TensorFlow zips them): the
  # latest checkpoint has none here, so its `.flax` time is used.
  _write_state(src, ["ckpt-1", "ckpt-2"], [1000.25], last=1.0)
  found = plan.discover(str(src)).checkpoints
  assert [(c.number, c.saved_at) for c in found] == [
      (1, 1000.25), (2, os.stat(src / "ckpt-2.flax").st_mtime)]
  assert found[1].saved_at == pytest.approx(600000000.75, abs=1e-6)
  # No timestamps at all: only the latest is listed, with its `.flax` time.
  _write_state(src, ["ckpt-1", "ckpt-2"], [])
  found = plan.discover(str(src)).checkpoints
  assert [(c.number, c.saved_at) for c in found] == [
      (2, os.stat(src / "ckpt-2.flax").st_mtime)]


def test_saved_at_of_a_multihost_source_is_the_state_hosts(tmp_path):
  base = tmp_path / "src" / "ckpts"
  for host in (0, 1):
    ckpt = clu_checkpoint.MultihostCheckpoint(str(base), host_id=host)
    ckpt.save({"step": np.int64(1), "w": np.ones(2)})
  _write_state(tmp_path / "src" / "ckpts-0", ["ckpt-1"], [111.5], last=1.0)
  _write_state(tmp_path / "src" / "ckpts-1", ["ckpt-1"], [222.5], last=1.0)
  found = plan.discover(str(base)).checkpoints
  assert [(c.number, c.saved_at) for c in found] == [(1, 111.5)]


def test_a_constructed_source_checkpoint_has_no_time():
  assert plan.SourceCheckpoint(3, {0: "/c/ckpt-3"}).saved_at is None


@pytest.mark.parametrize("step,want", [
    (7, 7), (np.int64(7), 7), (np.asarray(5, np.int32), 5), (1.5, None),
    (np.arange(2), None), (True, None),
])
def test_peek_step_reads_only_the_head_of_a_bucket_file(gcs, monkeypatch,
                                                        step, want):
  from clu_ckpt import fsspec_fs  # pylint: disable=g-import-not-at-top
  maps = []
  real_map = fsspec_fs.FsspecFileSystem.map
  monkeypatch.setattr(fsspec_fs.FsspecFileSystem, "map",
                      lambda self, path, **kw: maps.append(path) or real_map(
                          self, path, **kw))
  path = f"gs://{gcs.bucket()}/run/ckpt-1.flax"
  big = np.zeros(3 * plan.PEEK_BYTES // 4, np.float32)  # 3 MiB after `step`
  flax_format.save_file({"step": step, "w": big}, path)
  assert plan.peek_step(path) == (
      want, len(flax_format.save({"step": step, "w": big})))
  assert maps == []  # never downloaded whole
  # `step` after 3 MiB of arrays: the headers are read by ranges (the
  # arrays skipped, never the whole file), same answer.
  flax_format.save_file({"a": big, "step": step}, path)
  assert plan.peek_step(path)[0] == want
  assert maps == []


# ---------------------------------------------------------------------------
# Flax's own layout: `flax.training.checkpoints` files.
# ---------------------------------------------------------------------------


def _flax_files(directory, steps, prefix="checkpoint_"):
  import warnings  # pylint: disable=g-import-not-at-top
  import flax  # pylint: disable=g-import-not-at-top
  from flax.training import checkpoints  # pylint: disable=g-import-not-at-top
  flax.config.update("flax_use_orbax_checkpointing", False)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    for step in steps:
      checkpoints.save_checkpoint(
          str(directory), {"step": step * 100, "params": {
              "w": np.arange(4, dtype=np.float32) * step}, "name": "adam"},
          step, prefix=prefix, keep=3)


def test_discover_flax_training_files(tmp_path):
  _flax_files(tmp_path / "run", [2, 4, 6, 8])
  (tmp_path / "run" / "checkpoint_tmp").write_bytes(b"\x80")
  src = plan.discover(str(tmp_path / "run"))
  assert src.kind == plan.FLAX_TRAINING_KIND
  assert [c.number for c in src.checkpoints] == [4, 6, 8]
  assert src.checkpoints[-1].flax_path(0) == str(
      tmp_path / "run" / "checkpoint_8")
  naming, mapping = plan.name_steps(src.checkpoints, {4: 400, 6: 600, 8: 800})
  assert (naming, mapping) == ("number", {4: 4, 6: 6, 8: 8})
  _flax_files(tmp_path / "other", [3], prefix="model_")
  assert [c.name for c in plan.discover(str(tmp_path / "other")).checkpoints
          ] == ["model_3"]
  with pytest.raises(migration.MigrationError, match="flax.training"):
    plan.discover(str(tmp_path / "nothing"))


def test_migrated_flax_files_restore_with_stock_orbax(tmp_path):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from flax.training import checkpoints  # pylint: disable=g-import-not-at-top
  from migration_helpers import same_tree  # pylint: disable=g-import-not-at-top
  from clu_ckpt import checkpoint  # pylint: disable=g-import-not-at-top
  _flax_files(tmp_path / "run", [5, 10, 15])
  summary = migration.migrate(str(tmp_path / "run"), str(tmp_path / "orbax"),
                              verify=True)
  assert summary.ok, summary.failed
  assert [s.step for s in summary.steps] == [5, 10, 15]
  with ocp.CheckpointManager(str(tmp_path / "orbax")) as mngr:
    assert list(mngr.all_steps()) == [5, 10, 15]
    restored = mngr.restore(10, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore()))
    assert "dataset" not in mngr.item_metadata(10)
  want = checkpoints.restore_checkpoint(str(tmp_path / "run"), None, step=10)
  np.testing.assert_array_equal(restored["state"]["params"]["w"],
                                want["params"]["w"])
  assert restored["state"]["name"] == "adam"
  assert same_tree(migration.restore_state(str(tmp_path / "orbax"), 10), want)
  assert same_tree(checkpoint.load_state_dict(str(tmp_path / "orbax")),
                   checkpoints.restore_checkpoint(str(tmp_path / "run"), None))
  from clu_ckpt import orbax_root  # pylint: disable=g-import-not-at-top
  result = orbax_root.verify_orbax_root(str(tmp_path / "orbax"),
                                        source=str(tmp_path / "run"))
  assert result["ok"], result["problems"]
