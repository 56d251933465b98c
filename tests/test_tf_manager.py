"""Tests for `clu_ckpt.tf_manager`: the one user of TensorFlow's private API."""

import collections
import contextlib
import errno
import json
import logging
import os
import pathlib
import re
import subprocess
import time

import pytest
import tensorflow as tf

from clu_ckpt import errors
from clu_ckpt import storage
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


# ---------------------------------------------------------------------------
# What each function promises, exactly (messages included).
# ---------------------------------------------------------------------------


def test_a_missing_private_attribute_error_names_all_and_what_to_do(
    tmp_path, monkeypatch):
  monkeypatch.setattr(tf_manager, "PRIVATE_ATTRIBUTES",
                      tf_manager.PRIVATE_ATTRIBUTES + ("_gone_a", "_gone_b"))
  with pytest.raises(errors.PrivateApiError) as raised:
    _manager(tmp_path)
  assert str(raised.value) == (
      f"tf.train.CheckpointManager has no _gone_a, _gone_b in TensorFlow "
      f"{tf.__version__}; clu_ckpt was checked against TensorFlow "
      f"{', '.join(tf_manager.CHECKED_TENSORFLOW)}. Install one of those or "
      "a clu_ckpt release that supports this TensorFlow.")


def test_new_manager_hands_its_arguments_to_tensorflow(tmp_path):
  manager = tf_manager.new_manager(
      tf.train.Checkpoint(v=tf.Variable(1)), str(tmp_path), max_to_keep=2,
      checkpoint_name="model")
  assert isinstance(manager, tf.train.CheckpointManager)
  assert manager.latest_checkpoint is None
  for _ in range(3):
    manager.save()
  assert manager.directory == str(tmp_path)
  assert manager.checkpoints == [f"{tmp_path}/model-2", f"{tmp_path}/model-3"]


@pytest.fixture(name="bucket")
def bucket_fixture(monkeypatch):
  """`gs://` served by a dict (test_local_fs.MemoryObjectStore)."""
  from test_local_fs import MemoryObjectStore  # pylint: disable=g-import-not-at-top
  store = MemoryObjectStore()
  monkeypatch.setattr(storage, "_FACTORIES", dict(storage._FACTORIES))  # pylint: disable=protected-access
  monkeypatch.setattr(storage, "_INSTANCES", {})  # pylint: disable=protected-access
  storage.register_filesystem("gs", lambda: store)
  return store


def test_new_manager_of_a_bucket_keeps_the_books_itself(bucket, caplog):
  v = tf.Variable(1)
  manager = tf_manager.new_manager(tf.train.Checkpoint(v=v), "gs://b/run",
                                   max_to_keep=2, checkpoint_name="model")
  assert isinstance(manager, tf_manager.ObjectStoreManager)
  assert manager.directory == "gs://b/run"
  for _ in range(3):
    manager.save()
  assert manager.checkpoints == ["gs://b/run/model-2", "gs://b/run/model-3"]
  assert sorted(bucket.objects) == ["gs://b/run/checkpoint"] + [
      f"gs://b/run/model-{n}{s}" for n in (2, 3)
      for s in (".data-00000-of-00001", ".index")]
  # A listed checkpoint outside the directory is never managed (pruned).
  state = bucket.objects["gs://b/run/checkpoint"].decode()
  bucket.objects["gs://b/run/checkpoint"] = (
      'all_model_checkpoint_paths: "../other/model-1"\n'
      f"all_model_checkpoint_timestamps: {time.time() - 1}\n" + state).encode()
  with caplog.at_level(logging.WARNING):
    again = tf_manager.new_manager(tf.train.Checkpoint(v=v), "gs://b/run",
                                   max_to_keep=2, checkpoint_name="model")
  assert again.checkpoints == ["gs://b/run/model-2", "gs://b/run/model-3"]
  assert [r.getMessage() for r in caplog.records] == [
      "gs://b/run/checkpoint lists gs://b/run/../other/model-1, which is "
      "outside "
      "gs://b/run: it is left alone (never pruned or deleted)"]


def test_outside_entries_are_named_in_a_warning(tmp_path, caplog):
  run = tmp_path / "run"
  run.mkdir()
  _manager(run).save()
  state = (run / "checkpoint").read_text()
  outside = tmp_path / "outside" / "ckpt-9"
  (run / "checkpoint").write_text(
      f'all_model_checkpoint_paths: "{outside}"\n'
      f"all_model_checkpoint_timestamps: {time.time() - 1}\n" + state)
  with caplog.at_level(logging.WARNING):
    assert _manager(run).checkpoints == [f"{run}/ckpt-1"]
  assert [r.getMessage() for r in caplog.records] == [
      f"{run}/checkpoint lists {outside}, which is outside {run}: it is left "
      "alone (never pruned or deleted)"]


