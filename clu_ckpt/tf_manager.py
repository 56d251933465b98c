"""TensorFlow's side of a `Checkpoint`: its CheckpointManager, contained.

clu stores a `tf_state` (a tf.data iterator) with `tf.train.CheckpointManager`,
whose `checkpoint` state file is the commit of every save. Two things the
manager does not offer publicly are needed: dropping listed checkpoints that
lie outside the directory from its prune list (TensorFlow would delete their
files), and rewriting the state file without some checkpoints before their
files are deleted. Both use the manager's private bookkeeping
(`_maybe_delete`, `_latest_checkpoint`, `_last_preserved_timestamp`,
`_record_state`), and this module is the only one that touches it: if a
TensorFlow release drops an attribute, `PrivateApiError` says which, and
`tests/test_tf_manager.py` pins the versions it was checked against.
TensorFlow is imported only when a manager is made.

On object stores (`gs://`, `s3://`), where TensorFlow can reach neither an
emulator nor S3 and nothing can be renamed, `new_manager` returns an
`ObjectStoreManager` instead: the same bookkeeping, attribute for attribute,
with TensorFlow serializing the `tf_state` only (`tf.train.Checkpoint.write`
into a local temporary directory) and every file reaching the bucket whole
through `storage.atomic_writer`, in the commit order of `ObjectStoreManager`.

Synopsis::

  from clu_ckpt import tf_manager

  manager = tf_manager.new_manager(tf.train.Checkpoint(ds=it), "/ckpts",
                                   max_to_keep=5, checkpoint_name="ckpt")
  tf_manager.unlist(manager, "/ckpts", ["/ckpts/ckpt-7"], current="/ckpts/ckpt-5")
  try:
    manager.save()
  except Exception as e:
    if tf_manager.is_io_error(e):
      raise tf_manager.as_os_error(e, "could not write", "/ckpts/ckpt-6")
"""

from __future__ import annotations

import collections
import errno
import json
import os
import tempfile
import time
from typing import Any, Optional, Sequence

from absl import logging

from clu_ckpt import errors
from clu_ckpt import layout
from clu_ckpt import state_file
from clu_ckpt import storage

# TensorFlow versions whose private CheckpointManager attributes were checked
# (they have been stable since 1.13): the stacks of the support matrix
# (noxfile.py; README.md, "Support matrix") that run tests/test_tf_manager.py.
CHECKED_TENSORFLOW = ("2.16", "2.18", "2.21")
PRIVATE_ATTRIBUTES = ("_maybe_delete", "_latest_checkpoint",
                      "_last_preserved_timestamp", "_record_state")

_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES,
           errno.EIO)
# TensorFlow's errors for failed file operations.
_TF_IO_ERRORS = ("NotFoundError", "PermissionDeniedError",
                 "ResourceExhaustedError", "DataLossError", "UnavailableError",
                 "AbortedError", "DeadlineExceededError")


def check_private_api(manager: Any) -> None:
  """Raises `PrivateApiError` unless `manager` has what this module uses.

  Args:
    manager: A `tf.train.CheckpointManager`.

  Raises:
    errors.PrivateApiError: Names the missing attribute, the TensorFlow
      versions checked and the one installed.
  """
  missing = [a for a in PRIVATE_ATTRIBUTES if not hasattr(manager, a)]
  if missing:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    raise errors.PrivateApiError(
        f"tf.train.CheckpointManager has no {', '.join(missing)} in "
        f"TensorFlow {tf.__version__}; clu_ckpt was checked against "
        f"TensorFlow {', '.join(CHECKED_TENSORFLOW)}. Install one of those "
        "or a clu_ckpt release that supports this TensorFlow.")


def uses_object_store(directory: str) -> bool:
  """Whether `directory` is in a bucket TensorFlow is not given (gs, s3).

  Such directories get an `ObjectStoreManager`, and restores read their
  TensorFlow files through `storage.local_prefix`.
  """
  scheme, _ = layout.split_scheme(directory)
  return scheme.lower() in ("gs://", "s3://")


