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

import errno
import os
from typing import Any, Optional, Sequence

from absl import logging

from clu_ckpt import errors
from clu_ckpt import layout
from clu_ckpt import storage

# TensorFlow versions whose private CheckpointManager attributes were checked
# (they have been stable since 1.13).
CHECKED_TENSORFLOW = ("2.21",)
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
    The manager.

  Raises:
    errors.NotRegularFileError: `checkpoint` is a pipe, device, ...
    errors.PrivateApiError: This TensorFlow lacks what is used here.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  state_file = storage.join(directory, layout.STATE_FILENAME)
  try:
    storage.check_regular_file(state_file)
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
                      "(never pruned or deleted)", state_file, path, directory)
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
  state_file = storage.join(directory, layout.STATE_FILENAME)
  if not managed:
    # Saving without restoring starts over at number 1: nothing to list.
    manager._latest_checkpoint = None
    storage.remove(state_file)
    return
  if latest in checkpoints:
    manager._latest_checkpoint = next(reversed(managed))
  manager._record_state()
  # pylint: enable=protected-access
  storage.sync(state_file)


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
