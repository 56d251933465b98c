"""The `.flax` writer: a state streamed to Flax's msgpack bytes, copying nothing.

It owns the encoding half of the format `flax_format` describes: turning a
state into its state dict (as `flax.serialization.to_state_dict` does, without
importing Flax for plain trees), and emitting the msgpack bytes `to_bytes`
would, array data straight from each array's buffer. Small msgpack pieces are
gathered into one buffer; array data goes through as memoryviews of the
array itself (of a copy of at most `_WRITE_BLOCK` bytes when the array is not
C-contiguous). Arrays over `chunk_bytes` bytes (`flax_format.chunk_bytes()`:
Flax's `MAX_CHUNK_SIZE`, 1 GiB unless changed) take Flax's chunked form: the
C-order flattened data cut into pieces of `max(1, int(chunk_bytes /
itemsize))` elements, each an ordinary 1-D ndarray ext. Callers use
`flax_format.save` and `flax_format.save_file`; this module has no file I/O.

The bytes follow the installed Flax (its version read from the package
metadata, without importing it). Flax before 0.9.0 hands what msgpack cannot
pack to numpy (`np.issctype`): a Python `complex` becomes a numpy complex128
scalar (ext type 3) and an int outside [-2**63, 2**64 - 1] an object array,
refused with ValueError. Flax 0.9.0 (its commit 5172c78, "Fix users of NumPy
APIs that are removed in NumPy 2.0") writes `complex` natively (ext type 2) and
leaves msgpack's OverflowError; so does clu_ckpt when Flax is absent.

Synopsis::

  from clu_ckpt import flax_encode

  out = bytearray()
  n = flax_encode.encode({"params": {"w": np.ones((2, 2))}, "step": 3},
                         out.extend, chunk_bytes=2**30)  # n == len(out)
"""

from __future__ import annotations

import functools
from importlib import metadata
import re
import struct
import sys
from typing import Any, Callable, Iterator, Optional

import msgpack
import numpy as np

from clu_ckpt import errors
from clu_ckpt.flax_parse import _CHUNKED_KEY
from clu_ckpt.flax_parse import _EXT_COMPLEX
from clu_ckpt.flax_parse import _EXT_NDARRAY
from clu_ckpt.flax_parse import _EXT_NPSCALAR

# Pieces of array data at most this large are written in one system call.
_WRITE_BLOCK = 64 * 2**20
# Small msgpack pieces are gathered up to this size before they are written.
_SMALL_BUFFER = 2**20

_PLAIN_LEAVES = (type(None), bool, int, float, str, bytes, complex)

# The first Flax release that writes a Python complex natively (ext type 2)
# and leaves out-of-range ints to msgpack's OverflowError.
NATIVE_COMPLEX_FLAX = (0, 9, 0)


@functools.lru_cache(maxsize=None)
def installed_flax_version() -> Optional[tuple[int, ...]]:
  """The installed Flax's version as numbers, None when Flax is absent.

  Read from the package metadata: Flax is not imported. Cached; tests that
  install or fake another version call `installed_flax_version.cache_clear()`.

  Returns:
    E.g. (0, 8, 5); None without Flax.
  """
  try:
    version = metadata.version("flax")
  except metadata.PackageNotFoundError:
    return None
  return tuple(int(n) for n in re.findall(r"\d+", version.split("+")[0])[:3])


def legacy_flax_leaves() -> bool:
  """Whether the installed Flax writes leaves as Flax before 0.9.0 does.

  True for Flax 0.8.x: a Python complex is written as a numpy complex128
  scalar and ints msgpack cannot hold raise ValueError. False for newer Flax
  and without Flax (the native complex, OverflowError).
  """
  version = installed_flax_version()
  return version is not None and version < NATIVE_COMPLEX_FLAX


def encode(state: Any, write: Callable[[Any], Any], *,
           chunk_bytes: int) -> int:
  """Encodes `state` as `to_bytes` would, through `write`; returns the size.

  `write` is called with bytes and with memoryviews of array buffers, which it
  must consume before returning (`flax_format.save_file` hands it the staged
  writer of `storage.atomic_writer`, `flax_format.save` a bytearray's extend).
  Arrays of more than `chunk_bytes` bytes are written in Flax's chunked form.

  Args:
    state: The state (see `flax_format.save`).
    write: Called with each piece of the encoding, in order.
    chunk_bytes: Flax's `MAX_CHUNK_SIZE`: arrays whose `size * itemsize`
      exceeds it are chunked (numpy scalars never are, as in Flax).

  Returns:
    The number of bytes passed to `write`.

  Raises:
    TypeError, ValueError, OverflowError: See `flax_format.save`; an int
      outside [-2**63, 2**64 - 1] raises what the installed Flax raises
      (ValueError before Flax 0.9.0, OverflowError since and without Flax).
  """
  sink = _Sink(write)
  _Encoder(sink, chunk_bytes, legacy_flax_leaves()).value(
      _to_state_dict(state), "")
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

  def __init__(self, sink: _Sink, chunk_bytes: int, legacy: bool):
    self._sink = sink
    self._chunk_bytes = chunk_bytes
    self._legacy = legacy  # Flax < 0.9.0: see `legacy_flax_leaves`
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
    elif kind is complex and self._legacy:
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
    except OverflowError:
      if not self._legacy:
        raise
      # Flax < 0.9.0 turns the int into a numpy object array and refuses it.
      raise errors.InvalidCheckpointError(
          "Object and structured dtypes not supported for serialization of "
          f"ndarrays (the int {obj} at {path or '/'} is outside [-2**63, "
          "2**64 - 1]).") from None

  def _array(self, arr: Any, path: str) -> None:
    arr = np.asarray(arr)  # zero-copy for numpy and CPU jax arrays
    if arr.size * arr.dtype.itemsize <= self._chunk_bytes:
      self._ndarray_ext(_EXT_NDARRAY, arr, path)
      return
    # Flax's chunked form: {"__msgpack_chunked_array__": True, "shape":
    # {"0": d0, ...}, "chunks": {"0": 1-D piece, ...}}, keys in that order.
    chunk = max(1, int(self._chunk_bytes / arr.dtype.itemsize))
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
