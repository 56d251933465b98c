"""The crash-safety protocol around TensorFlow's commit of a `Checkpoint.save`.

A save writes `<name>-<N>.flax` first, then TensorFlow's CheckpointManager
writes `.index` / `.data-*` and commits by rewriting the `checkpoint` state
file. A `.flax` without that commit (a crash in between) is not a
checkpoint: it is ignored and later overwritten. What happens around the
commit lives here, so that a process killed at any point leaves every listed
checkpoint whole:

- before: `delete_future_checkpoints` removes checkpoints numbered after the
  current one (a host re-joining its peers, or leftovers of a killed save),
  unlisting them from the state file before deleting their files;
- the commit itself: `commit` has the manager save; when TensorFlow's write
  fails, `failed_commit` tells whether the commit happened (`committed`),
  undoes the save if not (counter, partial files), re-reads the manager and
  returns the error to raise;
- after: `sweep_debris` removes the `.flax` of pruned checkpoints and what
  killed saves left (`_temp/` directories, temporary state files).

In a bucket (`gs://`, `s3://`) the manager is a
`tf_manager.ObjectStoreManager`: the same bookkeeping, with TensorFlow only
serializing the `tf_state` locally and the files uploaded whole, in the
commit order it documents; this protocol runs on it unchanged.

The private CheckpointManager API is touched only through `clu_ckpt.tf_manager`;
the directory rules come from `clu_ckpt.layout`, file operations from
`clu_ckpt.storage`.

Synopsis (what `Checkpoint.save` does)::

  from clu_ckpt import save_protocol

  save_protocol.delete_future_checkpoints(manager, "/ckpts", "ckpt", current=5)
  # ... write /ckpts/ckpt-6.flax ...
  save_protocol.commit(manager, tf_checkpoint, "/ckpts", "/ckpts/ckpt-6",
                       reread=reread_manager)   # undone if TensorFlow fails
  save_protocol.sweep_debris(manager, "/ckpts", "ckpt")
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

from absl import logging

from clu_ckpt import layout
from clu_ckpt import storage
from clu_ckpt import tf_manager


def _numbered(base_directory: str, checkpoint_name: str, number: int) -> str:
  """`{base_directory}/{checkpoint_name}-{number}`: where saves write."""
  return f"{base_directory}/{checkpoint_name}-{number}"


def _remove(path: str) -> None:
  """Removes a file, or a whole TensorFlow `_temp` directory."""
  if path.endswith("_temp"):
    storage.remove_tree(path)
  else:
    storage.remove(path)


# --------------------------------------------------------------------------
# Before the save: checkpoints after the current one.
# --------------------------------------------------------------------------


def future_checkpoints(manager: Any, base_directory: str,
                       checkpoint_name: str,
                       current: int) -> dict[str, list[str]]:
  """This directory's checkpoints numbered after `current`, with their files.

  That is the numbers `current + 1, current + 2, ...` that have files on
  disk, up to the first gap, and the checkpoints the manager lists (or names
  as latest) with a higher number, with or without files. Listed paths
  outside `base_directory` are left out, with a warning.

  Args:
    manager: The directory's `tf.train.CheckpointManager` (see
      `tf_manager.new_manager`).
    base_directory: The checkpoint directory.
    checkpoint_name: Prefix of the checkpoint files (`ckpt`).
    current: The number last saved or restored (0: none).

  Returns:
    Checkpoint path -> its files (`.flax`, `.index`, `.data-*`, `_temp`).
  """
  future = {}
  number = current
  while True:
    number += 1
    checkpoint = _numbered(base_directory, checkpoint_name, number)
    paths = layout.checkpoint_files(checkpoint)
    if not paths:
      break
    future[checkpoint] = paths
  # Listed ones after a gap in the numbers (or without files) go too, if
  # they are this directory's (`tf_manager.new_manager` keeps only those
  # managed).
  for listed in manager.checkpoints + [manager.latest_checkpoint]:
    if not listed or listed in future:
      continue
    if not layout.is_contained(base_directory, listed):
      logging.warning("The latest checkpoint %s is outside %s: it is left "
                      "alone", listed, base_directory)
      continue
    listed_number = layout.checkpoint_number(listed, checkpoint_name)
    if listed_number is not None and listed_number > current:
      future[listed] = layout.checkpoint_files(listed)
  return future


def delete_future_checkpoints(manager: Any, base_directory: str,
                              checkpoint_name: str, current: int, *,
                              keep_current: bool = True) -> None:
  """Removes every checkpoint after the current one.

  They exist after restoring an older checkpoint than the newest (a host
  that re-joins its peers after a preemption), or as the leftovers of a save
  that died before its commit. They leave TensorFlow's `checkpoint` file
  first (one atomic rewrite, `tf_manager.unlist`), their files after that: a
  crash in between leaves files nobody lists, never a listed checkpoint
  without its files. (clu deletes the files first and keeps listing them.)
  Only this directory's own checkpoints (`{checkpoint_name}-{number}` inside
  `base_directory`) are removed; listed entries elsewhere are left alone.

  Example::

    delete_future_checkpoints(manager, "/ckpts", "ckpt", current=2)
    # ckpt-3, ckpt-4, ... are unlisted, then their files removed

  Args:
    manager: The directory's `tf.train.CheckpointManager`.
    base_directory: The checkpoint directory.
    checkpoint_name: Prefix of the checkpoint files (`ckpt`).
    current: The number last saved or restored (0: none).
    keep_current: Keep the current checkpoint listed when nothing else is
      (False when it is not a CLU checkpoint: an Orbax step of
      `Checkpoint(layout="orbax")`).

  Raises:
    OSError: The state file or a file could not be rewritten or removed.
  """
  future = future_checkpoints(manager, base_directory, checkpoint_name,
                              current)
  if not future:
    return
  tf_manager.unlist(
      manager, base_directory, list(future),
      _numbered(base_directory, checkpoint_name, current)
      if current and keep_current else None)
  for paths in future.values():
    for path in paths:
      logging.info("Cleaning up future checkpoint file '%s'", path)
      _remove(path)


def delete_checkpoints(manager: Any, base_directory: str,
                       checkpoints: list[str]) -> None:
  """Unlists `checkpoints` from TensorFlow's `checkpoint` file, then deletes
  their files (`.flax`, `.index`, `.data-*`).

  `Checkpoint(layout="orbax")` prunes CLU checkpoints that have an Orbax
  copy this way; only checkpoints inside `base_directory` are touched.

  Example::

    delete_checkpoints(manager, "/ckpts", ["/ckpts/ckpt-2"])

  Args:
    manager: The directory's `tf.train.CheckpointManager`.
    base_directory: The checkpoint directory.
    checkpoints: The checkpoints (paths as listed).

  Raises:
    OSError: The state file or a file could not be rewritten or removed.
  """
  inside = [c for c in checkpoints if layout.is_contained(base_directory, c)]
  if not inside:
    return
  latest = manager.latest_checkpoint
  tf_manager.unlist(manager, base_directory, inside,
                    latest if latest not in inside else None)
  for checkpoint in inside:
    for path in layout.checkpoint_files(checkpoint):
      logging.info("Removing checkpoint file '%s'", path)
      _remove(path)


# --------------------------------------------------------------------------
# When TensorFlow's write fails.
# --------------------------------------------------------------------------


def committed(base_directory: str, checkpoint: str) -> Optional[bool]:
  """Whether TensorFlow's `checkpoint` file names `checkpoint` as latest.

  Args:
    base_directory: The checkpoint directory.
    checkpoint: The checkpoint being saved (`<base_directory>/ckpt-N`).

  Returns:
    True or False; None when the file exists but cannot be read or parsed.
  """
  try:
    if not storage.exists(storage.join(base_directory, "checkpoint")):
      return False
    state = layout.read_checkpoint_state(base_directory)
  except Exception:  # pylint: disable=broad-except
    return None
  if state is None:
    return None
  return (os.path.basename(state.model_checkpoint_path) ==
          os.path.basename(checkpoint))


def _undo_save(tf_checkpoint: Any, checkpoint: str, counter: int) -> None:
  """Puts the save counter back and removes the save's partial files."""
  tf_checkpoint.save_counter.assign(counter)
  try:
    for path in storage.glob(f"{storage.glob_escape(checkpoint)}.*"):
      storage.remove(path)
    storage.remove_tree(f"{checkpoint}_temp")
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("Could not remove the files of the failed save %s "
                    "(a later save replaces them): %s", checkpoint, e)


