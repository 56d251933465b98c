"""The `tf.io.gfile` back end of `filesystem.FileSystem`, for `scheme://` URLs.

Every URL whose scheme has no back end of its own registered in
`clu_ckpt.storage` (`gs://...`, `ram://...`, `hdfs://...`) goes through
TensorFlow's file-system layer. TensorFlow is imported on first use only;
without it the call raises an ImportError that says how to install it
(`filesystem.TF_INSTALL_HINT`).

Synopsis::

  from clu_ckpt import gfile_fs

  fs = gfile_fs.GFileFileSystem()
  with fs.atomic_writer("gs://bucket/ckpts/ckpt-3.flax") as write:
    write(b"...")   # the object appears when the block ends
  fs.read_bytes("gs://bucket/ckpts/ckpt-3.flax", offset=8, length=16)
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

from clu_ckpt import filesystem


def gfile():
  """`tf.io.gfile`, imported on first use; a clear ImportError without TF.

  Raises:
    ImportError: TensorFlow is not installed (the message says how to).
  """
  try:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(filesystem.TF_INSTALL_HINT) from e
  return tf.io.gfile


class GFileFileSystem(filesystem.FileSystem):
  """Any URL, through `tf.io.gfile`.

  Example::

    fs = GFileFileSystem()
    fs.listdir("gs://bucket/ckpts")   # ["checkpoint", "ckpt-1.flax", ...]
  """

  def exists(self, path: str) -> bool:
    return gfile().exists(path)

  def isdir(self, path: str) -> bool:
    return gfile().isdir(path)

  def listdir(self, path: str) -> list[str]:
    return sorted(p.rstrip("/") for p in gfile().listdir(path))

  def glob(self, pattern: str) -> list[str]:
    return sorted(gfile().glob(pattern))

  def makedirs(self, path: str) -> None:
    gfile().makedirs(path)

  def remove(self, path: str) -> None:
    try:
      gfile().remove(path)
    except Exception as e:  # pylint: disable=broad-except
      if type(e).__name__ != "NotFoundError":  # tf.errors.NotFoundError
        raise

  def remove_tree(self, path: str) -> None:
    if gfile().isdir(path):
      gfile().rmtree(path)

  def rename(self, src: str, dst: str) -> None:
    gfile().rename(src, dst, overwrite=True)

  def stat(self, path: str) -> tuple[int, float]:
    st = gfile().stat(path)
    return st.length, st.mtime_nsec / 1e9

  def read_bytes(self, path: str, offset: int = 0,
                 length: Optional[int] = None) -> bytes:
    with gfile().GFile(path, "rb") as f:
      if offset:
        f.seek(offset)
      return f.read() if length is None else f.read(length)

  def map(self, path: str, *, populate: bool = True) -> Any:
    del populate  # read whole: nothing to populate
    if not gfile().exists(path):
      raise FileNotFoundError(f"No such file: {path}")
    return self.read_bytes(path)

  @contextlib.contextmanager
  def atomic_writer(self, path: str) -> Iterator[Callable[[Any], None]]:
    """Writes through `GFile`, which publishes the object when closed."""
    with gfile().GFile(path, "wb") as f:
      yield lambda data: f.write(bytes(data))
