"""The local back end of `filesystem.FileSystem`: the os module, with fast paths.

Plain paths and `file://` URLs. Reads open only regular files (a symlink to
one is fine): a named pipe, device, socket or directory where a file is
expected raises `NotRegularFileError` at once instead of blocking forever (a
FIFO) or never ending (`/dev/zero`); the type is checked before opening and
again on the open descriptor, which is opened `O_NONBLOCK`. Files are
memory-mapped and read ahead as a stream (see `_advise`). Writes go to
a temporary file in the same directory through two page-aligned staging
buffers with `O_DIRECT` where the file system allows it, are fsynced, renamed
over the destination, and the directory is fsynced.

Callers use the module-level functions of `clu_ckpt.storage`, which pick this
back end for local paths; use it directly only to bypass the dispatch.

Synopsis::

  from clu_ckpt import local_fs

  fs = local_fs.LocalFileSystem()
  with fs.atomic_writer("/ckpts/ckpt-3.flax") as write:
    write(b"...")
  buf = fs.map("/ckpts/ckpt-3.flax")      # an mmap.mmap, read-ahead advised
  fs.check_regular_file("/ckpts/ckpt-3.index")  # or NotRegularFileError
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import glob as globlib
import mmap
import os
import shutil
import stat as statlib
import uuid
from typing import Any, Callable, Iterator, Optional

from clu_ckpt import errors
from clu_ckpt import filesystem


def local_path(path: str) -> str:
  """`path` without a `file://` prefix (any case)."""
  return path[len("file://"):] if path.lower().startswith("file://") else path


_KINDS = ((statlib.S_ISDIR, "a directory"), (statlib.S_ISFIFO, "a named pipe"),
          (statlib.S_ISCHR, "a character device"),
          (statlib.S_ISBLK, "a block device"), (statlib.S_ISSOCK, "a socket"),
          (statlib.S_ISLNK, "a symbolic link"))


def _check_mode(mode: int, path: str) -> None:
  if statlib.S_ISREG(mode):
    return
  kind = next((k for test, k in _KINDS if test(mode)),
              f"file type {statlib.S_IFMT(mode):#o}")
  raise errors.NotRegularFileError(
      errno.EISDIR if statlib.S_ISDIR(mode) else errno.EINVAL,
      f"not a regular file ({kind})", path)


def _open_regular(path: str) -> int:
  """A read-only descriptor of the local regular file `path`.

  The type is checked before opening (so that no device is even opened) and
  again on the open descriptor (the file may have been swapped meanwhile);
  `O_NONBLOCK` keeps a FIFO swapped in from blocking the open.
  """
  local = local_path(path)
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


def fsync_path(path: str) -> None:
  """Flushes a local file or directory; best effort, never raises.

  A vanished file, or a file system that cannot fsync a directory, is not an
  error. Only files and directories are opened (with O_NONBLOCK, should one
  be swapped for a FIFO): a FIFO would block.
  """
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


# madvise(2) advice numbers missing from older `mmap` modules.
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14
# Files up to this share of physical memory are read in whole when mapped.
_POPULATE_MAX_SHARE = 0.25


def _advise(buffer: mmap.mmap, populate: bool = True) -> None:
  """Reads a fresh map of a file ahead, as a stream, before it is touched.

  Without advice, a cold first pass over a map is slow twice over: parsing
  faults in the page of each leaf's header, each fault a synchronous
  read-around (`read_ahead_kb` around it, one at a time, the disk idle in
  between), and every page is then mapped by a fault of its own. Measured on
  a 1 GiB `.flax` (75 leaves, read_ahead_kb 8192): ~0.6 of a cold `dd` of the
  same file; `MADV_WILLNEED` or a prefetching thread (WILLNEED windows or
  reads) were no better (they compete with the parser's faults).

  Here the map is advised `MADV_SEQUENTIAL` (faults read ahead, not around)
  and then populated with `MADV_POPULATE_READ` (Linux >= 5.14): one pass in
  file order, pipelined by the kernel's read-ahead, that also maps the pages,
  so that the caller's touches fault no more; ~0.8-1.0 of `dd` on the same
  file. Populating reads the whole file when mapped, so it is done only for
  files up to `_POPULATE_MAX_SHARE` of physical memory (a larger one could
  not stay cached anyway); parsing reads ~40 % of a file through
  read-arounds regardless. Callers that will touch only part of the file
  (headers, one subtree) pass `populate=False`: the map is then only advised
  `MADV_SEQUENTIAL`, and pages are read when touched. A file already wholly
  in the page cache is not populated either (see `_resident`). Best effort:
  advice a kernel refuses is skipped.
  """
  with contextlib.suppress(AttributeError, OSError, ValueError):
    buffer.madvise(mmap.MADV_SEQUENTIAL)
  if not populate:
    return
  try:
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (AttributeError, ValueError, OSError):
    return
  if len(buffer) <= memory * _POPULATE_MAX_SHARE and not _resident(buffer):
    _populate(buffer)


def _populate(buffer: mmap.mmap) -> None:
  with contextlib.suppress(AttributeError, OSError, ValueError):
    buffer.madvise(_MADV_POPULATE_READ)


def _resident(buffer: mmap.mmap, samples: int = 1024) -> bool:
  """Whether the map's pages are in the page cache (mincore(2), sampled).

  Populating a file that is already cached reads nothing, but still maps
  every page up front: ~70 ms per GiB, more than the faults it saves when
  the caller touches the data (the kernel maps cached pages around each
  fault, 16 at a time). So a cached file is left to those faults. One page
  in every `len / samples` bytes is asked (asking for every page costs ~25
  ms per GiB itself). False when it cannot be told.
  """
  try:
    import ctypes  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    start = np.frombuffer(buffer, np.uint8).ctypes.data
    page = mmap.PAGESIZE
    pages = -(-len(buffer) // page)
    stride = max(1, pages // samples)
    flag = ctypes.c_ubyte()
    for index in list(range(0, pages, stride)) + [pages - 1]:
      if mincore(start + index * page, page, ctypes.byref(flag)) != 0:
        return False
      if not flag.value & 1:
        return False
    return True
  except (AttributeError, OSError, TypeError, ValueError, ImportError):
    return False


class LocalFileSystem(filesystem.FileSystem):
  """Plain paths and `file://` URLs, through the os module.

  Example::

    fs = LocalFileSystem()
    fs.makedirs("/ckpts")
    with fs.atomic_writer("/ckpts/a") as write:
      write(b"abc")
    fs.read_bytes("/ckpts/a", offset=1)   # b"bc"
  """

  def exists(self, path: str) -> bool:
    return os.path.exists(local_path(path))

  def isdir(self, path: str) -> bool:
    return os.path.isdir(local_path(path))

  def listdir(self, path: str) -> list[str]:
    return sorted(os.listdir(local_path(path)))

  def glob(self, pattern: str) -> list[str]:
    local = local_path(pattern)
    scheme = pattern[:len(pattern) - len(local)]
    return sorted(scheme + p for p in globlib.glob(local))

  def makedirs(self, path: str) -> None:
    os.makedirs(local_path(path), exist_ok=True)

  def remove(self, path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
      os.remove(local_path(path))

  def remove_tree(self, path: str) -> None:
    local = local_path(path)
    if os.path.islink(local) or (os.path.lexists(local) and
                                 not os.path.isdir(local)):
      with contextlib.suppress(FileNotFoundError):
        os.remove(local)
      return
    shutil.rmtree(local, ignore_errors=True)

  def rename(self, src: str, dst: str) -> None:
    os.replace(local_path(src), local_path(dst))

  def stat(self, path: str) -> tuple[int, float]:
    st = os.stat(local_path(path))
    return st.st_size, st.st_mtime

  def check_regular_file(self, path: str) -> None:
    local = local_path(path)
    _check_mode(os.stat(local).st_mode, local)

  def read_bytes(self, path: str, offset: int = 0,
                 length: Optional[int] = None) -> bytes:
    with open(_open_regular(path), "rb") as f:
      if offset:
        f.seek(offset)
      return f.read() if length is None else f.read(length)

  def map(self, path: str, *, populate: bool = True) -> Any:
    """An `mmap.mmap` of the file (`b""` if empty), read-ahead advised.

    With `populate` (and a file up to `_POPULATE_MAX_SHARE` of physical
    memory) the whole file is read in when mapped; see `_advise`.
    """
    fd = _open_regular(path)
    try:
      if os.fstat(fd).st_size == 0:
        return b""
      buffer = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
      _advise(buffer, populate=populate)
      return buffer
    finally:
      os.close(fd)

  @contextlib.contextmanager
  def atomic_writer(self, path: str) -> Iterator[Callable[[Any], None]]:
    """Temporary file, staged (O_DIRECT) writes, fsync, rename, dir fsync."""
    final = local_path(path)
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
    # Crash tests stop a save at `local_fs.fsync_directory`.
    fsync_directory(os.path.dirname(final) or ".")

  def create_exclusive(self, path: str, data: bytes) -> None:
    """Written under a temporary name, then hard-linked into place."""
    final = local_path(path)
    tmp = f"{final}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
      fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
      try:
        _write_all(fd, data)
        os.fsync(fd)
      finally:
        os.close(fd)
      os.link(tmp, final)  # fails with EEXIST if anything is at `final`
    except OSError as e:
      raise _naming(e, final) from e
    finally:
      with contextlib.suppress(OSError):
        os.remove(tmp)
    fsync_directory(os.path.dirname(final) or ".")

  def sync(self, path: str) -> None:
    local = local_path(path)
    fsync_path(local)
    fsync_directory(os.path.dirname(local) or ".")


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


def fsync_directory(directory: str) -> None:
  """Makes renames and deletions in a local directory durable (best effort)."""
  fsync_path(directory)
