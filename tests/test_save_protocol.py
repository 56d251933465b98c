"""Tests for `clu_ckpt.save_protocol`: crash safety around TensorFlow's commit.

Real TensorFlow managers on real files in `tmp_path`; `.flax` files are
stand-ins (the protocol never reads them).
"""

import errno
import logging
import os
import pathlib

import pytest
import tensorflow as tf

from clu_ckpt import errors
from clu_ckpt import layout
from clu_ckpt import save_protocol
from clu_ckpt import storage
from clu_ckpt import tf_manager


def _setup(directory: pathlib.Path, saves: int, max_to_keep: int = 5):
  """A manager with `saves` committed checkpoints, each with a `.flax`."""
  directory.mkdir(exist_ok=True)
  tf_checkpoint = tf.train.Checkpoint(v=tf.Variable(1))
  manager = tf_manager.new_manager(tf_checkpoint, str(directory),
                                   max_to_keep=max_to_keep,
                                   checkpoint_name="ckpt")
  for _ in range(saves):
    number = int(tf_checkpoint.save_counter.numpy()) + 1
    (directory / f"ckpt-{number}.flax").write_bytes(b"flax")
    manager.save()
  return tf_checkpoint, manager


def _names(directory: pathlib.Path) -> set[str]:
  return set(os.listdir(directory))


def _listed(directory: pathlib.Path) -> tuple[str, list[str]]:
  state = layout.read_checkpoint_state(str(directory))
  return (os.path.basename(state.model_checkpoint_path),
          [os.path.basename(p) for p in state.all_model_checkpoint_paths])


def _files_of(number: int) -> set[str]:
  return {f"ckpt-{number}{ext}" for ext in
          (".flax", ".index", ".data-00000-of-00001")}


# --------------------------------------------------------------------------
# sweep_debris
# --------------------------------------------------------------------------


def test_sweep_removes_debris_but_never_a_checkpoint_with_its_index(tmp_path,
                                                                   caplog):
  _, manager = _setup(tmp_path, saves=4, max_to_keep=2)  # keeps 3, 4
  debris = {"ckpt-1.flax",             # pruned: no .index any more
            "ckpt-1.flax.tmp-x1",      # a killed .flax write, below oldest
            "ckpt-3_temp",             # TensorFlow's unfinished write
            "checkpoint.tmp1234"}      # TensorFlow's temporary state file
  kept = {"ckpt-2.flax", "ckpt-2.index",  # has its .index: never touched
          "ckpt-5_temp",                  # after the latest: not ours yet
          "ckpt-3.flax.tmp-x2",           # not below the oldest kept
          "notes.txt", "other-1.flax"}
  for name in debris | kept:
    if name.endswith("_temp"):
      (tmp_path / name).mkdir()
      (tmp_path / name / "part").write_bytes(b"x")
    else:
      (tmp_path / name).write_bytes(b"x")
  before = _names(tmp_path)
  with caplog.at_level(logging.INFO):
    save_protocol.sweep_debris(manager, str(tmp_path), "ckpt")
  assert _names(tmp_path) == before - debris
  assert _files_of(3) | _files_of(4) | kept <= _names(tmp_path)
  assert sorted(r.getMessage() for r in caplog.records
                if "leftover" in r.getMessage()) == sorted(
                    f"Removing leftover '{tmp_path}/{name}'" for name in debris)


def test_sweep_without_checkpoints_touches_nothing(tmp_path):
  _, manager = _setup(tmp_path, saves=0)
  (tmp_path / "ckpt-1.flax").write_bytes(b"x")
  (tmp_path / "ckpt-1_temp").mkdir()
  save_protocol.sweep_debris(manager, str(tmp_path), "ckpt")
  assert _names(tmp_path) == {"ckpt-1.flax", "ckpt-1_temp"}


def _unmanaged(directory: pathlib.Path, saves: int):
  """A manager of `saves` checkpoints listed but not managed: the state
  file's last_preserved_timestamp is in the future (a clock ahead of this
  one), so `manager.checkpoints` is empty while the latest is listed."""
  _setup(directory, saves=saves)
  state_file = directory / "checkpoint"
  lines = [l for l in state_file.read_text().splitlines()
           if not l.startswith("last_preserved_timestamp")]
  lines.append("last_preserved_timestamp: 9999999999.0")
  state_file.write_text("\n".join(lines) + "\n")
  manager = tf_manager.new_manager(tf.train.Checkpoint(v=tf.Variable(1)),
                                   str(directory), max_to_keep=5,
                                   checkpoint_name="ckpt")
  assert manager.checkpoints == []
  assert manager.latest_checkpoint == f"{directory}/ckpt-{saves}"
  return manager


