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
