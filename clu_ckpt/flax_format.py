"""The Flax msgpack checkpoint format (`*.flax`): one module owns it.

`flax.serialization.to_bytes` writes a state as msgpack: the state dict's maps
and scalars as plain msgpack, numpy and jax arrays as ext type 1 holding a
msgpack triple `(shape, dtype name, C-order bytes)`, numpy scalars as ext type
3 (a 0-d array), complex numbers as ext type 2 (`(real, imag)`), and arrays over
1 GiB split into a `{"__msgpack_chunked_array__": True, "shape": ..., "chunks":
...}` map. This module writes exactly those bytes, but streams them: array data
goes from the array's own buffer to the file, so saving costs no copy of the
state. It reads by memory-mapping the file and handing out read-only numpy views
of the array bytes, so loading costs no copy either, and it can decode a single
subtree or only the headers.

Synopsis::

  from clu_ckpt import flax_format

  flax_format.save_file(state, "/tmp/ckpt-1.flax")   # == to_bytes(state)
  state_dict = flax_format.load_file("/tmp/ckpt-1.flax")
  params = flax_format.load_file("/tmp/ckpt-1.flax", subtree="params")
  for leaf in flax_format.inspect_file("/tmp/ckpt-1.flax"):
    print(leaf.path, leaf.dtype, leaf.shape, leaf.nbytes)

  data = flax_format.save(state)                      # bytes, for small states
  state_dict = flax_format.load(data)

  with flax_format.FlaxFile("/tmp/ckpt-1.flax") as f:  # parsed once, on use
    f.tree, f.leaves, f.subtree("params"), f.nbytes

  flax_format.dtype_name(np.dtype(">f4"))             # ">f4": the one codec
  flax_format.dtype_from_name("bfloat16")             # (see flax_dtypes)

Reading needs only numpy, msgpack and ml_dtypes; writing a plain tree of dicts,
lists and arrays needs nothing more either. Flax is imported only to turn other
objects (dataclasses, named tuples, registered types) into state dicts, with
`flax.serialization.to_state_dict`, exactly as `to_bytes` does.

Every problem with the bytes of a file raises `FlaxFormatError`, a `ValueError`
naming the file and the byte offset. The reader never recurses deeper than
`MAX_DEPTH`, parses each byte a bounded number of times (time is linear in the
file's size), and whatever the bytes are, decoding or inspecting an M-byte
file allocates at most `MEMORY_FACTOR * M + MEMORY_BASE` bytes (64 x M + 16
MiB), the file's own bytes included: every Python object it creates (dicts,
lists, strings, numpy views, `LeafInfo`s and their paths) is charged to that
budget at no less than its CPython size, and a file whose objects would need
more is refused with `FlaxFormatError` before they are built. Real states are
far below the bound: array data stays in the file, and even a dict of a
million small python scalars costs about 20 x its msgpack bytes. Hostile ones
(millions of empty maps or nils, one long key repeated in a million paths)
would cost 70 x their size to unboundedly more. Map keys are strings (as Flax
writes them), bytes, ints, bools or None; float and complex keys are refused
(their hashes can be made to collide, which would make building a dict
quadratic).
"""

from __future__ import annotations

import dataclasses
import os
import struct
import sys
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import msgpack
import numpy as np

from clu_ckpt import errors
from clu_ckpt import storage
# The one dtype codec (re-exported: `flax_format.dtype_name`, ...).
from clu_ckpt.flax_dtypes import _DTYPE_CACHE  # pylint: disable=unused-import
from clu_ckpt.flax_dtypes import _dtype_from_name  # pylint: disable=unused-import
from clu_ckpt.flax_dtypes import dtype_from_name  # pylint: disable=unused-import
from clu_ckpt.flax_dtypes import dtype_name  # pylint: disable=unused-import