# `ObjectStoreManager` uploads TensorFlow's files in pieces of this size.
_UPLOAD_CHUNK = 16 * 2**20
# Names the checkpoints an `ObjectStoreManager` save prunes, while it does.
PRUNING_FILENAME = "clu_ckpt-pruning.json"


class ObjectStoreManager:
  """`tf.train.CheckpointManager`'s bookkeeping for a bucket, without its I/O.

  It reads and writes the directory's `checkpoint` state file itself
  (`state_file`), with TensorFlow's own rules: the same managed list (paths
  newer than `last_preserved_timestamp`), the same timestamps, the same
  pruning beyond `max_to_keep`, the same file, byte for byte. It has the
  attributes `unlist` uses (`_maybe_delete`, `_latest_checkpoint`,
  `_last_preserved_timestamp`, `_record_state`), so the save protocol runs
  unchanged. TensorFlow only serializes the `tf_state` into a local
  temporary directory.

  `save()` commits in this order, each object appearing whole (an upload
  that completes, or no object): `.data-*`, then `.index` (the `.flax` is
  already there); when checkpoints are to be pruned, `PRUNING_FILENAME`
  naming them; then the `checkpoint` state file, which is the commit; then
  the pruned checkpoints' `.index` and `.data-*` are deleted, now that the
  state file no longer lists them, and `PRUNING_FILENAME` last (their `.flax`
  goes in `save_protocol.sweep_debris`). A kill before the state file leaves
  the previous checkpoint the latest and unlisted files of the new number,
  which the next save deletes (`save_protocol.delete_future_checkpoints`);
  a kill after it leaves `PRUNING_FILENAME`, and the next save first deletes
  the files of the checkpoints it names that the state file does not list.
  `keep_checkpoint_every_n_hours` is not supported (clu never sets it).

  Example::

    manager = ObjectStoreManager(tf.train.Checkpoint(ds=it), "gs://b/run",
                                 max_to_keep=3, checkpoint_name="ckpt")
    manager.save()          # "gs://b/run/ckpt-1"
    manager.checkpoints     # ["gs://b/run/ckpt-1"]
  """

  def __init__(self, tf_checkpoint: Any, directory: str, *,
               max_to_keep: Optional[int], checkpoint_name: str):
    if max_to_keep is not None and max_to_keep <= 0:
      raise ValueError("Expected a positive integer or `None` for "
                       f"`max_to_keep`, got {max_to_keep}.")
    self._checkpoint = tf_checkpoint
    self._directory = directory
    self._max_to_keep = max_to_keep
    self._prefix = f"{directory.rstrip('/')}/{checkpoint_name}"
    state = state_file.read_checkpoint_state(directory)
    now = time.time()
    self._maybe_delete: collections.OrderedDict[str, float] = (
        collections.OrderedDict())
    if state is None:
      self._latest_checkpoint = None
      self._last_preserved_timestamp = now - 1.
      return
    self._latest_checkpoint = state.model_checkpoint_path
    self._last_preserved_timestamp = state.last_preserved_timestamp
    if now < self._last_preserved_timestamp:
      logging.warning("time.time() returned a value %f seconds behind the "
                      "last preserved checkpoint timestamp.",
                      self._last_preserved_timestamp - now)
      self._last_preserved_timestamp = now
    stamps = state.all_model_checkpoint_timestamps or (
        [self._last_preserved_timestamp] * len(state.all_model_checkpoint_paths))
    for path, stamp in zip(state.all_model_checkpoint_paths, stamps):
      stamp = min(stamp, now)
      if stamp > self._last_preserved_timestamp:
        self._maybe_delete[path] = stamp

  @property
  def directory(self) -> str:
    return self._directory

  @property
  def checkpoints(self) -> list[str]:
    """The managed checkpoints, oldest first."""
    return list(self._maybe_delete)

  @property
  def latest_checkpoint(self) -> Optional[str]:
    return self._latest_checkpoint

  def _record_state(self) -> None:
    """Writes the `checkpoint` state file (one upload: the commit)."""
    text = state_file.format_checkpoint_state(
        self._directory, self._latest_checkpoint, list(self._maybe_delete),
        list(self._maybe_delete.values()), self._last_preserved_timestamp)
    path = storage.join(self._directory, layout.STATE_FILENAME)
    with storage.atomic_writer(path) as write:
      write(text.encode("utf-8"))

  def save(self) -> str:
    """Writes the next checkpoint's TensorFlow files and commits it.

    The save counter is incremented first, as TensorFlow's manager does (the
    caller undoes it if this raises before the commit).

    Returns:
      The new checkpoint (`<directory>/<checkpoint_name>-<save_counter>`).

    Raises:
      OSError: An upload or the state file failed (names the object).
    """
    self._finish_pruning()
    counter = self._checkpoint.save_counter
    counter.assign_add(1)
    checkpoint = f"{self._prefix}-{int(counter.numpy())}"
    name = checkpoint.rsplit("/", 1)[-1]
    with tempfile.TemporaryDirectory(prefix="clu_ckpt-tf-") as tmp:
      self._checkpoint.write(os.path.join(tmp, name))
      files = sorted(os.listdir(tmp), key=lambda f: (f.endswith(".index"), f))
      for file in files:  # `.data-*` first, `.index` last
        if file.startswith(f"{name}."):
          _upload(os.path.join(tmp, file), f"{checkpoint}{file[len(name):]}")
    self._maybe_delete.pop(checkpoint, None)
    self._maybe_delete[checkpoint] = time.time()
    self._latest_checkpoint = checkpoint
    pruned = []
    while self._max_to_keep and len(self._maybe_delete) > self._max_to_keep:
      pruned.append(self._maybe_delete.popitem(last=False)[0])
    pruning = storage.join(self._directory, PRUNING_FILENAME)
    if pruned:
      with storage.atomic_writer(pruning) as write:
        write(json.dumps(pruned).encode("utf-8"))
    self._record_state()  # the commit
    if pruned:
      self._delete_unlisted(pruned)
      storage.remove(pruning)
    return checkpoint

  def _delete_unlisted(self, checkpoints: Sequence[str]) -> None:
    """Deletes TensorFlow's files of those `checkpoints` no longer listed.

    Listed means in this manager's list or in the state file on the store:
    a manager whose clock is behind the file's `last_preserved_timestamp`
    manages fewer checkpoints than the file lists, and those stay.
    """
    listed = set(self._maybe_delete) | {self._latest_checkpoint}
    on_store = layout.read_checkpoint_state(self._directory)
    if on_store is not None:
      listed |= set(on_store.all_model_checkpoint_paths)
      listed.add(on_store.model_checkpoint_path)
    for path in checkpoints:
      if path in listed or not layout.is_contained(self._directory, path):
        continue
      pattern = storage.glob_escape(path)
      for found in (storage.glob(f"{pattern}.index") +
                    storage.glob(f"{pattern}.data-?????-of-?????")):
        storage.remove(found)

  def _finish_pruning(self) -> None:
    """Completes the pruning of a save killed after its commit, if any."""
    pruning = storage.join(self._directory, PRUNING_FILENAME)
    try:
      names = json.loads(storage.read_bytes(pruning))
    except FileNotFoundError:
      return
    except ValueError:  # torn by hand: only this save's pruning is lost
      names = []
    if isinstance(names, list):
      self._delete_unlisted([n for n in names if isinstance(n, str)])
    storage.remove(pruning)


