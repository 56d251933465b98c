"""Tests for the file-system seam: `storage.filesystem`, `LocalFileSystem`.

The seam must pick back ends by URL scheme in one place, accept a new back
end for an object store (no rename, ranged reads, commit by upload) without
any caller changing, and keep the local fast paths (memory maps with
read-ahead advice, atomic writes).
"""

import contextlib
import errno
import fcntl
import fnmatch
import math
import mmap
import os
import pathlib
import resource
import signal
import socket
import stat as statlib
import threading
import time
from typing import Optional

import pytest

from clu_ckpt import errors
from clu_ckpt import fsspec_fs
from clu_ckpt import gfile_fs
from clu_ckpt import local_fs
from clu_ckpt import state_file
from clu_ckpt import storage


class MemoryObjectStore(storage.FileSystem):
  """An object store in a dict: no directories, no rename, commit by upload."""

  def __init__(self):
    self.objects: dict[str, bytes] = {}
    self.reads: list[tuple[str, int, Optional[int]]] = []

  def exists(self, path: str) -> bool:
    return path in self.objects or self.isdir(path)

  def isdir(self, path: str) -> bool:
    prefix = path.rstrip("/") + "/"
    return any(k.startswith(prefix) for k in self.objects)

  def listdir(self, path: str) -> list[str]:
    prefix = path.rstrip("/") + "/"
    return sorted({k[len(prefix):].split("/")[0] for k in self.objects
                   if k.startswith(prefix)})

  def glob(self, pattern: str) -> list[str]:
    return sorted(k for k in self.objects if fnmatch.fnmatchcase(k, pattern))

  def makedirs(self, path: str) -> None:
    pass

  def remove(self, path: str) -> None:
    self.objects.pop(path, None)

  def remove_tree(self, path: str) -> None:
    for k in [k for k in self.objects if k.startswith(path.rstrip("/") + "/")]:
      del self.objects[k]

  def stat(self, path: str) -> tuple[int, float]:
    if path not in self.objects:
      raise FileNotFoundError(path)
    return len(self.objects[path]), 0.0

  def read_bytes(self, path: str, offset: int = 0,
                 length: Optional[int] = None) -> bytes:
    self.reads.append((path, offset, length))
    if path not in self.objects:
      raise FileNotFoundError(path)
    data = self.objects[path]
    return data[offset:] if length is None else data[offset:offset + length]

  @contextlib.contextmanager
  def atomic_writer(self, path: str):
    pieces = []
    yield lambda data: pieces.append(bytes(data))
    self.objects[path] = b"".join(pieces)  # the upload: all or nothing


@pytest.fixture
def memory_store(monkeypatch):
  store = MemoryObjectStore()
  monkeypatch.setattr(storage, "_FACTORIES", dict(storage._FACTORIES))
  monkeypatch.setattr(storage, "_INSTANCES", {})
  storage.register_filesystem("mem", lambda: store)
  return store


def test_back_ends_are_chosen_by_scheme(tmp_path):
  assert isinstance(storage.filesystem(str(tmp_path)), local_fs.LocalFileSystem)
  assert isinstance(storage.filesystem("relative/x"), local_fs.LocalFileSystem)
  assert isinstance(storage.filesystem(f"FILE://{tmp_path}"),
                    local_fs.LocalFileSystem)
  for url in ("ram://x", "hdfs://n/x"):
    assert isinstance(storage.filesystem(url), gfile_fs.GFileFileSystem)
  for url in ("gs://bucket/x", "s3://bucket/x", "GS://bucket/x"):
    assert isinstance(storage.filesystem(url), fsspec_fs.FsspecFileSystem)
  assert storage.filesystem("/a") is storage.filesystem("/b")  # shared


