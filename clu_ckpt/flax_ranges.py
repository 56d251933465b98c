"""The `.flax` file of a bucket, read by ranges: headers first, arrays on demand.

A `.flax` file is one msgpack map whose arrays' bytes sit between small
headers (a key, an ext header, a shape and a dtype name). To list its leaves,
find its `step` or load one subtree, only those headers and the arrays asked
for are needed. `open_remote` walks the msgpack structure by ranged reads into
a `fsspec_fs.SparseSpool` (a sparse local copy, memory-mapped), fetching a
window at each header it reaches and skipping every array's bytes, and records
where each array's bytes are and under which keys. The ordinary parser
(`flax_parse`) then runs over the spool's map: it never reads the bytes of an
array it does not return, so it sees only fetched bytes; the arrays a caller
wants are fetched, many ranges in flight, before they are handed out.

Cost: one round trip per array larger than the window (`WINDOW`, 64 KiB,
doubling while headers run on), and at most about `WINDOW` bytes beyond the
headers per array. Files whose structure the walk does not understand (they
are corrupt, or not Flax's) are fetched whole, so that the parser reports the
real problem.

Synopsis::

  from clu_ckpt import flax_ranges

  remote = flax_ranges.open_remote("gs://b/run/ckpt-7.flax")
  buffer = remote.spool.map             # headers fetched; arrays not yet
  remote.fetch_subtree(("params",))     # the arrays under /params
  remote.fetch_all()                    # the rest, each byte once
"""

from __future__ import annotations

import collections
import struct
import threading
from typing import Any, Optional

import msgpack

from clu_ckpt import fsspec_fs
from clu_ckpt import storage

# A header read fetches at least this many bytes (more while headers follow
# each other, doubling up to MAX_WINDOW).
WINDOW = 64 * 2**10
MAX_WINDOW = 4 * 2**20
# Strings and byte strings longer than this are skipped like array data.
_BIG = 64 * 2**10
# Keep the walks of this many files (headers, offsets) for the next opening
# of the same object (same size and time) in this process.
_CACHED = 8
_MAX_DEPTH = 256

_INTS = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4,
         0xD3: 8, 0xCA: 4, 0xCB: 8}
_LEN = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}
_EXT_LEN = {0xC7: 1, 0xC8: 2, 0xC9: 4}
_FIXEXT = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}
_UNSIGNED = {1: ">B", 2: ">H", 4: ">I", 8: ">Q"}


def is_remote(path: str) -> bool:
  """Whether `path` is in a store read by ranges (a bucket)."""
  return isinstance(storage.filesystem(path), fsspec_fs.FsspecFileSystem)


class RemoteFlax:
  """A `.flax` object with its headers fetched into a sparse local spool.

  Attributes:
    spool: The `fsspec_fs.SparseSpool`; `spool.map` is the buffer to parse.
    arrays: (keys, start, end) of each array's (or long string's) bytes,
      not fetched until asked for; keys from the root, list items as ints.
    views: Indices in `arrays` of the numpy arrays the parser hands out as
      views of the buffer (it reads none of their bytes); the others (long
      strings, chunks it joins) it copies.
  """

  def __init__(self, spool: fsspec_fs.SparseSpool,
               arrays: list[tuple[tuple, int, int]],
               views: frozenset = frozenset()):
    self.spool = spool
    self.arrays = arrays
    self.views = views

  def fetch_subtree(self, keys: tuple) -> None:
    """Fetches the bytes of every array under `keys` (a prefix of keys)."""
    n = len(keys)
    self.spool.ensure([(s, e) for path, s, e in self.arrays
                       if tuple(path[:n]) == tuple(keys)])

  def fetch_all(self) -> None:
    """Fetches every byte not fetched yet."""
    self.spool.fill()

  def fetch_for_parse(self) -> None:
    """Fetches every byte the parser reads: all but the arrays' views.

    The arrays it hands out are then views of bytes not fetched yet: each
    must be fetched before it is read, by `spool.ensure` or by advising the
    spool's map (`madvise(MADV_WILLNEED)` over the array's bytes).
    """
    deferred = sorted((s, e) for i, (_, s, e) in enumerate(self.arrays)
                      if i in self.views)
    wanted, at = [], 0
    for start, end in deferred:
      if start > at:
        wanted.append((at, start))
      at = max(at, end)
    if at < self.spool.size:
      wanted.append((at, self.spool.size))
    self.spool.ensure(wanted)

  def fetch_views(self, value: Any) -> None:
    """Fetches the bytes behind every numpy view of the spool in `value`.

    A check on top of `fetch_subtree`: whatever the parser returned, the
    arrays handed out hold the file's bytes, not the spool's holes.
    """
    buffer = self.spool.map
    if not buffer:
      return
    import numpy as np  # pylint: disable=g-import-not-at-top
    base = np.frombuffer(buffer, np.uint8).__array_interface__["data"][0]
    ranges = []
    stack = [value]
    while stack:
      node = stack.pop()
      if isinstance(node, dict):
        stack.extend(node.values())
      elif isinstance(node, (list, tuple)):
        stack.extend(node)
      elif isinstance(node, np.ndarray) and node.nbytes:
        start = node.__array_interface__["data"][0] - base
        if 0 <= start < len(buffer):
          ranges.append((start, start + node.nbytes))
    self.spool.ensure(ranges)