# Arrays larger than this many bytes are split into chunks (Flax's MAX_CHUNK_SIZE).
CHUNK_BYTES = 2**30
# Maps and arrays nested deeper than this are refused as hostile input.
MAX_DEPTH = 256
# numpy's own limit on the number of dimensions.
MAX_NDIM = 64
# Reading an M-byte input (load, load_file, inspect, inspect_file) allocates at
# most MEMORY_FACTOR * M + MEMORY_BASE bytes, the input included; inputs that
# would need more are refused (once the reader's estimates, which are never
# below CPython's real sizes, reach 15/16 of the bound). Legitimate states are
# charged far less: tiny nested dicts of small scalars, None and empty dicts
# (the worst we know) about 35 x M (their real use: ~20 x M), dicts of short
# keys to python scalars or lists of floats 14-24 x M (real: 10-20 x), tiny
# arrays 10-25 x M, real models' arrays about 1 x. Hostile shapes (a 64-byte
# dict per byte of file, a LeafInfo and its path per 2 bytes, a long key in
# every path) would take 70 x M to unboundedly more.
MEMORY_FACTOR = 64
# On top: recursion frames down to MAX_DEPTH, small files' fixed costs.
MEMORY_BASE = 16 * 2**20

_EXT_NDARRAY = 1
_EXT_COMPLEX = 2
_EXT_NPSCALAR = 3
_CHUNKED_KEY = "__msgpack_chunked_array__"
# Pieces of array data at most this large are written in one system call.
_WRITE_BLOCK = 64 * 2**20
# Small msgpack pieces are gathered up to this size before they are written.
_SMALL_BUFFER = 2**20

Subtree = Union[None, str, Sequence[str]]


FlaxFormatError = errors.FlaxFormatError


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


# --------------------------------------------------------------------------
# Writing.
# --------------------------------------------------------------------------

_PLAIN_LEAVES = (type(None), bool, int, float, str, bytes, complex)


def save(state: Any) -> bytes:
  """Serializes `state` to bytes, exactly as `flax.serialization.to_bytes`.

  Use `save_file` for anything large: it never holds the encoding in memory.

  Example::

    data = save({"params": {"w": np.ones((2, 2), np.float32)}, "step": 3})
    assert load(data)["step"] == 3

  Args:
    state: A Flax state: dicts, lists, tuples, flax dataclasses or any type
      registered with `flax.serialization`, with array and scalar leaves.

  Returns:
    The msgpack encoding.

  Raises:
    TypeError: A leaf is of a type msgpack cannot encode (names its path).
    ValueError: An object or structured dtype array, or dict keys whose
      string forms collide.
    OverflowError: An int outside [-2**63, 2**64 - 1].
  """
  out = bytearray()
  _encode(state, out.extend)
  return bytes(out)


def save_file(state: Any, path: str) -> int:
  """Writes `state` to `path` in Flax's format, streaming, crash-safe.

  The bytes are those of `flax.serialization.to_bytes(state)`. Array data is
  read straight from each array's buffer (jax arrays on the CPU are not
  copied; others cost one device-to-host transfer) and streamed to the file
  through one reused 16 MiB staging buffer (see `storage.atomic_writer`), so
  memory stays flat whatever the state's size. Local files are written under a temporary name in the same
  directory, flushed to disk with fsync and renamed, so `path` either holds the
  previous content or the complete new one; remote paths (`gs://...`) go
  through `tf.io.gfile`, whose objects appear only when complete.

  Example::

    n = save_file(state, "/ckpts/ckpt-7.flax")

  Args:
    state: See `save`.
    path: Destination file.

  Returns:
    The number of bytes written.

  Raises:
    TypeError, ValueError, OverflowError: See `save`; nothing is left at `path`.
    OSError: The file could not be written (e.g. the disk is full); `path` is
      left as it was.
  """
  with storage.atomic_writer(path) as write:
    return _encode(state, write)


def _encode(state: Any, write: Callable[[Any], Any]) -> int:
  """Encodes `state` through `write` (called with bytes or memoryviews)."""
  sink = _Sink(write)
  _Encoder(sink).value(_to_state_dict(state), "")
  sink.flush()
  return sink.total


class _Sink:
  """Gathers small msgpack pieces; hands large array buffers through as is."""

  def __init__(self, write: Callable[[Any], Any]):
    self._write = write
    self._buffer = bytearray()
    self.total = 0

  def small(self, data: bytes) -> None:
    self._buffer += data
    if len(self._buffer) >= _SMALL_BUFFER:
      self.flush()

  def large(self, view: memoryview) -> None:
    self.flush()
    for start in range(0, len(view), _WRITE_BLOCK):
      block = view[start:start + _WRITE_BLOCK]
      self._write(block)
      self.total += len(block)

  def flush(self) -> None:
    if self._buffer:
      self._write(self._buffer)
      self.total += len(self._buffer)
      self._buffer = bytearray()


