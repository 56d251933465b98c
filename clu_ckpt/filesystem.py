"""The interface every storage back end implements: `FileSystem`.

`clu_ckpt.storage` chooses a back end by URL scheme and delegates to it;
the back ends (`local_fs`, `gfile_fs`, and later object stores) derive from
`FileSystem` here, so that none of them imports `storage` (no import circle).

Synopsis::

  from clu_ckpt import filesystem

  class MemoryFileSystem(filesystem.FileSystem):
    ...                                  # the abstract methods
  storage.register_filesystem("mem", MemoryFileSystem)
"""

from __future__ import annotations

import abc
from typing import Any, Callable, ContextManager, Optional

TF_INSTALL_HINT = (
    "TensorFlow is required for this: install it with `pip install "
    "tensorflow-cpu` (or `pip install -e '.[tf]'` in a clu_ckpt checkout).")


class FileSystem(abc.ABC):
  """What the package needs from a store of files; one subclass per back end.

  Paths are full paths or URLs as the caller gave them (a back end strips
  its own scheme if it must). Errors are OSErrors where the store has them
  (FileNotFoundError for a missing file), else the store's own.

  A back end for an object store (fsspec: `gs://`, `s3://`) implements the
  abstract methods with ranged reads (`read_bytes(path, offset, length)`;
  `map` may return those bytes), commits by upload in `atomic_writer` (the
  object appears whole when the block ends, or not at all), and leaves
  `rename` unimplemented if the store has none; `sync` and
  `check_regular_file` default to no-ops. Register it with
  `register_filesystem("s3", S3FileSystem)`.

  Example::

    fs = storage.filesystem("/ckpts")
    if fs.exists("/ckpts/ckpt-3.flax"):
      header = fs.read_bytes("/ckpts/ckpt-3.flax", 0, 4096)
  """

  @abc.abstractmethod
  def exists(self, path: str) -> bool:
    """True if a file or directory is at `path`."""

  @abc.abstractmethod
  def isdir(self, path: str) -> bool:
    """True if `path` is a directory (or an object-store prefix)."""

  @abc.abstractmethod
  def listdir(self, path: str) -> list[str]:
    """The names (not paths) in directory `path`, sorted, no trailing `/`."""

  @abc.abstractmethod
  def glob(self, pattern: str) -> list[str]:
    """Paths matching `pattern` (`*`, `?`, `[...]`), sorted, same scheme."""

  @abc.abstractmethod
  def makedirs(self, path: str) -> None:
    """Creates directory `path` and its parents; existing ones are fine."""

  @abc.abstractmethod
  def remove(self, path: str) -> None:
    """Removes a file; a file that is already gone is not an error."""

  @abc.abstractmethod
  def remove_tree(self, path: str) -> None:
    """Removes a directory and its content; a missing one is not an error."""

  def rename(self, src: str, dst: str) -> None:
    """Moves `src` over `dst`, atomically where the store can.

    Raises:
      NotImplementedError: The store has no rename (commit by upload instead,
        see `atomic_writer`).
    """
    raise NotImplementedError(f"{type(self).__name__} cannot rename {src}")

  @abc.abstractmethod
  def stat(self, path: str) -> tuple[int, float]:
    """(size in bytes, modification time in seconds) of a file."""

  @abc.abstractmethod
  def read_bytes(self, path: str, offset: int = 0,
                 length: Optional[int] = None) -> bytes:
    """`length` bytes (all if None, fewer at the end) from `offset`."""

  def map(self, path: str, *, populate: bool = True) -> Any:
    """The whole file as a read-only buffer (a memory map where possible).

    `populate` is a hint for memory maps: True when most of the file will be
    read (a local map then reads it all in at once), False when only some of
    it will (headers, one subtree). Back ends that read the file whole ignore
    it.

    Raises:
      FileNotFoundError: `path` does not exist.
    """
    if not self.exists(path):
      raise FileNotFoundError(f"No such file: {path}")
    return self.read_bytes(path)

  @abc.abstractmethod
  def atomic_writer(self, path: str) -> ContextManager[Callable[[Any], None]]:
    """A context manager yielding `write(bytes_like)`; see `atomic_writer`."""

  def create_exclusive(self, path: str, data: bytes) -> None:
    """Writes `data` at `path` only if nothing is there, atomically.

    Raises:
      FileExistsError: Something is already at `path`.
      NotImplementedError: The store cannot do this atomically.
    """
    raise NotImplementedError(
        f"{type(self).__name__} cannot create {path} exclusively")

  def sync(self, path: str) -> None:
    """Makes a file written by someone else durable; no-op by default."""

  def check_regular_file(self, path: str) -> None:
    """Raises NotRegularFileError unless `path` is a regular file (no-op)."""
