"""The bounded msgpack parser under the `.flax` reader: values, in budget.

It owns the guarantees `flax_format`'s docstring states for reading: every
problem with the bytes is a `FlaxFormatError` naming the byte offset; nesting
stops at `MAX_DEPTH`; each byte is parsed a bounded number of times (time is
linear in the input's size); and every Python object made is charged, at no
less than its CPython size (the cost tables below), to a budget of
`memory_factor` x the input's size + `memory_base`, so that hostile input is
refused before its objects are built (the bound's two terms are
`flax_format.MEMORY_FACTOR` and `MEMORY_BASE`, passed in by the caller).
`_Parser` decodes values (`_value`)
and finds subtrees (`_descend`); `flax_decode._Reader` builds on it the walk
that lists leaves and joins chunked arrays. Callers use `flax_format`.

Synopsis::

  from clu_ckpt import flax_format, flax_parse

  data = flax_format.save({"step": 3})
  parser = flax_parse._Parser(data, "inline", writable=False,
                              memory_factor=64, memory_base=2**24)
  assert parser._value(0) == {"step": 3}     # flax_format.load is the API
"""

from __future__ import annotations

import struct
import sys
from typing import Any, Optional

import numpy as np

from clu_ckpt import errors
from clu_ckpt.flax_dtypes import _DTYPE_CACHE
from clu_ckpt.flax_dtypes import _dtype_from_name

# Maps and arrays nested deeper than this are refused as hostile input.
MAX_DEPTH = 256
# numpy's own limit on the number of dimensions.
MAX_NDIM = 64

# The ext type codes of the format, and the key marking a chunked array.
_EXT_NDARRAY = 1
_EXT_COMPLEX = 2
_EXT_NPSCALAR = 3
_CHUNKED_KEY = "__msgpack_chunked_array__"
# How many of a map's keys a "no subtree" message names.
_KEYS_SHOWN = 20

FlaxFormatError = errors.FlaxFormatError


_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_I8 = struct.Struct(">b")
_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_I64 = struct.Struct(">q")
_F32 = struct.Struct(">f")
_F64 = struct.Struct(">d")
_FIXED_INTS = {0xCC: _U8, 0xCD: _U16, 0xCE: _U32, 0xCF: _U64,
               0xD0: _I8, 0xD1: _I16, 0xD2: _I32, 0xD3: _I64}
_SIMPLE = {0xC0: "nil", 0xC2: "false", 0xC3: "true"}
_SIZED = {0xC4: ("bin", _U8), 0xC5: ("bin", _U16), 0xC6: ("bin", _U32),
          0xD9: ("str", _U8), 0xDA: ("str", _U16), 0xDB: ("str", _U32),
          0xDC: ("array", _U16), 0xDD: ("array", _U32),
          0xDE: ("map", _U16), 0xDF: ("map", _U32),
          0xC7: ("ext", _U8), 0xC8: ("ext", _U16), 0xC9: ("ext", _U32)}


# -- what the reader's objects cost -------------------------------------------
#
# Estimates of the memory each Python object the reader creates takes on
# CPython 3.11 (64-bit), allocator rounding and headers included; each is at
# least the real size (checked by tests/test_flax_format.py, which measures
# the process' RSS), so charging them against the budget bounds real memory.


def _alloc(n: int) -> int:
  """Bytes taken by an n-byte allocation: pymalloc rounds up to 16 bytes,
  malloc adds a header, and large blocks are mapped in whole pages."""
  if n <= 512:
    return (n + 15) & ~15
  if n < 2**17:
    return (n + 23) & ~15
  return (n + 4096 + 23) & ~4095