def _upload(local: str, url: str) -> None:
  """Copies a local file to `url` in pieces; the object appears whole."""
  with open(local, "rb") as f, storage.atomic_writer(url) as write:
    while chunk := f.read(_UPLOAD_CHUNK):
      write(chunk)


def new_manager(tf_checkpoint: Any, directory: str, *, max_to_keep: int,
                checkpoint_name: str) -> Any:
  """A `tf.train.CheckpointManager` for `directory`, contained.

  The `checkpoint` file must be a regular file (TensorFlow would block
  forever on a named pipe), and listed checkpoints outside `directory` are
  dropped from the manager's prune list, with a warning naming each: neither
  TensorFlow's pruning nor anything else here will delete them.

  Example::

    manager = new_manager(tf.train.Checkpoint(ds=it), "/ckpts",
                          max_to_keep=3, checkpoint_name="ckpt")

  Args:
    tf_checkpoint: The `tf.train.Checkpoint`.
    directory: The checkpoint directory.
    max_to_keep: As for `tf.train.CheckpointManager`.
    checkpoint_name: As for `tf.train.CheckpointManager`.

  Returns:
    The manager (an `ObjectStoreManager` for `gs://` and `s3://`).

  Raises:
    errors.NotRegularFileError: `checkpoint` is a pipe, device, ...
    errors.PrivateApiError: This TensorFlow lacks what is used here.
  """
  state_path = storage.join(directory, layout.STATE_FILENAME)
  if uses_object_store(directory):
    manager = ObjectStoreManager(tf_checkpoint, directory,
                                 max_to_keep=max_to_keep,
                                 checkpoint_name=checkpoint_name)
  else:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    try:
      storage.check_regular_file(state_path)
    except FileNotFoundError:
      pass  # no checkpoint yet
    manager = tf.train.CheckpointManager(
        tf_checkpoint, directory, max_to_keep=max_to_keep,
        checkpoint_name=checkpoint_name)
    check_private_api(manager)
  managed = manager._maybe_delete  # pylint: disable=protected-access
  for path in list(managed):
    if not layout.is_contained(directory, path):
      logging.warning("%s lists %s, which is outside %s: it is left alone "
                      "(never pruned or deleted)", state_path, path, directory)
      del managed[path]
  return manager