def test_sweep_with_nothing_managed_touches_nothing(tmp_path):
  manager = _unmanaged(tmp_path, saves=2)
  (tmp_path / "ckpt-1_temp").mkdir()
  (tmp_path / "ckpt-0.flax").write_bytes(b"x")
  before = _names(tmp_path)
  save_protocol.sweep_debris(manager, str(tmp_path), "ckpt")
  assert _names(tmp_path) == before


def test_sweep_failure_is_only_logged(tmp_path, monkeypatch, caplog):
  _, manager = _setup(tmp_path, saves=2, max_to_keep=1)
  (tmp_path / "ckpt-1.flax").write_bytes(b"x")

  def failing_remove(path):
    raise OSError(errno.EROFS, "Read-only file system", path)

  monkeypatch.setattr(storage, "remove", failing_remove)
  with caplog.at_level(logging.WARNING):
    save_protocol.sweep_debris(manager, str(tmp_path), "ckpt")
  assert [r.getMessage() for r in caplog.records
          if r.levelno == logging.WARNING] == [
              f"Could not remove leftovers in {tmp_path}: [Errno 30] "
              f"Read-only file system: '{tmp_path}/ckpt-1.flax'"]
  assert (tmp_path / "ckpt-1.flax").exists()


# --------------------------------------------------------------------------
# delete_future_checkpoints
# --------------------------------------------------------------------------


def test_future_checkpoints_are_the_numbers_after_current(tmp_path):
  _, manager = _setup(tmp_path, saves=4)
  (tmp_path / "ckpt-5.flax").write_bytes(b"x")  # uncommitted leftover
  (tmp_path / "ckpt-7.flax").write_bytes(b"x")  # unlisted, after a gap
  future = save_protocol.future_checkpoints(manager, str(tmp_path), "ckpt", 2)
  assert {os.path.basename(c): {os.path.basename(p) for p in paths}
          for c, paths in future.items()} == {
              "ckpt-3": _files_of(3), "ckpt-4": _files_of(4),
              "ckpt-5": {"ckpt-5.flax"}}


def test_future_checkpoints_include_listed_ones_after_a_gap(tmp_path):
  _, manager = _setup(tmp_path, saves=4)
  for name in _files_of(3):
    (tmp_path / name).unlink()
  future = save_protocol.future_checkpoints(manager, str(tmp_path), "ckpt", 2)
  assert sorted(future) == [f"{tmp_path}/ckpt-3", f"{tmp_path}/ckpt-4"]
  assert future[f"{tmp_path}/ckpt-3"] == []


def test_future_checkpoints_include_listed_ones_around_a_gap(tmp_path):
  _, manager = _setup(tmp_path, saves=5)
  for name in _files_of(4):
    (tmp_path / name).unlink()
  future = save_protocol.future_checkpoints(manager, str(tmp_path), "ckpt", 2)
  assert {os.path.basename(c): {os.path.basename(p) for p in paths}
          for c, paths in future.items()} == {
              "ckpt-3": _files_of(3), "ckpt-4": set(), "ckpt-5": _files_of(5)}


def test_a_latest_checkpoint_outside_is_no_future_one(tmp_path, caplog):
  _setup(tmp_path, saves=3)
  elsewhere = tmp_path.parent / "elsewhere"
  (tmp_path / "checkpoint").write_text(
      f'model_checkpoint_path: "{elsewhere}/ckpt-9"\n' + "".join(
          f'all_model_checkpoint_paths: "{p}"\n'
          for p in (f"{tmp_path}/ckpt-1", f"{tmp_path}/ckpt-2",
                    f"{elsewhere}/ckpt-9")))
  manager = tf_manager.new_manager(tf.train.Checkpoint(v=tf.Variable(1)),
                                   str(tmp_path), max_to_keep=5,
                                   checkpoint_name="ckpt")
  assert manager.latest_checkpoint == f"{elsewhere}/ckpt-9"
  with caplog.at_level(logging.WARNING):
    future = save_protocol.future_checkpoints(manager, str(tmp_path), "ckpt",
                                              1)
  assert sorted(future) == [f"{tmp_path}/ckpt-2", f"{tmp_path}/ckpt-3"]
  assert [r.getMessage() for r in caplog.records
          if r.getMessage().startswith("The latest checkpoint")] == [
              f"The latest checkpoint {elsewhere}/ckpt-9 is outside "
              f"{tmp_path}: it is left alone"]


