"""File-system access for checkpoints: local fast paths, `tf.io.gfile` for URLs.

Local paths (and `file://` URLs) are handled with the os module: memory maps
for reading, temporary file + fsync + rename for writing. Any other
`scheme://` path (`gs://...`) goes through `tf.io.gfile`, imported only then.

It also reads the `checkpoint` state file that `tf.train.CheckpointManager`
keeps beside its checkpoints, without TensorFlow, so the latest checkpoint of a
directory can be found in an environment that does not have it.

Synopsis::

  from clu_ckpt import storage

  with storage.atomic_writer("/ckpts/ckpt-3.flax") as write:
    write(b"...")
  buf = storage.map_file("/ckpts/ckpt-3.flax")
  state = storage.read_checkpoint_state("/ckpts")
  state.model_checkpoint_path   # "/ckpts/ckpt-3"
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import fcntl
import glob as globlib
import mmap
import os
import re
import shutil
import time
import uuid
from typing import Any, Callable, Iterator, Optional

from absl import logging

_SCHEME_RE = re.compile(r"^(?P<scheme>[a-z][a-z0-9.+-]+)://", re.I)

TF_INSTALL_HINT = (
    "TensorFlow is required for this: install it with `pip install "
    "tensorflow-cpu` (or `pip install clu_ckpt[tf]`).")


def is_local(path: str) -> bool:
  """True for plain paths and `file://` URLs."""
  m = _SCHEME_RE.match(path)
  return m is None or m.group("scheme").lower() == "file"


def _local(path: str) -> str:
  return path[len("file://"):] if path.lower().startswith("file://") else path


def gfile():
  """`tf.io.gfile`, imported on first use; a clear ImportError without TF."""
  try:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(TF_INSTALL_HINT) from e
  return tf.io.gfile


def exists(path: str) -> bool:
  if is_local(path):
    return os.path.exists(_local(path))
  return gfile().exists(path)


def isdir(path: str) -> bool:
  if is_local(path):
    return os.path.isdir(_local(path))
  return gfile().isdir(path)


def glob(pattern: str) -> list[str]:
  """Paths matching `pattern` (`*`, `?`, `[...]`), sorted.

  A `file://` pattern gives `file://` paths, so that callers can slice them
  by the prefix they globbed for.
  """
  if is_local(pattern):
    local = _local(pattern)
    scheme = pattern[:len(pattern) - len(local)]
    return sorted(scheme + p for p in globlib.glob(local))
  return sorted(gfile().glob(pattern))


def glob_escape(path: str) -> str:
  """`path` with its glob characters (`*`, `?`, `[`) matching literally."""
  return re.sub(r"([*?\[])", r"[\1]", path)


def listdir(path: str) -> list[str]:
  if is_local(path):
    return sorted(os.listdir(_local(path)))
  return sorted(p.rstrip("/") for p in gfile().listdir(path))


def makedirs(path: str) -> None:
  if is_local(path):
    os.makedirs(_local(path), exist_ok=True)
  else:
    gfile().makedirs(path)


def remove(path: str) -> None:
  """Removes a file; a file that is already gone is not an error."""
  try:
    if is_local(path):
      os.remove(_local(path))
    else:
      gfile().remove(path)
  except FileNotFoundError:
    pass
  except Exception as e:  # pylint: disable=broad-except
    if type(e).__name__ != "NotFoundError":  # tf.errors.NotFoundError
      raise


def remove_tree(path: str) -> None:
  """Removes a directory and its content; a missing one is not an error."""
  if is_local(path):
    shutil.rmtree(_local(path), ignore_errors=True)
  elif gfile().isdir(path):
    gfile().rmtree(path)


def stat(path: str) -> tuple[int, float]:
  """(size in bytes, modification time) of a file."""
  if is_local(path):
    st = os.stat(_local(path))
    return st.st_size, st.st_mtime
  st = gfile().stat(path)
  return st.length, st.mtime_nsec / 1e9


def read_bytes(path: str) -> bytes:
  if is_local(path):
    with open(_local(path), "rb") as f:
      return f.read()
  with gfile().GFile(path, "rb") as f:
    return f.read()


def map_file(path: str) -> Any:
  """The content of a file as a read-only buffer, memory-mapped when local.

  Args:
    path: The file.

  Returns:
    An `mmap.mmap` (local, non-empty files), else `bytes`.

  Raises:
    FileNotFoundError: `path` does not exist.
  """
  if not is_local(path):
    if not gfile().exists(path):
      raise FileNotFoundError(f"No such file: {path}")
    return read_bytes(path)
  with open(_local(path), "rb") as f:
    if os.fstat(f.fileno()).st_size == 0:
      return b""
    return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


@contextlib.contextmanager
def atomic_writer(path: str) -> Iterator[Callable[[Any], None]]:
  """Yields a `write(bytes_like)` function whose output appears at `path` whole.

  Locally the data goes to `<path>.tmp-<unique>` in the same directory, is
  flushed to disk (fsync), and is renamed over `path`; the directory is then
  fsynced so the rename itself survives a power cut. If the block raises, the
  temporary file is removed and `path` is untouched. Remote objects
  (`gs://...`) are written through `tf.io.gfile`, which publishes them only
  when closed.

  Local data is staged through two reused 16 MiB buffers (one filling while
  a helper thread writes the other) and written with `O_DIRECT` where the
  file system allows it: a multi-GiB checkpoint then
  goes to disk at disk speed without first filling (and evicting) gigabytes
  of page cache. File systems without `O_DIRECT` (tmpfs) get ordinary writes.

  Example::

    with atomic_writer("/ckpts/ckpt-3.flax") as write:
      write(header)
      write(memoryview(array))

  Args:
    path: Final destination.

  Yields:
    The write function.
  """
  if not is_local(path):
    with gfile().GFile(path, "wb") as f:
      yield lambda data: f.write(bytes(data))
    return
  final = _local(path)
  tmp = f"{final}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
  try:
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
  except OSError as e:
    raise _naming(e, final) from e
  writer = _StagedWriter(fd)

  def write(data: Any) -> None:
    try:
      writer.write(data)
    except OSError as e:
      raise _naming(e, final) from e

  try:
    yield write
    try:
      writer.close()
      os.fsync(fd)
    except OSError as e:
      raise _naming(e, final) from e
  except BaseException:
    writer.close(discard=True)
    os.close(fd)
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise
  os.close(fd)
  try:
    os.replace(tmp, final)
  except BaseException as e:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    if isinstance(e, OSError):
      raise _naming(e, final) from e
    raise
  fsync_directory(os.path.dirname(final) or ".")


def _naming(error: OSError, path: str) -> OSError:
  """`error` with `path` as its filename, so the message names the file.

  `os.write` and the staging thread raise OSErrors without a filename; a
  full disk would otherwise read "[Errno 28] No space left on device".
  """
  if error.filename == path or error.errno is None:
    return error
  # OSError(errno, ...) picks the subclass (PermissionError, ...) itself.
  return OSError(error.errno, error.strerror or str(error), path)


def _write_all(fd: int, data: Any) -> None:
  view = memoryview(data)
  while view:
    n = os.write(fd, view)
    view = view[n:]


_STAGE_BYTES = 16 * 2**20  # a multiple of every logical block size


class _StagedWriter:
  """Writes a stream through two page-aligned buffers, with O_DIRECT if allowed.

  While one full buffer is being written (by a helper thread: `os.write`
  releases the GIL), the stream is copied into the other, so copying and disk
  I/O overlap. Full buffers are written with `O_DIRECT` (aligned offset,
  length and memory); the last, partial one through the page cache. Where the
  file system refuses `O_DIRECT`, every write is an ordinary one.
  """

  def __init__(self, fd: int):
    self._fd = fd
    self._buffers: list[mmap.mmap] = []
    self._views: list[memoryview] = []
    self._current = 0
    self._fill = 0
    self._pending: Optional[concurrent.futures.Future] = None
    self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
    self._direct: Optional[bool] = None if hasattr(os, "O_DIRECT") else False

  def write(self, data: Any) -> None:
    src = memoryview(data).cast("B")
    if not self._buffers:
      if len(src) >= _STAGE_BYTES and self._direct is False:
        _write_all(self._fd, src)  # no O_DIRECT: skip the staging copy
        return
      self._buffers = [mmap.mmap(-1, _STAGE_BYTES) for _ in range(2)]
      self._views = [memoryview(b) for b in self._buffers]
    while src:
      n = min(len(src), _STAGE_BYTES - self._fill)
      self._views[self._current][self._fill:self._fill + n] = src[:n]
      self._fill += n
      src = src[n:]
      if self._fill == _STAGE_BYTES:
        self._submit()

  def _submit(self) -> None:
    """Hands the full buffer to the writer thread; continues in the other."""
    if self._direct is None:
      self._direct = self._set_direct(True)
    self._wait()
    if self._pool is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(
          1, thread_name_prefix="clu_ckpt-write")
    self._pending = self._pool.submit(self._write_full,
                                      self._views[self._current])
    self._current = 1 - self._current
    self._fill = 0

  def _wait(self) -> None:
    if self._pending is not None:
      pending, self._pending = self._pending, None
      pending.result()  # re-raises the writer thread's OSError

  def _write_full(self, view: memoryview) -> None:
    if self._direct:
      try:
        _write_all(self._fd, view)
        return
      except OSError as e:
        if e.errno != errno.EINVAL:
          raise
        # Refused after all (e.g. a larger block size): fall back for good.
        self._set_direct(False)
        self._direct = False
        if os.lseek(self._fd, 0, os.SEEK_CUR) % _STAGE_BYTES:
          raise
    _write_all(self._fd, view)

  def _set_direct(self, on: bool) -> bool:
    try:
      flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
      flags = flags | os.O_DIRECT if on else flags & ~os.O_DIRECT
      fcntl.fcntl(self._fd, fcntl.F_SETFL, flags)
    except OSError:
      return False
    return on

  def close(self, discard: bool = False) -> None:
    """Finishes the writes (the tail through the page cache), frees buffers.

    Args:
      discard: The stream is abandoned: write nothing more and swallow the
        pending write's error (the caller is already raising its own).
    """
    if not self._buffers:
      return
    try:
      try:
        self._wait()
      except OSError:
        if not discard:
          raise
      if not discard and self._fill:
        if self._direct:
          self._set_direct(False)
        with self._views[self._current][:self._fill] as tail:
          _write_all(self._fd, tail)
    finally:
      if self._pool is not None:
        self._pool.shutdown(wait=True)
      for view in self._views:
        view.release()
      for buffer in self._buffers:
        try:
          buffer.close()
        except BufferError:
          pass  # a traceback still holds a view; freed with it
      self._buffers, self._views, self._pool = [], [], None


def sync(path: str) -> None:
  """Makes a local file written by someone else (TensorFlow) durable.

  Flushes the file and its directory (the rename that put it there); a no-op
  for remote paths, which are durable once written.
  """
  if is_local(path):
    local = _local(path)
    _fsync_path(local)
    fsync_directory(os.path.dirname(local) or ".")


def fsync_directory(directory: str) -> None:
  """Makes renames and deletions in a local directory durable."""
  _fsync_path(directory)


def _fsync_path(path: str) -> None:
  # Best effort: a vanished file, or a file system that cannot fsync a
  # directory, is not an error.
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


# --------------------------------------------------------------------------
# TensorFlow's `checkpoint` state file (a text-format CheckpointState proto).
# --------------------------------------------------------------------------

STATE_FILENAME = "checkpoint"


@dataclasses.dataclass
class CheckpointState:
  """What TensorFlow's `checkpoint` state file says about a directory.

  Paths are joined with the directory when relative, as TensorFlow does.
  """
  model_checkpoint_path: str
  all_model_checkpoint_paths: list[str]
  all_model_checkpoint_timestamps: list[float]
  last_preserved_timestamp: float

  def managed_checkpoints(self, now: Optional[float] = None) -> list[str]:
    """The checkpoints a fresh `tf.train.CheckpointManager` would list.

    `CheckpointManager.checkpoints` keeps only paths whose timestamp is newer
    than `last_preserved_timestamp` (timestamps from the future count as now);
    files without timestamps list nothing.

    Args:
      now: The current time (default `time.time()`).

    Returns:
      Checkpoint prefixes, oldest first.
    """
    now = time.time() if now is None else now
    last = min(self.last_preserved_timestamp, now)
    stamps = self.all_model_checkpoint_timestamps or (
        [last] * len(self.all_model_checkpoint_paths))
    return [p for p, t in zip(self.all_model_checkpoint_paths, stamps)
            if min(t, now) > last]


def read_checkpoint_state(directory: str) -> Optional[CheckpointState]:
  """Parses `<directory>/checkpoint` like `tf.train.get_checkpoint_state`.

  Args:
    directory: A checkpoint directory.

  Returns:
    The state, or None when the file is missing or cannot be parsed (which
    TensorFlow, too, treats as "no checkpoint", with a warning).

  Raises:
    ValueError: The file parses but names no `model_checkpoint_path`.
  """
  path = join(directory, STATE_FILENAME)
  if not exists(path):
    return None
  try:
    text = read_bytes(path).decode("utf-8")
  except FileNotFoundError:
    return None
  except (OSError, UnicodeDecodeError) as e:
    logging.warning("%s: %s; checkpoint state ignored", path, e)
    return None
  try:
    fields = _parse_text_proto(text)
  except ValueError as e:
    logging.warning("%s: %s; checkpoint state ignored", path, e)
    return None
  latest = (fields.get("model_checkpoint_path") or [""])[-1]
  if not latest:
    raise ValueError(f"Invalid checkpoint state loaded from {directory}")
  absolute = lambda p: p if os.path.isabs(p) else os.path.join(directory, p)
  return CheckpointState(
      model_checkpoint_path=absolute(latest),
      all_model_checkpoint_paths=[
          absolute(p) for p in fields.get("all_model_checkpoint_paths", [])],
      all_model_checkpoint_timestamps=[
          float(t) for t in fields.get("all_model_checkpoint_timestamps", [])],
      last_preserved_timestamp=float(
          (fields.get("last_preserved_timestamp") or [0.0])[-1]),
  )


def join(directory: str, *names: str) -> str:
  return os.path.join(directory, *names)


_FIELD_RE = re.compile(
    r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*:\s*'
    r'("(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'|[-+0-9.eEinfINFa]+)\s*;?')
_STRING_FIELDS = ("model_checkpoint_path", "all_model_checkpoint_paths")
_FLOAT_FIELDS = ("all_model_checkpoint_timestamps", "last_preserved_timestamp")


def _parse_text_proto(text: str) -> dict[str, list]:
  """Parses the flat text proto of a CheckpointState into field -> values."""
  fields: dict[str, list] = {}
  pos = 0
  text = re.sub(r"#[^\n]*", "", text)
  while pos < len(text):
    if text[pos:].strip() == "":
      break
    m = _FIELD_RE.match(text, pos)
    if m is None:
      raise ValueError(f"cannot parse text proto near {text[pos:pos + 40]!r}")
    name, raw = m.group(1), m.group(2)
    if name in _STRING_FIELDS:
      if raw[0] not in "\"'":
        raise ValueError(f"field {name} expects a string, got {raw!r}")
      value: Any = _unescape(raw[1:-1])
    elif name in _FLOAT_FIELDS:
      value = float(raw)
    else:
      raise ValueError(f"unknown field {name!r}")
    fields.setdefault(name, []).append(value)
    pos = m.end()
  return fields


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"',
            "a": "\a", "b": "\b", "f": "\f", "v": "\v", "?": "?"}


def _unescape(s: str) -> str:
  """C-style unescaping as protobuf's text format writes it (UTF-8 bytes)."""
  out = bytearray()
  i = 0
  while i < len(s):
    c = s[i]
    if c != "\\":
      out += c.encode("utf-8")
      i += 1
      continue
    nxt = s[i + 1]
    if nxt in _ESCAPES:
      out += _ESCAPES[nxt].encode()
      i += 2
    elif nxt in "01234567":
      m = re.match(r"[0-7]{1,3}", s[i + 1:])
      out.append(int(m.group(0), 8) & 0xFF)
      i += 1 + len(m.group(0))
    elif nxt in "xX":
      m = re.match(r"[0-9a-fA-F]{1,2}", s[i + 2:])
      if m is None:
        raise ValueError(f"bad escape in {s!r}")
      out.append(int(m.group(0), 16))
      i += 2 + len(m.group(0))
    else:
      raise ValueError(f"bad escape in {s!r}")
  return out.decode("utf-8")  # invalid UTF-8 is a parse error, as in TF