def test_registered_object_store_serves_every_function(memory_store):
  with storage.atomic_writer("mem://b/d/ckpt-1.flax") as write:
    write(b"head")
    write(memoryview(b"-body"))
  assert memory_store.objects == {"mem://b/d/ckpt-1.flax": b"head-body"}
  assert storage.exists("mem://b/d/ckpt-1.flax")
  assert storage.isdir("mem://b/d") and not storage.isdir("mem://b/x")
  assert storage.listdir("mem://b/d") == ["ckpt-1.flax"]
  assert storage.glob("mem://b/d/*.flax") == ["mem://b/d/ckpt-1.flax"]
  assert storage.stat("mem://b/d/ckpt-1.flax")[0] == 9
  assert storage.read_bytes("mem://b/d/ckpt-1.flax") == b"head-body"
  assert bytes(storage.map_file("mem://b/d/ckpt-1.flax")) == b"head-body"
  with pytest.raises(FileNotFoundError):
    storage.map_file("mem://b/d/absent")
  storage.check_regular_file("mem://b/d/ckpt-1.flax")  # default: no check
  storage.sync("mem://b/d/ckpt-1.flax")  # default: no-op
  with pytest.raises(NotImplementedError):
    storage.filesystem("mem://b").rename("mem://b/d/ckpt-1.flax", "mem://b/e")
  storage.remove("mem://b/d/ckpt-1.flax")
  storage.remove("mem://b/d/ckpt-1.flax")  # already gone: not an error
  assert not storage.exists("mem://b/d/ckpt-1.flax")


def test_failed_upload_publishes_nothing(memory_store):
  with pytest.raises(RuntimeError):
    with storage.atomic_writer("mem://b/x") as write:
      write(b"partial")
      raise RuntimeError("interrupted")
  assert not memory_store.objects


def test_state_file_is_read_through_the_seam(memory_store):
  memory_store.objects["mem://b/d/checkpoint"] = (
      b'model_checkpoint_path: "ckpt-2"\n'
      b'all_model_checkpoint_paths: "ckpt-1"\n'
      b'all_model_checkpoint_paths: "ckpt-2"\n')
  state = state_file.read_checkpoint_state("mem://b/d")
  assert state.model_checkpoint_path == "mem://b/d/ckpt-2"
  assert state.all_model_checkpoint_paths == ["mem://b/d/ckpt-1",
                                              "mem://b/d/ckpt-2"]
  # One ranged read, bounded by the size limit.
  assert memory_store.reads == [("mem://b/d/checkpoint", 0,
                                 state_file.MAX_STATE_FILE_BYTES + 1)]
  assert state_file.read_checkpoint_state("mem://b/absent") is None


def test_local_ranged_reads_and_rename(tmp_path):
  fs = local_fs.LocalFileSystem()
  (tmp_path / "a").write_bytes(b"0123456789")
  assert fs.read_bytes(str(tmp_path / "a")) == b"0123456789"
  assert fs.read_bytes(str(tmp_path / "a"), 3) == b"3456789"
  assert fs.read_bytes(f"file://{tmp_path}/a", 3, 4) == b"3456"
  assert fs.read_bytes(str(tmp_path / "a"), 8, 100) == b"89"
  fs.rename(str(tmp_path / "a"), f"file://{tmp_path}/b")
  assert (tmp_path / "b").read_bytes() == b"0123456789"
  assert not (tmp_path / "a").exists()


def test_local_map_is_advised_and_reads_everything(tmp_path, monkeypatch):
  advised = []
  real_advise = local_fs._advise
  monkeypatch.setattr(local_fs, "_advise",
                      lambda buffer, **kw: advised.append(len(buffer)) or
                      real_advise(buffer, **kw))
  data = os.urandom(3 * mmap.PAGESIZE + 5)
  (tmp_path / "f").write_bytes(data)
  mapped = storage.map_file(str(tmp_path / "f"))
  assert isinstance(mapped, mmap.mmap)
  assert bytes(mapped) == data
  assert advised == [len(data)]
  assert storage.map_file(str(tmp_path / "f"))[-5:] == data[-5:]


def _resident_share(buffer: mmap.mmap) -> float:
  """The share of a map's pages in the page cache (mincore(2)), or -1."""
  import ctypes  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  pages = (len(buffer) + mmap.PAGESIZE - 1) // mmap.PAGESIZE
  vec = (ctypes.c_ubyte * pages)()
  view = np.frombuffer(buffer, np.uint8)  # for the map's address
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                             ctypes.c_void_p]
    address = view.__array_interface__["data"][0]
    if libc.mincore(address, len(buffer), vec) != 0:
      return -1.0
  except (AttributeError, OSError):
    return -1.0
  finally:
    del view
  return sum(v & 1 for v in vec) / pages