def test_future_checkpoints_are_unlisted_before_their_files_go(
    tmp_path, monkeypatch, caplog):
  _, manager = _setup(tmp_path, saves=4)
  (tmp_path / "ckpt-5_temp").mkdir()
  (tmp_path / "ckpt-7.flax").write_bytes(b"x")
  removed = []
  remove, remove_tree = storage.remove, storage.remove_tree

  def checked(real):
    def call(path):
      # Every file goes only once the state file no longer lists it.
      latest, listed = _listed(tmp_path)
      assert (latest, listed) == ("ckpt-2", ["ckpt-1", "ckpt-2"]), path
      removed.append(os.path.basename(path))
      real(path)
    return call

  monkeypatch.setattr(storage, "remove", checked(remove))
  monkeypatch.setattr(storage, "remove_tree", checked(remove_tree))
  with caplog.at_level(logging.INFO, logger="absl"):
    save_protocol.delete_future_checkpoints(manager, str(tmp_path), "ckpt", 2)
  assert set(removed) == _files_of(3) | _files_of(4) | {"ckpt-5_temp"}
  # One line naming each file or directory removed.
  cleaning = sorted(r.getMessage() for r in caplog.records
                    if r.getMessage().startswith("Cleaning"))
  assert cleaning == sorted(
      f"Cleaning up future checkpoint file '{tmp_path}/{name}'"
      for name in removed)
  assert _names(tmp_path) == ({"checkpoint", "ckpt-7.flax"} | _files_of(1) |
                              _files_of(2))
  assert manager.checkpoints == [f"{tmp_path}/ckpt-1", f"{tmp_path}/ckpt-2"]
  assert manager.latest_checkpoint == f"{tmp_path}/ckpt-2"


def test_future_checkpoints_from_zero_remove_the_state_file(tmp_path):
  _, manager = _setup(tmp_path, saves=2)
  save_protocol.delete_future_checkpoints(manager, str(tmp_path), "ckpt", 0)
  assert _names(tmp_path) == set()
  assert manager.latest_checkpoint is None


def test_an_unmanaged_current_checkpoint_stays_listed(tmp_path):
  """Checkpoints older than the state file's last_preserved_timestamp (a
  clock ahead of this one) are listed but not managed: when the future ones
  leave, the current one must stay the listed latest, at its own path."""
  _setup(tmp_path, saves=3)
  state_file = tmp_path / "checkpoint"
  lines = [l for l in state_file.read_text().splitlines()
           if not l.startswith("last_preserved_timestamp")]
  lines.append("last_preserved_timestamp: 9999999999.0")
  state_file.write_text("\n".join(lines) + "\n")
  manager = tf_manager.new_manager(tf.train.Checkpoint(v=tf.Variable(1)),
                                   str(tmp_path), max_to_keep=5,
                                   checkpoint_name="ckpt")
  assert manager.checkpoints == []  # nothing managed
  save_protocol.delete_future_checkpoints(manager, str(tmp_path), "ckpt", 1)
  state = layout.read_checkpoint_state(str(tmp_path))
  assert state.model_checkpoint_path == f"{tmp_path}/ckpt-1"
  assert state.all_model_checkpoint_paths == [f"{tmp_path}/ckpt-1"]
  assert _names(tmp_path) == {"checkpoint"} | _files_of(1)
  assert tf.train.latest_checkpoint(str(tmp_path)) == f"{tmp_path}/ckpt-1"


