"""Tests for the file-system seam: `storage.filesystem`, `LocalFileSystem`.

The seam must pick back ends by URL scheme in one place, accept a new back
end for an object store (no rename, ranged reads, commit by upload) without
any caller changing, and keep the local fast paths (memory maps with
read-ahead advice, atomic writes).
"""

import contextlib
import fnmatch
import mmap
import os
from typing import Optional

import pytest

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