def _evict(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
  finally:
    os.close(fd)


def test_local_map_populates_only_when_asked(tmp_path):
  """populate=False leaves a cold file on disk; populate=True reads it in."""
  if not hasattr(os, "posix_fadvise"):
    pytest.skip("no posix_fadvise: the page cache cannot be emptied")
  path = str(tmp_path / "big")
  block = os.urandom(2**20)
  with open(path, "wb") as f:
    for _ in range(64):  # 64 MiB
      f.write(block)
    f.flush()
    os.fsync(f.fileno())
  _evict(path)
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0,
                                        access=mmap.ACCESS_READ) as raw:
    cold = _resident_share(raw)
  if cold < 0:
    pytest.skip("mincore(2) is not available: residency cannot be measured")
  if cold > 0.05:
    pytest.skip(f"the page cache cannot be emptied here ({cold:.0%} of the "
                "file stays resident after POSIX_FADV_DONTNEED)")

  lazy = storage.map_file(path, populate=False)
  assert _resident_share(lazy) < 0.05
  lazy.close()

  _evict(path)
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0,
                                        access=mmap.ACCESS_READ) as probe:
    try:
      probe.madvise(local_fs._MADV_POPULATE_READ)  # pylint: disable=protected-access
    except OSError:
      pytest.skip("the kernel has no MADV_POPULATE_READ (Linux < 5.14)")
  _evict(path)
  eager = storage.map_file(path)  # populate=True, the default
  assert _resident_share(eager) > 0.9
  eager.close()


@pytest.mark.parametrize("share", [0, 0.25])
def test_local_map_survives_advice_the_kernel_refuses(tmp_path, monkeypatch,
                                                      share):
  monkeypatch.setattr(local_fs, "_MADV_POPULATE_READ", 12345)  # unknown
  monkeypatch.setattr(local_fs, "_POPULATE_MAX_SHARE", share)
  (tmp_path / "f").write_bytes(b"abc")
  assert bytes(storage.map_file(str(tmp_path / "f"))) == b"abc"


def test_storage_delegates_to_the_back_end(tmp_path, monkeypatch):
  calls = []

  class Recording(local_fs.LocalFileSystem):

    def remove(self, path: str) -> None:
      calls.append(path)
      super().remove(path)

  monkeypatch.setattr(storage, "_INSTANCES", {"": Recording()})
  (tmp_path / "x").write_bytes(b"")
  storage.remove(str(tmp_path / "x"))
  assert calls == [str(tmp_path / "x")] and not (tmp_path / "x").exists()


def test_gfile_back_end_ranged_read_and_rename():
  tf = pytest.importorskip("tensorflow")
  fs = gfile_fs.GFileFileSystem()
  base = f"ram://clu_ckpt_gfile_fs_{os.getpid()}"
  fs.makedirs(base)
  with fs.atomic_writer(f"{base}/a") as write:
    write(b"0123456789")
  assert fs.read_bytes(f"{base}/a", 2, 3) == b"234"
  fs.rename(f"{base}/a", f"{base}/b")
  assert fs.read_bytes(f"{base}/b") == b"0123456789"
  assert not fs.exists(f"{base}/a")
  fs.remove_tree(base)
  assert not tf.io.gfile.exists(base)


def test_cached_file_is_not_populated_again(tmp_path, monkeypatch):
  """A file wholly in the page cache is left to the caller's faults."""
  if not hasattr(os, "posix_fadvise"):
    pytest.skip("no posix_fadvise: the page cache cannot be emptied")
  path = str(tmp_path / "f")
  with open(path, "wb") as f:
    f.write(os.urandom(8 * 2**20))
    f.flush()
    os.fsync(f.fileno())
  populated = []
  monkeypatch.setattr(local_fs, "_populate",
                      lambda buffer: populated.append(len(buffer)))
  with open(path, "rb") as f:
    f.read()  # now cached
  assert local_fs._resident(storage.map_file(path))  # pylint: disable=protected-access
  storage.map_file(path)
  assert populated == []
  _evict(path)
  mapped = storage.map_file(path)
  if _resident_share(mapped) > 0.5:
    pytest.skip("the page cache cannot be emptied here")
  assert populated == [8 * 2**20]
  # Half cached is not cached: the sampled pages find the other half.
  del mapped
  with open(path, "rb") as f:
    f.read()
    os.posix_fadvise(f.fileno(), 4 * 2**20, 0, os.POSIX_FADV_DONTNEED)
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0,
                                        access=mmap.ACCESS_READ) as raw:
    if not 0.4 < _resident_share(raw) < 0.6:
      pytest.skip("the page cache cannot be emptied in part here")
    assert not local_fs._resident(raw)  # pylint: disable=protected-access