def unlist(manager: Any, directory: str, checkpoints: Sequence[str],
           current: Optional[str]) -> None:
  """Rewrites the `checkpoint` file without `checkpoints`, as TF would.

  Uses the manager's own bookkeeping so that the file is exactly what
  TensorFlow itself writes for the remaining list, then fsyncs it: the
  deletions that follow must not reach the disk before this rewrite does.

  Args:
    manager: The directory's manager (see `new_manager`).
    directory: The checkpoint directory.
    checkpoints: Paths to unlist.
    current: The checkpoint the caller last saved or restored, kept listed
      (unmanaged) when nothing else is; None when there is none.
  """
  # pylint: disable=protected-access
  managed = manager._maybe_delete  # path -> timestamp, oldest first
  latest = manager.latest_checkpoint
  listed = [p for p in managed if p in checkpoints]
  if not listed and latest not in checkpoints:
    return
  logging.info("Unlisting checkpoints %s (latest was %s)", listed, latest)
  for path in listed:
    del managed[path]
  if not managed and current is not None:
    # The current checkpoint is listed but not managed (older than the
    # file's last_preserved_timestamp, e.g. written under a clock ahead of
    # this one): it stays listed and unmanaged, as a fresh manager sees it.
    managed[current] = manager._last_preserved_timestamp
  state_path = storage.join(directory, layout.STATE_FILENAME)
  if not managed:
    # Saving without restoring starts over at number 1: nothing to list.
    manager._latest_checkpoint = None
    storage.remove(state_path)
    return
  if latest in checkpoints:
    manager._latest_checkpoint = next(reversed(managed))
  manager._record_state()
  # pylint: enable=protected-access
  storage.sync(state_path)


def is_io_error(error: Exception) -> bool:
  """Whether `error` is a failed file operation (not, e.g., a bad iterator)."""
  if isinstance(error, OSError):
    return True
  text = str(error)
  return type(error).__name__ in _TF_IO_ERRORS or any(
      os.strerror(code) in text for code in _ERRNOS)


def as_os_error(error: Exception, message: str,
                filename: str) -> errors.CheckpointWriteError:
  """An OSError for a failed TensorFlow write (TF raises its own types).

  The errno is the one whose text TensorFlow's message carries ("No space
  left on device"), when there is one.

  Args:
    error: What TensorFlow raised.
    message: What failed, for the message.
    filename: The checkpoint.

  Returns:
    A `CheckpointWriteError` (an `OSError`) naming `filename`.
  """
  if isinstance(error, OSError):
    code = error.errno
  else:
    text = str(error)
    code = next((c for c in _ERRNOS if os.strerror(c) in text), None)
  detail = str(error).strip().splitlines()[0] if str(error).strip() else ""
  return errors.CheckpointWriteError(
      code, f"{message}: {type(error).__name__}: {detail}", filename)
