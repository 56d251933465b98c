"""The `.flax` reader: Flax's state dicts and the `LeafInfo`s of their leaves.

It owns what reading makes of a file's values: `LeafInfo` (one leaf, from the
headers alone), Flax's chunked arrays (checked, described as one leaf, and
joined), and `_Reader`, the `flax_parse._Parser` (the bounded msgpack parser:
errors, limits, the memory budget) with the entry points `flax_format` uses.
One walker serves both reads that list leaves: `tree_and_leaves` (the state
dict and its `LeafInfo`s in one pass, for `FlaxFile`) and `leaves` (the
`LeafInfo`s alone, for `inspect`, which checks values without keeping them);
`root` decodes the state dict or one subtree (`load`). This module does no
file I/O.

Synopsis::

  from clu_ckpt import flax_decode

  data = open("ckpt-1.flax", "rb").read()     # flax_format maps the file
  reader = flax_decode._Reader(data, "ckpt-1.flax", writable=False,
                               memory_factor=64, memory_base=2**24)
  state_dict, leaves = reader.tree_and_leaves()   # or .leaves(), .root(keys)
  print(leaves[0].path, leaves[0].dtype, leaves[0].shape, leaves[0].nbytes)
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Optional, Union

import numpy as np

from clu_ckpt import flax_parse
from clu_ckpt.flax_parse import _alloc
from clu_ckpt.flax_parse import _CHUNKED_KEY
from clu_ckpt.flax_parse import _COST_ARRAY
from clu_ckpt.flax_parse import _COST_ARRAY_DIM
from clu_ckpt.flax_parse import _COST_DICT
from clu_ckpt.flax_parse import _COST_DICT_ITEM
from clu_ckpt.flax_parse import _COST_DICT_TABLE
from clu_ckpt.flax_parse import _COST_INT
from clu_ckpt.flax_parse import _EXT_NDARRAY
from clu_ckpt.flax_parse import _EXT_NPSCALAR
from clu_ckpt.flax_parse import _I8
from clu_ckpt.flax_parse import _int_cost
from clu_ckpt.flax_parse import _SIZEOF_STR
from clu_ckpt.flax_parse import _SIZEOF_TUPLE
from clu_ckpt.flax_parse import _str_cost
from clu_ckpt.flax_parse import FlaxFormatError
from clu_ckpt.flax_parse import MAX_NDIM


# What `inspect` calls the leaves of each msgpack kind (ext: other than arrays).
_LEAF_KINDS = {"int": "int", "float": "float", "nil": "none", "true": "bool",
               "false": "bool", "str": "str", "bin": "bytes", "array": "list",
               "ext": "complex"}
# One (key, summary) pair kept while a chunked array's map is inspected.
_COST_PAIR = 288


@dataclasses.dataclass(frozen=True, slots=True)
class LeafInfo:
  """One leaf of a `.flax` file, as described by its headers.

  Attributes:
    path: "/"-joined keys from the root, e.g. "/params/Dense_0/kernel".
    kind: "ndarray", "npscalar", "int", "float", "bool", "str", "bytes",
      "none" or "complex". Arrays stored in Flax's chunked form are "ndarray".
    dtype: numpy dtype name for arrays and numpy scalars, else None.
    shape: The array shape for arrays and numpy scalars, else None.
    nbytes: Bytes of array data (for arrays and numpy scalars), else 0.
    offset: Byte offset in the file of the array data (of the first chunk for
      chunked arrays), or of the value itself for other leaves.
  """
  path: str
  kind: str
  dtype: Optional[str]
  shape: Optional[tuple]
  nbytes: int
  offset: int


class _Chunk:
  """What `inspect` keeps of an ndarray ext that may be a chunk of an array."""
  __slots__ = ("dtype", "ndim", "count", "nbytes", "offset")

  def __init__(self, dtype: np.dtype, ndim: int, count: int, nbytes: int,
               offset: int):
    self.dtype = dtype
    self.ndim = ndim
    self.count = count
    self.nbytes = nbytes
    self.offset = offset


# What `_Reader._walk` returns about the value it walks: nothing (inspect).
_WANT_NOTHING = 0
# An int's value, a `_Chunk` for an ndarray (what load turns into an
# np.ndarray), else None: the entries of a chunked array's "shape" or "chunks".
_WANT_SUMMARY = 1
# For a map, its (key, summary) pairs (the value of a "shape" or "chunks"
# key); for anything else, its summary.
_WANT_ENTRIES = 2
# The value itself, as `load` decodes it (a full read).
_WANT_VALUE = 3


class _Reader(flax_parse._Parser):  # pylint: disable=protected-access
  """The bounded parser, with the reads `flax_format` makes of a whole input.

  Charges what it builds (dicts, paths, `LeafInfo`s) to the parser's budget.
  """

  def __init__(self, data: Any, name: Optional[str], writable: bool, *,
               memory_factor: int, memory_base: int):
    super().__init__(data, name, writable, memory_factor=memory_factor,
                     memory_base=memory_base)
    # inspect: the first error of a chunked array's map, kept until it is
    # known whether an enclosing map is itself a chunked array (load ignores
    # what such a map holds besides its shape and chunks).
    self._deferred: Optional[FlaxFormatError] = None
    self._names: dict[np.dtype, str] = {}

  # -- entry points ---------------------------------------------------------

  def root(self, keys: tuple) -> Any:
    if keys:
      value = self._descend(keys)
    else:
      value = self._value(0)
      self._expect_end()
    return _unchunk(value, self)

  def tree_and_leaves(self) -> tuple[Any, list[LeafInfo]]:
    """The state dict `root(())` returns and the LeafInfos `leaves()` does.

    One pass: each value is decoded as `load` decodes it, and described as
    `inspect` describes it on the way; both are charged to the one budget.
    """
    return self._walk_root(_WANT_VALUE)

  def leaves(self) -> list[LeafInfo]:
    """The LeafInfos alone: values are checked as `load` would, not kept."""
    return self._walk_root(_WANT_NOTHING)[1]

  def _walk_root(self, want: int) -> tuple[Any, list[LeafInfo]]:
    out: list[LeafInfo] = []
    value = self._walk("", 0, out, want)
    self._expect_end()
    if self._deferred is not None:
      raise self._deferred
    return _unchunk(value, self), out

  # -- the walker: leaves, and values if wanted ---------------------------------

  def _walk(self, path: str, depth: int, out: list, want: int) -> Any:
    """Appends the LeafInfos of one value to `out`, in one pass.

    With `_WANT_VALUE` the value is built as `_value` builds it (a full
    read); otherwise it is only checked as `_value` would check it, and only
    what `want` asks for is kept: the objects a full read would keep are
    never made, or are refunded as soon as they are dropped.

    Args:
      path: The value's path.
      depth: Its nesting depth.
      out: Where its leaves go.
      want: `_WANT_NOTHING`, `_WANT_SUMMARY`, `_WANT_ENTRIES` or
        `_WANT_VALUE`: what to return about the value (see their definitions).

    Returns:
      What `want` asks for, or None.
    """
    self._check_depth(depth)
    build = want == _WANT_VALUE
    at = self._pos
    kind, n, offset = self._header()
    if kind == "map":
      return self._walk_map(path, n, depth, offset, out, want)
    if kind == "ext":
      code = self._unpack(_I8)
      start = self._take(n)
      if code in (_EXT_NDARRAY, _EXT_NPSCALAR):
        shape, dtype, data_at, count = self._ndarray_parts(start, start + n,
                                                           offset)
        arr = self._ndarray_from(shape, dtype, data_at, count) if build else None
        nbytes = count * dtype.itemsize
        self._leaf(out, path, "ndarray" if code == _EXT_NDARRAY else
                   "npscalar", self._dtype_name(dtype), shape, nbytes, data_at)
        if build:
          return self._array_value(code, arr, offset)
        # load makes an np.ndarray of it (a numpy scalar if code 3 and 0-d).
        if want and (code == _EXT_NDARRAY or shape):
          self._charge(_COST_PAIR)
          return _Chunk(dtype, len(shape), count, nbytes, data_at)
        return None
    value = n if want and kind == "int" else None
    if build or kind in ("array", "ext"):  # decoded again, from its header
      self._pos = at
      mark = self._left
      value = self._value(depth)
      if not build:  # checked only: dropped
        self._left, value = mark, None
    elif kind == "str":
      mark = self._left
      self._str(n, offset)  # checks the UTF-8
      self._left = mark
    elif kind == "bin":
      self._take(n)
    self._leaf(out, path, _LEAF_KINDS[kind], None, None, 0, at)
    return value

  def _walk_map(self, path: str, n: int, depth: int, offset: int,
                out: list, want: int) -> Any:
    """Walks a map's entries; a chunked array's map becomes one leaf.

    Whether a map is a chunked array is known only after its last key; its
    entries are walked as they come. A full read builds the map's dict; other
    reads keep only what makes it one leaf, its "shape" and "chunks" entries
    (`_WANT_ENTRIES`), so nothing is parsed twice.

    Returns:
      The dict (`_WANT_VALUE`), the (key, summary) pairs (`_WANT_ENTRIES`),
      else None.
    """
    self._check_count(n, 2)
    build = want == _WANT_VALUE
    if build:
      self._charge(_COST_DICT)
    deferred, self._deferred = self._deferred, None
    first = len(out)
    chunked = False
    # The map's dict (full reads), else its "shape" and "chunks" entries.
    fields: dict = {}
    entries: Optional[list] = [] if want == _WANT_ENTRIES else None
    for _ in range(n):
      mark = self._left
      key = self._key(depth)
      key_cost = mark - self._left
      child = self._child_path(path, key)
      field = None
      if type(key) is str:
        if key == _CHUNKED_KEY:
          chunked = True
        elif key == "shape" or key == "chunks":
          field = "shape" if key == "shape" else "chunks"  # not `key` itself
      if build:
        value = self._walk(child, depth + 1, out, want)
        del child
        self._put(fields, key, value)
        continue
      if entries is None:
        del key
        self._left += key_cost
      if field is not None:
        child_want = _WANT_ENTRIES
      else:
        child_want = _WANT_NOTHING if entries is None else _WANT_SUMMARY
      result = self._walk(child, depth + 1, out, child_want)
      del child
      if field is not None:
        if not fields:
          self._charge(_COST_DICT + _COST_DICT_TABLE)
        fields[field] = result if isinstance(result, list) else None
      if entries is not None:
        self._charge(_COST_PAIR)
        entries.append((key, None if isinstance(result, list) else result))
    if chunked:
      # What the entries described is moot: load returns one array, and
      # ignores what the map holds besides its shape and chunks.
      del out[first:]
      self._deferred = self._chunked_leaf(path, fields, offset, out, build)
    if deferred is not None:
      self._deferred = deferred
    return fields if build else entries

  def _chunked_leaf(self, path: str, fields: dict, offset: int, out: list,
                    built: bool) -> Optional[FlaxFormatError]:
    """Appends the leaf of a chunked array's map, or returns why it is not one.

    The checks are `load`'s (`_chunk_layout`), on what the map's "shape" and
    "chunks" entries hold: decoded values if `built`, else summaries.
    """
    shape, chunks = fields.get("shape"), fields.get("chunks")
    if not built:
      shape, chunks = self._as_dict(shape), self._as_dict(chunks)
    layout = _chunk_layout(shape, chunks)
    if isinstance(layout, str):
      return self.error(layout, offset)
    dims, parts = layout
    start = self._data_offset(parts[0]) if built else parts[0].offset
    self._leaf(out, path, "ndarray", self._dtype_name(parts[0].dtype), dims,
               sum(p.nbytes for p in parts), start)
    return None

  def _as_dict(self, entries: Optional[list]) -> Optional[dict]:
    """The dict `load` builds from these (key, value) pairs (later keys win)."""
    if entries is None:
      return None
    self._charge(_COST_DICT + _COST_DICT_TABLE +
                 _COST_DICT_ITEM * len(entries))
    return dict(entries)

  def _data_offset(self, arr: np.ndarray) -> int:
    """The offset in the input of a view's first byte."""
    base = np.frombuffer(self._view, np.uint8)
    return (arr.__array_interface__["data"][0] -
            base.__array_interface__["data"][0])

  def _child_path(self, path: str, key: Any) -> str:
    """f"{path}/{key}", charged (its estimate first, then its real size)."""
    if type(key) is str:
      if key.isascii() and path.isascii():  # the size is known: 49 + length
        self._charge(_alloc(_SIZEOF_STR + len(path) + 1 + len(key)))
        return f"{path}/{key}"
      text, text_cost = key, 0
    else:
      text_cost = _alloc(80 + 4 * len(key)) if type(key) is bytes else 128
      self._charge(text_cost)
      text = str(key)
    estimate = _alloc(80 + 4 * (len(path) + 1 + len(text)))
    self._charge(estimate)
    child = f"{path}/{text}"
    self._left += estimate + text_cost - _str_cost(child)
    return child

  def _leaf(self, out: list, path: str, kind: str, dtype: Optional[str],
            shape: Optional[tuple], nbytes: int, offset: int) -> None:
    # nbytes and offset are below the file's size: small ints.
    cost = (_COST_LEAF + (_COST_INT if nbytes > 256 else 0) +
            (_COST_INT if offset > 256 else 0))
    if shape:
      cost += _alloc(_SIZEOF_TUPLE + 8 * len(shape))
      for dim in shape:
        cost += _int_cost(dim)
    self._charge(cost)
    out.append(LeafInfo(path, kind, dtype, shape, nbytes, offset))

  def _dtype_name(self, dtype: np.dtype) -> str:
    """`dtype.name`, one string per dtype and reader."""
    name = self._names.get(dtype)
    if name is None:
      name = dtype.name
      self._charge(_COST_DICT_TABLE + _str_cost(name))
      self._names[dtype] = name
    return name