class _Encoder:
  """Walks a state dict and emits the msgpack bytes `to_bytes` would."""

  def __init__(self, sink: _Sink):
    self._sink = sink
    self._packer = msgpack.Packer(use_bin_type=True, strict_types=True,
                                  autoreset=True)

  def value(self, obj: Any, path: str) -> None:
    kind = type(obj)
    if kind is dict:
      self._sink.small(self._packer.pack_map_header(len(obj)))
      for key, item in obj.items():
        self._plain(key, path)
        self.value(item, f"{path}/{key}")
    elif isinstance(obj, np.ndarray) or _is_jax_array(obj):
      self._array(obj, path)
    elif isinstance(obj, np.generic):
      self._ndarray_ext(_EXT_NPSCALAR, np.asarray(obj), path)
    elif kind is complex:
      payload = msgpack.packb((obj.real, obj.imag))
      self._sink.small(_ext_header(_EXT_COMPLEX, len(payload)) + payload)
    else:
      self._plain(obj, path)

  def _plain(self, obj: Any, path: str) -> None:
    try:
      self._sink.small(self._packer.pack(obj))
    except TypeError as e:
      raise errors.UnsupportedLeafError(
          f"{e} at {path or '/'}: register its type with flax.serialization "
          "or convert it to a supported leaf") from None

  def _array(self, arr: Any, path: str) -> None:
    arr = np.asarray(arr)  # zero-copy for numpy and CPU jax arrays
    if arr.size * arr.dtype.itemsize <= CHUNK_BYTES:
      self._ndarray_ext(_EXT_NDARRAY, arr, path)
      return
    # Flax's chunked form for arrays over 1 GiB.
    chunk = max(1, int(CHUNK_BYTES / arr.dtype.itemsize))
    flat = _flat_c_order(arr)
    pack = self._packer.pack
    self._sink.small(self._packer.pack_map_header(3) + pack(_CHUNKED_KEY) +
                     pack(True) + pack("shape") +
                     pack({str(i): d for i, d in enumerate(arr.shape)}) +
                     pack("chunks"))
    starts = range(0, flat.size, chunk)
    self._sink.small(self._packer.pack_map_header(len(starts)))
    for i, start in enumerate(starts):
      self._sink.small(pack(str(i)))
      self._ndarray_ext(_EXT_NDARRAY, flat[start:start + chunk], path)

  def _ndarray_ext(self, code: int, arr: np.ndarray, path: str) -> None:
    if arr.dtype.hasobject or arr.dtype.isalignedstruct:
      raise errors.InvalidCheckpointError(
          "Object and structured dtypes not supported for serialization of "
          f"ndarrays (at {path or '/'}).")
    nbytes = arr.size * arr.dtype.itemsize
    head = (b"\x93" + msgpack.packb(list(arr.shape)) +
            msgpack.packb(arr.dtype.name) + _bin_header(nbytes))
    self._sink.small(_ext_header(code, len(head) + nbytes) + head)
    for block in _c_order_blocks(arr):
      self._sink.large(block)


def _to_state_dict(obj: Any) -> Any:
  """`flax.serialization.to_state_dict`, without importing Flax for plain trees.

  Dicts, lists and tuples are converted here the way Flax converts them (string
  keys, lists as {"0": ..., "1": ...}); any other non-leaf object goes through
  Flax's registry, which is what `to_bytes` does.
  """
  kind = type(obj)
  if kind is dict:
    keys = [str(k) for k in obj]
    if len(set(keys)) != len(obj):
      raise errors.InvalidCheckpointError(
          "Dict keys do not have a unique string representation: "
          f"{sorted(set(keys))} vs given keys {list(obj)}")
    return {k: _to_state_dict(v) for k, v in zip(keys, obj.values())}
  if (kind is list or kind is tuple) and not hasattr(obj, "_fields"):
    return {str(i): _to_state_dict(v) for i, v in enumerate(obj)}
  if (kind in _PLAIN_LEAVES or isinstance(obj, (np.ndarray, np.generic)) or
      _is_jax_array(obj)):
    return obj
  serialization = _flax_serialization()
  if serialization is None:
    return obj  # the encoder reports it as an unsupported leaf
  converted = serialization.to_state_dict(obj)
  return obj if converted is obj else _to_state_dict(converted)


def _flax_serialization():
  try:
    from flax import serialization  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return serialization