# ---------------------------------------------------------------------------
# Files that are not regular files, refused in this process (the child-process
# tests in test_storage.py also catch a hang; these name every kind exactly).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode, kind", [
    (statlib.S_IFDIR | 0o755, "a directory"),
    (statlib.S_IFIFO | 0o644, "a named pipe"),
    (statlib.S_IFCHR | 0o666, "a character device"),
    (statlib.S_IFBLK | 0o660, "a block device"),
    (statlib.S_IFSOCK | 0o755, "a socket"),
    (statlib.S_IFLNK | 0o777, "a symbolic link"),
    (0o644, "file type 0o0"),
])
def test_every_kind_of_file_that_is_not_regular_is_named(mode, kind):
  with pytest.raises(errors.NotRegularFileError) as raised:
    local_fs._check_mode(mode, "/c/ckpt-1.index")  # pylint: disable=protected-access
  code = errno.EISDIR if kind == "a directory" else errno.EINVAL
  assert raised.value.errno == code
  assert raised.value.filename == "/c/ckpt-1.index"
  assert str(raised.value) == (
      f"[Errno {code}] not a regular file ({kind}): '/c/ckpt-1.index'")
  local_fs._check_mode(statlib.S_IFREG | 0o644, "/c/ckpt-1.index")  # pylint: disable=protected-access


@contextlib.contextmanager
def _woken_after(fifo: str, seconds: float = 2.0):
  """Yields a list that gets an item if a reader of `fifo` blocked `seconds`.

  A blocked reader is then woken (the pipe opened for writing and closed), so
  that a regression fails the test instead of hanging it. `os.open` releases
  the GIL, so a thread can do it.
  """
  woken, stop = [], threading.Event()

  def wake():
    if stop.wait(seconds):
      return
    while not stop.is_set():
      try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
      except OSError:  # ENXIO: nobody is reading
        time.sleep(0.02)
        continue
      woken.append(fifo)
      os.close(fd)
      time.sleep(0.02)

  thread = threading.Thread(target=wake, daemon=True)
  thread.start()
  try:
    yield woken
  finally:
    stop.set()
    thread.join()


def _hostile(kind: str, path: pathlib.Path) -> None:
  if kind == "named pipe":
    os.mkfifo(path)
  elif kind == "directory":
    path.mkdir()
  elif kind == "character device":
    if not os.path.exists("/dev/null"):
      pytest.skip("no /dev/null")
    path.symlink_to("/dev/null")  # only the target's type counts
  elif kind == "socket":
    sock = socket.socket(socket.AF_UNIX)
    try:
      sock.bind(str(path))
    except OSError as e:  # a path too long for AF_UNIX
      pytest.skip(str(e))
    finally:
      sock.close()


@pytest.mark.parametrize("kind", ["named pipe", "directory", "character device",
                                  "socket"])
def test_reads_refuse_what_is_not_a_regular_file_at_once(tmp_path, kind):
  path = tmp_path / "ckpt-1.index"
  _hostile(kind, path)
  fs = local_fs.LocalFileSystem()
  code = errno.EISDIR if kind == "directory" else errno.EINVAL
  calls = dict(check=lambda: fs.check_regular_file(str(path)),
               check_url=lambda: fs.check_regular_file(f"file://{path}"),
               read=lambda: fs.read_bytes(str(path)),
               map=lambda: fs.map(str(path)),
               map_url=lambda: fs.map(f"file://{path}", populate=False))
  for name, call in calls.items():
    with _woken_after(str(path)) as woken:
      start = time.monotonic()
      with pytest.raises(errors.NotRegularFileError) as raised:
        call()
      seconds = time.monotonic() - start
    assert not woken, f"{name} blocked on {path}"
    assert seconds < 1, (name, seconds)
    assert raised.value.errno == code, name
    assert raised.value.filename == str(path), name
    assert str(raised.value) == (
        f"[Errno {code}] not a regular file (a {kind}): {str(path)!r}"), name
  fs.sync(str(path))  # best effort: never blocks nor raises