_COST_INT = _alloc(sys.getsizeof(2**59))       # ints in (-2**60, 2**60)
_COST_BIG_INT = _alloc(sys.getsizeof(2**64))   # the others
_COST_FLOAT = _alloc(sys.getsizeof(0.0))
_COST_COMPLEX = _alloc(sys.getsizeof(0j))
_SIZEOF_BYTES = sys.getsizeof(b"")             # + 1 per byte
_SIZEOF_STR = sys.getsizeof("")                # + 1 per ASCII character
_SIZEOF_LIST = sys.getsizeof([])               # + 8 per slot, allocated whole
_SIZEOF_TUPLE = sys.getsizeof(())              # + 8 per item
_COST_DICT = _alloc(sys.getsizeof({}))
# A dict's first entry allocates its 8-slot table; CPython then doubles the
# table when it is 2/3 full and frees the old one after copying: at most 90
# bytes per entry at that moment (60 after), 92 with a margin.
_COST_DICT_TABLE = 176
_COST_DICT_ITEM = 92
# A numpy array view: the object (~90 bytes) and its shape and strides.
_COST_ARRAY = 128
_COST_ARRAY_DIM = 16
# A numpy scalar (str_ and bytes_ scalars hold a copy of the data on top).
_COST_NPSCALAR = 160
# A dtype object made for one array (the module caches only a few).
_COST_DTYPE = 512


def _int_cost(value: int) -> int:
  """Cost of a Python int (those in [-5, 256] are shared singletons)."""
  if -5 <= value <= 256:
    return 0
  return _COST_INT if -2**60 < value < 2**60 else _COST_BIG_INT


def _str_cost(text: str) -> int:
  """Cost of a str (the empty and one-latin-1-character ones are shared)."""
  if len(text) <= 1 and text <= "\xff":
    return 0
  size = sys.getsizeof(text)
  return (size + 15) & ~15 if size <= 512 else _alloc(size)