def _is_jax_array(obj: Any) -> bool:
  jax = sys.modules.get("jax")
  return jax is not None and isinstance(obj, jax.Array)


def _flat_c_order(arr: np.ndarray) -> np.ndarray:
  """A 1-D C-order view of `arr` (a copy only if `arr` is not C-contiguous)."""
  return arr.reshape(-1) if arr.flags.c_contiguous else np.ravel(arr, "C")


def _c_order_blocks(arr: np.ndarray) -> Iterator[memoryview]:
  """Yields the C-order bytes of `arr` as memoryviews, copying at most a block.

  C-contiguous arrays yield one view of their own buffer. Others (Fortran
  order, strided views) are copied a slab of rows at a time, so memory stays
  bounded by `_WRITE_BLOCK`.
  """
  if arr.size == 0:
    return
  if arr.flags.c_contiguous:
    yield _byte_view(arr)
    return
  rows = arr.reshape((1,) + arr.shape) if arr.ndim == 0 else arr
  row_bytes = max(1, rows[0].size * rows.dtype.itemsize)
  step = max(1, _WRITE_BLOCK // row_bytes)
  for start in range(0, rows.shape[0], step):
    yield _byte_view(np.ascontiguousarray(rows[start:start + step]))


def _byte_view(arr: np.ndarray) -> memoryview:
  return memoryview(arr.reshape(-1).view(np.uint8))


def _bin_header(n: int) -> bytes:
  if n < 2**8:
    return struct.pack(">BB", 0xC4, n)
  if n < 2**16:
    return struct.pack(">BH", 0xC5, n)
  return struct.pack(">BI", 0xC6, n)


_FIXEXT = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}


def _ext_header(code: int, n: int) -> bytes:
  if n in _FIXEXT:
    return struct.pack(">BB", _FIXEXT[n], code)
  if n < 2**8:
    return struct.pack(">BBB", 0xC7, n, code)
  if n < 2**16:
    return struct.pack(">BHB", 0xC8, n, code)
  if n < 2**32:
    return struct.pack(">BIB", 0xC9, n, code)
  raise errors.InvalidCheckpointError(
      f"ext payload of {n} bytes exceeds msgpack's 4 GiB limit")


# --------------------------------------------------------------------------
# Reading.
# --------------------------------------------------------------------------


def load(data: Any, *, writable: bool = False, subtree: Subtree = None,
         name: Optional[str] = None) -> Any:
  """Decodes Flax msgpack bytes, like `flax.serialization.msgpack_restore`.

  Decoding M bytes allocates at most `MEMORY_FACTOR * M + MEMORY_BASE` bytes
  (`data` included) and takes time linear in M, whatever the bytes are: a
  state whose Python objects would need more (no real Flax state does, see
  `MEMORY_FACTOR`) is refused before it is built.

  Example::

    state_dict = load(open("ckpt-1.flax", "rb").read())

  Args:
    data: bytes, bytearray, memoryview, mmap or any buffer.
    writable: Return arrays that own writable memory (copies) instead of
      read-only views of `data`.
    subtree: Return only this subtree: a "/"-separated path ("params/Dense_0")
      or a sequence of keys. Other values are skipped without being decoded.
    name: How to name `data` in error messages (e.g. its file).

  Returns:
    The state dict: dicts, lists, python scalars, numpy arrays and scalars.

  Raises:
    FlaxFormatError: The bytes are not a valid encoding, `subtree` is not in
      them, or decoding them would need more memory than the bound above.
  """
  reader = _Reader(data, name, writable)
  return reader.root(_subtree_keys(subtree))


def load_file(path: str, *, writable: bool = False,
              subtree: Subtree = None) -> Any:
  """Reads a `.flax` file, memory-mapped: arrays are views of the file.

  Array leaves are read-only numpy views of the mapping (their data is read
  from disk only when touched), except with `writable=True`, and except arrays
  in Flax's chunked form, which are reassembled into new memory. Views may be
  unaligned; numpy handles that, and `jax.device_put` copies them anyway. The
  file is unmapped when the last view is gone. Remote paths are read whole
  through `tf.io.gfile`. Memory and time are bounded as for `load`: at most
  `MEMORY_FACTOR` x the file's size + `MEMORY_BASE` bytes, the mapped pages
  included.

  Example::

    params = load_file("/ckpts/ckpt-7.flax", subtree="params")

  Args:
    path: The `.flax` file.
    writable: See `load`.
    subtree: See `load`.

  Returns:
    See `load`.

  Raises:
    FileNotFoundError: `path` does not exist.
    FlaxFormatError: The file is truncated, corrupt, not a Flax checkpoint, or
      would need more memory than the bound above.
  """
  return load(_open(path), writable=writable, subtree=subtree, name=path)