def _swapped_for_a_fifo(tmp_path, monkeypatch) -> str:
  """A FIFO that `os.stat` reports as a regular file (swapped after a check)."""
  regular, fifo = tmp_path / "regular", tmp_path / "ckpt-1.data-00000-of-00001"
  regular.write_bytes(b"x")
  os.mkfifo(fifo)
  real_stat = os.stat

  def stat(path, *args, **kwargs):
    if os.fspath(path) == str(fifo):
      return real_stat(regular)
    return real_stat(path, *args, **kwargs)

  monkeypatch.setattr(os, "stat", stat)
  return str(fifo)


def test_file_swapped_for_a_fifo_after_the_check_is_refused_at_once(
    tmp_path, monkeypatch):
  fifo = _swapped_for_a_fifo(tmp_path, monkeypatch)
  fs = local_fs.LocalFileSystem()
  for name, call in dict(read=lambda: fs.read_bytes(fifo),
                         map=lambda: fs.map(fifo)).items():
    with _woken_after(fifo) as woken:
      with pytest.raises(errors.NotRegularFileError) as raised:
        call()
    assert not woken, f"{name} opened {fifo} without O_NONBLOCK"
    assert raised.value.filename == fifo, name
    assert "(a named pipe)" in str(raised.value), name


def test_sync_of_a_file_swapped_for_a_fifo_does_not_block(tmp_path,
                                                          monkeypatch):
  fifo = _swapped_for_a_fifo(tmp_path, monkeypatch)
  with _woken_after(fifo) as woken:
    local_fs.LocalFileSystem().sync(fifo)
    local_fs.fsync_path(fifo)
  assert not woken, f"{fifo} was opened without O_NONBLOCK"


# ---------------------------------------------------------------------------
# Errors name the file; new files get the usual permissions.
# ---------------------------------------------------------------------------


def test_errors_are_given_the_path_they_lack():
  naming = local_fs._naming  # pylint: disable=protected-access
  full = OSError(errno.ENOSPC, "No space left on device")
  named = naming(full, "/c/ckpt-1.flax")
  assert type(named) is OSError  # pylint: disable=unidiomatic-typecheck
  assert (named.errno, named.strerror, named.filename) == (
      errno.ENOSPC, "No space left on device", "/c/ckpt-1.flax")
  assert str(named) == "[Errno 28] No space left on device: '/c/ckpt-1.flax'"
  # The subclass follows the errno; another file's name is replaced.
  denied = naming(OSError(errno.EACCES, "Permission denied", "/c/x.tmp-1"),
                  "/c/ckpt-1.flax")
  assert isinstance(denied, PermissionError)
  assert denied.filename == "/c/ckpt-1.flax"
  # No text: the error's own string stands in.
  assert naming(OSError(errno.EIO, ""), "/c/f").strerror == str(
      OSError(errno.EIO, ""))
  # Already named, or no errno to keep: returned as it is.
  same = OSError(errno.EIO, "I/O error", "/c/f")
  assert naming(same, "/c/f") is same
  bare = OSError("no errno")
  assert naming(bare, "/c/f") is bare


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def test_new_files_get_the_usual_permissions(tmp_path):
  fs = local_fs.LocalFileSystem()
  with fs.atomic_writer(str(tmp_path / "a.flax")) as write:
    write(b"x")
  fs.create_exclusive(str(tmp_path / "lock"), b"mine")
  mode = lambda name: statlib.S_IMODE(os.stat(tmp_path / name).st_mode)
  assert mode("a.flax") == 0o666 & ~_umask()
  assert mode("lock") == 0o644 & ~_umask()
  assert (tmp_path / "lock").read_bytes() == b"mine"


def test_create_exclusive_never_replaces_and_names_the_file(tmp_path):
  fs = local_fs.LocalFileSystem()
  lock = tmp_path / "lock"
  fs.create_exclusive(str(lock), b"first")
  with pytest.raises(FileExistsError) as raised:
    fs.create_exclusive(str(lock), b"second")
  assert raised.value.filename == str(lock)
  assert lock.read_bytes() == b"first"
  with pytest.raises(FileNotFoundError) as raised:
    fs.create_exclusive(str(tmp_path / "absent" / "lock"), b"x")
  assert raised.value.filename == str(tmp_path / "absent" / "lock")
  assert sorted(os.listdir(tmp_path)) == ["lock"]  # no temporary file left


# ---------------------------------------------------------------------------
# The staged writer: O_DIRECT for full buffers, from the writer thread.
# ---------------------------------------------------------------------------