def _error_to_raise(error: Exception, was_committed: Optional[bool],
                    base_directory: str, checkpoint: str) -> Exception:
  """An OSError naming `checkpoint` for I/O errors; any other error as is."""
  if not tf_manager.is_io_error(error):
    return error
  message = {
      True: f"Checkpoint {checkpoint} was committed, but removing older "
            "checkpoints failed",
      False: f"Could not write checkpoint {checkpoint}; earlier "
             "checkpoints are intact",
      None: f"Could not write checkpoint {checkpoint}, nor read "
            f"{base_directory}/checkpoint to tell whether it was "
            "committed",
  }[was_committed]
  return tf_manager.as_os_error(error, message, checkpoint)


def failed_commit(tf_checkpoint: Any, base_directory: str, checkpoint: str,
                  counter: int, error: Exception, *,
                  reread: Callable[[], Any]) -> Exception:
  """Undoes a save whose TensorFlow write failed; returns the error to raise.

  TensorFlow has already counted the save. Unless its `checkpoint` file
  lists the new checkpoint (then only the clean-up after the commit failed)
  or cannot be read (then nothing is touched), the counter goes back and the
  partial files go, so that the next save writes the same number. The
  manager is re-read from disk in every case (a failure to is only logged).

  Example::

    try:
      manager.save()
    except Exception as e:
      error = failed_commit(tf_checkpoint, "/ckpts", "/ckpts/ckpt-6", 5, e,
                            reread=reread_manager)
      if error is e:
        raise
      raise error from e

  Args:
    tf_checkpoint: The `tf.train.Checkpoint` whose `save_counter` counted
      the save.
    base_directory: The checkpoint directory.
    checkpoint: The checkpoint being saved (`<base_directory>/ckpt-N`).
    counter: The save counter before the save.
    error: What TensorFlow raised.
    reread: Replaces the caller's manager with one read from disk.

  Returns:
    For I/O errors (TensorFlow raises its own types) a
    `CheckpointWriteError` (an OSError) naming the checkpoint; any other
    error (e.g. from a `tf_state` object) is `error` itself.
  """
  was_committed = committed(base_directory, checkpoint)
  if was_committed is False:
    _undo_save(tf_checkpoint, checkpoint, counter)
  try:
    reread()
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("Could not re-read %s after a failed save: %s",
                    base_directory, e)
  return _error_to_raise(error, was_committed, base_directory, checkpoint)