def inspect_file(path: str) -> list[LeafInfo]:
  """Lists the leaves of a `.flax` file from its headers alone.

  No array data is read: only the msgpack headers are parsed, so this is fast
  on files of any size. The list costs memory like a decoded state (a
  `LeafInfo` and its path per leaf); as for `load`, at most `MEMORY_FACTOR` x
  the file's size + `MEMORY_BASE` bytes, in time linear in the file's size.

  Example::

    total = sum(leaf.nbytes for leaf in inspect_file("ckpt-7.flax"))

  Args:
    path: The `.flax` file.

  Returns:
    One `LeafInfo` per leaf, in file order.

  Raises:
    FileNotFoundError: `path` does not exist.
    FlaxFormatError: The file is truncated, corrupt, not a Flax checkpoint
      (chunked arrays included: their shape must match their chunks, as
      `load` requires), or would need more memory than the bound above.
  """
  reader = _Reader(_open(path), path, writable=False)
  return reader.leaves()


def inspect(data: Any, name: Optional[str] = None) -> list[LeafInfo]:
  """`inspect_file` for bytes already in memory.

  Example::

    leaves = inspect(save({"w": np.ones(3)}))  # [LeafInfo("/w", ...)]

  Args:
    data: bytes, bytearray, memoryview, mmap or any buffer.
    name: How to name `data` in error messages.

  Returns:
    One `LeafInfo` per leaf, in file order.

  Raises:
    FlaxFormatError: As `inspect_file`; memory is bounded by `MEMORY_FACTOR`
      x `len(data)` + `MEMORY_BASE` bytes (`data` included).
  """
  return _Reader(data, name, writable=False).leaves()


class FlaxFile:
  """An open `.flax` file: parsed once, its tree and leaves handed out.

  The file is memory-mapped when opened; the first use of `tree`, `leaves`,
  `subtree` or `nbytes` parses it once, in one pass that builds both the
  state dict (as `load_file` returns it: arrays are read-only views of the
  mapping, chunked arrays joined) and its `LeafInfo`s (as `inspect_file`
  lists them). Memory and time are bounded as for `load`. Closing drops the
  handle's references; the mapping is unmapped once no view is left.

  Example::

    with flax_format.FlaxFile("/ckpts/ckpt-7.flax") as f:
      print(f.nbytes, [leaf.path for leaf in f.leaves])
      step = f.subtree("step")
      state = f.tree

  Raises (on first use):
    FileNotFoundError: The file does not exist (on opening).
    FlaxFormatError: As `load_file` and `inspect_file`.
  """

  def __init__(self, path: str):
    self.path = path
    self._buffer: Any = _open(path)
    self._parsed: Optional[tuple[Any, list[LeafInfo]]] = None

  def __enter__(self) -> "FlaxFile":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def close(self) -> None:
    """Drops the handle's references to the mapping and the parsed tree."""
    self._buffer = None
    self._parsed = None

  def _parse(self) -> tuple[Any, list[LeafInfo]]:
    if self._parsed is None:
      if self._buffer is None:
        raise ValueError(f"{self.path}: FlaxFile is closed")
      reader = _Reader(self._buffer, self.path, writable=False)
      self._parsed = reader.tree_and_leaves()
    return self._parsed

  @property
  def tree(self) -> Any:
    """The state dict, as `load_file(path)` returns it (shared, read-only)."""
    return self._parse()[0]

  @property
  def leaves(self) -> list[LeafInfo]:
    """The leaves, as `inspect_file(path)` lists them."""
    return self._parse()[1]

  @property
  def nbytes(self) -> int:
    """Bytes of array data in the file (the sum of the leaves' nbytes)."""
    return sum(leaf.nbytes for leaf in self.leaves)

  def subtree(self, keys: Subtree) -> Any:
    """A subtree of `tree`, as `load_file(path, subtree=keys)` returns it.

    Raises:
      FlaxFormatError: There is no such subtree.
    """
    node = self.tree
    wanted = _subtree_keys(keys)
    for depth, key in enumerate(wanted):
      where = "/" + "/".join(wanted[:depth])
      if not isinstance(node, dict):
        raise FlaxFormatError(f"no subtree {'/'.join(wanted)!r}: {where} is "
                              "not a map", self.path, 0)
      if key not in node:
        raise FlaxFormatError(f"no subtree {'/'.join(wanted)!r}: {where} has "
                              f"no key {key!r}", self.path, 0)
      node = node[key]
    return node