_STAGE = local_fs._STAGE_BYTES  # pylint: disable=protected-access
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class _Writes:
  """Records (and may fail or shorten) `os.write` calls on files under a root.

  Each call: its size, whether the descriptor had O_DIRECT, its flags and the
  calling thread's name. `fail(index, call)` may return an errno to raise
  instead of writing; `most` bounds what one call writes (a short write).
  """

  def __init__(self, monkeypatch, root, fail=None, most=None):
    real = os.write
    root = os.path.realpath(root) + os.sep
    self.calls = []

    def write(fd, data):
      try:
        path = os.readlink(f"/proc/self/fd/{fd}")
      except OSError:
        path = ""
      if not path.startswith(root):
        return real(fd, data)
      flags = fcntl.fcntl(fd, fcntl.F_GETFL)
      call = dict(size=memoryview(data).nbytes, direct=bool(flags & _O_DIRECT),
                  flags=flags, thread=threading.current_thread().name)
      self.calls.append(call)
      code = fail(len(self.calls) - 1, call) if fail else None
      if code:
        raise OSError(code, os.strerror(code))
      if most is not None:
        data = memoryview(data)[:most]
      return real(fd, data)

    monkeypatch.setattr(os, "write", write)

  def summary(self):
    return [(c["size"], c["direct"]) for c in self.calls]


def _direct_allowed(directory) -> bool:
  if not _O_DIRECT:
    return False
  fd = os.open(os.path.join(directory, "probe"), os.O_WRONLY | os.O_CREAT)
  try:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | _O_DIRECT)
    return True
  except OSError:
    return False
  finally:
    os.close(fd)
    os.remove(os.path.join(directory, "probe"))


def test_full_buffers_are_written_direct_by_the_writer_thread(tmp_path,
                                                             monkeypatch):
  if not _direct_allowed(tmp_path):
    pytest.skip("this file system refuses O_DIRECT")
  writes = _Writes(monkeypatch, tmp_path)
  data = os.urandom(2 * _STAGE + 12345)
  with local_fs.LocalFileSystem().atomic_writer(str(tmp_path / "f")) as write:
    write(data)
  assert (tmp_path / "f").read_bytes() == data
  assert writes.summary() == [(_STAGE, True), (_STAGE, True), (12345, False)]
  first, second, tail = writes.calls
  assert first["thread"].startswith("clu_ckpt-write")
  assert second["thread"] == first["thread"]
  assert tail["thread"] == threading.current_thread().name
  assert tail["flags"] == first["flags"] & ~_O_DIRECT  # as opened


@pytest.mark.parametrize("refusals, expected", [
    # O_DIRECT refused at the first full buffer: everything after is plain.
    ({0}, [True, False, False, False, False]),
    # ... or at the second, once 16 MiB went through: the same, from there.
    ({1}, [True, True, False, False, False]),
])
def test_o_direct_refused_midway_falls_back_for_good(tmp_path, monkeypatch,
                                                     refusals, expected):
  if not _direct_allowed(tmp_path):
    pytest.skip("this file system refuses O_DIRECT")
  writes = _Writes(monkeypatch, tmp_path,
                   fail=lambda i, call: errno.EINVAL if i in refusals else 0)
  data = os.urandom(3 * _STAGE + 999)
  with local_fs.LocalFileSystem().atomic_writer(str(tmp_path / "f")) as write:
    write(data)
  assert (tmp_path / "f").read_bytes() == data
  assert [c["direct"] for c in writes.calls] == expected
  assert [c["size"] for c in writes.calls] == [_STAGE] * 4 + [999]


def test_einval_from_an_ordinary_write_is_an_error(tmp_path, monkeypatch):
  """After the fall-back, EINVAL is not taken for O_DIRECT's refusal again."""
  if not _direct_allowed(tmp_path):
    pytest.skip("this file system refuses O_DIRECT")
  _Writes(monkeypatch, tmp_path,
          fail=lambda i, call: errno.EINVAL if i in (0, 2) else 0)
  with pytest.raises(OSError) as raised:
    with local_fs.LocalFileSystem().atomic_writer(str(tmp_path / "f")) as w:
      w(os.urandom(3 * _STAGE + 999))
  assert raised.value.errno == errno.EINVAL
  assert raised.value.filename == str(tmp_path / "f")
  assert os.listdir(tmp_path) == []


