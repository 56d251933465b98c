"""File-system access for checkpoints: local fast paths, `tf.io.gfile` for URLs.

Local paths (and `file://` URLs) are handled with the os module: memory maps
for reading, temporary file + fsync + rename for writing. Any other
`scheme://` path (`gs://...`) goes through `tf.io.gfile`, imported only then.

Local reads open only regular files (a symlink to one is fine): a named pipe,
device, socket or directory where a file is expected raises
`NotRegularFileError` (an OSError naming the file) at once instead of
blocking forever (a FIFO) or never ending (`/dev/zero`). Call
`check_regular_file` before handing a path to a library that opens it itself
(TensorFlow).

It also reads the `checkpoint` state file that `tf.train.CheckpointManager`
keeps beside its checkpoints, without TensorFlow, so the latest checkpoint of a
directory can be found in an environment that does not have it. The parser is
linear in the file's size; files over `MAX_STATE_FILE_BYTES` are refused.

Synopsis::

  from clu_ckpt import storage

  with storage.atomic_writer("/ckpts/ckpt-3.flax") as write:
    write(b"...")
  buf = storage.map_file("/ckpts/ckpt-3.flax")
  state = storage.read_checkpoint_state("/ckpts")
  state.model_checkpoint_path   # "/ckpts/ckpt-3"
  storage.read_checkpoint_state("/ckpts", strict=True)  # or raises
  storage.check_regular_file("/ckpts/ckpt-3.index")  # or NotRegularFileError
"""

from __future__ import annotations

import codecs
import concurrent.futures
import contextlib
import dataclasses
import errno
import fcntl
import glob as globlib
import math
import mmap
import os
import re
import shutil
import stat as statlib
import sys
import time
import uuid
from typing import Any, Callable, Iterator, Optional

from absl import logging

from clu_ckpt import errors

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
  """Removes a directory and its content; a missing one is not an error.

  A symlink (to a directory or anything else) is removed itself: what it
  points to is never touched, nor are the targets of symlinks inside.
  """
  if is_local(path):
    local = _local(path)
    if os.path.islink(local) or (os.path.lexists(local) and
                                 not os.path.isdir(local)):
      with contextlib.suppress(FileNotFoundError):
        os.remove(local)
      return
    shutil.rmtree(local, ignore_errors=True)
  elif gfile().isdir(path):
    gfile().rmtree(path)


def stat(path: str) -> tuple[int, float]:
  """(size in bytes, modification time) of a file."""
  if is_local(path):
    st = os.stat(_local(path))
    return st.st_size, st.st_mtime
  st = gfile().stat(path)
  return st.length, st.mtime_nsec / 1e9


NotRegularFileError = errors.NotRegularFileError


_KINDS = ((statlib.S_ISDIR, "a directory"), (statlib.S_ISFIFO, "a named pipe"),
          (statlib.S_ISCHR, "a character device"),
          (statlib.S_ISBLK, "a block device"), (statlib.S_ISSOCK, "a socket"),
          (statlib.S_ISLNK, "a symbolic link"))


def _check_mode(mode: int, path: str) -> None:
  if statlib.S_ISREG(mode):
    return
  kind = next((k for test, k in _KINDS if test(mode)),
              f"file type {statlib.S_IFMT(mode):#o}")
  raise NotRegularFileError(
      errno.EISDIR if statlib.S_ISDIR(mode) else errno.EINVAL,
      f"not a regular file ({kind})", path)


def check_regular_file(path: str) -> None:
  """Raises unless `path` is a regular file, without opening it.

  For paths that another library (TensorFlow) will open: a named pipe there
  would block it forever. Symlinks are followed (only the target counts).
  Remote paths (`gs://...`) are not checked.

  Example::

    storage.check_regular_file(prefix + ".index")
    tf_checkpoint.restore(prefix)

  Args:
    path: A file path or URL.

  Raises:
    NotRegularFileError: `path` is a named pipe, device, socket, directory...
    FileNotFoundError: `path` does not exist (or is a dangling symlink).
    OSError: It cannot be examined (ELOOP for a symlink loop, EACCES...),
      with `filename` set.
  """
  if is_local(path):
    local = _local(path)
    _check_mode(os.stat(local).st_mode, local)