def open_file(path: str) -> FlaxFile:
  """`FlaxFile(path)`: the file, mapped, to be parsed once on first use."""
  return FlaxFile(path)


def _open(path: str) -> Any:
  buffer = storage.map_file(path)
  if len(buffer) == 0:
    raise FlaxFormatError("empty file", path, 0)
  return buffer


def _subtree_keys(subtree: Subtree) -> tuple:
  if subtree is None:
    return ()
  if isinstance(subtree, str):
    return tuple(k for k in subtree.split("/") if k)
  return tuple(subtree)


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
# What `inspect` calls the leaves of each msgpack kind.
_LEAF_KINDS = {"int": "int", "float": "float", "nil": "none", "true": "bool",
               "false": "bool", "str": "str", "bin": "bytes", "array": "list"}


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
# One (key, summary) pair kept while a chunked array's map is inspected.
_COST_PAIR = 288


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


# What `_Reader._describe` returns about the value it describes.
_WANT_NOTHING = 0
# An int's value, a `_Chunk` for an ndarray (what load turns into an
# np.ndarray), else None: the entries of a chunked array's "shape" or "chunks".
_WANT_SUMMARY = 1
# For a map, its (key, summary) pairs (the value of a "shape" or "chunks"
# key); for anything else, its summary.
_WANT_ENTRIES = 2


