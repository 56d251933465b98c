"""Tests for `clu_ckpt.tf_manager`: the one user of TensorFlow's private API."""

import os
import pathlib
import re

import pytest
import tensorflow as tf

from clu_ckpt import errors
from clu_ckpt import tf_manager

REPO = pathlib.Path(__file__).resolve().parents[1]


def _manager(directory, **kwargs):
  return tf_manager.new_manager(
      tf.train.Checkpoint(v=tf.Variable(1)), str(directory),
      max_to_keep=kwargs.get("max_to_keep", 3), checkpoint_name="ckpt")


def test_installed_tensorflow_is_one_the_private_api_was_checked_against():
  # Each stack of the matrix (noxfile.py) runs this with its own TensorFlow;
  # test_private_attributes_exist_and_behave checks the attributes there.
  version = ".".join(tf.__version__.split(".")[:2])
  assert version in tf_manager.CHECKED_TENSORFLOW, (
      f"TensorFlow {tf.__version__}: run the matrix's session for it "
      "(noxfile.py), re-check tf_manager.PRIVATE_ATTRIBUTES and add the "
      "version to CHECKED_TENSORFLOW")


def test_checked_tensorflow_names_the_matrix_stacks():
  noxfile = (REPO / "noxfile.py").read_text()
  pinned = sorted(set(re.findall(r'"tensorflow-cpu==(\d+\.\d+)\.\d+"',
                                 noxfile)))
  assert pinned == sorted(tf_manager.CHECKED_TENSORFLOW)


def test_private_attributes_exist_and_behave(tmp_path):
  manager = _manager(tmp_path)
  for name in tf_manager.PRIVATE_ATTRIBUTES:
    assert hasattr(manager, name), name
  manager.save()
  manager.save()
  # `_maybe_delete` is the ordered path -> timestamp map behind `checkpoints`.
  assert list(manager._maybe_delete) == manager.checkpoints  # pylint: disable=protected-access
  assert callable(manager._record_state)  # pylint: disable=protected-access


def test_a_missing_private_attribute_is_a_clear_error(tmp_path, monkeypatch):
  monkeypatch.setattr(tf_manager, "PRIVATE_ATTRIBUTES",
                      tf_manager.PRIVATE_ATTRIBUTES + ("_gone_in_tf_9",))
  with pytest.raises(errors.PrivateApiError,
                     match=r"_gone_in_tf_9.*TensorFlow .*checked against"):
    _manager(tmp_path)


def test_unlist_rewrites_the_state_file_as_tensorflow_would(tmp_path):
  manager = _manager(tmp_path)
  for _ in range(3):
    manager.save()
  tf_manager.unlist(manager, str(tmp_path), [f"{tmp_path}/ckpt-3"],
                    current=f"{tmp_path}/ckpt-2")
  fresh = _manager(tmp_path)
  assert fresh.checkpoints == [f"{tmp_path}/ckpt-1", f"{tmp_path}/ckpt-2"]
  assert fresh.latest_checkpoint == f"{tmp_path}/ckpt-2"


def test_outside_entries_never_reach_the_prune_list(tmp_path):
  (tmp_path / "run").mkdir()
  manager = _manager(tmp_path / "run")
  manager.save()
  state = (tmp_path / "run" / "checkpoint").read_text()
  stamp = re.search(r"all_model_checkpoint_timestamps: (\S+)", state).group(1)
  outside = tmp_path / "outside" / "ckpt-9"
  state = (f'all_model_checkpoint_paths: "{outside}"\n'
           f"all_model_checkpoint_timestamps: {float(stamp) - 1}\n" + state)
  (tmp_path / "run" / "checkpoint").write_text(state)
  assert str(outside) not in _manager(tmp_path / "run").checkpoints


def test_is_the_only_module_touching_the_private_api():
  pattern = re.compile(r"\._(maybe_delete|latest_checkpoint|record_state|"
                       r"last_preserved_timestamp)\b")
  users = [p.name for p in (REPO / "clu_ckpt").rglob("*.py")
           if pattern.search(p.read_text())]
  assert users == ["tf_manager.py"]


def test_tensorflow_io_errors_become_os_errors():
  error = tf.errors.ResourceExhaustedError(None, None,
                                           "No space left on device")
  assert tf_manager.is_io_error(error)
  converted = tf_manager.as_os_error(error, "Could not write", "/c/ckpt-3")
  assert isinstance(converted, OSError) and converted.errno == 28
  assert converted.filename == "/c/ckpt-3"
  assert not tf_manager.is_io_error(ValueError("bad iterator"))


# ---------------------------------------------------------------------------
# ObjectStoreManager: TensorFlow's bookkeeping, clu_ckpt's I/O.
# ---------------------------------------------------------------------------


def test_uses_object_store():
  assert tf_manager.uses_object_store("gs://b/run")
  assert tf_manager.uses_object_store("S3://b/run")
  assert not tf_manager.uses_object_store("/local/run")
  assert not tf_manager.uses_object_store("file:///local/run")
  assert not tf_manager.uses_object_store("hdfs://n/run")