def _open_regular(path: str) -> int:
  """A read-only descriptor of the local regular file `path`.

  The type is checked before opening (so that no device is even opened) and
  again on the open descriptor (the file may have been swapped meanwhile);
  `O_NONBLOCK` keeps a FIFO swapped in from blocking the open.
  """
  local = _local(path)
  _check_mode(os.stat(local).st_mode, local)
  fd = os.open(local, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
  try:
    _check_mode(os.fstat(fd).st_mode, local)
    fcntl.fcntl(fd, fcntl.F_SETFL,
                fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
  except BaseException:
    os.close(fd)
    raise
  return fd


def read_bytes(path: str) -> bytes:
  """The whole content of a file.

  Args:
    path: The file (path or URL).

  Returns:
    Its bytes.

  Raises:
    NotRegularFileError: A local `path` is not a regular file.
    OSError: It cannot be read (FileNotFoundError if missing).
  """
  if is_local(path):
    with open(_open_regular(path), "rb") as f:
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
    NotRegularFileError: A local `path` is not a regular file.
    OSError: It cannot be read.
  """
  if not is_local(path):
    if not gfile().exists(path):
      raise FileNotFoundError(f"No such file: {path}")
    return read_bytes(path)
  fd = _open_regular(path)
  try:
    if os.fstat(fd).st_size == 0:
      return b""
    return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
  finally:
    os.close(fd)


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
  # directory, is not an error. Only files and directories are opened (with
  # O_NONBLOCK, should one be swapped for a FIFO): a FIFO would block.
  try:
    mode = os.stat(path).st_mode
    if not (statlib.S_ISREG(mode) or statlib.S_ISDIR(mode)):
      return
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
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
# TensorFlow writes a few hundred bytes per checkpoint; larger files are
# refused before they are read.
MAX_STATE_FILE_BYTES = 128 * 2**20
# Each listed path or timestamp costs ~100 bytes of Python objects however
# short it is in the file (`"a",`): files listing more are refused.
MAX_STATE_ENTRIES = 2**22


CheckpointStateError = errors.CheckpointStateError


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


def read_checkpoint_state(directory: str, *,
                          strict: bool = False) -> Optional[CheckpointState]:
  r"""Parses `<directory>/checkpoint` like `tf.train.get_checkpoint_state`.

  The file is a text-format `CheckpointState` proto; it is parsed as
  TensorFlow's (Python protobuf) reader does: comments (`#` outside quotes),
  `"`/`'` strings with C, hex, octal and `\u` escapes, adjacent strings
  concatenated, `field: [a, b]` lists, `,`/`;` separators, repeated scalar
  fields (the last wins), and the same float spellings (`1e3`, `inf`, `2f`).

  Example::

    state = read_checkpoint_state("/ckpts")
    latest = state.model_checkpoint_path if state else None

  Args:
    directory: A checkpoint directory (path or URL).
    strict: Raise `CheckpointStateError` for a file that cannot be read, is
      not UTF-8 or does not parse, instead of returning None with a warning
      (which TensorFlow does).

  Returns:
    The state, or None when the file is missing (or, unless `strict`, cannot
    be used).

  Raises:
    NotRegularFileError: The file is a named pipe, device, directory...
      (in both modes: TensorFlow would block on it or fail).
    CheckpointStateError: In both modes: the file is larger than
      `MAX_STATE_FILE_BYTES` (128 MiB; refused before reading), lists more
      than `MAX_STATE_ENTRIES` (4M) paths and timestamps, or parses but names
      no `model_checkpoint_path` ("Invalid checkpoint state", a ValueError as
      in TensorFlow). With `strict`, also when it cannot be read, is not UTF-8
      or does not parse. The message names the file and the problem ("not
      UTF-8 at byte 17", "cannot parse: line 2, column 5: ...").
  """
  path = join(directory, STATE_FILENAME)
  try:
    data = _read_state_file(path)
  except (NotRegularFileError, CheckpointStateError):
    raise
  except Exception as e:  # pylint: disable=broad-except
    if not (isinstance(e, OSError) or
            any(c.__name__ == "OpError" for c in type(e).__mro__)):
      raise
    return _unusable(path, f"cannot read: {e}", strict, e)
  if data is None:
    return None
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    return _unusable(path, f"not UTF-8 at byte {e.start}", strict, e)
  del data
  try:
    fields = _parse_text_proto(text)
  except _TooManyEntries as e:
    raise CheckpointStateError(path, str(e)) from None
  except ValueError as e:
    return _unusable(path, f"cannot parse: {e}", strict, e)
  del text
  latest = (fields["model_checkpoint_path"] or [""])[-1]
  if not latest:
    raise CheckpointStateError(
        path, f"Invalid checkpoint state loaded from {directory}: "
        "no model_checkpoint_path")
  # os.path.isabs and os.path.join (POSIX), inlined for long lists.
  prefix = directory if not directory or directory.endswith("/") else (
      directory + "/")
  absolute = lambda p: p if p.startswith("/") else prefix + p
  paths = fields["all_model_checkpoint_paths"]
  for i, p in enumerate(paths):  # in place: no second list of copies
    paths[i] = absolute(p)
  stamps = fields["last_preserved_timestamp"]
  return CheckpointState(
      model_checkpoint_path=absolute(latest),
      all_model_checkpoint_paths=paths,
      all_model_checkpoint_timestamps=fields["all_model_checkpoint_timestamps"],
      last_preserved_timestamp=stamps[-1] if stamps else 0.0,
  )


def _read_state_file(path: str) -> Optional[bytes]:
  """The bytes of the state file, None if missing; refuses oversized ones."""

  def read(f: Any, size: int) -> bytes:
    if size > MAX_STATE_FILE_BYTES:
      raise CheckpointStateError(
          path, f"{size} bytes, over the limit of {MAX_STATE_FILE_BYTES} "
          "(storage.MAX_STATE_FILE_BYTES)")
    data = f.read(size + 1)
    if len(data) > size:  # growing while read
      data += f.read(MAX_STATE_FILE_BYTES + 1 - len(data))
      if len(data) > MAX_STATE_FILE_BYTES:
        raise CheckpointStateError(
            path, f"over the limit of {MAX_STATE_FILE_BYTES} bytes "
            "(storage.MAX_STATE_FILE_BYTES)")
    return data

  if is_local(path):
    try:
      fd = _open_regular(path)
    except (FileNotFoundError, NotADirectoryError):
      return None
    with open(fd, "rb") as f:
      return read(f, os.fstat(fd).st_size)
  if not gfile().exists(path):
    return None
  with gfile().GFile(path, "rb") as f:
    return read(f, gfile().stat(path).length)


def _unusable(path: str, problem: str, strict: bool,
              cause: Exception) -> None:
  if strict:
    raise CheckpointStateError(path, problem) from cause
  logging.warning("%s: %s; checkpoint state ignored", path, problem)
  return None


def join(directory: str, *names: str) -> str:
  return os.path.join(directory, *names)


# The text-format tokenizer. Every repetition is possessive (Python >= 3.11):
# `re` then keeps no backtracking state per repetition, so long strings,
# escape runs and comment runs cost no memory beyond the text. Python 3.10
# gets the same patterns without it (none needs it for its meaning): still
# linear in time.
def _compile(pattern: Any) -> re.Pattern:
  if sys.version_info < (3, 11):
    strip = r"(?<=[*+?}])\+"
    pattern = re.sub(strip.encode() if isinstance(pattern, bytes) else strip,
                     pattern[:0], pattern)
  return re.compile(pattern)


_SKIP = r"\s*+(?:#[^\n]*+(?![^\n])\s*+)*+"  # whitespace, comments to EOL
_WORD = r"[A-Za-z_][0-9A-Za-z_+-]*+|(?:[0-9+-]|\.[0-9])[0-9A-Za-z_.+-]*+"
_STRING = (r'"[^"\\\n]*+(?:\\.[^"\\\n]*+)*+"|'
           r"'[^'\\\n]*+(?:\\.[^'\\\n]*+)*+'")
_LONE_STRING = rf"(?:{_STRING})(?!{_SKIP}[\"'])"  # no adjacent string to join
_NUMBER = rf"(?!-?0[0-9])(?:{_WORD})"  # not octal-looking (an error)
_STRING_FIELDS = ("model_checkpoint_path", "all_model_checkpoint_paths")
_FLOAT_FIELDS = ("all_model_checkpoint_timestamps", "last_preserved_timestamp")
_REPEATED = ("all_model_checkpoint_paths", "all_model_checkpoint_timestamps")
_NAMES = {kind: f"(?:{'|'.join(names)})(?![0-9A-Za-z_+-])"
          for kind, names in (("s", _STRING_FIELDS), ("f", _FLOAT_FIELDS))}
# One token (any other character is a token by itself).
_TOKEN_RE = _compile(
    rf"{_SKIP}(?:(?P<word>{_WORD})|(?P<string>{_STRING})|(?P<char>.))?")
# Fast paths, matched as runs of up to 1024, then split with findall (no match
# object each): `name: value` fields with a single string or number, list
# items with their comma, adjacent strings. Anything else goes token by token.
# (No capturing group inside a possessive repeat: Python 3.11's `re` gets
# their spans wrong.)
_RUNS_RE = {
    "field": _compile(
        rf"(?:{_SKIP}(?:{_NAMES['s']}{_SKIP}:{_SKIP}{_LONE_STRING}|"
        rf"{_NAMES['f']}{_SKIP}:{_SKIP}{_NUMBER}){_SKIP}[,;]?){{1,1024}}+"),
    "string": _compile(rf"(?:{_SKIP}(?:{_STRING}){_SKIP},){{1,1024}}+"),
    "number": _compile(rf"(?:{_SKIP}{_NUMBER}{_SKIP},){{1,1024}}+"),
    "adjacent": _compile(rf"(?:{_SKIP}(?:{_STRING})){{1,1024}}+"),
}
_ITEMS_RE = {
    "field": _compile(
        rf"{_SKIP}(?:({_NAMES['s']}){_SKIP}:{_SKIP}({_STRING})|"
        rf"({_NAMES['f']}){_SKIP}:{_SKIP}({_WORD})){_SKIP}[,;]?"),
    "string": _compile(rf"{_SKIP}({_STRING}){_SKIP},"),
    "number": _compile(rf"{_SKIP}({_WORD}){_SKIP},"),
    "adjacent": _compile(rf"{_SKIP}({_STRING})"),
}


def _parse_text_proto(text: str) -> dict[str, list]:
  """Parses the flat text proto of a CheckpointState into field -> values.

  Raises:
    ValueError: "line 3, column 7: ..." (a syntax error, an unknown field, a
      bad escape or number, a string that is not UTF-8 once unescaped);
      `_TooManyEntries` over MAX_STATE_ENTRIES.
  """
  fields: dict[str, list] = {n: [] for n in _STRING_FIELDS + _FLOAT_FIELDS}
  pos = bulk_from = 0
  while pos >= 0:
    if pos >= bulk_from:
      pos, bulk_from = _parse_run("field", text, pos, fields)
    pos = _parse_field(text, pos, fields)
    _check_entries(fields)
  return fields


class _TooManyEntries(ValueError):
  pass


def _check_entries(fields: dict[str, list]) -> None:
  """Keeps the last value of singular fields; enforces MAX_STATE_ENTRIES."""
  del fields["model_checkpoint_path"][:-1], fields[
      "last_preserved_timestamp"][:-1]
  if len(fields["all_model_checkpoint_paths"]) + len(
      fields["all_model_checkpoint_timestamps"]) > MAX_STATE_ENTRIES:
    raise _TooManyEntries(
        f"more than {MAX_STATE_ENTRIES} paths and timestamps "
        "(storage.MAX_STATE_ENTRIES)")


def _parse_run(kind: str, text: str, pos: int, fields: dict[str, list],
               name: str = "") -> tuple[int, int]:
  """Appends a run of simple fields or list items at `pos` in bulk.

  Returns:
    (its end, where to try the next run); (pos, the run's end) when one of
    them is bad: parsed one by one, it is then reported precisely.
  """
  m = _RUNS_RE[kind].match(text, pos)
  if m is None:
    return pos, pos + 1
  end = m.end()
  found = _ITEMS_RE[kind].findall(text, pos, end)
  string = ((lambda t: t[1:-1]) if text.find("\\", pos, end) < 0 else
            (lambda t: _unescape(t).decode("utf-8")))
  try:
    if kind == "field":
      values = [(s, string(v)) if s else (f, _double(w))
                for s, v, f, w in found]
    elif kind == "number":
      try:
        values = list(map(float, found))
      except ValueError:
        values = [_double(t) for t in found]
    else:
      values = list(map(string, found))
  except ValueError:
    return pos, end
  if kind == "field":
    for field, value in values:
      fields[field].append(value)
  else:
    fields[name] += values
  return end, end


def _token(text: str, pos: int) -> tuple[Optional[str], int, int]:
  """(kind, start, end) of the token after `pos`; kind None at the end."""
  m = _TOKEN_RE.match(text, pos)
  kind = m.lastgroup
  return kind, m.start(kind) if kind else m.end(), m.end()


def _parse_field(text: str, pos: int, fields: dict[str, list]) -> int:
  """Parses one field of any form at `pos`; returns its end, -1 at the end."""
  kind, start, end = _token(text, pos)
  name = text[start:end]
  if kind is None:
    return -1
  if kind != "word" or name not in fields:
    raise _syntax_error(text, start, f"unknown field {_excerpt(name)}")
  kind, start, pos = _token(text, end)
  if text[start:pos] != ":":
    raise _syntax_error(text, start, f"expected ':' after {name}")
  kind, start, end = _token(text, pos)
  if name in _REPEATED and text[start:end] == "[":
    kind, start, pos = _token(text, end)
    if text[start:pos] != "]":
      pos = _parse_list(text, end, name, fields)
  else:
    pos = _parse_value(text, pos, name, fields)
  kind, start, end = _token(text, pos)
  return end if text[start:end] in (",", ";") else pos


def _parse_list(text: str, pos: int, name: str, fields: dict[str, list]) -> int:
  """Parses `value, value]` at `pos` (after the `[`); returns its end."""
  kind = "string" if name in _STRING_FIELDS else "number"
  bulk_from = pos
  while True:
    if pos >= bulk_from:
      pos, bulk_from = _parse_run(kind, text, pos, fields, name)
      _check_entries(fields)
    pos = _parse_value(text, pos, name, fields)
    _, start, end = _token(text, pos)
    if text[start:end] == "]":
      return end
    if text[start:end] != ",":
      raise _syntax_error(text, start, f"expected ',' or ']' in {name}")
    pos = end


def _parse_value(text: str, pos: int, name: str,
                 fields: dict[str, list]) -> int:
  """Appends the value at `pos` (adjacent strings joined); returns its end."""
  kind, start, end = _token(text, pos)
  if name in _FLOAT_FIELDS and kind is not None:
    try:
      fields[name].append(_double(text[start:end]))
    except ValueError as e:
      raise _syntax_error(text, start, str(e)) from None
    return end
  if kind != "string":
    got = _excerpt(text[start:end]) if kind else "the end of the file"
    if kind == "char" and text[start] in "\"'":
      got = "a string not closed on its line"
    what = "number" if name in _FLOAT_FIELDS else "string"
    raise _syntax_error(text, start, f"expected a {what} for {name}, got {got}")
  pieces = []
  while m := _RUNS_RE["adjacent"].match(text, pos):
    if text.find("\\", pos, m.end()) < 0:
      pieces.append("".join(
          [t[1:-1] for t in _ITEMS_RE["adjacent"].findall(text, pos, m.end())]
      ).encode("utf-8"))
    else:
      for t in _ITEMS_RE["adjacent"].finditer(text, pos, m.end()):
        try:
          pieces.append(_unescape(t[1]))
        except ValueError as e:
          raise _syntax_error(text, t.start(1),
                              f"bad escape in a string: {e}") from None
    pos = m.end()
  try:
    fields[name].append(b"".join(pieces).decode("utf-8"))
  except UnicodeDecodeError as e:
    raise _syntax_error(
        text, start, f"string not UTF-8 once unescaped (byte {e.start})"
    ) from None
  return pos


def _syntax_error(text: str, pos: int, problem: str) -> ValueError:
  line = text.count("\n", 0, pos) + 1
  column = pos - text.rfind("\n", 0, pos)
  return ValueError(f"line {line}, column {column}: {problem}")


def _excerpt(s: str) -> str:
  return repr(s[:40]) + ("..." if len(s) > 40 else "")


_OCTAL_FLOAT_RE = re.compile(r"-?0[0-9]")
_INF_RE = re.compile(r"(-?)inf(?:inity)?f?", re.I)
_NAN_RE = re.compile(r"nanf?", re.I)


def _double(token: str) -> float:
  """`token` read as protobuf's text format reads a double (`-inf`, `2f`)."""
  if not _OCTAL_FLOAT_RE.match(token):
    with contextlib.suppress(ValueError):
      return float(token)
    if m := _INF_RE.fullmatch(token):
      return -math.inf if m[1] else math.inf
    if _NAN_RE.fullmatch(token):
      return math.nan
    with contextlib.suppress(ValueError):
      return float(token.rstrip("fF"))
  raise ValueError(f"not a number: {_excerpt(token)}")


# TensorFlow's reader unescapes with Python's codecs: `\u`/`\U` first
# (raw_unicode_escape), then C escapes, octal and hex (unicode_escape) on the
# UTF-8 bytes, with a one-digit `\xf` allowed and unknown escapes (`\?`)
# kept verbatim. Escaped backslashes are hidden as 0xFF bytes (never in
# UTF-8) meanwhile, so that every backslash left starts an escape, which the
# patterns below (and numpy, for long strings) find without counting.
_WIDE_ESCAPE_RE = _compile(rb"\\[uU\xc4-\xf4]")  # \u, \U, \<char over U+00FF>
_BIG_OCTAL_RE = _compile(rb"\\[4-7][0-7][0-7]")
_SHORT_HEX_RE = _compile(rb"\\x(?=[0-9a-fA-F](?![0-9a-fA-F]))")
_UNKNOWN_ESCAPE_RE = _compile(rb"\\(?=[^\\'\"abfnrtvxuUN0-7\n])")
_VECTOR_MIN = 1 << 16  # longer strings are fixed with numpy (see _insert)
_CHUNK = 1 << 20


def _unescape(token: str) -> bytes:
  r"""The bytes a quoted string (`token`, with its quotes) stands for.

  Raises:
    ValueError: A bad escape (`\x` without digits, a trailing backslash,
      `\400`, a truncated `\u`, a surrogate...).
  """
  hidden = token.encode("utf-8").replace(b"\\\\", b"\xff\xff")
  if b"\\x" in hidden:  # `\xf` -> `\x0f`, before `\u` escapes are decoded
    hidden = _fix_escapes(hidden, "hex")
  if _WIDE_ESCAPE_RE.search(hidden):
    hidden = hidden.replace(b"\xff", b"\\").decode("utf-8").encode(
        "raw_unicode_escape").decode("raw_unicode_escape").encode(
            "utf-8").replace(b"\\\\", b"\xff\xff")
  if _BIG_OCTAL_RE.search(hidden):
    raise ValueError("octal escape above \\377")
  # `\?` -> `\\?`: kept as the codec would, without its DeprecationWarning.
  hidden = _fix_escapes(hidden, "unknown")
  data = hidden.replace(b"\xff", b"\\")
  del hidden  # long strings: one copy fewer while decoding
  return codecs.unicode_escape_decode(memoryview(data)[1:-1])[0].encode(
      "latin-1")


# Pattern, re.sub template, byte inserted and where, into each escape found.
_FIXES = {"hex": (_SHORT_HEX_RE, rb"\\x0", ord("0"), 2),
          "unknown": (_UNKNOWN_ESCAPE_RE, rb"\\\\", ord("\\"), 0)}


def _fix_escapes(hidden: bytes, fix: str) -> bytes:
  """`hidden` with a byte inserted into each escape of kind `fix`."""
  pattern, template, byte, offset = _FIXES[fix]
  if not pattern.search(hidden):
    return hidden
  if len(hidden) < _VECTOR_MIN:
    return pattern.sub(template, hidden)
  return _insert(hidden, fix == "hex", byte, offset)  # re.sub: 180 B/escape


def _insert(hidden: bytes, hex_fix: bool, byte: int,
            offset: int) -> bytearray:
  """`_fix_escapes` for long strings: numpy, a chunk at a time."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  a = np.frombuffer(hidden, np.uint8)
  n = len(a)
  is_hex = np.zeros(257, bool)  # [256]: past the end
  is_hex[list(b"0123456789abcdefABCDEF")] = True
  unknown = np.ones(256, bool)
  unknown[list(b"\\'\"abfnrtvxuUN01234567\n")] = False
  out = bytearray()
  for i in range(0, n, _CHUNK):
    j = min(i + _CHUNK, n)
    s = np.flatnonzero(a[max(i - 2, 0):j] == ord("\\")) + max(i - 2, 0)
    s = s[s + 1 < n]  # a trailing backslash: the codec rejects it
    if not hex_fix:
      at = s[unknown[a[s + 1]]]
    else:
      s = s[(a[s + 1] == ord("x")) & (s + 2 < n)]
      after = np.where(s + 3 < n, a[np.minimum(s + 3, n - 1)], 256)
      at = s[is_hex[a[s + 2]] & ~is_hex[after]]
    at = at[(at + offset >= i) & (at + offset < j)] + offset - i
    out += np.insert(a[i:j], at, byte).tobytes()
  return out