def commit(manager: Any, tf_checkpoint: Any, base_directory: str,
           checkpoint: str, *, reread: Callable[[], Any]) -> None:
  """Has TensorFlow write and commit `checkpoint`; undoes a failed write.

  The `.flax` of `checkpoint` is already in place: TensorFlow writes its
  files and then rewrites its `checkpoint` state file, which is the commit.

  Example::

    commit(manager, tf_checkpoint, "/ckpts", "/ckpts/ckpt-6",
           reread=reread_manager)

  Args:
    manager: The directory's `tf.train.CheckpointManager`.
    tf_checkpoint: Its `tf.train.Checkpoint`.
    base_directory: The checkpoint directory.
    checkpoint: The checkpoint being saved (`<base_directory>/ckpt-N`).
    reread: Replaces the caller's manager with one read from disk; called
      when the write fails.

  Raises:
    OSError: TensorFlow's write failed on I/O (see `failed_commit`).
    Exception: Anything else TensorFlow (or a `tf_state` object) raised.
  """
  counter = int(tf_checkpoint.save_counter.numpy())
  try:
    manager.save()
  except Exception as e:  # pylint: disable=broad-except
    error = failed_commit(tf_checkpoint, base_directory, checkpoint, counter,
                          e, reread=reread)
    if error is e:
      raise
    raise error from e


# --------------------------------------------------------------------------
# After the commit: debris.
# --------------------------------------------------------------------------


def sweep_debris(manager: Any, base_directory: str,
                 checkpoint_name: str) -> None:
  """Removes the `.flax` of pruned checkpoints and what killed saves left.

  That is the `.flax` (and temporary `.flax`) of numbers TensorFlow pruned
  (just now, or before a kill: no `.index` any more), TensorFlow's
  unfinished `{name}-N_temp/` and its temporary `checkpoint.tmp*` state
  files (see `layout.is_debris`). A checkpoint that still has its `.index`
  is never touched. Best effort: the save has committed, so a failure here
  is only logged.

  Example::

    manager.save()
    sweep_debris(manager, "/ckpts", "ckpt")

  Args:
    manager: The directory's `tf.train.CheckpointManager`, after the commit.
    base_directory: The checkpoint directory.
    checkpoint_name: Prefix of the checkpoint files (`ckpt`).
  """
  numbers = [layout.checkpoint_number(p, checkpoint_name)
             for p in manager.checkpoints]
  numbers = [n for n in numbers if n is not None]
  latest = layout.checkpoint_number(manager.latest_checkpoint or "",
                                    checkpoint_name)
  if not numbers or latest is None:
    return
  oldest = min(numbers)
  try:
    names = set(storage.listdir(base_directory))
    for entry in sorted(names):
      if not layout.is_debris(entry, names, checkpoint_name, oldest, latest):
        continue
      path = storage.join(base_directory, entry)
      logging.info("Removing leftover '%s'", path)
      _remove(path)
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("Could not remove leftovers in %s: %s", base_directory, e)
