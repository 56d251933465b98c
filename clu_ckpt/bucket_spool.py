"""A sparse local copy of a bucket object, filled by parallel ranged reads.

`SparseSpool` is an unlinked sparse file in the temporary directory
(`$TMPDIR`), memory-mapped, filled by ranged reads only where asked (each
byte at most once); `flax_ranges` reads a `.flax`'s headers into one, and a
whole-object read (`FsspecFileSystem.map`) fills one whole. `fetch_ranges`
does the reading: ranges of `SPOOL_CHUNK` bytes, `streams()` of them always
in flight (8, `CLU_CKPT_BUCKET_STREAMS`), each written to the file as it
arrives: the process never holds the object in anonymous memory, the kernel
pages the copy in and out like any local file, and the copy disappears when
the last view of it is dropped. An object that changes size while it is
read raises an OSError naming it.

Synopsis::

  from clu_ckpt import bucket_spool

  spool = fs.spool("gs://b/run/ckpt-3.flax")   # a bucket_spool.SparseSpool
  spool.ensure([(0, 4096)])                      # one ranged read
  header = spool.map[:16]
  spool.fill()                                   # the rest, 8 reads in flight
"""

from __future__ import annotations

import concurrent.futures
import errno
import mmap
import os
import tempfile
import threading
from typing import Any, Callable, Optional

from clu_ckpt import bucket_client

# `map` reads an object in ranges of this many bytes, SPOOL_READS of them in
# flight at all times (a new one starts as each ends). The client holds each
# range about twice while it arrives: 8 MiB x 8 peaks at ~110 MiB of
# anonymous memory. The environment variable CLU_CKPT_BUCKET_STREAMS, when
# set, overrides SPOOL_READS (see `streams`).
SPOOL_CHUNK = 8 * 2**20
SPOOL_READS = 8
_MIN_CHUNK = 2**20
# Reads in flight when a consumer advises a range as needed (the migration's
# writer, array by array): enough to keep ahead of its upload, at half the
# memory of a whole-object read (whose reads would stack on the writer's).
READ_AHEAD_STREAMS = 4
# The ranges of that read-ahead: what it holds at once is about twice
# READ_AHEAD_STREAMS x this (anonymous memory, on top of the writer's).
# Measured (benchmarks/bench_buckets.py, migrate@16x8r2 against migrate,
# gs:// -> gs:// of 1344 MiB through the 30 ms / 60 MB/s proxy, one run at
# load 20): 2 MiB ranges 63.4 s and 0.14x the checkpoint in extra RssAnon,
# 8 MiB ranges 79.8 s and 0.17x.
READ_AHEAD_CHUNK = 2 * 2**20


def streams() -> int:
  """How many ranged reads a whole-object read keeps in flight.

  `CLU_CKPT_BUCKET_STREAMS` when set (a positive integer), else
  `SPOOL_READS`; read at each call.

  Raises:
    ValueError: The variable is set to anything but a positive integer.
  """
  return bucket_client.positive_int_setting("CLU_CKPT_BUCKET_STREAMS",
                                            SPOOL_READS)


