"""A summary of a `.flax` file's leaves, in memory independent of their count.

`flax_format.inspect_file` returns one `LeafInfo` per leaf: for a wide but
legal file (a map of millions of nils) that list costs more than decoding
the file. `summarize_file` walks the same headers with the same checks
(`flax_decode`'s walk: a damaged file raises the same `FlaxFormatError`),
but keeps only totals per top-level key and the first `sample` leaves, so
`clu-ckpt inspect` of any file costs no more time or memory than
`flax_format.load_file` of it.

Synopsis::

  from clu_ckpt import flax_summary

  s = flax_summary.summarize_file("/ckpts/ckpt-7.flax", sample=1000)
  s.leaves, s.nbytes            # every leaf counted
  s.sample                      # the first 1000 LeafInfos, in file order
  s.subtrees                    # {"params": [leaves, bytes], ...} (capped)
  s.more_subtrees               # [leaves, bytes] under the top keys not listed
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from clu_ckpt import flax_decode
from clu_ckpt import flax_format
from clu_ckpt import flax_ranges
from clu_ckpt.flax_parse import MAX_DEPTH

# Keys that may make a map a chunked array (walked as `inspect_file` does).
_CHUNK_KEYS = frozenset(("__msgpack_chunked_array__", "shape", "chunks"))
# Scalars' msgpack type bytes -> their encoded size (fixints: 1 byte).
_SCALAR_SIZES = {0xC0: 1, 0xC2: 1, 0xC3: 1, 0xCA: 5, 0xCB: 9,
                 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9,
                 0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9}
# How many top-level keys `Summary.subtrees` lists; the others are added up
# in `more_subtrees`.
MAX_SUBTREES = 1000


@dataclasses.dataclass
class Summary:
  """What `summarize_file` found.

  Attributes:
    path: The file.
    leaves: How many leaves (a chunked array is one).
    nbytes: Bytes of array data.
    sample: The first leaves, `flax_format.LeafInfo`s in file order.
    subtrees: Top-level key -> [leaves, bytes], for the first
      `MAX_SUBTREES` top-level keys.
    more_subtrees: [leaves, bytes] under the other top-level keys.
    step: The integer value of a top-level `step` leaf (a Python int or a
      0-d integer array), else None.
  """
  path: str
  leaves: int = 0
  nbytes: int = 0
  sample: list = dataclasses.field(default_factory=list)
  subtrees: dict = dataclasses.field(
      default_factory=collections.OrderedDict)
  more_subtrees: list = dataclasses.field(default_factory=lambda: [0, 0])
  step: Any = None


class _Frame:
  """The leaves of one open map, until it is known not to be a chunked
  array (then they join the enclosing map's) or to be one (then they are
  dropped for the one leaf that stands for it)."""
  __slots__ = ("path", "leaves", "nbytes", "sample", "tops")

  def __init__(self, path: str = ""):
    self.path = path
    self.leaves = 0
    self.nbytes = 0
    self.sample: list = []
    self.tops: dict = {}  # top-level key -> [leaves, bytes] (root map only)


class _Sink:
  """Stands for the reader's list of leaves: counts instead of keeping.

  The reader takes `len(out)` when a map starts and, when the map turns
  out to be a chunked array, deletes `out[first:]`: with one frame per open
  map (`push`/`pop`), that is the top frame. Frame 0 holds the totals,
  frame 1 is the root map's.
  """

  def __init__(self, sample: int):
    self.frames = [_Frame()]
    self.sample = sample
    self.kept = 0  # leaves in samples (of every frame)
    self.step_leaf = None  # the root's "step" leaf

  def __len__(self) -> int:
    return 0

  def __delitem__(self, index: Any) -> None:
    frame = self.frames[-1]
    self.kept -= len(frame.sample)
    self.frames[-1] = _Frame(frame.path)

  def push(self, path: str) -> None:
    self.frames.append(_Frame(path))

  def pop(self) -> None:
    frame = self.frames.pop()
    parent = self.frames[-1]
    parent.leaves += frame.leaves
    parent.nbytes += frame.nbytes
    parent.sample.extend(frame.sample)
    if len(self.frames) == 2:  # a top-level key's map: one subtree
      _count(parent.tops, frame.path[1:], frame.leaves, frame.nbytes)
    elif len(self.frames) == 1:
      for top, entry in frame.tops.items():
        _count(parent.tops, top, entry[0], entry[1])


def _count(tops: dict, top: Any, leaves: int, nbytes: int) -> None:
  entry = tops.get(top)
  if entry is None:
    if top is not None and len(tops) >= MAX_SUBTREES:
      _count(tops, None, leaves, nbytes)  # counted in `more_subtrees`
      return
    entry = tops[top] = [0, 0]
  entry[0] += leaves
  entry[1] += nbytes


class _SummaryReader(flax_decode._Reader):  # pylint: disable=protected-access
  """`flax_decode._Reader`'s walk, its leaves handed to a `_Sink`.

  Once the sample is full, a leaf's path below the top-level key is not
  built (only its top-level key is needed).
  """
  sink = None

  def _walk_map(self, path, n, depth, offset, out, want):
    if out is not self.sink:
      return super()._walk_map(path, n, depth, offset, out, want)
    out.push(path)
    try:
      if want == flax_decode._WANT_NOTHING:  # pylint: disable=protected-access
        start, left = self._pos, self._left
        if self._count_map(path, n, depth, out):
          return None
        # A chunked array's key: walked again, as `inspect_file` walks it.
        self._pos, self._left = start, left
        out.frames[-1] = _Frame(path)
      return super()._walk_map(path, n, depth, offset, out, want)
    finally:
      out.pop()

  def _count_map(self, path: str, n: int, depth: int, out: _Sink) -> bool:
    """Counts a map's leaves; scalars are skipped without a walk each.

    The same checks as the walk (`_key`, `_walk` for containers, arrays
    and strings); a scalar value is counted from its type byte.

    Returns:
      False, having stopped, at a key that may make the map a chunked array
      ("__msgpack_chunked_array__", "shape", "chunks").
    """
    self._check_count(n, 2)
    deferred, self._deferred = self._deferred, None
    frame = out.frames[-1]
    at_root = len(out.frames) == 2
    view, end = self._view, self._end
    for _ in range(n):
      mark = self._left
      key = self._key(depth)
      if type(key) is str and key in _CHUNK_KEYS:
        self._deferred = deferred
        return False
      self._left = mark
      pos = self._pos
      size = _SCALAR_SIZES.get(view[pos]) if pos < end else None
      if size is None and pos < end and (view[pos] <= 0x7F or
                                         view[pos] >= 0xE0):
        size = 1
      if (size is not None and pos + size <= end and depth < MAX_DEPTH and
          out.kept >= out.sample and not (at_root and key == "step")):
        self._pos = pos + size
        frame.leaves += 1
        if at_root:
          _count(frame.tops, key if type(key) is str else str(key), 1, 0)
      else:
        child = self._child_path(path, key)
        self._walk(child, depth + 1, out, flax_decode._WANT_NOTHING)  # pylint: disable=protected-access
    if deferred is not None:
      self._deferred = deferred
    return True

  def _child_path(self, path, key):
    sink = self.sink
    if path and sink is not None and sink.kept >= sink.sample:
      return path
    return super()._child_path(path, key)

  def _leaf(self, out, path, kind, dtype, shape, nbytes, offset):
    sink = self.sink
    if out is not sink:
      return super()._leaf(out, path, kind, dtype, shape, nbytes, offset)
    frames = sink.frames
    frame = frames[-1]
    if len(frames) == 2 and path == "/step":
      sink.step_leaf = flax_decode.LeafInfo(path, kind, dtype, shape, nbytes,
                                            offset)
    frame.leaves += 1
    frame.nbytes += nbytes
    if sink.kept < sink.sample:
      frame.sample.append(
          flax_decode.LeafInfo(path, kind, dtype, shape, nbytes, offset))
      sink.kept += 1
    if len(frames) <= 2:  # a leaf at the root (or the root itself)
      _count(frame.tops, path[1:], 1, nbytes)
    return None


def summarize_file(path: str, sample: int = 1000) -> Summary:
  """Counts the leaves of a `.flax` file from its headers, keeping few.

  Args:
    path: The file.
    sample: How many leaves to keep (the first ones, in file order).

  Returns:
    The `Summary`.

  Raises:
    FlaxFormatError: The file is damaged (as `flax_format.inspect_file`).
    OSError: It cannot be read.
  """
  remote = None
  if flax_ranges.is_remote(path):  # a bucket's: its headers only, by ranges
    remote = flax_format._open_remote(path)  # pylint: disable=protected-access
    buffer = remote.spool.map
  else:
    buffer = flax_format._open(path, populate=False)  # pylint: disable=protected-access
  reader = _SummaryReader(buffer, path, False,
                          memory_factor=flax_format.MEMORY_FACTOR,
                          memory_base=flax_format.MEMORY_BASE)
  sink = reader.sink = _Sink(sample)
  reader._walk("", 0, sink, flax_decode._WANT_NOTHING)  # pylint: disable=protected-access
  reader._expect_end()  # pylint: disable=protected-access
  if reader._deferred is not None:  # pylint: disable=protected-access
    raise reader._deferred  # pylint: disable=protected-access
  frame = sink.frames[0]
  out = Summary(path, frame.leaves, frame.nbytes, frame.sample)
  if sink.step_leaf is not None:
    if remote is not None:  # the step's own bytes, if an array holds it
      remote.fetch_subtree(("step",))
    out.step = _step_value(reader, buffer, sink.step_leaf)
  for top, (leaves, nbytes) in frame.tops.items():
    if top is None:
      out.more_subtrees = [leaves, nbytes]
    else:
      out.subtrees[top] = [leaves, nbytes]
  return out


def _step_value(reader: _SummaryReader, buffer: Any,
                leaf: flax_decode.LeafInfo) -> Any:
  """The integer a `step` leaf holds, read at its offset, or None."""
  if leaf.kind == "int":
    reader._pos = leaf.offset  # pylint: disable=protected-access
    return reader._value(0)  # pylint: disable=protected-access
  if leaf.kind in ("ndarray", "npscalar") and leaf.shape == ():
    dtype = flax_format.dtype_from_name(leaf.dtype)
    if dtype.kind in "iu":
      return int(np.frombuffer(buffer, dtype, 1, leaf.offset)[0])
  return None