def test_o_direct_refused_at_once_means_ordinary_writes(tmp_path, monkeypatch):
  """A file system refusing O_DIRECT (fcntl's EINVAL): every write ordinary,
  and an ordinary write's EINVAL is an error, not a refusal to retry."""
  if not _O_DIRECT:
    pytest.skip("no O_DIRECT here")
  real_fcntl = fcntl.fcntl

  def refusing(fd, cmd, *args):
    if cmd == fcntl.F_SETFL and args and args[0] & _O_DIRECT:
      raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
    return real_fcntl(fd, cmd, *args)

  monkeypatch.setattr(fcntl, "fcntl", refusing)
  writes = _Writes(monkeypatch, tmp_path)
  data = os.urandom(2 * _STAGE + 3)
  with local_fs.LocalFileSystem().atomic_writer(str(tmp_path / "f")) as write:
    write(data)
  assert (tmp_path / "f").read_bytes() == data
  assert writes.summary() == [(_STAGE, False), (_STAGE, False), (3, False)]
  _Writes(monkeypatch, tmp_path,
          fail=lambda i, call: errno.EINVAL if i == 0 else 0)
  with pytest.raises(OSError) as raised:
    with local_fs.LocalFileSystem().atomic_writer(str(tmp_path / "g")) as w:
      w(data)
  assert raised.value.errno == errno.EINVAL
  assert sorted(os.listdir(tmp_path)) == ["f"]


def test_without_o_direct_large_pieces_skip_the_staging(tmp_path,
                                                        monkeypatch):
  if _O_DIRECT:
    monkeypatch.delattr(os, "O_DIRECT")  # as on a platform without it
  writes = _Writes(monkeypatch, tmp_path)
  data = os.urandom(2 * _STAGE + 4)
  with local_fs.LocalFileSystem().atomic_writer(str(tmp_path / "f")) as write:
    write(data[:_STAGE])
    write(data[_STAGE:_STAGE + 4])
    write(data[_STAGE + 4:])
  assert (tmp_path / "f").read_bytes() == data
  assert writes.summary() == [(_STAGE, False), (_STAGE, False), (4, False)]
  main = threading.current_thread().name
  assert writes.calls[0]["thread"] == main  # written as it came, no copy
  assert writes.calls[1]["thread"].startswith("clu_ckpt-write")
  assert writes.calls[2]["thread"] == main


def test_short_writes_are_continued(tmp_path, monkeypatch):
  writes = _Writes(monkeypatch, tmp_path, most=2**20)
  fs = local_fs.LocalFileSystem()
  data = os.urandom(2 * _STAGE + 3 * 2**20 + 5)
  with fs.atomic_writer(str(tmp_path / "f")) as write:
    write(data)
  fs.create_exclusive(str(tmp_path / "lock"), data[:3 * 2**20 + 5])
  assert (tmp_path / "f").read_bytes() == data
  assert (tmp_path / "lock").read_bytes() == data[:3 * 2**20 + 5]
  assert len(writes.calls) > 32


def _file_size_limit(limit: int):
  """RLIMIT_FSIZE at `limit`: the kernel then fails writes past it (EFBIG)."""
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
  try:
    yield
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, handler)


_file_size_limit = contextlib.contextmanager(_file_size_limit)


def test_a_failed_buffer_write_names_the_file_or_yields_to_the_callers_error(
    tmp_path):
  target = tmp_path / "big.bin"
  fs = local_fs.LocalFileSystem()
  with _file_size_limit(2**16):
    # The writer thread's error surfaces when the stream is closed.
    with pytest.raises(OSError) as raised:
      with fs.atomic_writer(str(target)) as write:
        write(b"x" * (_STAGE + 10))
    assert raised.value.errno == errno.EFBIG
    assert raised.value.filename == str(target)
    # The caller's own error wins; nothing more is written.
    with pytest.raises(RuntimeError, match="the caller's"):
      with fs.atomic_writer(str(target)) as write:
        write(b"x" * (_STAGE + 10))
        raise RuntimeError("the caller's")
  assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------
# Read-ahead advice: what is populated, and what is resident.
# ---------------------------------------------------------------------------