def fetch_ranges(read: Callable[[int, int], bytes], path: str, fd: int,
                 ranges: list[tuple[int, int]], size: int,
                 width: Optional[int] = None,
                 chunk: Optional[int] = None) -> int:
  """Copies byte ranges of an object into file `fd` at the same offsets.

  `read(start, end)` returns the object's bytes [start, end) (one ranged
  read, errors naming `path`); it is called from `streams()` threads.

  Ranges are split into pieces of `SPOOL_CHUNK` bytes (less for objects
  under 10 x that x `streams()`: at least 1 MiB); `streams()` reads are kept
  in flight at all times (a new one starts as soon as one ends, not in
  batches), and each range's bytes are written to `fd` as soon as they
  arrive, so at most `streams()` chunks are held in memory.

  Returns:
    The number of requests made.

  Raises:
    OSError: A read failed, returned fewer bytes than asked (the object
      changed), or the local copy could not be written.
  """
  width = width or streams()
  # Ranges of SPOOL_CHUNK, smaller for small objects: what is in flight
  # (held about twice as it arrives) stays near 0.2x the object.
  chunk = min(chunk or SPOOL_CHUNK, max(_MIN_CHUNK, size // (10 * width)))
  pieces = [(s, min(s + chunk, end)) for start, end in ranges
            for s in range(start, end, chunk)]
  if not pieces:
    return 0

  def fetch(piece: tuple[int, int]) -> None:
    start, end = piece
    data = read(start, end)
    if len(data) != end - start:
      raise OSError(f"{path}: the object changed while it was read "
                    f"({len(data)} bytes at {start}, {end - start} "
                    "expected)")
    view = memoryview(data)
    try:
      while view:
        view = view[os.pwrite(fd, view, start + len(data) - len(view)):]
    except OSError as e:
      raise _spool_error(e, path, size) from e

  if len(pieces) == 1:
    fetch(pieces[0])
    return 1
  width = min(width, len(pieces))
  todo = iter(pieces)
  with concurrent.futures.ThreadPoolExecutor(
      width, thread_name_prefix="clu_ckpt-spool") as pool:
    running = {pool.submit(fetch, p) for p in
               (next(todo) for _ in range(width))}
    try:
      while running:
        done, running = concurrent.futures.wait(
            running, return_when=concurrent.futures.FIRST_COMPLETED)
        for future in done:
          future.result()  # raises the first failure
          piece = next(todo, None)
          if piece is not None:
            running.add(pool.submit(fetch, piece))
    except BaseException:
      for future in running:
        future.cancel()
      raise
  return len(pieces)


class FetchFailedError(RuntimeError):
  """A range advised as needed could not be fetched (its cause says why).

  Not an OSError: callers of `madvise` take an OSError for a refused hint
  and go on to read the range, which would be the sparse file's zeros.
  """


class _SpoolMap(mmap.mmap):
  """A spool's map: advice that a range will be needed fetches it first."""

  spool: Optional["SparseSpool"] = None

  def madvise(self, option: int, start: int = 0, length: Optional[int] = None
              ) -> None:
    """`mmap.madvise`; MADV_WILLNEED fetches the range first.

    Raises:
      FetchFailedError: The range could not be fetched.
    """
    if option == mmap.MADV_WILLNEED and self.spool is not None:
      end = len(self) if length is None else start + length
      try:
        self.spool.ensure([(start, end)],
                          width=min(READ_AHEAD_STREAMS, streams()),
                          chunk=READ_AHEAD_CHUNK)
      except Exception as e:  # pylint: disable=broad-except
        raise FetchFailedError(f"{self.spool.path}: bytes {start}-{end} "
                               f"could not be fetched ({e})") from e
    if length is None:
      return super().madvise(option, start)
    return super().madvise(option, start, length)


class SparseSpool:
  """A local copy of an object, filled by ranged reads only where asked.

  The copy is an unlinked sparse file in `$TMPDIR`, memory-mapped (`map`):
  bytes not fetched yet read as zeros, and every range fetched later shows
  up in the same map (and in every numpy view of it). Each byte of the
  object is downloaded at most once, however many callers ask for it.

  Example::

    spool = fs.spool("gs://b/run/ckpt-3.flax")
    spool.ensure([(0, 4096)])          # one ranged read
    header = spool.map[:16]
    spool.fill()                        # the rest, many reads in flight

  Reading ahead: `map.madvise(mmap.MADV_WILLNEED, start, length)` (what a
  consumer says before it reads a range, as the migration's writer does for
  each array: `migration.memory.will_need`) fetches that range first, so
  that a consumer walking the object's arrays downloads each just ahead of
  its use, overlapping the download of the next with whatever it does with
  the current one (an upload), without holding more than its own window.

  Attributes:
    path: The object's URL.
    size: Its size in bytes.
    map: An `mmap.mmap` of the local copy (`b""` for an empty object); its
      `madvise(MADV_WILLNEED, ...)` fetches the range advised.
    requests: Ranged reads made so far.
    fetched: Bytes downloaded so far.
    identity: (path, size, modification time, generation or ETag): what
      names this version of the object, for caches.
  """

  def __init__(self, fs: Any, path: str, size: int):
    self.path, self.size = path, size
    self.identity: tuple = (path, size)
    self.requests = self.fetched = 0
    self._fs = fs
    self._lock = threading.Lock()
    self._have: list[tuple[int, int]] = []  # sorted, disjoint, merged
    self._file = tempfile.TemporaryFile(prefix="clu_ckpt-spool-")
    if size:
      try:
        os.ftruncate(self._file.fileno(), size)  # sparse: no blocks yet
      except OSError as e:
        raise _spool_error(e, path, size) from e
      self.map: Any = _SpoolMap(self._file.fileno(), size,
                                access=mmap.ACCESS_READ)
      self.map.spool = self
    else:
      self.map = b""

  def missing(self, start: int, end: int) -> list[tuple[int, int]]:
    """The parts of [start, end) not fetched yet."""
    start, end = max(0, start), min(end, self.size)
    out = []
    for s, e in self._have:  # (a list replaced whole, never changed)
      if e <= start:
        continue
      if s >= end:
        break
      if s > start:
        out.append((start, s))
      start = max(start, e)
    if start < end:
      out.append((start, end))
    return out

  def has(self, start: int, end: int) -> bool:
    """Whether [start, end) is all fetched."""
    return not self.missing(start, end)

  def ensure(self, ranges: list[tuple[int, int]],
             width: Optional[int] = None,
             chunk: Optional[int] = None) -> None:
    """Fetches whatever of `ranges` is not here yet, many reads in flight.

    Args:
      ranges: (start, end) byte ranges.
      width: Reads in flight (default `streams()`).
      chunk: The most bytes one read asks for (default `SPOOL_CHUNK`).

    Raises:
      OSError: A read failed or the object changed; the local copy could
        not be written (a full `$TMPDIR`).
    """
    if all(self.has(start, end) for start, end in ranges):
      # Already here: no wait for another caller's fetch under way (a
      # read-ahead downloading later ranges holds the lock meanwhile).
      # `_have` is replaced whole, never changed in place: a consistent
      # list without the lock.
      return
    with self._lock:
      todo = []
      for start, end in sorted(ranges):
        for piece in self.missing(start, end):
          if todo and todo[-1][1] >= piece[0]:
            todo[-1] = (todo[-1][0], max(todo[-1][1], piece[1]))
          else:
            todo.append(piece)
      if not todo:
        return
      if sum(e - s for s, e in todo) > self.size // 2:
        self._reserve()
      self.requests += self._fs.fetch_into(self.path, self._file.fileno(),
                                           todo, self.size, width=width,
                                           chunk=chunk)
      self.fetched += sum(e - s for s, e in todo)
      self._have = _merge(self._have + todo)

  def fill(self) -> None:
    """Fetches everything not here yet."""
    self.ensure([(0, self.size)])

  def copy_fetched(self, limit: int) -> Optional[list[tuple[int, bytes]]]:
    """(offset, bytes) of what was fetched, if no more than `limit` bytes."""
    with self._lock:
      if sum(e - s for s, e in self._have) > limit:
        return None
      return [(s, bytes(self.map[s:e])) for s, e in self._have]

  def adopt(self, pieces: list[tuple[int, bytes]]) -> None:
    """Takes bytes of the object known from elsewhere (`copy_fetched`)."""
    with self._lock:
      fd = self._file.fileno()
      for start, data in pieces:
        view = memoryview(data)
        try:
          while view:
            view = view[os.pwrite(fd, view, start + len(data) - len(view)):]
        except OSError as e:
          raise _spool_error(e, self.path, self.size) from e
      self._have = _merge(self._have + [(s, s + len(d)) for s, d in pieces])

  def _reserve(self) -> None:
    """Allocates the whole copy's blocks, so that a full disk fails now."""
    if not getattr(self, "_reserved", False):
      _reserve(self._file.fileno(), self.size, self.path)
      self._reserved = True


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
  out: list[tuple[int, int]] = []
  for start, end in sorted(ranges):
    if out and out[-1][1] >= start:
      out[-1] = (out[-1][0], max(out[-1][1], end))
    else:
      out.append((start, end))
  return out


def _spool_error(e: OSError, path: str, size: int) -> OSError:
  """`e` naming the object and where its local copy was going."""
  return OSError(e.errno, f"{path}: its {size}-byte local copy in "
                 f"{tempfile.gettempdir()} failed ({e.strerror}); set TMPDIR "
                 "to a directory with room for it")


def _reserve(fd: int, size: int, path: str) -> None:
  """Allocates the spool file's blocks, so that a full disk fails at once."""
  try:
    os.posix_fallocate(fd, 0, size)
  except OSError as e:
    if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
      os.ftruncate(fd, size)  # a file system without fallocate
    else:
      raise _spool_error(e, path, size) from e