def test_no_future_checkpoints_leaves_everything(tmp_path):
  _, manager = _setup(tmp_path, saves=2)
  before = {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
  save_protocol.delete_future_checkpoints(manager, str(tmp_path), "ckpt", 2)
  assert {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before


def test_delete_checkpoints_unlists_them_then_removes_their_files(
    tmp_path, caplog):
  _, manager = _setup(tmp_path, saves=3)
  outside = tmp_path.parent / "elsewhere"
  with caplog.at_level(logging.INFO):
    save_protocol.delete_checkpoints(
        manager, str(tmp_path),
        [f"{tmp_path}/ckpt-1", f"{tmp_path}/ckpt-2", f"{outside}/ckpt-9"])
  assert _listed(tmp_path) == ("ckpt-3", ["ckpt-3"])
  assert _names(tmp_path) == {"checkpoint"} | _files_of(3)
  assert sorted(r.getMessage() for r in caplog.records
                if "Removing" in r.getMessage()) == sorted(
                    f"Removing checkpoint file '{tmp_path}/{name}'"
                    for name in _files_of(1) | _files_of(2))


def test_delete_checkpoints_keeps_an_unmanaged_latest_listed(tmp_path):
  """The latest checkpoint listed but not managed (older than the state
  file's last_preserved_timestamp) stays listed when every managed one is
  deleted: the directory still restores it."""
  _setup(tmp_path, saves=2)
  (tmp_path / "checkpoint").write_text(
      f'model_checkpoint_path: "{tmp_path}/ckpt-2"\n'
      f'all_model_checkpoint_paths: "{tmp_path}/ckpt-1"\n'
      f'all_model_checkpoint_paths: "{tmp_path}/ckpt-2"\n'
      "all_model_checkpoint_timestamps: 9999999999.0\n"  # the future: now
      "all_model_checkpoint_timestamps: 1.0\n"
      "last_preserved_timestamp: 5.0\n")
  manager = tf_manager.new_manager(tf.train.Checkpoint(v=tf.Variable(1)),
                                   str(tmp_path), max_to_keep=5,
                                   checkpoint_name="ckpt")
  assert manager.checkpoints == [f"{tmp_path}/ckpt-1"]
  assert manager.latest_checkpoint == f"{tmp_path}/ckpt-2"
  save_protocol.delete_checkpoints(manager, str(tmp_path),
                                   [f"{tmp_path}/ckpt-1"])
  assert _listed(tmp_path) == ("ckpt-2", ["ckpt-2"])
  assert _names(tmp_path) == {"checkpoint"} | _files_of(2)
  assert tf.train.latest_checkpoint(str(tmp_path)) == f"{tmp_path}/ckpt-2"


# --------------------------------------------------------------------------
# committed, failed_commit, commit
# --------------------------------------------------------------------------


def test_committed(tmp_path):
  assert save_protocol.committed(str(tmp_path), f"{tmp_path}/ckpt-1") is False
  _setup(tmp_path, saves=2)
  assert save_protocol.committed(str(tmp_path), f"{tmp_path}/ckpt-2") is True
  assert save_protocol.committed(str(tmp_path), f"{tmp_path}/ckpt-3") is False
  (tmp_path / "checkpoint").write_bytes(
      b'model_checkpoint_path: "caf\xc3\xa9\xff"\n')
  assert save_protocol.committed(str(tmp_path), f"{tmp_path}/ckpt-2") is None


def _failed_write(tmp_path, tf_checkpoint, number):
  """What a TensorFlow write that failed before its commit leaves."""
  tf_checkpoint.save_counter.assign_add(1)
  (tmp_path / f"ckpt-{number}.flax").write_bytes(b"flax")
  (tmp_path / f"ckpt-{number}.index").write_bytes(b"partial")
  (tmp_path / f"ckpt-{number}_temp").mkdir()


def test_failed_commit_undoes_an_uncommitted_save(tmp_path):
  tf_checkpoint, _ = _setup(tmp_path, saves=2)
  _failed_write(tmp_path, tf_checkpoint, 3)
  rereads = []
  error = tf.errors.ResourceExhaustedError(None, None,
                                           "No space left on device")
  got = save_protocol.failed_commit(
      tf_checkpoint, str(tmp_path), f"{tmp_path}/ckpt-3", 2, error,
      reread=lambda: rereads.append(1))
  assert isinstance(got, errors.CheckpointWriteError)
  assert got.errno == errno.ENOSPC and got.filename == f"{tmp_path}/ckpt-3"
  assert f"Could not write checkpoint {tmp_path}/ckpt-3; earlier " \
         "checkpoints are intact" in str(got)
  assert int(tf_checkpoint.save_counter.numpy()) == 2
  assert _names(tmp_path) == {"checkpoint"} | _files_of(1) | _files_of(2)
  assert rereads == [1]


def test_failed_commit_after_the_commit_keeps_the_checkpoint(tmp_path):
  tf_checkpoint, _ = _setup(tmp_path, saves=3)
  before = _names(tmp_path)
  error = OSError(errno.EIO, "Input/output error")
  got = save_protocol.failed_commit(
      tf_checkpoint, str(tmp_path), f"{tmp_path}/ckpt-3", 2, error,
      reread=lambda: None)
  assert f"Checkpoint {tmp_path}/ckpt-3 was committed, but removing older " \
         "checkpoints failed" in str(got)
  assert int(tf_checkpoint.save_counter.numpy()) == 3
  assert _names(tmp_path) == before


def test_failed_commit_with_an_unreadable_state_file_touches_nothing(
    tmp_path):
  tf_checkpoint, _ = _setup(tmp_path, saves=2)
  _failed_write(tmp_path, tf_checkpoint, 3)
  (tmp_path / "checkpoint").write_bytes(b'model_checkpoint_path: "\xff"\n')
  before = _names(tmp_path)
  got = save_protocol.failed_commit(
      tf_checkpoint, str(tmp_path), f"{tmp_path}/ckpt-3", 2,
      OSError(errno.EIO, "Input/output error"), reread=lambda: None)
  assert f"Could not write checkpoint {tmp_path}/ckpt-3, nor read " \
         f"{tmp_path}/checkpoint to tell whether it was committed" in str(got)
  assert int(tf_checkpoint.save_counter.numpy()) == 3
  assert _names(tmp_path) == before


def test_failed_commit_returns_other_errors_as_they_are(tmp_path, caplog):
  tf_checkpoint, _ = _setup(tmp_path, saves=1)
  _failed_write(tmp_path, tf_checkpoint, 2)
  error = ValueError("the iterator cannot be saved")

  def failing_reread():
    raise OSError(errno.EMFILE, "Too many open files")

  with caplog.at_level(logging.WARNING):
    got = save_protocol.failed_commit(
        tf_checkpoint, str(tmp_path), f"{tmp_path}/ckpt-2", 1, error,
        reread=failing_reread)
  assert got is error
  assert [r.getMessage() for r in caplog.records] == [
      f"Could not re-read {tmp_path} after a failed save: [Errno 24] Too many "
      "open files"]
  assert int(tf_checkpoint.save_counter.numpy()) == 1
  assert _names(tmp_path) == {"checkpoint"} | _files_of(1)


def test_an_undo_that_cannot_remove_the_files_is_only_logged(
    tmp_path, monkeypatch, caplog):
  tf_checkpoint, _ = _setup(tmp_path, saves=2)
  _failed_write(tmp_path, tf_checkpoint, 3)

  def refused(path):
    raise PermissionError(errno.EACCES, "Permission denied", path)

  monkeypatch.setattr(storage, "remove", refused)
  error = OSError(errno.EIO, "Input/output error")
  with caplog.at_level(logging.WARNING):
    got = save_protocol.failed_commit(
        tf_checkpoint, str(tmp_path), f"{tmp_path}/ckpt-3", 2, error,
        reread=lambda: None)
  assert f"Could not write checkpoint {tmp_path}/ckpt-3; earlier " \
         "checkpoints are intact" in str(got)
  assert int(tf_checkpoint.save_counter.numpy()) == 2  # put back all the same
  first = sorted(storage.glob(f"{tmp_path}/ckpt-3.*"))[0]
  assert [r.getMessage() for r in caplog.records] == [
      f"Could not remove the files of the failed save {tmp_path}/ckpt-3 (a "
      f"later save replaces them): [Errno 13] Permission denied: '{first}'"]


def test_commit_writes_and_commits(tmp_path):
  tf_checkpoint, manager = _setup(tmp_path, saves=1)
  (tmp_path / "ckpt-2.flax").write_bytes(b"flax")
  save_protocol.commit(manager, tf_checkpoint, str(tmp_path),
                       f"{tmp_path}/ckpt-2", reread=pytest.fail)
  assert _listed(tmp_path) == ("ckpt-2", ["ckpt-1", "ckpt-2"])
  assert _files_of(2) <= _names(tmp_path)


def test_commit_undoes_a_failed_write_and_raises_an_os_error(
    tmp_path, monkeypatch):
  tf_checkpoint, manager = _setup(tmp_path, saves=1)
  cause = tf.errors.ResourceExhaustedError(None, None,
                                           "No space left on device")

  def failing_save():
    _failed_write(tmp_path, tf_checkpoint, 2)
    raise cause

  monkeypatch.setattr(manager, "save", failing_save)
  rereads = []
  with pytest.raises(errors.CheckpointWriteError) as raised:
    save_protocol.commit(manager, tf_checkpoint, str(tmp_path),
                         f"{tmp_path}/ckpt-2", reread=lambda: rereads.append(1))
  assert raised.value.__cause__ is cause
  assert raised.value.errno == errno.ENOSPC
  assert int(tf_checkpoint.save_counter.numpy()) == 1
  assert _names(tmp_path) == {"checkpoint"} | _files_of(1)
  assert rereads == [1]


def test_commit_reraises_other_errors_unchanged(tmp_path, monkeypatch):
  tf_checkpoint, manager = _setup(tmp_path, saves=1)
  cause = ValueError("the iterator cannot be saved")

  def failing_save():
    tf_checkpoint.save_counter.assign_add(1)
    raise cause

  monkeypatch.setattr(manager, "save", failing_save)
  with pytest.raises(ValueError) as raised:
    save_protocol.commit(manager, tf_checkpoint, str(tmp_path),
                         f"{tmp_path}/ckpt-2", reread=lambda: None)
  assert raised.value is cause
  assert int(tf_checkpoint.save_counter.numpy()) == 1
