"""Every exception clu_ckpt raises on purpose, under one base: `CluCkptError`.

Callers that want "anything clu_ckpt refused" catch `CluCkptError`; callers that
relied on the standard types before keep working, because each class also
derives from the standard exception it replaced (`ValueError`, `OSError`,
`FileNotFoundError`, ...).

Synopsis::

  from clu_ckpt import errors

  try:
    state = load_state_dict("/ckpts")
  except errors.CluCkptError as e:      # FlaxFormatError, NotRegularFileError, ...
    print(f"cannot restore: {e}")

The classes are defined here and re-exported by the module that raises them
(`flax_format.FlaxFormatError`, `migration.MigrationError`, ...).
"""

from __future__ import annotations

from typing import Optional


class CluCkptError(Exception):
  """Base of every exception clu_ckpt raises on purpose."""


class FlaxFormatError(CluCkptError, ValueError):
  """A `.flax` file (or byte string) is not a valid Flax msgpack checkpoint.

  Attributes:
    path: The file, or None for an in-memory byte string.
    offset: Byte offset at which the problem was found, or None.
  """

  def __init__(self, message: str, path: Optional[str] = None,
               offset: Optional[int] = None):
    where = path if path is not None else "<bytes>"
    if offset is not None:
      where = f"{where} at byte {offset}"
    super().__init__(f"{where}: {message}")
    self.path = path
    self.offset = offset

  def __reduce__(self):
    message = str(self).split(": ", 1)[-1]
    return type(self), (message, self.path, self.offset)


class NotRegularFileError(CluCkptError, OSError):
  """A named pipe, device, socket or directory where a file is expected.

  Reading one could block forever (a FIFO), never end (`/dev/zero`) or fail
  obscurely, so it is refused before anything reads it. `e.filename` is the
  path; `str(e)` reads e.g.
  "[Errno 22] not a regular file (a named pipe): '/ckpts/checkpoint'"
  (errno EISDIR for a directory, else EINVAL).
  """


class CheckpointStateError(CluCkptError, ValueError):
  """TensorFlow's `checkpoint` state file cannot be used; `.path` names it."""

  def __init__(self, path: str, problem: str):
    super().__init__(f"checkpoint state file {path}: {problem}")
    self.path = path
    self.problem = problem

  def __reduce__(self):
    return type(self), (self.path, self.problem)


class OutsideDirectoryError(CluCkptError, ValueError):
  """A checkpoint file or listed checkpoint resolves outside its directory.

  Attributes:
    path: The offending path, as listed or found.
    directory: The checkpoint directory it should be in.
  """

  def __init__(self, path: str, directory: str, how: str):
    super().__init__(f"{path}: resolves outside the checkpoint directory "
                     f"{directory} ({how}); refused")
    self.path = path
    self.directory = directory


class InvalidCheckpointError(CluCkptError, ValueError):
  """A checkpoint path or state does not have the expected form.

  Raised for a path without `-<number>` (`CheckpointInfo.from_path`) and for
  a saved state that does not match the template it is restored into.
  """


class CheckpointNotFoundError(CluCkptError, FileNotFoundError):
  """There is no checkpoint (or no such checkpoint, or step) to restore."""


class CheckpointWriteError(CluCkptError, OSError):
  """A checkpoint could not be written; `.filename` names it.

  The errno is the operating system's (ENOSPC for a full disk) when known.
  """


class ConcurrentWriterError(CluCkptError, RuntimeError):
  """Another process changed a checkpoint directory while this one saved."""


class UnsupportedLeafError(CluCkptError, TypeError):
  """A state holds a leaf of a type the format cannot store (names its path)."""


class MigrationError(CluCkptError):
  """A migration cannot proceed; the message says why and what to do."""


class VerificationError(MigrationError):
  """A migrated step is not what its source holds, or cannot be read back."""


class DestinationLockedError(MigrationError):
  """Another migration holds the destination's lock (the message names it).

  Attributes:
    holder: What the holder recorded: host, pid, since (may be empty).
  """

  def __init__(self, message: str, holder: Optional[dict] = None):
    super().__init__(message)
    self.holder = dict(holder or {})


class PrivateApiError(CluCkptError, ImportError):
  """A private TensorFlow or Orbax API clu_ckpt relies on is not there.

  The message names the API, the versions it was checked against and the
  versions installed.
  """


class UsageError(CluCkptError, ValueError):
  """An argument is not one clu_ckpt accepts (e.g. `max_to_keep < 2`)."""


class MissingBackendError(CluCkptError, ImportError):
  """The package a storage back end needs (gcsfs, s3fs) is not installed.

  The message names the scheme and the extra that installs it
  (`pip install -e '.[gcs]'` in a checkout).
  """


class StoreAccessError(CluCkptError, PermissionError):
  """An object store refused access or no credentials were found for it.

  The message names the path and what the store said.
  """