# A LeafInfo and its slot in the list (which grows by 1/8 and is copied).
_COST_LEAF = _alloc(sys.getsizeof(LeafInfo("", "", None, None, 0, 0))) + 24


def _part_info(part: Any) -> Optional[tuple[int, np.dtype, int]]:
  """(ndim, dtype, size) of a chunk, decoded or as `inspect` saw it, or None
  if it is not an array."""
  if isinstance(part, np.ndarray):
    return part.ndim, part.dtype, part.size
  if isinstance(part, _Chunk):
    return part.ndim, part.dtype, part.count
  return None


def _chunk_layout(shape_map: Any,
                  chunks: Any) -> Union[str, tuple[tuple, list]]:
  """Checks a chunked array's "shape" and "chunks" as `load` needs them.

  Args:
    shape_map: The "shape" value: {"0": dim, "1": dim, ...}.
    chunks: The "chunks" value: {"0": 1-D array, "1": ...} (arrays, or
      `_Chunk`s when inspecting).

  Returns:
    (shape, chunks in order), or the message of what is wrong.
  """
  if isinstance(shape_map, dict) and len(shape_map) > MAX_NDIM:
    return (f"chunked array shape has {len(shape_map)} dimensions, numpy "
            f"allows {MAX_NDIM}")
  shape = _chunked_shape(shape_map)
  if shape is None or not isinstance(chunks, dict):
    return "malformed chunked array"
  try:
    parts = [chunks[str(i)] for i in range(len(chunks))]
  except KeyError:
    return "chunked array is missing a chunk"
  infos = [_part_info(p) for p in parts]
  if not infos or not all(i is not None and i[0] == 1 and
                          i[1] == infos[0][1] for i in infos):
    return "chunked array chunks are not 1-D arrays of one dtype"
  total = sum(i[2] for i in infos)
  count = nonzero = 1
  for dim in shape:
    count *= dim
    nonzero *= max(dim, 1)
  if nonzero * infos[0][1].itemsize > sys.maxsize:
    return f"chunked array shape {shape} is too large for numpy"
  if total != count:
    return f"chunked array of shape {shape} has {total} elements"
  return shape, parts


def _chunked_shape(shape: Any) -> Optional[tuple]:
  if not isinstance(shape, dict):
    return None
  try:
    dims = tuple(shape[str(i)] for i in range(len(shape)))
  except KeyError:
    return None
  if not all(type(d) is int and d >= 0 for d in dims):
    return None
  return dims


def _unchunk(value: Any, reader: _Reader) -> Any:
  """Reassembles Flax's chunked arrays, like `msgpack_restore` does."""
  if not isinstance(value, dict):
    return value
  if _CHUNKED_KEY in value:
    return _join_chunks(value, reader)
  for key, item in value.items():
    if isinstance(item, dict):
      value[key] = _unchunk(item, reader)
  return value


def _join_chunks(value: dict, reader: _Reader) -> np.ndarray:
  layout = _chunk_layout(value.get("shape"), value.get("chunks"))
  if isinstance(layout, str):
    raise reader.error(layout, None)
  shape, parts = layout
  view = _alloc(_COST_ARRAY + _COST_ARRAY_DIM * len(shape))
  reader._charge(2 * view + _alloc(sum(p.nbytes for p in parts)))  # pylint: disable=protected-access
  return np.concatenate(parts).reshape(shape)