class _Reader:
  """A bounded msgpack parser over a buffer, producing Flax's state dicts.

  Every Python object it creates is charged, at its estimated size, to a
  budget of `MEMORY_FACTOR` x the input's size + `MEMORY_BASE` (minus the
  input itself); objects it builds only to check them and drops (keys it
  compares, leaves `inspect` validates) are refunded once dropped. Each byte
  is parsed a bounded number of times, so time is linear in the input's size.
  """

  def __init__(self, data: Any, name: Optional[str], writable: bool):
    self._buf = data
    self._view = memoryview(data).cast("B") if not isinstance(
        data, memoryview) else data.cast("B")
    self._end = len(self._view)
    self._name = name
    self._writable = writable
    self._pos = 0
    self._size = self._end
    self._limit = MEMORY_FACTOR * self._size + MEMORY_BASE
    # The input's own bytes count; and 1/16 of the bound is kept for what is
    # not charged (interpreter frames, allocator slack, temporary objects).
    self._left = self._limit - self._limit // 16 - self._size
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
    out: list[LeafInfo] = []
    value = self._walk("", 0, out)
    self._expect_end()
    if self._deferred is not None:
      raise self._deferred
    return _unchunk(value, self), out

  def _walk(self, path: str, depth: int, out: list) -> Any:
    """`_value`, also appending the value's LeafInfos to `out`."""
    if depth > MAX_DEPTH:
      raise self.error(f"nesting deeper than {MAX_DEPTH} levels")
    at = self._pos
    kind, n, offset = self._header()
    if kind == "map":
      return self._walk_map(path, n, depth, offset, out)
    if kind == "ext":
      code = self._unpack(_I8)
      start = self._take(n)
      if code in (_EXT_NDARRAY, _EXT_NPSCALAR):
        shape, dtype, data_at, count = self._ndarray_parts(start, start + n,
                                                           offset)
        arr = self._ndarray_from(shape, dtype, data_at, count)
        self._leaf(out, path, "ndarray" if code == _EXT_NDARRAY else
                   "npscalar", self._dtype_name(dtype), shape,
                   count * dtype.itemsize, data_at)
        return self._array_value(code, arr, offset)
      self._pos = at
      value = self._value(depth)
      self._leaf(out, path, "complex", None, None, 0, at)
      return value
    self._pos = at
    value = self._value(depth)
    self._leaf(out, path, _LEAF_KINDS[kind], None, None, 0, at)
    return value

  def _walk_map(self, path: str, n: int, depth: int, offset: int,
                out: list) -> dict:
    """A map's dict (as `_value`) and its leaves (as `_describe_map`)."""
    self._check_count(n, 2)
    self._charge(_COST_DICT)
    deferred, self._deferred = self._deferred, None
    first = len(out)
    result: dict = {}
    for _ in range(n):
      key = self._key(depth)
      child = self._child_path(path, key)
      value = self._walk(child, depth + 1, out)
      del child
      size = len(result)
      cost = _COST_DICT_ITEM if size else _COST_DICT_TABLE
      self._charge(cost)
      result[key] = value
      if len(result) == size:  # a repeated key: the dict did not grow
        self._left += cost
    if _CHUNKED_KEY in result:
      # One leaf, as `inspect` has it; `_unchunk` joins the chunks later.
      del out[first:]
      layout = _chunk_layout(result.get("shape"), result.get("chunks"),
                             _array_info)
      if isinstance(layout, str):
        self._deferred = self.error(layout, offset)
      else:
        self._deferred = None
        dims, parts = layout
        self._leaf(out, path, "ndarray", self._dtype_name(parts[0].dtype),
                   dims, sum(p.nbytes for p in parts), self._data_offset(
                       parts[0]))
    if deferred is not None:
      self._deferred = deferred
    return result

  def _data_offset(self, arr: np.ndarray) -> int:
    """The offset in the input of a view's first byte."""
    base = np.frombuffer(self._view, np.uint8)
    return (arr.__array_interface__["data"][0] -
            base.__array_interface__["data"][0])

  def leaves(self) -> list[LeafInfo]:
    out: list[LeafInfo] = []
    self._describe("", 0, out, _WANT_NOTHING)
    self._expect_end()
    if self._deferred is not None:
      raise self._deferred
    return out

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
          f"a {self._size}-byte file (at most MEMORY_FACTOR={MEMORY_FACTOR} "
          f"x its size + MEMORY_BASE={MEMORY_BASE} bytes are allowed)")

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
    if depth > MAX_DEPTH:
      raise self.error(f"nesting deeper than {MAX_DEPTH} levels")
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
      out = {}
      for _ in range(n):
        key = self._key(depth)
        value = self._value(depth + 1)
        size = len(out)
        cost = _COST_DICT_ITEM if size else _COST_DICT_TABLE
        self._charge(cost)
        out[key] = value
        if len(out) == size:  # a repeated key: the dict did not grow
          self._left += cost
      return out
    return self._ext(n, offset)

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
    if depth > MAX_DEPTH:
      raise self.error(f"nesting deeper than {MAX_DEPTH} levels")
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
      for _ in range(n):
        mark = self._left
        match = self._key(depth) == key
        self._left = mark  # the key is dropped
        if match:
          break
        self._skip(depth + 1)
      else:
        raise self.error(f"no subtree {'/'.join(keys)!r}: {where} has no key "
                         f"{key!r}", offset)
      if depth == len(keys) - 1:
        found = self._value(depth + 1)
    return found

  def _transient(self, depth: int) -> None:
    """Decodes one value to check it, and drops it."""
    mark = self._left
    self._value(depth)
    self._left = mark

  # -- inspect -------------------------------------------------------------------

  def _describe(self, path: str, depth: int, out: list, want: int) -> Any:
    """Appends the LeafInfos of one value to `out`, in one pass.

    Args:
      path: The value's path.
      depth: Its nesting depth.
      out: Where its leaves go.
      want: `_WANT_NOTHING`, `_WANT_SUMMARY` or `_WANT_ENTRIES`: what to
        return about the value (see their definitions).

    Returns:
      What `want` asks for, or None.
    """
    if depth > MAX_DEPTH:
      raise self.error(f"nesting deeper than {MAX_DEPTH} levels")
    at = self._pos
    kind, n, offset = self._header()
    if kind == "map":
      return self._describe_map(path, n, depth, offset, out, want)
    if kind == "ext":
      code = self._unpack(_I8)
      start = self._take(n)
      if code in (_EXT_NDARRAY, _EXT_NPSCALAR):
        shape, dtype, data_at, count = self._ndarray_parts(start, start + n,
                                                           offset)
        nbytes = count * dtype.itemsize
        self._leaf(out, path, "ndarray" if code == _EXT_NDARRAY else
                   "npscalar", self._dtype_name(dtype), shape, nbytes, data_at)
        # load makes an np.ndarray of it (a numpy scalar if code 3 and 0-d).
        if want and (code == _EXT_NDARRAY or shape):
          self._charge(_COST_PAIR)
          return _Chunk(dtype, len(shape), count, nbytes, data_at)
        return None
      self._pos = at
      self._transient(depth)
      self._leaf(out, path, "complex", None, None, 0, at)
      return None
    if kind == "array":
      self._pos = at
      self._transient(depth)
    elif kind == "str":
      mark = self._left
      self._str(n, offset)  # checks the UTF-8
      self._left = mark
    elif kind == "bin":
      self._take(n)
    self._leaf(out, path, _LEAF_KINDS[kind], None, None, 0, at)
    return n if want and kind == "int" else None

  def _describe_map(self, path: str, n: int, depth: int, offset: int,
                    out: list, want: int) -> Optional[list]:
    """Describes a map's entries; a chunked array's map becomes one leaf.

    Whether a map is a chunked array is known only after its last key; its
    entries are described as they come, and the shape and chunks that make
    it one leaf are gathered on the way (`_WANT_ENTRIES`), so nothing is
    parsed twice.
    """
    self._check_count(n, 2)
    deferred, self._deferred = self._deferred, None
    first = len(out)
    chunked = False
    fields: dict[str, Any] = {}
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
      if entries is None:
        del key
        self._left += key_cost
      if field is not None:
        child_want = _WANT_ENTRIES
      else:
        child_want = _WANT_NOTHING if entries is None else _WANT_SUMMARY
      result = self._describe(child, depth + 1, out, child_want)
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
      self._deferred = self._chunked_leaf(path, fields, offset, out)
    if deferred is not None:
      self._deferred = deferred
    return entries

  def _chunked_leaf(self, path: str, fields: dict, offset: int,
                    out: list) -> Optional[FlaxFormatError]:
    """Appends the leaf of a chunked array's map, or returns why it is not one.

    The checks are `load`'s (`_chunk_layout`), on what the map's "shape" and
    "chunks" entries hold.
    """
    shape = self._as_dict(fields.get("shape"))
    chunks = self._as_dict(fields.get("chunks"))
    layout = _chunk_layout(shape, chunks, _chunk_info)
    if isinstance(layout, str):
      return self.error(layout, offset)
    dims, parts = layout
    self._leaf(out, path, "ndarray", self._dtype_name(parts[0].dtype), dims,
               sum(p.nbytes for p in parts), parts[0].offset)
    return None

  def _as_dict(self, entries: Optional[list]) -> Optional[dict]:
    """The dict `load` builds from these (key, value) pairs (later keys win)."""
    if entries is None:
      return None
    self._charge(_COST_DICT + _COST_DICT_TABLE +
                 _COST_DICT_ITEM * len(entries))
    return dict(entries)

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