_cache: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_cache_lock = threading.Lock()


def open_remote(path: str, keys: tuple = ()) -> RemoteFlax:
  """Fetches the headers of the `.flax` object at `path` by ranged reads.

  The walk of an object already opened in this process (same URL, size,
  modification time and generation or ETag: one metadata request) is not
  repeated: its headers are copied from memory.

  Args:
    path: The object.
    keys: Only the headers on the way to this subtree, and the subtree's
      (its `arrays` are then those of the subtree and of what was skipped on
      the way); all of them if empty.

  Raises:
    FileNotFoundError: No object at `path`.
    OSError: It cannot be read.
  """
  spool = storage.filesystem(path).spool(path)
  size, key = spool.size, spool.identity
  with _cache_lock:
    cached = _cache.get(key)
    if cached is not None:
      _cache.move_to_end(key)
  if cached is not None:
    pieces, arrays, views = cached
    spool.adopt(pieces)
    return RemoteFlax(spool, arrays, views)
  walker = _Walker(spool)
  try:
    if keys:
      walker.descend(tuple(keys))
      return RemoteFlax(spool, walker.arrays, frozenset(walker.views))
    walker.value((), 0)
    if walker.pos != spool.size:
      raise _Unknown("trailing bytes")
  except _Unknown:
    spool.fill()  # let the parser name what is wrong
    return RemoteFlax(spool, [])
  pieces = spool.copy_fetched(limit=max(2 * 2**20, size // 50 + 2**20))
  if pieces is not None and key[-1]:  # a version that names the bytes
    with _cache_lock:
      _cache[key] = (pieces, walker.arrays, frozenset(walker.views))
      while len(_cache) > _CACHED:
        _cache.popitem(last=False)
  return RemoteFlax(spool, walker.arrays, frozenset(walker.views))


class _Unknown(Exception):
  """The bytes are not a structure the walk knows: fetch the whole file."""


class _Walker:
  """Walks msgpack values by ranged reads, skipping arrays' bytes."""

  def __init__(self, spool: fsspec_fs.SparseSpool):
    self.spool = spool
    self.pos = 0
    self.arrays: list[tuple[tuple, int, int]] = []
    self.views: set[int] = set()  # indices of arrays handed out as views
    self._window = WINDOW
    self._last_end = -1

  def _need(self, n: int) -> memoryview:
    start, end = self.pos, self.pos + n
    if end > self.spool.size:
      raise _Unknown("truncated")
    if not self.spool.has(start, end):
      # Headers that run on past the last window get a larger one.
      self._window = (min(2 * self._window, MAX_WINDOW)
                      if start <= self._last_end else WINDOW)
      stop = min(self.spool.size, max(end, start + self._window))
      self.spool.ensure([(start, stop)])
      self._last_end = stop
    self.pos = end
    return memoryview(self.spool.map)[start:end]

  def _uint(self, n: int) -> int:
    return struct.unpack(_UNSIGNED[n], self._need(n))[0]

  def value(self, path: tuple, depth: int) -> None:
    if depth > _MAX_DEPTH:
      raise _Unknown("too deep")
    tag = self._need(1)[0]
    if tag <= 0x7F or tag >= 0xE0 or tag in (0xC0, 0xC2, 0xC3):
      return
    if 0x80 <= tag <= 0x8F:
      return self._map(tag & 0x0F, path, depth)
    if 0x90 <= tag <= 0x9F:
      return self._array(tag & 0x0F, path, depth)
    if 0xA0 <= tag <= 0xBF:
      return self._bytes(tag & 0x1F, path)
    if tag in _INTS:
      self._need(_INTS[tag])
      return
    if tag in _LEN:
      return self._bytes(self._uint(_LEN[tag]), path)
    if tag in (0xDC, 0xDD):
      return self._array(self._uint(2 if tag == 0xDC else 4), path, depth)
    if tag in (0xDE, 0xDF):
      return self._map(self._uint(2 if tag == 0xDE else 4), path, depth)
    if tag in _EXT_LEN:
      return self._ext(self._uint(_EXT_LEN[tag]), path)
    if tag in _FIXEXT:
      return self._ext(_FIXEXT[tag], path)
    raise _Unknown(f"type byte {tag:#x}")

  def descend(self, keys: tuple) -> None:
    """Walks the headers on the way to `keys` and the subtree there.

    Stops early where the parser will find no such subtree (it then reads
    only what was fetched here to say so).
    """
    path: tuple = ()
    for depth, wanted in enumerate(keys):
      tag = self._need(1)[0]
      if 0x80 <= tag <= 0x8F:
        n = tag & 0x0F
      elif tag in (0xDE, 0xDF):
        n = self._uint(2 if tag == 0xDE else 4)
      else:
        return  # not a map: no such subtree
      for _ in range(n):
        key = self._key(depth)
        if key == wanted:
          path += (key,)
          break
        self.value(path + (key,), depth + 1)
      else:
        return  # no such key
    self.value(path, len(keys))

  def _key(self, depth: int) -> Any:
    start = self.pos
    self.value((), depth + 1)
    raw = bytes(memoryview(self.spool.map)[start:self.pos])
    try:
      key = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception:  # pylint: disable=broad-except
      raise _Unknown("key") from None
    if isinstance(key, (list, dict)):
      raise _Unknown("key")
    return key

  def _bytes(self, n: int, path: tuple) -> None:
    if n > _BIG:
      self._skip_data(n, path)
    else:
      self._need(n)

  def _skip_data(self, n: int, path: tuple, view: bool = False) -> None:
    if self.pos + n > self.spool.size:
      raise _Unknown("truncated")
    # A chunk of a chunked array ({"shape", "chunks": {"0": ...}}) is
    # joined, so read, by the parser: not a view.
    if view and not (len(path) >= 2 and path[-2] == "chunks"):
      self.views.add(len(self.arrays))
    self.arrays.append((path, self.pos, self.pos + n))
    self.pos += n

  def _array(self, n: int, path: tuple, depth: int) -> None:
    if n > self.spool.size - self.pos:
      raise _Unknown("count")
    for i in range(n):
      self.value(path + (i,), depth + 1)

  def _map(self, n: int, path: tuple, depth: int) -> None:
    if 2 * n > self.spool.size - self.pos:
      raise _Unknown("count")
    for _ in range(n):
      key = self._key(depth)
      self.value(path + (key,), depth + 1)

  def _ext(self, n: int, path: tuple) -> None:
    code = self._need(1)[0]
    end = self.pos + n
    if code != 1 or n <= 64:
      self._need(n)  # scalars, complex numbers, small arrays
      return
    # (shape, dtype name, data): all but the data are headers.
    if self._need(1)[0] != 0x93:
      raise _Unknown("ndarray")
    self.value(path, _MAX_DEPTH - 1)  # the shape: small
    self.value(path, _MAX_DEPTH - 1)  # the dtype name
    tag = self._need(1)[0]
    if tag in _LEN:
      length = self._uint(_LEN[tag])
    elif 0xA0 <= tag <= 0xBF:
      length = tag & 0x1F
    else:
      raise _Unknown("ndarray data")
    if self.pos + length != end:
      raise _Unknown("ndarray size")
    self._skip_data(length, path, view=True)


def cache_clear() -> None:
  """Forgets the walks kept for objects opened before."""
  with _cache_lock:
    _cache.clear()
