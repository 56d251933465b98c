"""The sparse local copy of a bucket object (`clu_ckpt.bucket_spool`).

`fetch_ranges` is driven by a `read` over bytes in memory (its contract: the
object's bytes [start, end)); `SparseSpool` by the bucket back end on fsspec's
in-memory file system (`test_bucket_cache.MemoryBucket`, every read counted).
Faults are real: a copy too large for the process's file-size limit, a full
temporary directory (a 1 MiB tmpfs, when this process may mount one), an
object shortened while it is read.
"""

import errno
import mmap
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import threading
import time

import numpy as np
import pytest

from clu_ckpt import bucket_spool
from test_bucket_cache import MemoryBucket

_MIB = 2**20
_CYCLE = bytes(range(251))


def _pattern(start: int, end: int) -> bytes:
  """The bytes [start, end) of an object whose byte i is i % 251."""
  if end <= start:
    return b""
  first = start % 251
  return (_CYCLE * ((end - start) // 251 + 2))[first:first + end - start]


class _Reads:
  """A `read` of `_pattern`'s object recording what it was asked for."""

  def __init__(self):
    self.asked = []
    self.threads = set()
    self._lock = threading.Lock()

  def __call__(self, start, end):
    with self._lock:
      self.asked.append((start, end))
      self.threads.add(threading.current_thread().name)
    return _pattern(start, end)


@pytest.fixture
def spool_file():
  with tempfile.TemporaryFile() as f:
    yield f


def _written(f, size):
  return os.pread(f.fileno(), size, 0).ljust(size, b"\0")


# -- fetch_ranges ------------------------------------------------------------


def test_ranges_land_at_their_offsets_and_nothing_else_is_written(spool_file):
  read = _Reads()
  size = 3 * _MIB
  ranges = [(0, 1), (4095, 4097), (_MIB - 1, _MIB + 1), (size - 1, size)]
  assert bucket_spool.fetch_ranges(read, "gs://b/o", spool_file.fileno(),
                                   ranges, size, width=3) == 4
  got = _written(spool_file, size)
  want = bytearray(size)
  for start, end in ranges:
    want[start:end] = _pattern(start, end)
  assert got == bytes(want)
  assert sorted(read.asked) == ranges


def test_pieces_are_a_tenth_of_the_object_per_stream_within_bounds(
    spool_file, monkeypatch):
  cases = [
      # (size, width, chunk, range) -> piece length
      ((40 * _MIB, 2, None, 5 * _MIB + 1), 2 * _MIB),  # 40 MiB / (10 x 2)
      ((40 * _MIB, 2, _MIB + 5, 3 * _MIB), _MIB + 5),  # a smaller chunk
      ((8 * _MIB, 2, None, 3 * _MIB), _MIB),  # never under 1 MiB
      ((400 * _MIB, 1, None, 9 * _MIB), 8 * _MIB),  # never over SPOOL_CHUNK
  ]
  for (size, width, chunk, end), piece in cases:
    read = _Reads()
    n = bucket_spool.fetch_ranges(read, "gs://b/o", spool_file.fileno(),
                                  [(0, end)], size, width=width, chunk=chunk)
    want = [(s, min(s + piece, end)) for s in range(0, end, piece)]
    assert sorted(read.asked) == want and n == len(want), (size, width)
  # Without a width: `streams()`, from the environment.
  monkeypatch.setenv("CLU_CKPT_BUCKET_STREAMS", "2")
  read = _Reads()
  bucket_spool.fetch_ranges(read, "gs://b/o", spool_file.fileno(),
                            [(0, 4 * _MIB)], 40 * _MIB)
  assert sorted(read.asked) == [(0, 2 * _MIB), (2 * _MIB, 4 * _MIB)]


def test_nothing_to_fetch_makes_no_request(spool_file):
  read = _Reads()
  assert bucket_spool.fetch_ranges(read, "gs://b/o", spool_file.fileno(),
                                   [], 10) == 0
  assert bucket_spool.fetch_ranges(read, "gs://b/o", spool_file.fileno(),
                                   [(5, 5)], 10) == 0
  assert read.asked == []


def test_one_piece_is_read_in_the_callers_thread(spool_file):
  read = _Reads()
  assert bucket_spool.fetch_ranges(read, "gs://b/o", spool_file.fileno(),
                                   [(3, 10)], 10) == 1
  assert read.threads == {threading.current_thread().name}
  assert _written(spool_file, 10) == b"\0" * 3 + _pattern(3, 10)


def test_width_reads_are_in_flight_at_all_times_not_in_batches(spool_file):
  # The first piece's read is held until the last has been asked for: in
  # batches of `width` the last would never start (the batch waits for the
  # first), so the read would time out. Never more than `width` at once.
  width, pieces = 3, 8
  lock = threading.Lock()
  state = {"in_flight": 0, "peak": 0, "asked": []}
  last_asked = threading.Event()
  first_ones = threading.Barrier(width, timeout=30)
  names = set()

  def read(start, end):
    with lock:
      state["in_flight"] += 1
      state["peak"] = max(state["peak"], state["in_flight"])
      state["asked"].append(start)
      names.add(threading.current_thread().name)
      if len(state["asked"]) == pieces:
        last_asked.set()
      first = len(state["asked"]) <= width
    try:
      if first:
        first_ones.wait()  # `width` reads in flight at once
      if start == 0:
        assert last_asked.wait(30), "reads were not kept in flight"
      return _pattern(start, end)
    finally:
      with lock:
        state["in_flight"] -= 1

  size = pieces * _MIB
  assert bucket_spool.fetch_ranges(read, "gs://b/o", spool_file.fileno(),
                                   [(0, size)], size, width=width) == pieces
  assert state["peak"] == width, state
  assert len(names) == width and all(
      n.startswith("clu_ckpt-spool") for n in names), names
  assert _written(spool_file, size) == _pattern(0, size)


def test_a_failed_read_fails_the_fetch_and_starts_no_more(spool_file):
  asked = []

  def read(start, end):
    asked.append(start)
    if start == _MIB:
      raise OSError(5, "link down", "gs://b/o")
    return _pattern(start, end)

  with pytest.raises(OSError, match="link down"):
    bucket_spool.fetch_ranges(read, "gs://b/o", spool_file.fileno(),
                              [(0, 10 * _MIB)], 10 * _MIB, width=1)
  assert asked == [0, _MIB]


@pytest.mark.parametrize("short", [True, False])
def test_an_object_that_changed_while_read_is_named(spool_file, short):
  def read(start, end):
    return _pattern(start, end - 1 if short else end + 1)

  with pytest.raises(OSError) as info:
    bucket_spool.fetch_ranges(read, "gs://b/run/ckpt-1.flax",
                              spool_file.fileno(), [(100, 200)], 1000)
  got = 99 if short else 101
  assert str(info.value) == (
      f"gs://b/run/ckpt-1.flax: the object changed while it was read ({got} "
      "bytes at 100, 100 expected)")


def test_a_copy_that_cannot_be_written_is_named_with_its_directory(
    tmp_path):
  fd = os.open(tmp_path / "read-only", os.O_RDONLY | os.O_CREAT)
  try:
    with pytest.raises(OSError) as info:
      bucket_spool.fetch_ranges(_Reads(), "gs://b/o", fd, [(0, 10)], 77)
  finally:
    os.close(fd)
  assert info.value.errno == errno.EBADF
  assert str(info.value) == (
      f"[Errno {errno.EBADF}] gs://b/o: its 77-byte local copy in "
      f"{tempfile.gettempdir()} failed (Bad file descriptor); set TMPDIR to "
      "a directory with room for it")


def test_streams_is_read_from_the_environment_at_each_call(monkeypatch):
  monkeypatch.delenv("CLU_CKPT_BUCKET_STREAMS", raising=False)
  assert bucket_spool.streams() == bucket_spool.SPOOL_READS == 8
  monkeypatch.setenv("CLU_CKPT_BUCKET_STREAMS", "3")
  assert bucket_spool.streams() == 3
  monkeypatch.setenv("CLU_CKPT_BUCKET_STREAMS", "0")
  with pytest.raises(ValueError, match="CLU_CKPT_BUCKET_STREAMS"):
    bucket_spool.streams()


# -- SparseSpool ---------------------------------------------------------------


@pytest.fixture
def bucket():
  return MemoryBucket("gs")


def _object(bucket_, size, name="run/ckpt-1.flax"):
  data = _pattern(0, size)
  bucket_.store.put_object(f"bk/{name}", data)
  return f"gs://bk/{name}", data


def test_a_spool_fetches_each_byte_once_exactly_where_asked(bucket):
  url, data = _object(bucket, 100_000)
  spool = bucket.spool(url)
  assert (spool.path, spool.size, spool.requests, spool.fetched) == (
      url, 100_000, 0, 0)
  assert bytes(spool.map[:10]) == b"\0" * 10  # nothing fetched yet
  spool.ensure([(10, 20)])
  assert bytes(spool.map[10:20]) == data[10:20]
  assert bytes(spool.map[9:11]) == b"\0" + data[10:11]
  assert bytes(spool.map[19:21]) == data[19:20] + b"\0"
  assert (spool.requests, spool.fetched) == (1, 10)
  assert spool.has(10, 20) and not spool.has(9, 20) and not spool.has(10, 21)
  assert spool.missing(0, 100_000) == [(0, 10), (20, 100_000)]
  assert spool.missing(-5, 200_000) == [(0, 10), (20, 100_000)]
  assert spool.missing(10, 20) == [] and spool.missing(12, 18) == []
  assert spool.missing(5, 25) == [(5, 10), (20, 25)]
  assert spool.missing(10, 30) == [(20, 30)]
  assert spool.missing(0, 20) == [(0, 10)]
  spool.ensure([(15, 30), (40, 50), (50, 60), (25, 35)])  # what is missing
  assert bucket.store.reads[1:] == [("bk/run/ckpt-1.flax", 20, 35),
                                    ("bk/run/ckpt-1.flax", 40, 60)]
  assert (spool.requests, spool.fetched) == (3, 45)
  assert spool.missing(0, 100) == [(0, 10), (35, 40), (60, 100)]
  spool.ensure([(12, 18)])  # all here: no request
  assert spool.requests == 3
  spool.fill()
  assert bytes(spool.map) == data
  assert (spool.requests, spool.fetched) == (6, 100_000)
  assert spool.missing(0, 100_000) == [] and spool.has(0, 100_000)
  spool.fill()
  assert spool.requests == 6 and len(bucket.store.reads) == 6


def test_a_spool_made_directly_is_named_by_path_and_size(bucket):
  url, _ = _object(bucket, 10)
  spool = bucket_spool.SparseSpool(bucket, url, 10)
  assert spool.identity == (url, 10)
  assert bucket.spool(url).identity[:2] == (url, 10)


def test_missing_across_many_pieces(bucket):
  url, _ = _object(bucket, 1000)
  spool = bucket.spool(url)
  spool.adopt([(100, b"x" * 100), (300, b"y" * 100), (250, b"z" * 10)])
  assert spool.missing(0, 1000) == [(0, 100), (200, 250), (260, 300),
                                    (400, 1000)]
  assert spool.missing(150, 320) == [(200, 250), (260, 300)]
  assert spool.missing(200, 250) == [(200, 250)]
  assert spool.missing(260, 261) == [(260, 261)]
  assert spool.missing(400, 400) == [] and spool.missing(500, 400) == []
  spool.adopt([(190, b"w" * 20)])  # overlapping: merged
  assert spool.missing(0, 1000) == [(0, 100), (210, 250), (260, 300),
                                    (400, 1000)]


def test_the_copy_is_read_only(bucket):
  url, _ = _object(bucket, 5000)
  spool = bucket.spool(url)
  with pytest.raises(TypeError):
    spool.map[0:1] = b"x"
  assert not np.frombuffer(spool.map, np.uint8).flags.writeable


def test_an_empty_object_has_an_empty_map_and_needs_no_request(bucket):
  url, _ = _object(bucket, 0)
  spool = bucket.spool(url)
  assert spool.map == b"" and spool.size == 0
  spool.fill()
  assert spool.requests == 0 and bucket.store.reads == []


def test_bytes_known_from_elsewhere_are_not_fetched_again(bucket):
  url, data = _object(bucket, 10_000)
  first = bucket.spool(url)
  first.ensure([(0, 100), (5000, 5100)])
  assert first.copy_fetched(199) is None  # more than the limit
  pieces = first.copy_fetched(200)  # exactly the limit
  assert pieces == [(0, data[:100]), (5000, data[5000:5100])]
  second = bucket.spool(url)
  second.adopt(pieces)
  assert bytes(second.map[:100]) == data[:100]
  assert bytes(second.map[5000:5100]) == data[5000:5100]
  second.ensure([(0, 100), (5000, 5100)])
  assert second.requests == 0 and second.fetched == 0
  second.fill()
  assert bytes(second.map) == data and second.fetched == 10_000 - 200
  assert second.copy_fetched(10_000) == [(0, data)]


def _blocks(spool):
  return os.fstat(spool._file.fileno()).st_blocks * 512  # pylint: disable=protected-access


def test_the_copy_is_sparse_until_more_than_half_is_asked_for(bucket):
  size = 4 * _MIB
  url, data = _object(bucket, size)
  spool = bucket.spool(url)
  spool.ensure([(0, 4096)])
  assert _blocks(spool) < _MIB  # only what was fetched
  spool.ensure([(_MIB, _MIB + size // 2)])  # exactly half: sparse
  assert _blocks(spool) < size * 3 // 4, _blocks(spool)
  spool.ensure([(3 * _MIB, 3 * _MIB + 8192)])
  assert _blocks(spool) < size * 3 // 4, _blocks(spool)
  other = bucket.spool(url)
  other.ensure([(0, size // 2 + 1)])  # more than half: the whole reserved
  assert _blocks(other) >= size
  assert os.fstat(other._file.fileno()).st_size == size  # pylint: disable=protected-access
  other.fill()
  assert bytes(other.map) == data


def test_advice_that_a_range_is_needed_fetches_it(bucket, monkeypatch):
  # One stream: pieces of READ_AHEAD_CHUNK (2 MiB), not the 4 MiB a
  # whole-object read of 40 MiB would use.
  monkeypatch.setenv("CLU_CKPT_BUCKET_STREAMS", "1")
  size = 40 * _MIB
  url, data = _object(bucket, size)
  spool = bucket.spool(url)
  spool.map.madvise(mmap.MADV_NORMAL, 0, size)  # other advice: no fetch
  assert spool.requests == 0
  page = mmap.PAGESIZE
  spool.map.madvise(mmap.MADV_WILLNEED, page, 5 * _MIB)
  chunk = bucket_spool.READ_AHEAD_CHUNK
  assert bucket.store.reads == [
      ("bk/run/ckpt-1.flax", s, min(s + chunk, page + 5 * _MIB))
      for s in range(page, page + 5 * _MIB, chunk)]
  assert bytes(spool.map[page:page + 5 * _MIB]) == data[page:page + 5 * _MIB]
  assert spool.missing(0, size) == [(0, page), (page + 5 * _MIB, size)]
  spool.map.madvise(mmap.MADV_WILLNEED, 37 * _MIB)  # to the end
  assert spool.missing(0, size) == [(0, page), (page + 5 * _MIB, 37 * _MIB)]
  assert bytes(spool.map[37 * _MIB:]) == data[37 * _MIB:]


@pytest.mark.parametrize("streams,width", [("8", 4), ("2", 2)])
def test_advice_reads_ahead_with_at_most_four_streams(bucket, monkeypatch,
                                                       streams, width):
  # Every read is held until `width` are in flight and half a second more
  # has passed for any further one to start.
  monkeypatch.setenv("CLU_CKPT_BUCKET_STREAMS", streams)
  size = 12 * _MIB
  url, data = _object(bucket, size)
  spool = bucket.spool(url)
  bucket.store.hold = threading.Event()
  advising = threading.Thread(target=spool.map.madvise,
                              args=(mmap.MADV_WILLNEED, 0, size))
  advising.start()
  try:
    deadline = time.monotonic() + 30
    while bucket.store.in_flight < width and time.monotonic() < deadline:
      time.sleep(0.01)
    time.sleep(0.5)
    peak = bucket.store.peak
  finally:
    bucket.store.hold.set()
    advising.join(60)
  assert peak == width
  assert spool.has(0, size) and bytes(spool.map) == data


def test_advice_without_a_range_fetches_the_whole_object(bucket):
  url, data = _object(bucket, 3 * _MIB + 5)
  spool = bucket.spool(url)
  spool.map.madvise(mmap.MADV_WILLNEED)
  assert spool.has(0, 3 * _MIB + 5) and bytes(spool.map) == data


def test_advice_of_a_range_that_cannot_be_fetched_is_no_os_error(bucket):
  url, _ = _object(bucket, 3 * _MIB)
  spool = bucket.spool(url)
  _object(bucket, _MIB)  # another process shortens it
  with pytest.raises(bucket_spool.FetchFailedError) as info:
    spool.map.madvise(mmap.MADV_WILLNEED, 0, 2 * _MIB)
  assert not isinstance(info.value, OSError)
  assert str(info.value) == (
      f"{url}: bytes 0-{2 * _MIB} could not be fetched ({url}: the object "
      f"changed while it was read (0 bytes at {_MIB}, {_MIB} "
      "expected))")
  assert isinstance(info.value.__cause__, OSError)


def _file_size_limit(limit):
  """Sets this process's file-size limit (SIGXFSZ ignored); returns undo."""
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))

  def undo():
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, old)
  return undo


def test_a_copy_past_the_file_size_limit_fails_naming_object_and_directory(
    bucket):
  url, _ = _object(bucket, 2 * _MIB)
  spool = bucket.spool(url)
  undo = _file_size_limit(_MIB)
  try:
    with pytest.raises(OSError) as made:
      bucket.spool(url)  # its sparse file cannot be made that long
    with pytest.raises(OSError) as adopted:
      spool.adopt([(_MIB + 10, b"x" * 10)])
    with pytest.raises(OSError) as fetched:
      spool.ensure([(_MIB + 10, _MIB + 20)])
  finally:
    undo()
  want = (f"[Errno {errno.EFBIG}] {url}: its {2 * _MIB}-byte local copy in "
          f"{tempfile.gettempdir()} failed (File too large); set TMPDIR to a "
          "directory with room for it")
  for info in (made, adopted, fetched):
    assert info.value.errno == errno.EFBIG and str(info.value) == want
  assert bucket.store.reads == [("bk/run/ckpt-1.flax", _MIB + 10, _MIB + 20)]
  assert spool.fetched == 0 and spool.missing(0, 2 * _MIB) == [
      (0, 2 * _MIB)]


def test_a_file_system_refusing_to_preallocate_is_no_error(tmp_path):
  with open(tmp_path / "copy", "w+b") as f:
    bucket_spool._reserve(f.fileno(), 0, "gs://b/o")  # EINVAL from fallocate  # pylint: disable=protected-access
    assert os.fstat(f.fileno()).st_size == 0
  r, w = os.pipe()
  try:
    with pytest.raises(OSError) as info:
      bucket_spool._reserve(w, 10, "gs://b/o")  # pylint: disable=protected-access
    assert info.value.errno == errno.ESPIPE and "gs://b/o" in str(info.value)
  finally:
    os.close(r)
    os.close(w)


def test_a_full_temporary_directory_fails_before_any_download(
    bucket, tmp_path, monkeypatch):
  small = tmp_path / "small"
  small.mkdir()
  if os.geteuid() != 0 or shutil.which("mount") is None or subprocess.run(
      ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)],
      capture_output=True).returncode != 0:
    pytest.skip("cannot mount a small tmpfs here (needs root)")
  try:
    url, _ = _object(bucket, 3 * _MIB)
    monkeypatch.setattr(tempfile, "tempdir", str(small))
    spool = bucket.spool(url)
    with pytest.raises(OSError) as info:
      spool.fill()
    assert info.value.errno == errno.ENOSPC
    assert str(info.value) == (
        f"[Errno {errno.ENOSPC}] {url}: its {3 * _MIB}-byte local copy in "
        f"{small} failed (No space left on device); set TMPDIR to a "
        "directory with room for it")
    assert bucket.store.reads == [] and spool.requests == 0
    assert os.listdir(small) == []
    del spool, info
  finally:
    subprocess.run(["umount", "-l", str(small)], capture_output=True)


def test_a_dropped_spool_leaves_no_open_file(bucket):
  import gc  # pylint: disable=g-import-not-at-top
  url, _ = _object(bucket, 100_000)

  def spools_open():
    gc.collect()
    found = 0
    for fd in os.listdir("/proc/self/fd"):
      try:
        target = os.readlink(f"/proc/self/fd/{fd}")
      except OSError:
        continue
      found += target.startswith(tempfile.gettempdir()) and target.endswith(
          "(deleted)")
    return found

  before = spools_open()
  spool = bucket.spool(url)
  spool.fill()
  view = np.frombuffer(spool.map, np.uint8)
  assert spools_open() > before
  assert view[-1] == (100_000 - 1) % 251
  del spool, view
  assert spools_open() == before


def test_bytes_already_here_do_not_wait_for_another_callers_fetch(bucket):
  # The migration's read-ahead fetches later arrays while the writer asks
  # for one already here: the writer goes on at once.
  url, data = _object(bucket, 100_000)
  spool = bucket.spool(url)
  spool.ensure([(0, 1000)])
  bucket.store.hold = threading.Event()  # reads wait until it is set
  try:
    other = threading.Thread(target=spool.ensure, args=([(50_000, 60_000)],))
    other.start()
    deadline = time.monotonic() + 30
    while bucket.store.in_flight == 0 and time.monotonic() < deadline:
      time.sleep(0.01)
    assert bucket.store.in_flight == 1  # the other fetch is under way
    here = threading.Event()
    asker = threading.Thread(
        target=lambda: (spool.ensure([(0, 1000)]), here.set()))
    asker.start()
    assert here.wait(30), "waited for another caller's fetch"
    assert other.is_alive() and bucket.store.in_flight == 1
  finally:
    bucket.store.hold.set()
  other.join(30)
  asker.join(30)
  assert bytes(spool.map[50_000:60_000]) == data[50_000:60_000]
  assert spool.requests == 2