def _chunk_info(part: Any) -> Optional[tuple[int, np.dtype, int]]:
  """(ndim, dtype, size) of what `inspect` saw of a chunk, if an array."""
  if isinstance(part, _Chunk):
    return part.ndim, part.dtype, part.count
  return None


def _array_info(part: Any) -> Optional[tuple[int, np.dtype, int]]:
  """(ndim, dtype, size) of a decoded chunk, if an array."""
  if isinstance(part, np.ndarray):
    return part.ndim, part.dtype, part.size
  return None


def _chunk_layout(shape_map: Any, chunks: Any,
                  info: Callable[[Any], Optional[tuple[int, np.dtype, int]]]
                  ) -> Union[str, tuple[tuple, list]]:
  """Checks a chunked array's "shape" and "chunks" as `load` needs them.

  Args:
    shape_map: The "shape" value: {"0": dim, "1": dim, ...}.
    chunks: The "chunks" value: {"0": 1-D array, "1": ...}.
    info: (ndim, dtype, size) of a chunk, or None if it is not an array.

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
  infos = [info(p) for p in parts]
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
  layout = _chunk_layout(value.get("shape"), value.get("chunks"), _array_info)
  if isinstance(layout, str):
    raise reader.error(layout, None)
  shape, parts = layout
  view = _alloc(_COST_ARRAY + _COST_ARRAY_DIM * len(shape))
  reader._charge(2 * view + _alloc(sum(p.nbytes for p in parts)))  # pylint: disable=protected-access
  return np.concatenate(parts).reshape(shape)