def _normalized(text: str) -> str:
  return re.sub(r"(timestamps?: )[0-9.e+-]+", r"\1T", text)


def test_object_store_manager_keeps_tensorflows_books(tmp_path):
  """Same saves, same files and state file as TensorFlow's manager.

  (ObjectStoreManager writes through `clu_ckpt.storage`, so a local
  directory serves as the store here; tests/test_checkpoint_buckets.py runs
  it on the emulators.)
  """
  ours_dir, tf_dir = tmp_path / "ours", tmp_path / "tf"
  ours_dir.mkdir()
  v1, v2 = tf.Variable(0), tf.Variable(0)
  ours = tf_manager.ObjectStoreManager(
      tf.train.Checkpoint(v=v1), str(ours_dir), max_to_keep=2,
      checkpoint_name="ckpt")
  theirs = tf.train.CheckpointManager(tf.train.Checkpoint(v=v2), str(tf_dir),
                                      max_to_keep=2, checkpoint_name="ckpt")
  for step in range(1, 5):
    v1.assign(step)
    v2.assign(step)
    assert ours.save() == f"{ours_dir}/ckpt-{step}"
    assert theirs.save() == f"{tf_dir}/ckpt-{step}"
    assert sorted(os.listdir(ours_dir)) == sorted(os.listdir(tf_dir))
    assert _normalized((ours_dir / "checkpoint").read_text()) == _normalized(
        (tf_dir / "checkpoint").read_text())
    assert [p.replace(str(ours_dir), "") for p in ours.checkpoints] == [
        p.replace(str(tf_dir), "") for p in theirs.checkpoints]
  # A fresh TensorFlow manager reads our books as its own.
  again = tf.train.CheckpointManager(tf.train.Checkpoint(v=tf.Variable(0)),
                                     str(ours_dir), max_to_keep=2)
  assert again.checkpoints == ours.checkpoints
  assert again._maybe_delete == ours._maybe_delete  # pylint: disable=protected-access
  restored = tf.Variable(0)
  ckpt = tf.train.Checkpoint(v=restored)
  ckpt.restore(again.latest_checkpoint).assert_consumed()
  assert int(restored.numpy()) == 4 and int(ckpt.save_counter.numpy()) == 4
  # And ours reads TensorFlow's.
  reread = tf_manager.ObjectStoreManager(
      tf.train.Checkpoint(v=tf.Variable(0)), str(tf_dir), max_to_keep=2,
      checkpoint_name="ckpt")
  assert reread._maybe_delete == theirs._maybe_delete  # pylint: disable=protected-access
  assert (reread._last_preserved_timestamp ==  # pylint: disable=protected-access
          theirs._last_preserved_timestamp)  # pylint: disable=protected-access


def test_object_store_manager_finishes_a_killed_pruning(tmp_path):
  v = tf.Variable(0)
  manager = tf_manager.ObjectStoreManager(
      tf.train.Checkpoint(v=v), str(tmp_path), max_to_keep=1,
      checkpoint_name="ckpt")
  manager.save()
  manager.save()
  assert not (tmp_path / "ckpt-1.index").exists()
  assert not (tmp_path / tf_manager.PRUNING_FILENAME).exists()
  # Killed after the commit of ckpt-2, before ckpt-1's files were deleted:
  # the pruning file names ckpt-1 (unlisted: goes) and, say, ckpt-2 (listed:
  # stays).
  (tmp_path / "ckpt-1.index").write_bytes(b"x")
  (tmp_path / "ckpt-1.data-00000-of-00001").write_bytes(b"x")
  (tmp_path / tf_manager.PRUNING_FILENAME).write_text(
      f'["{tmp_path}/ckpt-1", "{tmp_path}/ckpt-2"]')
  fresh = tf_manager.ObjectStoreManager(
      tf.train.Checkpoint(v=tf.Variable(0)), str(tmp_path), max_to_keep=1,
      checkpoint_name="ckpt")
  fresh._finish_pruning()  # pylint: disable=protected-access
  assert sorted(os.listdir(tmp_path)) == [
      "checkpoint", "ckpt-2.data-00000-of-00001", "ckpt-2.index"]


def test_a_killed_pruning_never_deletes_what_the_state_file_lists(tmp_path):
  manager = tf_manager.ObjectStoreManager(
      tf.train.Checkpoint(v=tf.Variable(0)), str(tmp_path), max_to_keep=2,
      checkpoint_name="ckpt")
  manager.save()
  manager.save()
  (tmp_path / tf_manager.PRUNING_FILENAME).write_text(
      f'["{tmp_path}/ckpt-1"]')
  fresh = tf_manager.ObjectStoreManager(
      tf.train.Checkpoint(v=tf.Variable(0)), str(tmp_path), max_to_keep=2,
      checkpoint_name="ckpt")
  # A manager whose clock is behind the file's: it manages nothing, but the
  # state file still lists ckpt-1, so its files stay.
  fresh._maybe_delete.clear()  # pylint: disable=protected-access
  fresh._finish_pruning()  # pylint: disable=protected-access
  assert (tmp_path / "ckpt-1.index").exists()
  assert not (tmp_path / tf_manager.PRUNING_FILENAME).exists()