@contextlib.contextmanager
def _unblocking(fifo: pathlib.Path, seconds: float = 5.0):
  """Opens `fifo` for writing after `seconds` (in another process: TensorFlow
  blocks in open(2) holding the GIL), so that a reader stuck on it wakes up.
  Yields a function telling whether that was needed."""
  marker = fifo.parent / "woken"
  helper = subprocess.Popen(
      ["sh", "-c", 'sleep "$3"; : > "$1" && echo woken > "$2"; '
       'while :; do : > "$1"; sleep 0.05; done',
       "sh", str(fifo), str(marker), str(seconds)],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    yield marker.exists
  finally:
    helper.kill()
    helper.wait()


def test_a_state_file_that_is_a_named_pipe_is_refused_before_tensorflow(
    tmp_path):
  fifo = tmp_path / "checkpoint"
  os.mkfifo(fifo)
  with _unblocking(fifo) as woken:
    start = time.monotonic()
    with pytest.raises(errors.NotRegularFileError) as raised:
      _manager(tmp_path)
    seconds = time.monotonic() - start
  assert not woken(), f"TensorFlow opened {fifo}"
  assert seconds < 1
  assert raised.value.filename == str(fifo)
  assert "(a named pipe)" in str(raised.value)


def test_unlist_of_an_older_checkpoint_keeps_the_latest(tmp_path, caplog):
  manager = _manager(tmp_path, max_to_keep=5)
  for _ in range(3):
    manager.save()
  with caplog.at_level(logging.INFO):
    tf_manager.unlist(manager, str(tmp_path), [f"{tmp_path}/ckpt-1"],
                      current=f"{tmp_path}/ckpt-3")
  assert [r.getMessage() for r in caplog.records
          if r.getMessage().startswith("Unlisting")] == [
              f"Unlisting checkpoints ['{tmp_path}/ckpt-1'] (latest was "
              f"{tmp_path}/ckpt-3)"]
  assert manager.latest_checkpoint == f"{tmp_path}/ckpt-3"
  fresh = _manager(tmp_path, max_to_keep=5)
  assert fresh.checkpoints == [f"{tmp_path}/ckpt-2", f"{tmp_path}/ckpt-3"]
  assert fresh.latest_checkpoint == f"{tmp_path}/ckpt-3"


def test_unlist_of_everything_forgets_the_latest_and_the_state_file(
    tmp_path):
  manager = _manager(tmp_path)
  manager.save()
  manager.save()
  tf_manager.unlist(manager, str(tmp_path),
                    [f"{tmp_path}/ckpt-1", f"{tmp_path}/ckpt-2"], current=None)
  assert manager.latest_checkpoint is None
  assert not (tmp_path / "checkpoint").exists()
  # Nothing listed among `checkpoints`: nothing is rewritten.
  manager.save()
  before = (tmp_path / "checkpoint").read_bytes()
  tf_manager.unlist(manager, str(tmp_path), [f"{tmp_path}/ckpt-7"],
                    current=None)
  assert (tmp_path / "checkpoint").read_bytes() == before


def test_io_errors_are_told_from_others():
  assert tf_manager.is_io_error(OSError(errno.EIO, "I/O error"))
  # By TensorFlow's type alone, or by an errno's text alone.
  assert tf_manager.is_io_error(tf.errors.NotFoundError(None, None, "gone"))
  assert tf_manager.is_io_error(RuntimeError("write: Disk quota exceeded"))
  assert not tf_manager.is_io_error(tf.errors.InvalidArgumentError(
      None, None, "bad iterator"))


@pytest.mark.parametrize("error, code, detail", [
    (OSError(errno.ENOSPC, "No space left on device"), errno.ENOSPC,
     "[Errno 28] No space left on device"),
    (tf.errors.UnknownError(None, None, "write: Disk quota exceeded\nmore"),
     errno.EDQUOT, "write: Disk quota exceeded"),
    (tf.errors.NotFoundError(None, None, "  gone  "), None, "gone"),
    (ValueError(""), None, ""),
])
def test_tensorflow_errors_become_os_errors_naming_the_checkpoint(
    error, code, detail):
  converted = tf_manager.as_os_error(error, "Could not write", "/c/ckpt-3")
  assert isinstance(converted, errors.CheckpointWriteError)
  assert converted.errno == code
  assert converted.filename == "/c/ckpt-3"
  assert converted.strerror == (
      f"Could not write: {type(error).__name__}: {detail}")


# ---------------------------------------------------------------------------
# ObjectStoreManager: TensorFlow's rules, one at a time.
# ---------------------------------------------------------------------------


def _object_store_manager(directory, variable=None, **kwargs):
  return tf_manager.ObjectStoreManager(
      tf.train.Checkpoint(v=variable if variable is not None else
                          tf.Variable(0)),
      str(directory), max_to_keep=kwargs.get("max_to_keep", 2),
      checkpoint_name="ckpt")


@pytest.mark.parametrize("max_to_keep", [0, -1])
def test_object_store_manager_refuses_what_tensorflow_refuses(tmp_path,
                                                              max_to_keep):
  with pytest.raises(ValueError) as theirs:
    tf.train.CheckpointManager(tf.train.Checkpoint(), str(tmp_path),
                               max_to_keep=max_to_keep)
  with pytest.raises(ValueError) as ours:
    _object_store_manager(tmp_path, max_to_keep=max_to_keep)
  assert str(ours.value) == str(theirs.value) == (
      "Expected a positive integer or `None` for `max_to_keep`, got "
      f"{max_to_keep}.")


def test_object_store_manager_without_a_limit_keeps_everything(tmp_path):
  start = time.time()
  manager = _object_store_manager(tmp_path / "runX", max_to_keep=None)
  end = time.time()
  # As TensorFlow: nothing saved yet, last preserved a second before now.
  assert manager.latest_checkpoint is None
  assert start - 1 <= manager._last_preserved_timestamp <= end - 1  # pylint: disable=protected-access
  (tmp_path / "runX").mkdir()
  for _ in range(4):
    manager.save()
  assert manager.checkpoints == [f"{tmp_path}/runX/ckpt-{n}"
                                 for n in (1, 2, 3, 4)]
  # A directory given with a trailing slash names checkpoints without it.
  again = tf_manager.ObjectStoreManager(
      tf.train.Checkpoint(v=tf.Variable(0)), f"{tmp_path}/runX/",
      max_to_keep=None, checkpoint_name="ckpt")
  assert again.latest_checkpoint == f"{tmp_path}/runX/ckpt-4"
  assert again.checkpoints == manager.checkpoints
  again._checkpoint.save_counter.assign(4)  # pylint: disable=protected-access
  assert again.save() == f"{tmp_path}/runX/ckpt-5"
  assert again.checkpoints == manager.checkpoints + [f"{tmp_path}/runX/ckpt-5"]


def test_object_store_manager_reads_books_as_tensorflow_does(tmp_path,
                                                             caplog):
  """A file without timestamps, and one from a clock ahead of this one."""
  paths = [f"{tmp_path}/ckpt-{n}" for n in (1, 2)]
  state = "".join(f'all_model_checkpoint_paths: "{p}"\n' for p in paths)
  (tmp_path / "checkpoint").write_text(
      f'model_checkpoint_path: "{paths[-1]}"\n' + state)
  theirs = tf.train.CheckpointManager(tf.train.Checkpoint(), str(tmp_path),
                                      max_to_keep=2)
  ours = _object_store_manager(tmp_path)
  assert ours._maybe_delete == theirs._maybe_delete == {}  # pylint: disable=protected-access
  assert ours.latest_checkpoint == theirs.latest_checkpoint == paths[-1]
  ahead = time.time() + 1000
  (tmp_path / "checkpoint").write_text(
      f'model_checkpoint_path: "{paths[-1]}"\n' + state +
      f"all_model_checkpoint_timestamps: {ahead - 10}\n"
      f"all_model_checkpoint_timestamps: {ahead - 5}\n"
      f"last_preserved_timestamp: {ahead}\n")
  with caplog.at_level(logging.WARNING):
    ours = _object_store_manager(tmp_path)
  now = time.time()
  (message,) = [r.getMessage() for r in caplog.records]
  behind = float(re.fullmatch(
      r"time\.time\(\) returned a value (\S+) seconds behind the last "
      r"preserved checkpoint timestamp\.", message).group(1))
  assert 999 < behind <= 1000
  assert now - 5 < ours._last_preserved_timestamp <= now  # pylint: disable=protected-access
  assert ours._maybe_delete == {}  # pylint: disable=protected-access


def test_object_store_manager_moves_a_saved_again_number_to_the_end(tmp_path):
  """Saving a number already listed (after restoring an older one)."""
  ours_dir, tf_dir = tmp_path / "ours", tmp_path / "tf"
  ours_dir.mkdir()
  ours_ckpt, tf_ckpt = (tf.train.Checkpoint(v=tf.Variable(0)),
                        tf.train.Checkpoint(v=tf.Variable(0)))
  ours = tf_manager.ObjectStoreManager(ours_ckpt, str(ours_dir), max_to_keep=3,
                                       checkpoint_name="ckpt")
  theirs = tf.train.CheckpointManager(tf_ckpt, str(tf_dir), max_to_keep=3)
  for manager, ckpt in ((ours, ours_ckpt), (theirs, tf_ckpt)):
    for _ in range(3):
      manager.save()
    ckpt.save_counter.assign(1)
    manager.save()  # ckpt-2 again
  assert [p.rsplit("/", 1)[1] for p in ours.checkpoints] == [
      p.rsplit("/", 1)[1] for p in theirs.checkpoints] == [
          "ckpt-1", "ckpt-3", "ckpt-2"]


def test_object_store_manager_names_the_pruned_before_the_commit(tmp_path,
                                                                 monkeypatch):
  manager = _object_store_manager(tmp_path, max_to_keep=1)
  manager.save()
  seen = []
  real = manager._record_state  # pylint: disable=protected-access

  def record_state():
    pruning = tmp_path / tf_manager.PRUNING_FILENAME
    seen.append(json.loads(pruning.read_text()) if pruning.exists() else None)
    real()

  monkeypatch.setattr(manager, "_record_state", record_state)
  manager.save()
  assert seen == [[f"{tmp_path}/ckpt-1"]]
  assert sorted(os.listdir(tmp_path)) == [
      "checkpoint", "ckpt-2.data-00000-of-00001", "ckpt-2.index"]


def test_object_store_pruning_deletes_only_what_nobody_lists(tmp_path):
  """Listed by this manager, by the state file, as its latest, or outside
  the directory: kept. Anything else named: its TensorFlow files go."""
  manager = _object_store_manager(tmp_path, max_to_keep=None)
  for _ in range(5):
    manager.save()
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "ckpt-1.index").write_bytes(b"x")
  ckpt = {n: f"{tmp_path}/ckpt-{n}" for n in range(1, 6)}
  manager._maybe_delete = collections.OrderedDict([(ckpt[1], 1.0)])  # pylint: disable=protected-access
  manager._latest_checkpoint = ckpt[2]  # pylint: disable=protected-access
  (tmp_path / "checkpoint").write_text(
      f'model_checkpoint_path: "{ckpt[4]}"\n'
      f'all_model_checkpoint_paths: "{ckpt[3]}"\n')
  manager._delete_unlisted([ckpt[1], ckpt[2], ckpt[3], ckpt[4],  # pylint: disable=protected-access
                            f"{outside}/ckpt-1", ckpt[5]])
  assert (outside / "ckpt-1.index").exists()
  left = sorted(os.listdir(tmp_path))
  for n in (1, 2, 3, 4):
    assert f"ckpt-{n}.index" in left and (
        f"ckpt-{n}.data-00000-of-00001" in left), n
  assert not [f for f in left if f.startswith("ckpt-5")]