class _Parser:
  """A bounded msgpack parser over a buffer, producing Flax's values.

  Every Python object it creates is charged, at its estimated size, to a
  budget of `memory_factor` x the input's size + `memory_base` (minus the
  input itself; `flax_format` passes its `MEMORY_FACTOR` and `MEMORY_BASE`);
  objects it builds only to check them and drops (keys it compares, leaves
  `inspect` validates) are refunded once dropped. Each byte
  is parsed a bounded number of times, so time is linear in the input's size.
  """

  def __init__(self, data: Any, name: Optional[str], writable: bool, *,
               memory_factor: int, memory_base: int):
    self._buf = data
    self._view = memoryview(data).cast("B") if not isinstance(
        data, memoryview) else data.cast("B")
    self._end = len(self._view)
    self._name = name
    self._writable = writable
    self._pos = 0
    self._size = self._end
    self._factor, self._base = memory_factor, memory_base
    self._limit = memory_factor * self._size + memory_base
    # The input's own bytes count; and 1/16 of the bound is kept for what is
    # not charged (interpreter frames, allocator slack, temporary objects).
    self._left = self._limit - self._limit // 16 - self._size

  # -- errors, primitives and the memory budget --------------------------------

  def error(self, message: str, offset: Optional[int] = None) -> FlaxFormatError:
    return FlaxFormatError(message, self._name,
                           self._pos if offset is None else offset)

  def _charge(self, n: int) -> None:
    """Reserves `n` bytes of the memory budget, or refuses the input."""
    self._left -= n
    if self._left < 0:
      raise self.error(
          f"decoding would need more than {self._limit} bytes of memory for "
          f"a {self._size}-byte file (at most MEMORY_FACTOR={self._factor} "
          f"x its size + MEMORY_BASE={self._base} bytes are allowed)")

  def _take(self, n: int) -> int:
    """Reserves `n` bytes at the cursor; returns their start offset."""
    start = self._pos
    if n < 0 or n > self._end - start:
      raise self.error(f"truncated: {n} bytes declared, "
                       f"{self._end - start} left in the file")
    self._pos = start + n
    return start

  def _unpack(self, fmt: struct.Struct) -> Any:
    start = self._take(fmt.size)
    return fmt.unpack_from(self._view, start)[0]

  def _expect_end(self) -> None:
    if self._pos != self._end:
      raise self.error(f"{self._end - self._pos} bytes of extra data after "
                       "the checkpoint")

  # -- the grammar -------------------------------------------------------------

  def _header(self) -> tuple[str, Any, int]:
    """Reads a type byte and its length/size field.

    Returns:
      (kind, n, offset): kind is one of "int", "nil", "false", "true",
      "float", "str", "bin", "array", "map", "ext"; n is the length (or the
      value for ints and floats).
    """
    offset = self._pos
    if offset >= self._end:
      self._take(1)  # raises: truncated
    tag = self._view[offset]
    self._pos = offset + 1
    if tag <= 0x7F:
      return "int", tag, offset
    if tag >= 0xE0:
      return "int", tag - 0x100, offset
    if 0x80 <= tag <= 0x8F:
      return "map", tag & 0x0F, offset
    if 0x90 <= tag <= 0x9F:
      return "array", tag & 0x0F, offset
    if 0xA0 <= tag <= 0xBF:
      return "str", tag & 0x1F, offset
    if tag in _FIXED_INTS:
      return "int", self._unpack(_FIXED_INTS[tag]), offset
    if tag in _SIMPLE:
      return _SIMPLE[tag], 0, offset
    if tag == 0xCA:
      return "float", self._unpack(_F32), offset
    if tag == 0xCB:
      return "float", self._unpack(_F64), offset
    if tag in _SIZED:
      kind, fmt = _SIZED[tag]
      return kind, self._unpack(fmt), offset
    if 0xD4 <= tag <= 0xD8:
      return "ext", 1 << (tag - 0xD4), offset
    raise self.error(f"invalid msgpack type byte 0x{tag:02x}", offset)

  def _value(self, depth: int) -> Any:
    self._check_depth(depth)
    kind, n, offset = self._header()
    if kind == "int":
      if not -5 <= n <= 256:
        self._charge(_int_cost(n))
      return n
    if kind == "float":
      self._charge(_COST_FLOAT)
      return n
    if kind == "nil":
      return None
    if kind in ("true", "false"):
      return kind == "true"
    if kind == "str":
      return self._str(n, offset)
    if kind == "bin":
      start = self._take(n)
      self._charge(_alloc(_SIZEOF_BYTES + n))
      return bytes(self._view[start:start + n])
    if kind == "array":
      self._check_count(n, 1)
      self._charge(_alloc(_SIZEOF_LIST + 8 * n))
      items = [None] * n
      for i in range(n):
        items[i] = self._value(depth + 1)
      return items
    if kind == "map":
      self._check_count(n, 2)
      self._charge(_COST_DICT)
      out: dict = {}
      for _ in range(n):
        key = self._key(depth)
        self._put(out, key, self._value(depth + 1))
      return out
    return self._ext(n, offset)

  def _put(self, out: dict, key: Any, value: Any) -> None:
    """`out[key] = value`, its table slot charged first."""
    size = len(out)
    cost = _COST_DICT_ITEM if size else _COST_DICT_TABLE
    self._charge(cost)
    out[key] = value
    if len(out) == size:  # a repeated key: the dict did not grow
      self._left += cost

  def _check_depth(self, depth: int) -> None:
    if depth > MAX_DEPTH:
      raise self.error(f"nesting deeper than {MAX_DEPTH} levels")

  def _check_count(self, n: int, min_bytes: int) -> None:
    # Every element takes at least `min_bytes`: refuse counts the file cannot
    # hold before building anything.
    if n * min_bytes > self._end - self._pos:
      raise self.error(f"truncated: {n} elements declared, "
                       f"{self._end - self._pos} bytes left in the file")

  def _key(self, depth: int) -> Any:
    """A map key: a str, bytes, int, bool or None.

    Containers and arrays are refused (containers before they are built), and
    so are floats and complex numbers: their hashes are easy to make collide,
    which would make building a dict of them quadratic (Flax writes only
    string keys).
    """
    offset = self._pos
    if offset < self._end:
      tag = self._view[offset]
      if 0x80 <= tag <= 0x8F or tag in (0xDE, 0xDF):
        raise self.error("map key of type dict", offset)
      if 0x90 <= tag <= 0x9F or tag in (0xDC, 0xDD):
        raise self.error("map key of type list", offset)
    key = self._value(depth + 1)
    if isinstance(key, (list, dict, float, complex, np.ndarray, np.generic)):
      raise self.error(f"map key of type {type(key).__name__}", offset)
    return key

  def _str(self, n: int, offset: int) -> str:
    start = self._take(n)
    estimate = _alloc(80 + 4 * n)  # up to 4 bytes per code point
    self._charge(estimate)
    try:
      text = str(self._view[start:start + n], "utf-8")
    except UnicodeDecodeError as e:
      raise self.error(f"invalid UTF-8 in string: {e.reason}", offset) from None
    self._left += estimate - _str_cost(text)
    return text

  def _ext(self, n: int, offset: int) -> Any:
    code = self._unpack(_I8)
    start = self._take(n)
    if code in (_EXT_NDARRAY, _EXT_NPSCALAR):
      arr = self._ndarray(start, start + n, offset)
      return self._array_value(code, arr, offset)
    if code == _EXT_COMPLEX:
      return self._complex(start, start + n, offset)
    raise self.error(f"unknown msgpack ext type {code}", offset)

  def _array_value(self, code: int, arr: np.ndarray, offset: int) -> Any:
    """What an ndarray (code 1) or numpy scalar (code 3) ext decodes to."""
    if code == _EXT_NDARRAY:
      return arr
    self._charge(_alloc(_COST_ARRAY + _COST_ARRAY_DIM * arr.ndim)
                 if arr.ndim else _alloc(_COST_NPSCALAR + arr.nbytes))
    try:
      return arr[()]
    except (SystemError, ValueError):
      # numpy cannot make a str scalar of invalid code points.
      raise self.error(f"numpy scalar of dtype {arr.dtype} holds invalid "
                       "data (code points)", offset) from None

  def _within(self, start: int, end: int) -> int:
    """Confines parsing to [start, end); returns the end to restore."""
    saved, self._pos, self._end = self._end, start, end
    return saved

  def _complex(self, start: int, end: int, offset: int) -> complex:
    """Parses a complex ext payload: a msgpack pair of numbers, nothing else."""
    saved = self._within(start, end)
    try:
      kind, n, _ = self._header()
      parts = []
      if kind == "array" and n == 2:
        for _ in range(2):
          kind, value, _ = self._header()
          if kind not in ("int", "float"):
            break
          parts.append(value)
      if len(parts) != 2 or self._pos != end:
        raise self.error("complex ext does not hold (real, imag)", offset)
    finally:
      self._pos, self._end = end, saved
    self._charge(_COST_COMPLEX)
    return complex(parts[0], parts[1])

  def _ndarray_parts(self, start: int, end: int,
                     offset: int) -> tuple[tuple, np.dtype, int, int]:
    """Parses an ndarray ext payload: (shape, dtype, data offset, data size)."""
    saved = self._within(start, end)
    try:
      return self._ndarray_payload(end, offset)
    finally:
      self._pos, self._end = end, saved

  def _ndarray_payload(self, end: int,
                       offset: int) -> tuple[tuple, np.dtype, int, int]:
    kind, n, _ = self._header()
    if kind != "array" or n != 3:
      raise self.error("ndarray ext is not a (shape, dtype, data) triple",
                       offset)
    kind, ndim, shape_at = self._header()
    if kind != "array" or ndim > MAX_NDIM:
      raise self.error("ndarray shape is not a list of at most "
                       f"{MAX_NDIM} sizes", shape_at)
    shape = []
    for _ in range(ndim):
      kind, dim, dim_at = self._header()
      if kind != "int" or not 0 <= dim <= sys.maxsize:
        raise self.error("ndarray shape holds a non-size value", dim_at)
      shape.append(dim)
    kind, n, name_at = self._header()
    if kind not in ("str", "bin"):
      raise self.error("ndarray dtype name is not a string", name_at)
    name_start = self._take(n)
    # Names longer than 32 bytes are refused; 41 bytes make the message.
    dtype = self._dtype(bytes(self._view[name_start:name_start + min(n, 41)]),
                        name_at)
    kind, n, data_at = self._header()
    if kind not in ("bin", "str"):
      raise self.error("ndarray data is not a byte string", data_at)
    data_start = self._take(n)
    if self._pos != end:
      raise self.error("ndarray ext has trailing bytes", offset)
    count = nonzero = 1
    for dim in shape:
      count *= dim
      nonzero *= max(dim, 1)
    if nonzero * dtype.itemsize > sys.maxsize:
      raise self.error(f"ndarray shape {tuple(shape)} is too large for "
                       "numpy", shape_at)
    if count * dtype.itemsize != n:
      raise self.error(f"ndarray of shape {tuple(shape)} and dtype "
                       f"{dtype.name} needs {count * dtype.itemsize} bytes, "
                       f"the file holds {n}", data_at)
    return tuple(shape), dtype, data_start, count

  def _ndarray(self, start: int, end: int, offset: int) -> np.ndarray:
    return self._ndarray_from(*self._ndarray_parts(start, end, offset))

  def _ndarray_from(self, shape: tuple, dtype: np.dtype, data_start: int,
                    count: int) -> np.ndarray:
    view = _alloc(_COST_ARRAY + _COST_ARRAY_DIM * len(shape))
    self._charge(view)
    arr = np.ndarray(shape, dtype, buffer=self._buf, offset=data_start)
    if not self._writable:
      return arr
    self._charge(view + _alloc(count * dtype.itemsize))
    return arr.copy()

  def _dtype(self, raw: bytes, offset: int) -> np.dtype:
    cached = raw in _DTYPE_CACHE
    dtype = _dtype_from_name(raw)
    if dtype is None:
      raise self.error(f"unknown dtype name {raw[:40]!r}", offset)
    if (dtype.hasobject or dtype.itemsize == 0 or dtype.fields is not None or
        dtype.subdtype is not None):
      raise self.error(f"unsupported dtype {dtype}", offset)
    if not cached:
      self._charge(_COST_DTYPE)
    return dtype

  # -- partial reads -------------------------------------------------------------

  def _skip(self, depth: int) -> None:
    """Moves past one value without building it (array data is not read)."""
    self._check_depth(depth)
    kind, n, _ = self._header()
    if kind in ("str", "bin"):
      self._take(n)
    elif kind == "ext":
      self._take(1 + n)
    elif kind in ("array", "map"):
      per = 2 if kind == "map" else 1
      self._check_count(n, per)
      for _ in range(n * per):
        self._skip(depth + 1)

  def _descend(self, keys: tuple) -> Any:
    found = None
    for depth, key in enumerate(keys):
      kind, n, offset = self._header()
      where = "/" + "/".join(keys[:depth])
      if kind != "map":
        raise self.error(f"no subtree {'/'.join(keys)!r}: {where} is not a "
                         "map", offset)
      self._check_count(n, 2)
      seen = []  # the first keys, for the message when `key` is not there
      for _ in range(n):
        mark = self._left
        found_key = self._key(depth)
        match = found_key == key
        self._left = mark  # the key is dropped
        if match:
          break
        if len(seen) < _KEYS_SHOWN and isinstance(found_key, str) and len(
            found_key) <= 200:
          seen.append(found_key)
        self._skip(depth + 1)
      else:
        shown = ", ".join(repr(k) for k in seen) or "none"
        if n > len(seen):
          shown += f" ({n} keys in all)"
        raise errors.SubtreeNotFoundError(
            f"no subtree {'/'.join(keys)!r}: {where} has no key {key!r}; "
            f"its keys: {shown}", self._name, offset)
      if depth == len(keys) - 1:
        found = self._value(depth + 1)
    return found