def test_advice_that_cannot_be_given_is_skipped(tmp_path, monkeypatch):
  (tmp_path / "f").write_bytes(b"abc" * 5000)
  with open(tmp_path / "f", "rb") as f:
    closed = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    live = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
  closed.close()
  # pylint: disable=protected-access
  for advise in (lambda b: local_fs._advise(b, populate=False),
                 local_fs._populate):
    advise(closed)    # ValueError
    advise(object())  # AttributeError: no madvise at all
  monkeypatch.setattr(mmap, "MADV_SEQUENTIAL", 12345)  # the kernel: EINVAL
  monkeypatch.setattr(local_fs, "_MADV_POPULATE_READ", 12345)
  local_fs._advise(live, populate=False)
  local_fs._populate(live)
  # pylint: enable=protected-access
  assert live[:3] == b"abc"
  live.close()


def test_residency_false_when_it_cannot_be_told():
  # Not page-aligned memory: mincore(2) refuses it.
  assert local_fs._resident(b"abc" * 5000) is False  # pylint: disable=protected-access
  # Not a buffer at all.
  assert local_fs._resident(object()) is False  # pylint: disable=protected-access


def _evict_pages(path, first: int, count: int) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.posix_fadvise(fd, first * mmap.PAGESIZE, count * mmap.PAGESIZE,
                     os.POSIX_FADV_DONTNEED)
  finally:
    os.close(fd)


def _cached_except(path, size: int, missing) -> None:
  """Writes `size` random bytes to `path`, cached except page `missing`.

  The file is evicted whole, then read back a page at a time without
  read-ahead (`POSIX_FADV_RANDOM`), skipping `missing`.
  """
  with open(path, "wb") as f:
    f.write(os.urandom(size))
    f.flush()
    os.fsync(f.fileno())  # clean pages: evictable
  _evict(path)
  fd = os.open(path, os.O_RDONLY)
  try:
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    for page in range(-(-size // mmap.PAGESIZE)):
      if page != missing:
        os.pread(fd, 1, page * mmap.PAGESIZE)
  finally:
    os.close(fd)


@pytest.mark.parametrize("pages, tail, missing", [
    # every page of a small file is asked: the first, a middle one, the
    # partial last one
    (3, 100, None), (3, 100, 0), (3, 100, 1), (3, 100, 3),
    # a sampled file (a page in every two): the last page is asked as well
    (2050, 0, 2049),
])
def test_residency_asks_the_first_the_sampled_and_the_last_page(
    tmp_path, pages, tail, missing):
  if not hasattr(os, "posix_fadvise"):
    pytest.skip("no posix_fadvise: the page cache cannot be emptied")
  path = str(tmp_path / "f")
  _cached_except(path, pages * mmap.PAGESIZE + tail, missing)
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0,
                                        access=mmap.ACCESS_READ) as mapped:
    share = _resident_share(mapped)
    total = pages + (1 if tail else 0)
    if share < 0 or share < (total - 1) / total - 1e-9 or (
        missing is not None and share == 1):
      pytest.skip(f"the page cache cannot be controlled here ({share:.0%})")
    assert local_fs._resident(mapped) is (missing is None)  # pylint: disable=protected-access


def test_map_populates_uncached_files_up_to_the_share(tmp_path, monkeypatch):
  if not hasattr(os, "posix_fadvise"):
    pytest.skip("no posix_fadvise: the page cache cannot be emptied")
  size = 64 * mmap.PAGESIZE
  path = str(tmp_path / "f")
  _cached_except(path, size, None)
  populated = []
  real = local_fs._populate  # pylint: disable=protected-access
  monkeypatch.setattr(local_fs, "_populate",
                      lambda buffer: populated.append(len(buffer)) or
                      real(buffer))
  fs = local_fs.LocalFileSystem()

  def cold_map(**kwargs):
    _evict(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0,
                                          access=mmap.ACCESS_READ) as probe:
      if _resident_share(probe) > 0.05:
        pytest.skip("the page cache cannot be emptied here")
    fs.map(path, **kwargs).close()

  cold_map(populate=False)
  assert populated == []
  cold_map()  # populate=True, the default
  assert populated == [size]
  memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  share = size / memory
  for _ in range(8):  # the share whose product is the size, exactly
    if memory * share == size:
      break
    share = math.nextafter(share, 1 if memory * share < size else 0)
  assert memory * share == size
  monkeypatch.setattr(local_fs, "_POPULATE_MAX_SHARE", share)
  cold_map()
  assert populated == [size, size]  # up to the share: included
  monkeypatch.setattr(local_fs, "_POPULATE_MAX_SHARE",
                      math.nextafter(share, 0))
  cold_map()
  assert populated == [size, size]  # a byte over it: not populated