def test_object_store_manager_uploads_files_a_piece_at_a_time(tmp_path,
                                                              monkeypatch):
  """Bounded memory: a TensorFlow file goes up in pieces of _UPLOAD_CHUNK
  bytes, never read whole."""
  monkeypatch.setattr(tf_manager, "_UPLOAD_CHUNK", 1000)
  real = storage.atomic_writer
  pieces = []

  @contextlib.contextmanager
  def recording(path):
    with real(path) as write:
      def record(data):
        pieces.append(len(data))
        write(data)
      yield record
  monkeypatch.setattr(storage, "atomic_writer", recording)
  local = tmp_path / "local.bin"
  data = os.urandom(2500)
  local.write_bytes(data)
  tf_manager._upload(str(local), str(tmp_path / "up.bin"))  # pylint: disable=protected-access
  assert pieces == [1000, 1000, 500]
  assert (tmp_path / "up.bin").read_bytes() == data


def test_object_store_manager_on_the_files_own_instant_does_not_warn(
    tmp_path, caplog, monkeypatch):
  """A clock equal to the file's last_preserved_timestamp is not behind it
  (TensorFlow's rule: `<`)."""
  paths = [f"{tmp_path}/ckpt-{n}" for n in (1, 2)]
  (tmp_path / "checkpoint").write_text(
      f'model_checkpoint_path: "{paths[-1]}"\n' +
      "".join(f'all_model_checkpoint_paths: "{p}"\n' for p in paths) +
      "all_model_checkpoint_timestamps: 990.0\n"
      "all_model_checkpoint_timestamps: 1000.5\n"
      "last_preserved_timestamp: 1000.0\n")
  monkeypatch.setattr(time, "time", lambda: 1000.0)
  with caplog.at_level(logging.WARNING):
    ours = _object_store_manager(tmp_path)
  assert not [r for r in caplog.records if "behind" in r.getMessage()]
  theirs = tf.train.CheckpointManager(tf.train.Checkpoint(), str(tmp_path),
                                      max_to_keep=2)
  assert ours._last_preserved_timestamp == theirs._last_preserved_timestamp == 1000.0  # pylint: disable=protected-access
  # Nothing is newer than the last preserved instant: nothing managed.
  assert ours._maybe_delete == theirs._maybe_delete == {}  # pylint: disable=protected-access
  assert ours.latest_checkpoint == theirs.latest_checkpoint == paths[1]
