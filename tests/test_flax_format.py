"""Tests for `clu_ckpt.flax_format`: Flax byte identity, the reader, bad input.

Flax itself is the oracle: the writer must produce exactly the bytes of
`flax.serialization.to_bytes` and the reader must return what
`flax.serialization.msgpack_restore` returns, over a zoo of states generated
with hypothesis. Hostile input (truncations, bit flips, huge declared lengths,
deep nesting, malformed ndarray payloads, impossible chunked shapes) may only
ever raise `FlaxFormatError` naming the file and a byte offset; and whatever
its shape (empty containers, nils, deep or long keys repeated in every path,
tiny arrays, nested chunked-array maps, keys of one hash), decoding or
inspecting it must cost at most `MEMORY_FACTOR` x its size + `MEMORY_BASE`
bytes and time linear in its size, measured in child processes.

Synopsis::

  python -m pytest -q -x tests/test_flax_format.py
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import math
import mmap
import os
from pathlib import Path
import struct
import subprocess
import sys
import textwrap
import tracemalloc
from typing import Any, Callable, Iterator, Optional

import flax
from flax import serialization
from flax.core import FrozenDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import msgpack
import numpy as np
import pytest

from conftest import fuzz_examples
from clu_ckpt import flax_format
from clu_ckpt.flax_format import FlaxFormatError

_FIXTURES = (Path(__file__).resolve().parents[2] / "shared" / "fixtures" /
             "clu-0.0.12")
_REPO = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------
# The zoo of states.
# --------------------------------------------------------------------------

Point = collections.namedtuple("Point", ["x", "y"])


@flax.struct.dataclass
class Pair:
  a: Any
  b: Any
  tag: str = flax.struct.field(pytree_node=False, default="meta")


_NUMPY_NUMERIC = [np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
    np.uint32, np.uint64, np.float16, np.float32, np.float64, np.longdouble,
    np.complex64, np.complex128, np.clongdouble, "M8[s]", "m8[ns]", "M8")]
_FLEXIBLE = [np.dtype(t) for t in (
    "U3", "S4", "V5", [("a", "<i4"), ("b", "<f2")])]


def _ml_dtypes() -> list[np.dtype]:
  out = []
  for name in sorted(dir(ml_dtypes)):
    kind = getattr(ml_dtypes, name)
    if isinstance(kind, type) and name not in ("finfo", "iinfo"):
      out.append(np.dtype(kind))
  return out


_ML_DTYPES = _ml_dtypes()
_ALL_DTYPES = _NUMPY_NUMERIC + _FLEXIBLE + _ML_DTYPES
# Converting an x87 long double *scalar* to an array leaves its 6 padding bytes
# uninitialized, so even two to_bytes calls can differ there: these get their
# own test. (Arrays are copied bytewise, padding included.)
_EXTENDED = (np.dtype(np.longdouble), np.dtype(np.clongdouble))
_SCALAR_DTYPES = [d for d in _ALL_DTYPES if d not in _EXTENDED]
_JAX_DTYPES = [np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32,
    np.float16, np.float32, np.complex64, ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.int4,
    ml_dtypes.uint4)]
_LAYOUTS = ("c", "fortran", "transposed", "reversed", "strided", "broadcast",
            "bigendian", "readonly")


def _random_array(dtype: np.dtype, shape: tuple,
                  rng: np.random.Generator) -> np.ndarray:
  """An array of arbitrary bit patterns (NaNs, odd ml_dtypes bits included)."""
  raw = rng.integers(0, 256, math.prod(shape) * dtype.itemsize, np.uint8)
  if dtype.kind == "b":
    raw &= 1
  return raw.view(dtype).reshape(shape)


def _with_layout(arr: np.ndarray, layout: str,
                 rng: np.random.Generator) -> np.ndarray:
  """`arr`, or an array like it laid out in memory as `layout` says."""
  if layout == "fortran":
    return np.asfortranarray(arr)
  if layout == "transposed":
    return arr.T
  if layout == "reversed" and arr.ndim:
    return arr[::-1]
  if layout == "strided" and arr.ndim:
    wide = arr.shape[:-1] + (2 * arr.shape[-1] + 1,)
    return _random_array(arr.dtype, wide, rng)[..., 1::2]
  if layout == "broadcast" and arr.ndim and arr.shape[-1]:
    return np.broadcast_to(arr[..., :1], arr.shape)
  if (layout == "bigendian" and arr.dtype in _NUMPY_NUMERIC and
      arr.dtype.itemsize > 1):
    return arr.astype(arr.dtype.newbyteorder(">"))
  if layout == "readonly":
    arr.flags.writeable = False
  return arr


@st.composite
def _np_arrays(draw, dtypes=tuple(_ALL_DTYPES), max_side: int = 4,
               max_dims: int = 3) -> np.ndarray:
  dtype = draw(st.sampled_from(dtypes))
  shape = draw(hnp.array_shapes(min_dims=0, max_dims=max_dims, min_side=0,
                                max_side=max_side))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  return _with_layout(_random_array(dtype, shape, rng),
                      draw(st.sampled_from(_LAYOUTS)), rng)


@st.composite
def _np_scalars(draw) -> np.generic:
  dtype = draw(st.sampled_from(_SCALAR_DTYPES))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  return _random_array(dtype, (1,), rng)[0]


@st.composite
def _jax_arrays(draw) -> jax.Array:
  dtype = draw(st.sampled_from(_JAX_DTYPES))
  shape = draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=0,
                                max_side=4))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  return jnp.asarray(_random_array(dtype, shape, rng))


_PY_LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1),
    st.floats(), st.complex_numbers(), st.text(max_size=20),
    st.binary(max_size=20))
_LEAVES = st.one_of(_PY_LEAVES, _np_arrays(), _np_scalars(), _jax_arrays())


def _unique_str_keys(d: dict) -> bool:
  return len({str(k) for k in d}) == len(d)


def _containers(children: st.SearchStrategy) -> st.SearchStrategy:
  keys = st.one_of(st.text(max_size=6), st.integers(-3, 300))
  return st.one_of(
      st.dictionaries(keys, children, max_size=4).filter(_unique_str_keys),
      st.lists(children, max_size=4),
      st.lists(children, max_size=4).map(tuple),
      st.builds(Point, children, children),
      st.builds(Pair, children, children),
      st.dictionaries(st.text(max_size=6), children, max_size=3).map(
          FrozenDict),
  )


_ZOO = st.recursive(_LEAVES, _containers, max_leaves=10)

_ZOO_SETTINGS = settings(max_examples=fuzz_examples(150), deadline=None,
                         suppress_health_check=[HealthCheck.too_slow])
# Hostile inputs are small: a generous deadline only catches hangs.
_FUZZ_SETTINGS = settings(max_examples=fuzz_examples(300), deadline=5000,
                          suppress_health_check=[HealthCheck.too_slow])

# --------------------------------------------------------------------------
# Helpers.
# --------------------------------------------------------------------------


def _flax_error(state: Any) -> Optional[type]:
  """The type of what the installed Flax raises serializing `state`, or None."""
  try:
    serialization.to_bytes(state)
  except Exception as e:  # pylint: disable=broad-except
    return type(e)
  return None


# What the installed Flax stores a Python complex as (and reads it back as):
# a numpy complex128 scalar before Flax 0.9.0, `complex` since.
_FLAX_COMPLEX = type(serialization.msgpack_restore(serialization.to_bytes(1j)))
# What it raises for an int msgpack cannot hold: ValueError before 0.9.0.
_FLAX_INT_ERROR = _flax_error({"i": 2**64})


def _expected(state: Any) -> Any:
  """The state dict Flax stores for `state`, derived from the input alone."""
  kind = type(state)
  if kind is dict or isinstance(state, FrozenDict):
    return {str(k): _expected(v) for k, v in state.items()}
  if isinstance(state, tuple) and hasattr(state, "_fields"):
    return {f: _expected(getattr(state, f)) for f in state._fields}
  if kind in (list, tuple):
    return {str(i): _expected(v) for i, v in enumerate(state)}
  if isinstance(state, Pair):
    return {"a": _expected(state.a), "b": _expected(state.b)}
  if isinstance(state, jax.Array):
    return np.asarray(state)
  if type(state) is complex:
    return _FLAX_COMPLEX(state)
  return state


def _assert_same(got: Any, want: Any, *, exact_dtype: bool = True,
                 where: str = "/") -> None:
  """Deep equality of decoded trees: types, key order, dtypes, exact bits."""
  if isinstance(want, dict):
    assert type(got) is dict, where
    assert list(got) == list(want), where
    for key in want:
      _assert_same(got[key], want[key], exact_dtype=exact_dtype,
                   where=f"{where}{key}/")
  elif isinstance(want, list):
    assert type(got) is list and len(got) == len(want), where
    for i, (g, w) in enumerate(zip(got, want)):
      _assert_same(g, w, exact_dtype=exact_dtype, where=f"{where}[{i}]/")
  elif isinstance(want, (np.ndarray, np.generic)):
    assert type(got) is type(want), (where, type(got), type(want))
    assert got.shape == want.shape, where
    assert got.dtype.name == want.dtype.name, where
    if exact_dtype:
      assert got.dtype == want.dtype, where
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), where
  else:
    assert type(got) is type(want), (where, type(got), type(want))
    if isinstance(want, float):
      assert struct.pack(">d", got) == struct.pack(">d", want), where
    elif isinstance(want, complex):
      assert (struct.pack(">dd", got.real, got.imag) ==
              struct.pack(">dd", want.real, want.imag)), where
    else:
      assert got == want, where


def _leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
  """(path, leaf) in file order, paths as inspect_file spells them."""
  if isinstance(tree, dict):
    for key, value in tree.items():
      yield from _leaves(value, f"{prefix}/{key}")
  else:
    yield prefix, tree


def _key_paths(tree: Any, prefix: tuple = ()) -> Iterator[tuple]:
  if isinstance(tree, dict):
    for key, value in tree.items():
      yield prefix + (key,)
      yield from _key_paths(value, prefix + (key,))


def _get(tree: Any, keys: tuple) -> Any:
  for key in keys:
    tree = tree[key]
  return tree


def _ext_hook(code: int, payload: bytes) -> Any:
  if code == 2:
    real, imag = msgpack.unpackb(payload)
    return complex(real, imag)
  return msgpack.ExtType(code, payload)


def _decode_at(data: bytes, offset: int) -> Any:
  unpacker = msgpack.Unpacker(raw=False, strict_map_key=False,
                              ext_hook=_ext_hook)
  unpacker.feed(data[offset:])
  return unpacker.unpack()


_KINDS = {type(None): "none", bool: "bool", int: "int", float: "float",
          str: "str", bytes: "bytes", complex: "complex"}


def _check_inspect(path: Path, full: Any,
                   chunk_bytes: Optional[int] = None) -> None:
  """inspect_file(path) agrees with the loaded tree and the file's bytes."""
  data = path.read_bytes()
  infos = flax_format.inspect_file(str(path))
  leaves = list(_leaves(full))
  assert [i.path for i in infos] == [p for p, _ in leaves]
  for info, (_, value) in zip(infos, leaves):
    if isinstance(value, (np.ndarray, np.generic)):
      assert info.kind == ("ndarray" if isinstance(value, np.ndarray) else
                           "npscalar"), info
      assert (info.dtype, info.shape, info.nbytes) == (
          value.dtype.name, value.shape, value.nbytes), info
      raw = np.asarray(value).tobytes()
      if chunk_bytes is not None and len(raw) > chunk_bytes:
        raw = raw[:max(1, chunk_bytes // value.dtype.itemsize) *
                  value.dtype.itemsize]  # first chunk only
      assert data[info.offset:info.offset + len(raw)] == raw, info
    else:
      assert info.kind == _KINDS[type(value)], info
      assert (info.dtype, info.shape, info.nbytes) == (None, None, 0), info
      _assert_same(_decode_at(data, info.offset), value, where=info.path)
  _check_handle(path)


def _check_handle(path: Path) -> None:
  """FlaxFile(path) gives load_file's tree and inspect_file's leaves.

  It parses once, so it fails when either of them does (with the error of
  the first problem in the file), and may fail on memory where each alone
  fits (it holds both the tree and the leaves).
  """
  outcomes = []
  for read in (flax_format.load_file, flax_format.inspect_file):
    try:
      outcomes.append(read(str(path)))
    except FlaxFormatError:
      outcomes.append(_REJECTED)
  rejected = any(o is _REJECTED for o in outcomes)
  try:
    with flax_format.FlaxFile(str(path)) as handle:
      tree, leaves = handle.tree, handle.leaves
  except FlaxFormatError as e:
    _check_error(e, path.stat().st_size, str(path))
    assert rejected or "bytes of memory" in str(e), str(e)
    return
  assert not rejected, "FlaxFile accepted rejected bytes"
  _assert_same(tree, outcomes[0])
  assert leaves == outcomes[1]


def _check_error(err: FlaxFormatError, size: int,
                 path: Optional[str] = None) -> None:
  assert isinstance(err, ValueError)
  assert isinstance(err.offset, int) and 0 <= err.offset <= size, err.offset
  assert f"at byte {err.offset}" in str(err), str(err)
  if path is not None:
    assert err.path == path
    assert path in str(err)


def _assert_rejected(data: bytes, directory: Optional[Path] = None, *,
                     inspect_rejects: bool = True,
                     **kwargs) -> FlaxFormatError:
  """load (and load_file, inspect_file) raise FlaxFormatError, nothing else.

  Args:
    data: The bad bytes.
    directory: Where to write them for load_file and inspect_file, or None.
    inspect_rejects: inspect_file must reject them too; if False it may also
      return (it reads headers only), but raise nothing but FlaxFormatError.
    **kwargs: For load and load_file.

  Returns:
    The error load raised.
  """
  with pytest.raises(FlaxFormatError) as caught:
    flax_format.load(data, **kwargs)
  _check_error(caught.value, len(data))
  if directory is not None:
    path = directory / "hostile.flax"
    path.write_bytes(data)
    with pytest.raises(FlaxFormatError) as from_file:
      flax_format.load_file(str(path), **kwargs)
    _check_error(from_file.value, len(data), str(path))
    if not kwargs:
      try:
        flax_format.inspect_file(str(path))
      except FlaxFormatError as e:
        _check_error(e, len(data), str(path))
      else:
        assert not inspect_rejects, "inspect_file accepted bad bytes"
      _check_handle(path)
  return caught.value


_REJECTED = object()


def _assert_same_as_flax(got: Any, encoded: bytes) -> None:
  """`got` equals msgpack_restore(encoded), where Flax can read it at all."""
  try:
    want = serialization.msgpack_restore(encoded)
  except TypeError:  # Flax cannot read its own str/bytes/void arrays.
    return
  _assert_same(got, want)


def _check_untrusted(data: bytes, path: Path) -> None:
  """Bytes of unknown quality: a result (equal to Flax's) or FlaxFormatError."""
  try:
    got = flax_format.load(data)
  except FlaxFormatError as e:
    _check_error(e, len(data))
    got = _REJECTED
  path.write_bytes(data)
  try:
    flax_format.inspect_file(str(path))
  except FlaxFormatError as e:
    _check_error(e, len(data), str(path))
  _check_handle(path)
  if got is _REJECTED:
    return
  try:
    want = serialization.msgpack_restore(data)
  except Exception:  # pylint: disable=broad-except
    return  # Flax refuses bytes we accept: allowed.
  _assert_same(got, want)


def _ndarray_ext(arr: np.ndarray, code: int = 1) -> msgpack.ExtType:
  """Flax's ndarray ext, written here independently of both implementations."""
  payload = msgpack.packb([list(arr.shape), arr.dtype.name, arr.tobytes()],
                          use_bin_type=True)
  return msgpack.ExtType(code, payload)


def _pack(obj: Any) -> bytes:
  def default(x):
    if isinstance(x, np.ndarray):
      return _ndarray_ext(x)
    if isinstance(x, np.generic):
      return _ndarray_ext(np.asarray(x), 3)
    if isinstance(x, complex):
      return msgpack.ExtType(2, msgpack.packb([x.real, x.imag]))
    raise TypeError(type(x))
  return msgpack.packb(obj, default=default, use_bin_type=True)


def _raw_ndarray(shape: Any, name: Any, data: Any, code: int = 1,
                 extra: bytes = b"") -> bytes:
  payload = msgpack.packb([shape, name, data], use_bin_type=True) + extra
  return msgpack.packb({"w": msgpack.ExtType(code, payload)})


def _mmap_root(arr: np.ndarray) -> Any:
  base = arr
  while isinstance(base, np.ndarray):
    base = base.base
  if isinstance(base, memoryview):
    base = base.obj
  return base


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
  return tmp_path_factory.mktemp("flax_format")


def _rich_state() -> dict:
  """A fixed state with one of everything, for the hand-written cases."""
  return {
      "params": {
          "Dense_0": {"kernel": np.arange(12, dtype=np.float32).reshape(3, 4),
                      "bias": np.ones(4, ml_dtypes.bfloat16)},
          "Conv_0": {"kernel": np.arange(6, dtype=np.float16)},
      },
      "opt": {"count": np.int32(7), "mu": [np.zeros(2), np.full(3, -1.5)],
              "lr": 0.01, "name": "adam", "none": None},
      "step": 12345,
      "flags": (True, False),
      "blob": b"\x00\xff",
      "z": 1 + 2j,
      "empty": {},
  }


# --------------------------------------------------------------------------
# Writer: byte identity with flax.serialization.to_bytes.
# --------------------------------------------------------------------------


@_ZOO_SETTINGS
@given(state=_ZOO)
def test_writer_matches_flax_to_bytes_over_zoo(state, workdir):
  refused = _flax_error(state)
  if refused is not None:
    # E.g. Flax before 0.10.7 asserts that a FrozenDict's keys are strings.
    with pytest.raises(refused):
      flax_format.save(state)
    return
  want = serialization.to_bytes(state)
  assert flax_format.save(state) == want
  directory = workdir / "writer"
  directory.mkdir(exist_ok=True)
  path = directory / "zoo.flax"
  written = flax_format.save_file(state, str(path))
  assert path.read_bytes() == want
  assert written == len(want)
  assert os.listdir(directory) == ["zoo.flax"]  # no temporary file left


@pytest.mark.parametrize("dtype", _ALL_DTYPES, ids=str)
def test_writer_every_dtype_and_layout(dtype, tmp_path):
  rng = np.random.default_rng(0)
  path = tmp_path / "a.flax"
  for layout in _LAYOUTS:
    for shape in [(), (0,), (3,), (2, 3), (2, 0, 3), (3, 1, 4)]:
      arr = _with_layout(_random_array(dtype, shape, rng), layout, rng)
      state = {"a": arr}
      if dtype not in _EXTENDED:
        state["s"] = _random_array(dtype, (1,), rng)[0]
      want = serialization.to_bytes(state)
      assert flax_format.save(state) == want, (layout, shape)
    flax_format.save_file(state, str(path))  # fsyncs: once per layout
    assert path.read_bytes() == want, layout


def test_writer_extended_precision_scalars_match_flax_but_padding():
  values = [np.longdouble("1.5"), np.longdouble("-inf"),
            np.clongdouble(complex(2.25, -3.0)), np.longdouble(1) / 3]
  x87 = np.finfo(np.longdouble).nmant == 63 and np.dtype(
      np.longdouble).itemsize == 16
  for value in values:
    data = flax_format.save({"s": value})
    want = serialization.to_bytes({"s": value})
    n = value.nbytes  # the data are the file's last bytes
    assert len(data) == len(want) and data[:-n] == want[:-n]
    for start in range(len(data) - n, len(data), 16 if x87 else n):
      width = 10 if x87 else n
      assert data[start:start + width] == want[start:start + width], value
    got = flax_format.load(data)["s"]
    assert type(got) is type(value) and got == value


def test_writer_layouts_really_are_not_c_contiguous():
  rng = np.random.default_rng(1)
  base = _random_array(np.dtype(np.float32), (3, 4), rng)
  for layout in ("fortran", "transposed", "reversed", "strided", "broadcast"):
    assert not _with_layout(base.copy(), layout, rng).flags.c_contiguous
  assert _with_layout(base.copy(), "bigendian", rng).dtype.byteorder == ">"


@pytest.mark.parametrize("dtype", _JAX_DTYPES, ids=str)
def test_writer_jax_arrays(dtype, tmp_path):
  rng = np.random.default_rng(2)
  for shape in [(), (0,), (5,), (2, 3)]:
    arr = jnp.asarray(_random_array(dtype, shape, rng))
    state = {"x": arr, "nested": [arr, {"y": arr}]}
    want = serialization.to_bytes(state)
    assert flax_format.save(state) == want
    assert flax_format.save(arr) == serialization.to_bytes(arr)
    path = tmp_path / "j.flax"
    assert flax_format.save_file(state, str(path)) == len(want)
    assert path.read_bytes() == want


_INT_BOUNDARIES = [
    -2**63, -2**63 + 1, -2**31 - 1, -2**31, -32769, -32768, -129, -128, -33,
    -32, -1, 0, 1, 127, 128, 255, 256, 65535, 65536, 2**31 - 1, 2**31,
    2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]


def test_writer_python_scalars_at_msgpack_boundaries():
  for value in _INT_BOUNDARIES:
    state = {"i": value, "l": [value]}
    data = flax_format.save(state)
    assert data == serialization.to_bytes(state), value
    assert flax_format.load(data)["i"] == value
  for value in [0.0, -0.0, 1.5, float("inf"), float("-inf"), float("nan"),
                5e-324, 1.7976931348623157e308, True, False, None,
                complex(float("nan"), -0.0), 1j, "", "é✓😀", b"", b"\x00"]:
    state = {"v": value}
    assert flax_format.save(state) == serialization.to_bytes(state), value
    assert flax_format.save(value) == serialization.to_bytes(value), value


def test_writer_lengths_at_msgpack_header_boundaries():
  sizes = [0, 1, 2, 4, 5, 8, 15, 16, 17, 31, 32, 33, 240, 245, 250, 255, 256,
           257, 65520, 65525, 65530, 65535, 65536, 65537]
  checked = 0
  for n in sizes:
    for dtype in (np.uint8, np.bool_, np.int16):
      state = {"a": np.zeros(n, dtype), "s": "x" * n, "b": b"y" * n}
      assert flax_format.save(state) == serialization.to_bytes(state), n
      checked += 1
  for n in range(0, 300):  # every ext8 / fixext payload size up to ext16
    state = np.arange(n, dtype=np.uint8)
    assert flax_format.save(state) == serialization.to_bytes(state), n
  for n in (15, 16, 65535, 65536):  # fixmap / map16 / map32
    state = {str(i): i for i in range(n)}
    assert flax_format.save(state) == serialization.to_bytes(state), n
  assert checked == len(sizes) * 3


def test_writer_out_of_range_ints_raise_like_the_installed_flax(tmp_path):
  # OverflowError from Flax 0.9.0 on, ValueError before (test_flax_encode).
  for value in (2**64, -2**63 - 1, 10**30):
    state = {"a": np.ones(3), "i": value}
    with pytest.raises((OverflowError, ValueError)) as raised:
      serialization.to_bytes(state)
    with pytest.raises(type(raised.value)):
      flax_format.save(state)
    with pytest.raises(type(raised.value)):
      flax_format.save_file(state, str(tmp_path / "x.flax"))
    assert os.listdir(tmp_path) == []


def test_writer_colliding_dict_keys_raise_value_error_like_flax(tmp_path):
  for state in ({1: "a", "1": "b"}, {"outer": [{True: 1, "True": 2}]}):
    with pytest.raises(ValueError, match="unique string"):
      serialization.to_bytes(state)
    with pytest.raises(ValueError, match="unique string"):
      flax_format.save(state)
    with pytest.raises(ValueError, match="unique string"):
      flax_format.save_file(state, str(tmp_path / "x.flax"))
    assert os.listdir(tmp_path) == []


def test_writer_unregistered_leaf_raises_type_error_naming_its_path(tmp_path):
  class Opaque:
    pass

  state = {"a": [0, {"b": Opaque()}], "c": 1}
  with pytest.raises(TypeError):
    serialization.to_bytes(state)
  with pytest.raises(TypeError, match="/a/1/b"):
    flax_format.save(state)
  with pytest.raises(TypeError, match="/a/1/b"):
    flax_format.save_file(state, str(tmp_path / "x.flax"))
  assert os.listdir(tmp_path) == []


def test_writer_object_dtype_array_raises_value_error_like_flax(tmp_path):
  for arr in (np.array([object()]), np.array([1, "a", None], dtype=object),
              np.zeros(2, dtype=[("o", object)])):
    state = {"p": {"w": arr}}
    with pytest.raises(ValueError):
      serialization.to_bytes(state)
    with pytest.raises(ValueError, match="(?i)object"):
      flax_format.save(state)
    with pytest.raises(ValueError, match="(?i)object"):
      flax_format.save_file(state, str(tmp_path / "x.flax"))
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------
# Chunked arrays (Flax's form for arrays over MAX_CHUNK_SIZE bytes).
# --------------------------------------------------------------------------

_SMALL_CHUNK = 1000


@st.composite
def _chunky_states(draw) -> Any:
  arrays = st.one_of(
      _np_arrays(max_side=30, max_dims=2),
      _np_arrays(dtypes=(np.dtype("U300"), np.dtype(np.float64)), max_side=5),
      _jax_arrays())
  if draw(st.booleans()):
    return draw(arrays)
  return draw(st.dictionaries(st.text(max_size=4),
                              st.one_of(arrays, _PY_LEAVES,
                                        st.lists(arrays, max_size=2)),
                              min_size=1, max_size=4))


@settings(max_examples=fuzz_examples(120), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(state=_chunky_states(), data=st.data())
def test_chunked_arrays_with_a_small_chunk_size(state, data, workdir):
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(serialization, "MAX_CHUNK_SIZE", _SMALL_CHUNK)
    patch.setattr(flax_format, "CHUNK_BYTES", _SMALL_CHUNK)
    if _flax_error(state) is not None:  # see test_writer_matches_flax_to_...
      return
    want = serialization.to_bytes(state)
    assert flax_format.save(state) == want
    path = workdir / "chunked.flax"
    assert flax_format.save_file(state, str(path)) == len(want)
    assert path.read_bytes() == want
    got = flax_format.load_file(str(path))
    _assert_same_as_flax(got, want)
    _assert_same(got, _expected(state), exact_dtype=False)
    _check_inspect(path, got, chunk_bytes=_SMALL_CHUNK)
    keys = list(_key_paths(got))
    if keys:
      chosen = data.draw(st.sampled_from(keys))
      _assert_same(flax_format.load_file(str(path), subtree=chosen),
                   _get(got, chosen))


def test_small_chunk_size_really_chunks(tmp_path, monkeypatch):
  monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", _SMALL_CHUNK)
  monkeypatch.setattr(flax_format, "CHUNK_BYTES", _SMALL_CHUNK)
  arr = np.arange(1001, dtype=np.int32)[::-1]  # 4004 bytes: 5 chunks
  state = {"p": {"w": arr}, "small": np.arange(250, dtype=np.int32)}
  data = flax_format.save(state)
  assert data == serialization.to_bytes(state)
  assert data.count(b"__msgpack_chunked_array__") == 1
  path = tmp_path / "c.flax"
  path.write_bytes(data)
  got = flax_format.load_file(str(path))
  np.testing.assert_array_equal(got["p"]["w"], arr)
  np.testing.assert_array_equal(
      flax_format.load_file(str(path), subtree="p/w"), arr)
  (w_info, small_info) = flax_format.inspect_file(str(path))
  assert (w_info.path, w_info.kind, w_info.shape, w_info.nbytes) == (
      "/p/w", "ndarray", (1001,), 4004)
  assert small_info.shape == (250,)
  assert data[w_info.offset:w_info.offset + 4] == arr[:1].tobytes()


# A soak (run with --soak: 1 GiB of file, 3 GiB of memory); the tests above
# chunk small arrays with a small MAX_CHUNK_SIZE.
@pytest.mark.soak
def test_chunked_array_over_one_gib(tmp_path):
  """The real thing: Flax's 1 GiB limit, written and read back exactly."""
  n = 2**28 + 7  # uint32: 1 GiB + 28 bytes, two chunks
  arr = np.arange(n, dtype=np.uint32)
  state = {"big": arr, "step": 3}
  path = tmp_path / "big.flax"
  written = flax_format.save_file(state, str(path))
  assert os.listdir(tmp_path) == ["big.flax"]
  want = serialization.to_bytes(state)
  assert written == len(want) == path.stat().st_size
  block, position = 64 * 2**20, 0
  with open(path, "rb") as f:
    while chunk := f.read(block):
      if want[position:position + len(chunk)] != chunk:
        pytest.fail(f"save_file differs from to_bytes in [{position}, "
                    f"{position + len(chunk)})")
      position += len(chunk)
  assert position == len(want)
  assert want.count(b"__msgpack_chunked_array__", 0, 4096) == 1
  del want
  (info_big, info_step) = flax_format.inspect_file(str(path))
  assert (info_big.path, info_big.kind, info_big.dtype, info_big.shape,
          info_big.nbytes) == ("/big", "ndarray", "uint32", (n,), n * 4)
  assert info_step.path == "/step"
  with open(path, "rb") as f:
    f.seek(info_big.offset)
    assert f.read(4096) == arr[:1024].tobytes()
  got = flax_format.load_file(str(path))
  assert got["step"] == 3
  assert got["big"].dtype == np.uint32 and got["big"].shape == (n,)
  assert np.array_equal(got["big"], arr)


# --------------------------------------------------------------------------
# Reader: equal to flax.serialization.msgpack_restore.
# --------------------------------------------------------------------------


@_ZOO_SETTINGS
@given(state=_ZOO, data=st.data())
def test_reader_matches_flax_msgpack_restore_over_zoo(state, data, workdir):
  if _flax_error(state) is not None:  # see test_writer_matches_flax_to_...
    return
  encoded = serialization.to_bytes(state)
  got = flax_format.load(encoded)
  _assert_same_as_flax(got, encoded)
  _assert_same(got, _expected(state), exact_dtype=False)
  assert flax_format.save(got) == encoded  # a restored state re-saves as is

  path = workdir / "reader.flax"
  path.write_bytes(encoded)
  from_file = flax_format.load_file(str(path))
  _assert_same(from_file, got)
  _check_inspect(path, from_file)

  writable = flax_format.load_file(str(path), writable=True)
  _assert_same(writable, got)
  for _, leaf in _leaves(writable):
    if isinstance(leaf, np.ndarray):
      assert leaf.flags.writeable and not isinstance(_mmap_root(leaf),
                                                     mmap.mmap)

  keys = list(_key_paths(got))
  if keys:
    chosen = data.draw(st.sampled_from(keys))
    _assert_same(flax_format.load(encoded, subtree=chosen), _get(got, chosen))
    _assert_same(flax_format.load_file(str(path), subtree=list(chosen)),
                 _get(got, chosen))
    if all(k and "/" not in k for k in chosen):
      _assert_same(flax_format.load_file(str(path),
                                         subtree="/".join(chosen)),
                   _get(got, chosen))


def test_reader_accepts_every_buffer_type():
  state = _rich_state()
  data = flax_format.save(state)
  want = serialization.msgpack_restore(data)
  for buffer in (data, bytearray(data), memoryview(data)):
    _assert_same(flax_format.load(buffer), want)


def test_reader_arrays_are_read_only_views_of_the_mmap(tmp_path):
  path = tmp_path / "r.flax"
  flax_format.save_file(_rich_state(), str(path))
  got = flax_format.load_file(str(path))
  offsets = {i.path: i.offset for i in flax_format.inspect_file(str(path))}
  file_bytes = path.read_bytes()
  for leaf_path, leaf in _leaves(got):
    if not isinstance(leaf, np.ndarray):
      continue
    assert leaf.flags.writeable is False, leaf_path
    root = _mmap_root(leaf)
    assert isinstance(root, mmap.mmap), (leaf_path, type(root))
    start = np.frombuffer(root, np.uint8).ctypes.data
    assert leaf.ctypes.data - start == offsets[leaf_path], leaf_path
    assert file_bytes[offsets[leaf_path]:][:leaf.nbytes] == leaf.tobytes()
    with pytest.raises(ValueError):
      leaf[...] = 0
  kernel = got["params"]["Dense_0"]["kernel"]
  np.testing.assert_array_equal(kernel, np.arange(12).reshape(3, 4))


def test_reader_writable_gives_independent_copies(tmp_path):
  path = tmp_path / "w.flax"
  flax_format.save_file(_rich_state(), str(path))
  before = path.read_bytes()
  got = flax_format.load_file(str(path), writable=True)
  kernel = got["params"]["Dense_0"]["kernel"]
  assert kernel.flags.writeable and kernel.flags.owndata
  kernel[...] = -7
  got["opt"]["mu"]["1"][0] = 99
  assert path.read_bytes() == before
  again = flax_format.load_file(str(path))
  np.testing.assert_array_equal(again["params"]["Dense_0"]["kernel"],
                                np.arange(12).reshape(3, 4))
  assert flax_format.load(before, writable=True)["opt"]["mu"]["1"].flags[
      "WRITEABLE"]


def test_reader_unaligned_array_data(tmp_path):
  residues = set()
  for pad in range(9):
    values = np.linspace(-3.0, 3.0, 7) + pad
    state = {"k" * (pad + 1): b"", "w": values, "c": np.arange(3, dtype=">i8")}
    path = tmp_path / f"u{pad}.flax"
    flax_format.save_file(state, str(path))
    info = {i.path: i for i in flax_format.inspect_file(str(path))}
    residues.add(info["/w"].offset % 8)
    got = flax_format.load_file(str(path))
    w = got["w"]
    if info["/w"].offset % 8:
      assert not w.flags.aligned
    np.testing.assert_array_equal(w, values)
    np.testing.assert_allclose(w.sum(), values.sum())
    assert (w * 2)[3] == values[3] * 2
    assert got["c"].tobytes() == np.arange(3, dtype=">i8").tobytes()
    _assert_same(got, serialization.msgpack_restore(path.read_bytes()))
  assert len(residues) >= 4 and any(r % 2 for r in residues), residues


def test_reader_subtree(tmp_path):
  path = tmp_path / "s.flax"
  flax_format.save_file(_rich_state(), str(path))
  full = flax_format.load_file(str(path))
  for subtree, keys in [("params", ("params",)),
                        ("params/Dense_0", ("params", "Dense_0")),
                        ("/params/Dense_0/kernel/", ("params", "Dense_0",
                                                     "kernel")),
                        (("opt", "mu", "1"), ("opt", "mu", "1")),
                        ("opt/count", ("opt", "count")),
                        ("step", ("step",)), ("empty", ("empty",))]:
    got = flax_format.load_file(str(path), subtree=subtree)
    _assert_same(got, _get(full, keys))
  kernel = flax_format.load_file(str(path), subtree="params/Dense_0/kernel")
  assert isinstance(_mmap_root(kernel), mmap.mmap)
  assert not kernel.flags.writeable
  assert flax_format.load_file(str(path), subtree="params/Dense_0/kernel",
                               writable=True).flags.writeable


@pytest.mark.parametrize("subtree", [
    "nope", "params/nope", "params/Dense_0/kernel/deeper", "step/x",
    ("opt", "mu", "2"), "opt/name/x"])
def test_reader_missing_subtree_raises(subtree, tmp_path):
  data = flax_format.save(_rich_state())
  err = _assert_rejected(data, tmp_path, subtree=subtree)
  assert "subtree" in str(err)


def test_reader_subtree_does_not_decode_other_arrays(tmp_path):
  state = {"opt": {"m": np.ones(4, np.float32)}, "params": {"w": np.arange(3.)},
           "late": {"v": np.zeros(2, np.float32)}}
  data = bytearray(flax_format.save(state))
  # Corrupt the dtype name of the two float32 arrays outside "params".
  assert data.count(b"float32") == 2
  data = bytes(data).replace(b"float32", b"floatXX")
  _assert_rejected(data, tmp_path)
  path = tmp_path / "p.flax"
  path.write_bytes(data)
  got = flax_format.load_file(str(path), subtree="params")
  _assert_same(got, {"w": np.arange(3.)})


def test_inspect_file_fixed_state(tmp_path):
  path = tmp_path / "i.flax"
  state = _rich_state()
  flax_format.save_file(state, str(path))
  infos = flax_format.inspect_file(str(path))
  by_path = {i.path: i for i in infos}
  assert list(by_path) == [
      "/params/Dense_0/kernel", "/params/Dense_0/bias", "/params/Conv_0/kernel",
      "/opt/count", "/opt/mu/0", "/opt/mu/1", "/opt/lr", "/opt/name",
      "/opt/none", "/step", "/flags/0", "/flags/1", "/blob", "/z"]
  kernel = by_path["/params/Dense_0/kernel"]
  assert (kernel.kind, kernel.dtype, kernel.shape, kernel.nbytes) == (
      "ndarray", "float32", (3, 4), 48)
  bias = by_path["/params/Dense_0/bias"]
  assert (bias.dtype, bias.shape, bias.nbytes) == ("bfloat16", (4,), 8)
  count = by_path["/opt/count"]
  assert (count.kind, count.dtype, count.shape, count.nbytes) == (
      "npscalar", "int32", (), 4)
  assert [by_path[p].kind for p in ("/opt/lr", "/opt/name", "/opt/none",
                                    "/step", "/flags/0", "/blob", "/z")] == [
                                        "float", "str", "none", "int", "bool",
                                        "bytes", "complex" if _FLAX_COMPLEX is
                                        complex else "npscalar"]
  _check_inspect(path, flax_format.load_file(str(path)))


def test_reader_empty_and_missing_files(tmp_path):
  empty = tmp_path / "empty.flax"
  empty.write_bytes(b"")
  for fn in (flax_format.load_file, flax_format.inspect_file):
    with pytest.raises(FlaxFormatError) as caught:
      fn(str(empty))
    _check_error(caught.value, 0, str(empty))
    with pytest.raises(FileNotFoundError):
      fn(str(tmp_path / "missing.flax"))
  _assert_rejected(b"")


@pytest.mark.skipif(not _FIXTURES.is_dir(), reason="no golden fixtures")
def test_reader_golden_clu_fixtures():
  files = sorted(_FIXTURES.rglob("*.flax"))
  assert len(files) >= 10
  for path in files:
    data = path.read_bytes()
    try:
      want = serialization.msgpack_restore(data)
    except ValueError:
      want = _REJECTED
    if want is _REJECTED:  # incomplete_save/ckpt-2.flax: a torn write
      with pytest.raises(FlaxFormatError) as caught:
        flax_format.load_file(str(path))
      _check_error(caught.value, len(data), str(path))
      continue
    got = flax_format.load_file(str(path))
    _assert_same(got, want)
    assert flax_format.save(got) == data, path
    _check_inspect(path, got)


# --------------------------------------------------------------------------
# Hostile input.
# --------------------------------------------------------------------------


def test_every_truncation_is_rejected(tmp_path):
  state = dict(_rich_state(), more=[np.float64(2.5), 2**40, -2**40, "é" * 40])
  data = flax_format.save(state)
  assert len(data) > 300
  for n in range(len(data)):
    _assert_rejected(data[:n], tmp_path)
    with pytest.raises(FlaxFormatError):
      flax_format.load(data[:n], subtree="more")  # the last key


def test_trailing_bytes_are_rejected_at_their_offset(tmp_path):
  data = flax_format.save(_rich_state())
  for extra in (b"\x00", b"\xc0" * 10, data):
    err = _assert_rejected(data + extra, tmp_path)
    assert err.offset == len(data)


def test_invalid_type_byte_is_rejected_at_its_offset(tmp_path):
  data = b"\x82\xa1a\x01\xa1b\xc1"
  err = _assert_rejected(data, tmp_path)
  assert err.offset == 6


@pytest.mark.parametrize("data", [
    b"\x81\xa1a\xa2\xff\xfe",            # invalid UTF-8 value
    b"\x81\xa2\xc3\x28\x01",             # invalid UTF-8 key
    b"\x81\x91\x01\x02",                 # array as a map key
    b"\x81\x80\x02",                     # map as a map key
    _pack({"a": {"b": 1}})[:-1] + b"\xc1",
], ids=["utf8-value", "utf8-key", "array-key", "map-key", "c1"])
def test_malformed_msgpack_is_rejected(data, tmp_path):
  _assert_rejected(data, tmp_path)


def test_ndarray_map_key_is_rejected(tmp_path):
  key = msgpack.packb(_ndarray_ext(np.arange(3)))
  _assert_rejected(b"\x81" + key + b"\x01", tmp_path)


_BASE_STATE = dict(_rich_state(), big=np.arange(40, dtype=np.int16).reshape(
    5, 8).T, scalar=np.float16(1.5), c=-1.5j)


@_FUZZ_SETTINGS
@given(flips=st.lists(st.integers(0, 8 * len(flax_format.save(_BASE_STATE)) -
                                  1), min_size=1, max_size=4),
       cut=st.none() | st.integers(0, len(flax_format.save(_BASE_STATE))))
def test_bit_flips_are_rejected_or_decoded_like_flax(flips, cut, workdir):
  data = bytearray(flax_format.save(_BASE_STATE))
  for bit in flips:
    data[bit // 8] ^= 1 << (bit % 8)
  _check_untrusted(bytes(data[:cut]), workdir / "flipped.flax")


_INTERESTING_BYTES = [0x00, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xC0, 0xC1,
                      0xC4, 0xC6, 0xC7, 0xC9, 0xCF, 0xD3, 0xD4, 0xD8, 0xDB,
                      0xDD, 0xDF, 0xFF]


@_FUZZ_SETTINGS
@given(edits=st.lists(st.tuples(st.integers(0, 2**16),
                                st.sampled_from(_INTERESTING_BYTES)),
                      min_size=1, max_size=3))
def test_byte_substitutions_are_rejected_or_decoded_like_flax(edits, workdir):
  data = bytearray(flax_format.save(_BASE_STATE))
  for position, value in edits:
    data[position % len(data)] = value
  _check_untrusted(bytes(data), workdir / "substituted.flax")


@_FUZZ_SETTINGS
@given(prefix=st.sampled_from([b"", b"\x81\xa1a", b"\xc7\x20\x01",
                               b"\x81\xa1a\xc9\x00\x00\x00\x30\x01\x93"]),
       noise=st.binary(max_size=64))
def test_random_bytes_are_rejected_or_decoded_like_flax(prefix, noise,
                                                        workdir):
  _check_untrusted(prefix + noise, workdir / "noise.flax")


_DTYPE_NAMES = st.one_of(
    st.sampled_from([
        "float32", "int8", "bool", "bfloat16", "uint4", "float8_e4m3fn",
        "datetime64[s]", "str32", "str7", "bytes8", "void16", "complex64",
        "O", "object", "2f4", "3i2", "V0", "U", "S0", "a", "", "float32,int32",
        "M8[zz]", "finfo", "str3200000000000000000000", "int0",
        "void8000000000000000000000", "U99999999999999999999"]),
    st.text(max_size=10), st.binary(max_size=10))
_DIMS = st.one_of(st.integers(-3, 5),
                  st.sampled_from([0, 2**31, 2**32, 2**63 - 1, 2**63,
                                   2**64 - 1, -2**63]),
                  st.none(), st.booleans(), st.floats(), st.text(max_size=2))
_SHAPES = st.one_of(st.lists(_DIMS, max_size=4), _DIMS)
_TRIPLES = st.one_of(
    st.tuples(_SHAPES, _DTYPE_NAMES, st.binary(max_size=48)).map(list),
    st.lists(st.one_of(_SHAPES, _DTYPE_NAMES, st.binary(max_size=8)),
             max_size=4))
_EXTS = st.builds(
    msgpack.ExtType, st.sampled_from([0, 1, 2, 3, 4, 127]),
    st.one_of(st.binary(max_size=16),
              _TRIPLES.map(lambda t: msgpack.packb(t, use_bin_type=True)),
              st.lists(st.one_of(st.floats(), st.integers(-5, 5), st.text(
                  max_size=2)), max_size=3).map(msgpack.packb)))
_KEYS = st.one_of(st.sampled_from(["__msgpack_chunked_array__", "shape",
                                   "chunks", "0", "1", "2"]),
                  st.text(max_size=3), st.integers(-2, 3))
_MSGPACK_TREES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1),
              st.floats(), st.text(max_size=5), st.binary(max_size=5), _EXTS),
    lambda c: st.one_of(st.lists(c, max_size=4),
                        st.dictionaries(_KEYS, c, max_size=4)),
    max_leaves=12)


@_FUZZ_SETTINGS
@given(tree=_MSGPACK_TREES)
def test_random_msgpack_is_rejected_or_decoded_like_flax(tree, workdir):
  _check_untrusted(msgpack.packb(tree, use_bin_type=True),
                   workdir / "random.flax")


def _ext32(code: int, payload: bytes) -> bytes:
  return b"\xc9" + struct.pack(">Ib", len(payload), code) + payload


_BIN32_MAX = b"\xc6\xff\xff\xff\xff"
_HUGE_HEADERS = {
    "map32": b"\xdf\xff\xff\xff\xff",
    "array32": b"\xdd\xff\xff\xff\xff",
    "str32": b"\xdb\xff\xff\xff\xff",
    "bin32": _BIN32_MAX,
    "ext32-ndarray": b"\xc9\xff\xff\xff\xff\x01",
    "ext32-complex": b"\xc9\xff\xff\xff\xff\x02",
    "map16": b"\xde\xff\xff",
    "array16": b"\xdc\xff\xff",
    # Inside a well-sized ndarray ext: the data declares 4 GiB.
    "ndarray-bin32": _ext32(1, b"\x93" + msgpack.packb([2**32 - 1]) +
                            msgpack.packb("uint8") + _BIN32_MAX),
    "ndarray-dims": _ext32(1, b"\x93" + msgpack.packb([2**64 - 1, 4]) +
                           msgpack.packb("uint8") + _BIN32_MAX),
    "ndarray-shape-array32": _ext32(1, b"\x93\xdd\xff\xff\xff\xff"),
    "chunked": b"\x83" + b"".join(msgpack.packb(x) for x in (
        "__msgpack_chunked_array__", True, "shape", {"0": 2**32},
        "chunks")) + b"\xdf\xff\xff\xff\xff",
}


def _peak_allocation(fn: Callable[[], Any]) -> int:
  tracemalloc.start()
  try:
    tracemalloc.reset_peak()
    with pytest.raises(FlaxFormatError):
      fn()
    return tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()


@pytest.mark.parametrize("name", sorted(_HUGE_HEADERS))
@pytest.mark.parametrize("filler", [0, 16, 60_000])
@pytest.mark.parametrize("nested", [False, True])
def test_huge_declared_lengths_are_rejected_in_bounded_memory(
    name, filler, nested, tmp_path):
  body = _HUGE_HEADERS[name] + b"\x00" * filler
  data = b"\x81\xa6params\x81\xa1w" + body if nested else body
  _assert_rejected(data, tmp_path)
  if nested:
    _assert_rejected(data, None, subtree="params/w")
  peak = _peak_allocation(lambda: flax_format.load(data))
  assert peak < len(data) + 256 * 2**10, peak
  path = tmp_path / "hostile.flax"
  assert _peak_allocation(
      lambda: flax_format.load_file(str(path))) < len(data) + 256 * 2**10


def _nested_complex_exts(depth: int) -> bytes:
  """A complex ext holding a complex ext holding ... `depth` levels."""
  inner = msgpack.packb([1.0, 2.0])
  heads = [b"\xc9" + struct.pack(">I", len(inner) + 6 * k) + b"\x02"
           for k in range(depth - 1, -1, -1)]
  return b"".join(heads) + inner


_DEEP = {
    "arrays": b"\x91" * 100_000 + b"\xc0",
    "maps": b"\x81\xa1k" * 100_000 + b"\xc0",
    "map-keys": b"\x81" * 100_000 + b"\xc0",
    "complex-exts": _nested_complex_exts(100_000),
    "complex-exts-in-map": b"\x81\xa1z" + _nested_complex_exts(5_000),
}


@pytest.mark.parametrize("name", sorted(_DEEP))
def test_deep_nesting_is_rejected(name, tmp_path):
  data = _DEEP[name]
  _assert_rejected(data, tmp_path)
  if not name.startswith("complex"):  # skipping an ext does not decode it
    _assert_rejected(b"\x82\xa1a" + data + b"\xa1b\x01", tmp_path,
                     subtree="b")


def test_moderate_nesting_is_fine():
  state = current = {}
  for i in range(100):
    current[f"k{i}"] = current = {}
  current["leaf"] = np.arange(3)
  data = serialization.to_bytes(state)
  assert flax_format.save(state) == data
  _assert_same(flax_format.load(data), serialization.msgpack_restore(data))


@pytest.mark.parametrize("code", [0, 4, 5, 100, 127, -1, -128])
@pytest.mark.parametrize("size", [1, 3, 16, 300])
def test_unknown_ext_types_are_rejected(code, size, tmp_path):
  fixext = {1: b"\xd4", 16: b"\xd8"}
  head = fixext.get(size) or (b"\xc7" + struct.pack(">B", size) if size < 256
                              else b"\xc8" + struct.pack(">H", size))
  ext = head + struct.pack(">b", code) + b"x" * size
  err = _assert_rejected(b"\x81\xa1e" + ext, tmp_path)
  assert "ext" in str(err)


_GOOD = [[2], "float32", b"\x00" * 8]
_BAD_NDARRAY_PAYLOADS = {
    "not-array": msgpack.packb(5),
    "pair": msgpack.packb([[2], "float32"]),
    "quad": msgpack.packb(_GOOD + [1], use_bin_type=True),
    "map": msgpack.packb({"shape": [2]}),
    "shape-int": msgpack.packb([2, "float32", b"\x00" * 8], use_bin_type=True),
    "shape-map": msgpack.packb([{"0": 2}, "float32", b"\x00" * 8],
                               use_bin_type=True),
    "dim-str": msgpack.packb([["2"], "float32", b"\x00" * 8],
                             use_bin_type=True),
    "dim-float": msgpack.packb([[2.0], "float32", b"\x00" * 8],
                               use_bin_type=True),
    "dim-none": msgpack.packb([[None], "float32", b""], use_bin_type=True),
    "dim-bool": msgpack.packb([[True], "float32", b"\x00" * 4],
                              use_bin_type=True),
    "dim-negative": msgpack.packb([[-1], "float32", b"\x00" * 8],
                                  use_bin_type=True),
    "dims-negative-product-matches": msgpack.packb(
        [[-2, -1], "float32", b"\x00" * 8], use_bin_type=True),
    "dims-65": msgpack.packb([[1] * 65, "uint8", b"\x00"], use_bin_type=True),
    "dims-huge-zero-size": msgpack.packb([[0, 2**63], "float32", b""],
                                         use_bin_type=True),
    "dims-huger-zero-size": msgpack.packb([[2**64 - 1, 0], "uint8", b""],
                                          use_bin_type=True),
    "dims-overflow-zero-size": msgpack.packb(
        [[2**32, 2**32, 0], "uint8", b""], use_bin_type=True),
    "dtype-int": msgpack.packb([[2], 7, b"\x00" * 8], use_bin_type=True),
    "dtype-none": msgpack.packb([[2], None, b"\x00" * 8], use_bin_type=True),
    "data-int": msgpack.packb([[1], "uint8", 5], use_bin_type=True),
    "data-list": msgpack.packb([[1], "uint8", [0]], use_bin_type=True),
    "data-short": msgpack.packb([[3], "float32", b"\x00" * 8],
                                use_bin_type=True),
    "data-long": msgpack.packb([[1], "float32", b"\x00" * 8],
                               use_bin_type=True),
    "data-not-multiple": msgpack.packb([[], "float64", b"\x00" * 3],
                                       use_bin_type=True),
    "trailing": msgpack.packb(_GOOD, use_bin_type=True) + b"\xc0",
    "truncated": msgpack.packb(_GOOD, use_bin_type=True)[:-1],
    "empty": b"",
}
# (name, shape, byte count): the bytes a naive reader would accept.
_BAD_DTYPE_NAMES = [
    ("O", [1], 8), ("object", [1], 8), ("|O", [1], 8), ("O8", [1], 8),
    ("", [1], 4), ("x" * 1000, [1], 4), ("float32,int32", [1], 8),
    ("2f4", [], 8), ("2f4", [2], 16), ("3i2", [1], 6), ("(2,)f4", [], 8),
    ("str0", [1], 0), ("str7", [1], 1), ("V0", [1], 0), ("void", [1], 0),
    ("str", [1], 0), ("S0", [1], 0), ("U", [1], 0), ("a", [1], 0),
    ("str3200000000000000000000", [1], 4),
    ("bytes99999999999999999999999", [1], 4),
    ("void8000000000000000000000", [1], 4),
    ("U99999999999999999999", [1], 4), ("V99999999999999", [1], 4),
    ("M8[zz]", [1], 8), ("finfo", [1], 8), ("iinfo", [1], 8),
    ("int0", [1], 8), ("Float32", [1], 4), ("float32 ", [1], 4),
    ("bfloat16x", [1], 2), (b"\xff\xfe", [1], 4), (b"float32\x00", [1], 4),
]


@pytest.mark.parametrize("code", [1, 3])
@pytest.mark.parametrize("name", sorted(_BAD_NDARRAY_PAYLOADS))
def test_malformed_ndarray_payloads_are_rejected(name, code, tmp_path):
  payload = _BAD_NDARRAY_PAYLOADS[name]
  _assert_rejected(msgpack.packb({"w": msgpack.ExtType(code, payload)}),
                   tmp_path)


@pytest.mark.parametrize("code", [1, 3])
@pytest.mark.parametrize("name,shape,size", _BAD_DTYPE_NAMES,
                         ids=[repr(n)[:30] for n, _, _ in _BAD_DTYPE_NAMES])
def test_object_and_garbage_dtype_names_are_rejected(name, shape, size, code,
                                                     tmp_path):
  if name == "int0" and np.__version__ < "2":
    # numpy 1.x still names intp `int0`: read as Flax reads it there.
    data = _raw_ndarray(shape, name, b"\x01" * size, code)
    _assert_same(flax_format.load(data), serialization.msgpack_restore(data))
    return
  _assert_rejected(_raw_ndarray(shape, name, b"\x01" * size, code), tmp_path)


def test_good_ndarray_payload_is_accepted_as_a_control():
  for code in (1, 3):  # an npscalar ext of shape (2,) is an array, as in Flax
    got = flax_format.load(_raw_ndarray(*_GOOD, code=code))
    _assert_same(got, {"w": np.zeros(2, np.float32)})
  got = flax_format.load(_raw_ndarray([], "float32", b"\x00" * 4, code=3))
  assert type(got["w"]) is np.float32


_CHUNK_KEY = "__msgpack_chunked_array__"
_BAD_CHUNKED = {
    "shape-list": {_CHUNK_KEY: True, "shape": [3],
                   "chunks": {"0": np.arange(3)}},
    "shape-negative": {_CHUNK_KEY: True, "shape": {"0": -3},
                       "chunks": {"0": np.arange(3)}},
    "shape-str": {_CHUNK_KEY: True, "shape": {"0": "3"},
                  "chunks": {"0": np.arange(3)}},
    "shape-gap": {_CHUNK_KEY: True, "shape": {"1": 3},
                  "chunks": {"0": np.arange(3)}},
    "no-chunks": {_CHUNK_KEY: True, "shape": {"0": 3}},
    "chunks-list": {_CHUNK_KEY: True, "shape": {"0": 3},
                    "chunks": [np.arange(3)]},
    "chunks-empty": {_CHUNK_KEY: True, "shape": {"0": 0}, "chunks": {}},
    "chunks-gap": {_CHUNK_KEY: True, "shape": {"0": 6},
                   "chunks": {"0": np.arange(3), "2": np.arange(3)}},
    "chunk-not-array": {_CHUNK_KEY: True, "shape": {"0": 1},
                        "chunks": {"0": 5}},
    "chunk-2d": {_CHUNK_KEY: True, "shape": {"0": 4},
                 "chunks": {"0": np.zeros((2, 2))}},
    "chunk-0d": {_CHUNK_KEY: True, "shape": {},
                 "chunks": {"0": np.zeros(())}},
    "chunks-mixed-dtypes": {_CHUNK_KEY: True, "shape": {"0": 4},
                            "chunks": {"0": np.zeros(2, np.float32),
                                       "1": np.zeros(2, np.int8)}},
    "size-mismatch": {_CHUNK_KEY: True, "shape": {"0": 2, "1": 3},
                      "chunks": {"0": np.arange(4)}},
    "size-huge": {_CHUNK_KEY: True, "shape": {"0": 2**63, "1": 2**63},
                  "chunks": {"0": np.arange(4)}},
    # Shapes no file can hold, or numpy cannot make (load used to raise a
    # plain ValueError from reshape, inspect to describe them as if real).
    "size-10**12-one-chunk": {_CHUNK_KEY: True, "shape": {"0": 10**12},
                              "chunks": {"0": np.arange(3, dtype=np.int8)}},
    "size-zero-times-huge": {_CHUNK_KEY: True, "shape": {"0": 0, "1": 2**63},
                             "chunks": {"0": np.zeros(0, np.float32)}},
    "size-zero-times-2**62": {_CHUNK_KEY: True,
                              "shape": {"0": 0, "1": 2**62, "2": 2},
                              "chunks": {"0": np.zeros(0, np.int8)}},
    "dims-65": {_CHUNK_KEY: True, "shape": {str(i): 1 for i in range(65)},
                "chunks": {"0": np.zeros(1, np.int8)}},
    "dims-5000": {_CHUNK_KEY: True, "shape": {str(i): 1 for i in range(5000)},
                  "chunks": {"0": np.zeros(1, np.int8)}},
    "chunks-mixed-dtypes-same-size": {
        _CHUNK_KEY: True, "shape": {"0": 4},
        "chunks": {"0": np.zeros(2, np.float32), "1": np.zeros(2, np.int32)}},
    "chunk-is-chunked": {_CHUNK_KEY: True, "shape": {"0": 2}, "chunks": {
        "0": {_CHUNK_KEY: True, "shape": {"0": 2},
              "chunks": {"0": np.zeros(2, np.int8)}}}},
    "chunk-is-map-of-arrays": {_CHUNK_KEY: True, "shape": {"0": 4}, "chunks": {
        "0": {"a": np.zeros(2, np.int8), "b": np.zeros(2, np.int8)}}},
    "chunk-npscalar": {_CHUNK_KEY: True, "shape": {"0": 1},
                       "chunks": {"0": np.int8(3)}},
    "chunks-extra-key": {_CHUNK_KEY: True, "shape": {"0": 4},
                         "chunks": {"0": np.zeros(4, np.int8), "x": 1}},
}


@pytest.mark.parametrize("name", sorted(_BAD_CHUNKED))
def test_malformed_chunked_arrays_are_rejected(name, tmp_path):
  # inspect reads only headers, but checks what load checks: the shape is
  # one the chunks fill exactly, with 1-D chunks of one dtype.
  data = _pack({"p": {"w": _BAD_CHUNKED[name]}})
  _assert_rejected(data, tmp_path)
  with pytest.raises(FlaxFormatError):
    flax_format.inspect(data)
  _assert_rejected(data, None, subtree="p/w")
  _assert_rejected(_pack(_BAD_CHUNKED[name]), tmp_path)


def test_well_formed_handmade_chunked_array_is_accepted_as_a_control():
  chunked = {_CHUNK_KEY: True, "shape": {"0": 2, "1": 3},
             "chunks": {"0": np.arange(4), "1": np.arange(4, 6)}}
  data = _pack({"p": {"w": chunked}})
  _assert_same(flax_format.load(data), serialization.msgpack_restore(data))
  np.testing.assert_array_equal(flax_format.load(data)["p"]["w"],
                                np.arange(6).reshape(2, 3))


@pytest.mark.parametrize("payload", [
    msgpack.packb([1.0]), msgpack.packb([1.0, 2.0, 3.0]), msgpack.packb("ab"),
    msgpack.packb([1.0, "x"]), msgpack.packb([None, 1.0]), b"",
    msgpack.packb({"0": 1.0, "1": 2.0}), msgpack.packb([1.0])[:-1]],
    ids=["one", "three", "str", "str-part", "none-part", "empty", "map",
         "truncated"])
def test_malformed_complex_payloads_are_rejected(payload, tmp_path):
  _assert_rejected(msgpack.packb({"z": msgpack.ExtType(2, payload)}), tmp_path)


# --------------------------------------------------------------------------
# Bounded memory and linear time, whatever the shape of the input.
# --------------------------------------------------------------------------
#
# Each hostile family below is built byte by byte to cost the reader as much
# as possible per byte of file. A child process decodes and inspects it
# (`_MEASURE`) and reports, per operation, its peak RSS growth and wall time:
# the reader must return or raise FlaxFormatError within MEMORY_FACTOR x size
# + MEMORY_BASE bytes and a time linear in the size. Legitimate states of
# many small leaves must decode, within the same bounds.

_MIB = 2**20
# The size of each family's file: large enough that the amplification of an
# unbounded reader shows over MEMORY_BASE, small enough that all of them take
# seconds. Colliding keys cost an unbounded reader time quadratic in their
# number: 1 MiB of them, a minute.
_SHAPE_BYTES = _MIB // 2
_SHAPE_BYTES_OF = {"colliding-keys": _MIB}
# Seconds allowed per operation: the reader parses ~1 MiB of the worst shapes
# per second on one laptop core; CI cores are slower and two children share
# them.
_SECONDS_BASE = 3.0
_SECONDS_PER_MIB = 10.0


def _map32(n: int) -> bytes:
  return b"\xdf" + struct.pack(">I", n)


def _array32(n: int) -> bytes:
  return b"\xdd" + struct.pack(">I", n)


def _mp(obj: Any) -> bytes:
  return msgpack.packb(obj, use_bin_type=True)


def _tiny_ext(code: int, shape: list, data: bytes) -> bytes:
  return _mp(msgpack.ExtType(code, _mp([shape, "u1", data])))


def _empty_maps(size: int) -> bytes:
  """A list of empty maps: 1 byte each, a 64-byte dict each."""
  n = size - 5
  return _array32(n) + b"\x80" * n


def _empty_lists(size: int) -> bytes:
  n = size - 5
  return _array32(n) + b"\x90" * n


def _nils(size: int) -> bytes:
  """{0: None, 0: None, ...}: a leaf (LeafInfo, path) per 2 bytes."""
  n = (size - 5) // 2
  return _map32(n) + b"\x00\xc0" * n


def _deep(size: int) -> bytes:
  """250 nested maps, then leaves: each leaf's path repeats all 250 keys."""
  head = b"".join(b"\x81" + _mp(f"level{i:03d}") for i in range(250))
  n = (size - len(head) - 5) // 9
  return head + _map32(n) + b"".join(_mp(f"{i:07d}") + b"\xc0"
                                     for i in range(n))


def _wide(size: int) -> bytes:
  """A wide map of tiny values under 16-bit int keys."""
  n = (size - 5) // 4
  return _map32(n) + b"".join(b"\xcd" + struct.pack(">H", i % 2**16) + b"\x01"
                              for i in range(n))


def _long_key(size: int) -> bytes:
  """A key of half the file, then a leaf per 2 bytes: each path holds it."""
  key = "k" * (size // 2)
  n = (size - len(key) - 20) // 2
  return b"\x81" + _mp(key) + _map32(n) + b"\x00\xc0" * n


def _tiny_arrays(size: int) -> bytes:
  """10-byte ndarray exts (empty arrays, 1-byte scalars): a view each."""
  pair = _tiny_ext(1, [0], b"") + _tiny_ext(3, [], b"\x07")
  assert len(pair) == 20
  n = (size - 5) // 20
  return _array32(2 * n) + pair * n


def _chunked_level(inner: bytes, key: str = "x") -> bytes:
  """A valid chunked array's map whose extra key holds `inner`, and whose
  chunked-array key comes last (found only after `inner` is read)."""
  return (b"\x84" + _mp("shape") + _mp({"0": 1}) + _mp("chunks") +
          _mp({"0": msgpack.ExtType(1, _mp([[1], "u1", b"\x01"]))}) +
          _mp(key) + inner + _mp(_CHUNK_KEY) + b"\xc3")


def _rewind_linear(size: int, levels: int = 120) -> bytes:
  """120 chunked arrays nested under their "x" keys, the bulk at the bottom:
  a reader that re-reads a map once it knows it is a chunked array reads the
  bottom 120 times."""
  n = size - 60 * levels
  data = _array32(n) + b"\x01" * n
  for _ in range(levels):
    data = _chunked_level(data)
  return data


def _rewind_exponential(size: int, levels: int = 40) -> bytes:  # pylint: disable=unused-argument
  """Chunked arrays whose chunk is the next one: re-describing the chunks of
  each map once it is known to be a chunked array doubles the work per
  level (2**40 here)."""
  data = _mp({"shape": {"0": 1}, _CHUNK_KEY: True, "chunks": {
      "0": msgpack.ExtType(1, _mp([[1], "u1", b"\x01"]))}})
  for _ in range(levels):
    data = (b"\x83" + _mp("shape") + _mp({"0": 1}) + _mp("chunks") + b"\x81" +
            _mp("0") + data + _mp(_CHUNK_KEY) + b"\xc3")
  return data


def _many_chunks(size: int) -> bytes:
  """A valid chunked array of 1-element chunks: 12 bytes each."""
  chunk = _tiny_ext(1, [1], b"\x05")
  n = (size - 100) // (len(chunk) + 8)
  chunks = b"".join(_mp(str(i)) + chunk for i in range(n))
  return (b"\x83" + _mp(_CHUNK_KEY) + b"\xc3" + _mp("shape") + _mp({"0": n}) +
          _mp("chunks") + _map32(n) + chunks)


def _colliding_keys(size: int) -> bytes:
  """Complex keys of one hash (hash(a + bj) = hash(a) + 1000003 hash(b)):
  building a dict of them is quadratic."""
  n = (size - 5) // 23
  top = 1000003 * (n + 1)
  return _map32(n) + b"".join(
      _mp(msgpack.ExtType(2, msgpack.packb([float(top - 1000003 * k),
                                            float(k)]))) + b"\x01"
      for k in range(1, n + 1))


_HOSTILE_SHAPES = {
    "empty-maps": _empty_maps, "empty-lists": _empty_lists, "nils": _nils,
    "deep-paths": _deep, "wide-map": _wide, "long-key-paths": _long_key,
    "tiny-arrays": _tiny_arrays, "rewind-linear": _rewind_linear,
    "rewind-exponential": _rewind_exponential, "many-chunks": _many_chunks,
    "colliding-keys": _colliding_keys,
}


def _legit_small_ints(size: int) -> Any:
  """A dict of short string keys to small ints (~9 bytes per entry)."""
  return {str(i): i % 1000 for i in range(size // 9)}


def _legit_floats(size: int) -> Any:
  """A list of python floats (a dict "0", "1", ... in the file)."""
  return [i / 3 for i in range(size // 16)]


def _legit_tiny_arrays(size: int) -> Any:
  """0-d arrays and numpy scalars (~28 bytes per leaf)."""
  return {f"a{i}": np.array(i, np.float32) if i % 2 else np.int16(i % 30000)
          for i in range(size // 28)}


def _legit_nested(size: int) -> Any:
  """Tiny nested dicts, None leaves and empty dicts (~20 bytes each)."""
  return [{"a": i % 100, "b": None, "c": {}, "d": (True, 0.5)}
          for i in range(size // 24)]


def _legit_model(size: int) -> Any:
  """A small model's state: many tiny arrays, optimizer moments, scalars."""
  layers = {f"Dense_{i}": {"kernel": np.full((2, 2), i, np.float32),
                           "bias": np.zeros(2, ml_dtypes.bfloat16)}
            for i in range(size // 240)}
  return {"params": layers,
          "opt_state": [{"count": np.int32(3), "mu": layers, "nu": layers},
                        {}, None],
          "step": 12345, "rng": np.arange(2, dtype=np.uint32)}


_LEGIT_STATES = {
    "small-ints": _legit_small_ints, "floats": _legit_floats,
    "tiny-arrays": _legit_tiny_arrays, "nested": _legit_nested,
    "model": _legit_model,
}


def _wrapped(payload: bytes) -> bytes:
  """{"x": payload, "y": 1}: subtree "y" must skip the payload."""
  return b"\x82\xa1x" + payload + b"\xa1y\x01"


_MEASURE = textwrap.dedent(r"""
    import gc, json, re, resource, sys, time
    import ml_dtypes, numpy as np  # their import is not the reader's cost
    from clu_ckpt import flax_format as ff

    def status(key):
      with open("/proc/self/status") as f:
        return int(re.search(key + r":\s+(\d+)", f.read()).group(1)) * 1024

    def reset_peak():  # Linux >= 4.0; if refused, peaks only grow: safe side
      try:
        with open("/proc/self/clear_refs", "w") as f:
          f.write("5")
      except OSError:
        pass

    path, subtree = sys.argv[1], sys.argv[2]
    with open(path, "rb") as f:
      data = f.read()
    bound = ff.MEMORY_FACTOR * len(data) + ff.MEMORY_BASE
    # An unbounded reader meets MemoryError here, not the OOM killer.
    limit = status("VmSize") + 2 * bound + 2**30
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    warm = ff.save({"w": np.ones(2, ml_dtypes.bfloat16), "s": [1, "x", 0.5],
                    "n": np.int8(1), "c": 1j, "b": b"x", "e": {}})
    ff.inspect(warm), ff.load(warm), ff.load(warm, writable=True)
    ops = {"load_file": lambda: ff.load_file(path),
           "load_writable": lambda: ff.load(data, writable=True),
           "load_subtree": lambda: ff.load(data, subtree=subtree),
           "inspect_file": lambda: ff.inspect_file(path)}
    report = {}
    for name, op in ops.items():
      gc.collect()
      reset_peak()
      before = status("VmRSS")
      start = time.perf_counter()
      try:
        result = op()
        outcome = "value"
      except ff.FlaxFormatError as e:
        outcome = "FlaxFormatError: " + str(e)
      except BaseException as e:  # pylint: disable=broad-except
        outcome = type(e).__name__ + ": " + str(e)
      seconds = time.perf_counter() - start
      peak = status("VmHWM") - before
      result = None
      report[name] = {"outcome": outcome[:600], "peak": peak,
                      "seconds": round(seconds, 3)}
    print(json.dumps(report))
    """)


def _seconds_allowed(size: int) -> float:
  return _SECONDS_BASE + _SECONDS_PER_MIB * size / _MIB


def _measure(path: Path, subtree: str = "y") -> dict:
  """Runs `_MEASURE` on `path` in a child: {operation: outcome, peak, s}."""
  timeout = 4 * _seconds_allowed(path.stat().st_size) + 30
  env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
  try:
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(path), subtree],
                          cwd=_REPO, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
  except subprocess.TimeoutExpired:
    return {"child": f"no answer within {timeout:.0f} s"}
  if proc.returncode or not proc.stdout.strip():
    return {"child": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _shape_file(name: str) -> bytes:
  """The file of family `name` ("hostile/..." or "legit/...")."""
  kind, family = name.split("/")
  if kind == "hostile":
    return _wrapped(_HOSTILE_SHAPES[family](_SHAPE_BYTES_OF.get(
        family, _SHAPE_BYTES)))
  return _wrapped(serialization.to_bytes(
      _LEGIT_STATES[family](_SHAPE_BYTES)))


class _ShapeReports(dict):
  """{name: (file size, `_measure` report)}, each measured on first use."""

  def __init__(self, directory: Path):
    super().__init__()
    self.directory = directory

  def _write(self, name: str) -> tuple[int, Path]:
    data = _shape_file(name)
    path = self.directory / (name.replace("/", "-") + ".flax")
    path.write_bytes(data)
    return len(data), path

  def __missing__(self, name: str) -> tuple[int, dict]:
    size, path = self._write(name)
    self[name] = (size, _measure(path))
    return self[name]

  def measure_all(self) -> None:
    """Every family measured in a child, two children at a time."""
    names = [f"hostile/{n}" for n in _HOSTILE_SHAPES] + [
        f"legit/{n}" for n in _LEGIT_STATES]
    written = {name: self._write(name) for name in names}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      futures = {name: pool.submit(_measure, path)
                 for name, (_, path) in written.items()}
      for name, (size, _) in written.items():
        self[name] = (size, futures[name].result())


@pytest.fixture(scope="module")
def shape_reports(tmp_path_factory, request) -> dict[str, tuple[int, dict]]:
  """The families measured in children: all of them, two at a time, when the
  soak tests run (--soak); otherwise only those a test asks for."""
  reports = _ShapeReports(tmp_path_factory.mktemp("shapes"))
  if request.config.getoption("--soak"):
    reports.measure_all()
  return reports


def _check_bounded(size: int, report: dict, legit: bool) -> None:
  """Every operation returned (or, if hostile, raised FlaxFormatError) within
  MEMORY_FACTOR x size + MEMORY_BASE bytes and the linear time bound."""
  assert "child" not in report, report["child"]
  bound = flax_format.MEMORY_FACTOR * size + flax_format.MEMORY_BASE
  seconds = _seconds_allowed(size)
  problems = []
  for op, got in report.items():
    allowed = got["outcome"] == "value" or (
        not legit and got["outcome"].startswith("FlaxFormatError: "))
    if not allowed:
      problems.append(f"{op}: {got['outcome']}")
    if got["peak"] > bound:
      problems.append(f"{op}: peak RSS growth {got['peak'] / _MIB:.1f} MiB "
                      f"({got['peak'] / size:.0f} x the {size}-byte file) > "
                      f"bound {bound / _MIB:.1f} MiB")
    if got["seconds"] > seconds:
      problems.append(f"{op}: {got['seconds']:.1f} s > {seconds:.1f} s")
  assert not problems, problems


# The two tests of `shape_reports` are soaks (run with --soak: 16 child
# processes); their quick versions are the in-process tests after them.
@pytest.mark.soak
@pytest.mark.parametrize("name", sorted(_HOSTILE_SHAPES))
def test_hostile_shapes_cost_bounded_memory_and_linear_time(name,
                                                            shape_reports):
  size, report = shape_reports[f"hostile/{name}"]
  _check_bounded(size, report, legit=False)


@pytest.mark.soak
@pytest.mark.parametrize("name", sorted(_LEGIT_STATES))
def test_many_small_leaves_states_decode_within_the_bound(name, shape_reports):
  size, report = shape_reports[f"legit/{name}"]
  _check_bounded(size, report, legit=True)


@pytest.mark.thorough("nested")
@pytest.mark.parametrize("name", sorted(_LEGIT_STATES))
def test_many_small_leaves_states_load_like_flax_on_the_factor_alone(
    name, monkeypatch):
  """With MEMORY_BASE = 0, the reader's estimates of these states must stay
  under MEMORY_FACTOR x their size: so they load at any scale."""
  state = _LEGIT_STATES[name](_MIB // 4)
  data = serialization.to_bytes(state)
  monkeypatch.setattr(flax_format, "MEMORY_BASE", 0)
  got = flax_format.load(data)
  _assert_same(got, serialization.msgpack_restore(data))
  _assert_same(flax_format.load(data, writable=True), got)
  infos = flax_format.inspect(data)
  assert [i.path for i in infos] == [p for p, _ in _leaves(got)]
  first = next(iter(got))
  _assert_same(flax_format.load(data, subtree=first), got[first])


def _count_headers(monkeypatch) -> list:
  """Counts the msgpack headers the reader parses."""
  calls = [0]
  header = flax_format._Reader._header  # pylint: disable=protected-access

  def counting(self):
    calls[0] += 1
    return header(self)

  monkeypatch.setattr(flax_format._Reader, "_header", counting)  # pylint: disable=protected-access
  return calls


@pytest.mark.parametrize("name", sorted(_HOSTILE_SHAPES))
def test_hostile_shapes_parse_each_byte_a_bounded_number_of_times(
    name, monkeypatch):
  """Linear time without a clock: headers parsed <= 2 x the file's bytes."""
  if name == "rewind-exponential":
    data = _wrapped(_rewind_exponential(0, levels=12))  # 2**12 x before
  else:
    data = _wrapped(_HOSTILE_SHAPES[name](16 * 2**10))
  calls = _count_headers(monkeypatch)
  for op in (flax_format.inspect, flax_format.load,
             lambda d: flax_format.load(d, subtree="y")):
    calls[0] = 0
    try:
      op(data)
    except FlaxFormatError:
      pass
    assert calls[0] <= 2 * len(data), (op, calls[0], len(data))


def test_rewound_chunked_arrays_are_one_leaf_each():
  data = _wrapped(_rewind_linear(20_000, levels=30))
  got = flax_format.load(data)
  np.testing.assert_array_equal(got["x"], np.array([1], np.uint8))
  assert got["y"] == 1
  (x, y) = flax_format.inspect(data)
  assert (x.path, x.kind, x.dtype, x.shape, x.nbytes) == (
      "/x", "ndarray", "uint8", (1,), 1)
  assert data[x.offset] == 1 and (y.path, y.kind) == ("/y", "int")
  with pytest.raises(FlaxFormatError, match="not 1-D arrays"):
    flax_format.inspect(_wrapped(_rewind_exponential(0, levels=12)))
  with pytest.raises(FlaxFormatError, match="not 1-D arrays"):
    flax_format.load(_wrapped(_rewind_exponential(0, levels=12)))


def test_many_chunks_join_and_inspect_alike():
  data = _many_chunks(50_000)
  got = flax_format.load(data)
  assert got.dtype == np.uint8 and (got == 5).all()
  (info,) = flax_format.inspect(data)
  assert (info.kind, info.dtype, info.shape, info.nbytes) == (
      "ndarray", "uint8", got.shape, got.size)
  _assert_same(got, serialization.msgpack_restore(data))


def test_memory_refusal_names_the_file_the_offset_and_the_bound(
    shape_reports, tmp_path_factory, monkeypatch):
  # Measured in a child (an unbounded reader would take the machine's memory
  # here): inspect_file refuses the long key repeated in every path.
  size, report = shape_reports["hostile/long-key-paths"]
  limit = flax_format.MEMORY_FACTOR * size + flax_format.MEMORY_BASE
  outcome = report["inspect_file"]["outcome"]
  assert outcome.startswith("FlaxFormatError: /"), outcome
  assert "hostile-long-key-paths.flax at byte " in outcome, outcome
  assert (f"would need more than {limit} bytes of memory for a {size}-byte "
          "file") in outcome, outcome
  assert report["load_file"]["outcome"] == "value"  # the key is one string
  # Without MEMORY_BASE, a list of empty maps (72 bytes each) is refused.
  monkeypatch.setattr(flax_format, "MEMORY_BASE", 0)
  empty = _wrapped(_empty_maps(200_000))
  with pytest.raises(FlaxFormatError, match="bytes of memory") as caught:
    flax_format.load(empty)
  _check_error(caught.value, len(empty))
  path = tmp_path_factory.mktemp("refusal") / "empty.flax"
  path.write_bytes(empty)
  with pytest.raises(FlaxFormatError, match="bytes of memory") as caught:
    flax_format.load_file(str(path))
  _check_error(caught.value, len(empty), str(path))


@pytest.mark.parametrize("key", [1.5, float("nan"), 2.0, 1 + 2j, 0j])
def test_float_and_complex_map_keys_are_rejected(key, tmp_path):
  """Their hashes can be made to collide (see _colliding_keys)."""
  def default(x):
    return msgpack.ExtType(2, msgpack.packb([x.real, x.imag]))
  data = b"\x81\xa1a\x81" + msgpack.packb(key, default=default) + b"\x01"
  err = _assert_rejected(data, tmp_path)
  assert "map key of type" in str(err)
  with pytest.raises(FlaxFormatError, match="map key of type"):
    flax_format.inspect(data)


def test_int_bytes_and_none_map_keys_still_load():
  data = b"\x84" + b"".join(msgpack.packb(k) + b"\x01" for k in (
      5, -3, None, True))
  assert flax_format.load(data) == {5: 1, -3: 1, None: 1, True: 1}
  data = b"\x81\xc4\x02ab\x01"
  assert flax_format.load(data) == {b"ab": 1}
  assert [i.path for i in flax_format.inspect(data)] == ["/b'ab'"]


def test_leaf_info_is_small_and_compares_by_value():
  info = flax_format.LeafInfo("/a", "int", None, None, 0, 3)
  assert not hasattr(info, "__dict__")
  assert info == flax_format.LeafInfo("/a", "int", None, None, 0, 3)
  with pytest.raises(dataclasses.FrozenInstanceError):
    info.path = "/b"  # type: ignore[misc]


# --------------------------------------------------------------------------
# Crash safety of save_file.
# --------------------------------------------------------------------------


class _Opaque:
  """A leaf no Flax serializer knows."""


@pytest.mark.parametrize("bad,error", [
    (_Opaque(), TypeError), (2**64, _FLAX_INT_ERROR),
    (np.array([None], dtype=object), ValueError)], ids=["type", "int", "obj"])
def test_failed_save_leaves_destination_untouched(bad, error, tmp_path):
  path = tmp_path / "ckpt.flax"
  previous = {"w": np.arange(5.0), "step": 1}
  flax_format.save_file(previous, str(path))
  before = path.read_bytes()
  # 64 MiB of array data is streamed to the temporary file before `bad`.
  state = {"big": np.ones(16 * 2**20, np.float32), "bad": bad}
  with pytest.raises(error):
    serialization.to_bytes(state)
  with pytest.raises(error):
    flax_format.save_file(state, str(path))
  assert path.read_bytes() == before
  assert os.listdir(tmp_path) == ["ckpt.flax"]
  _assert_same(flax_format.load_file(str(path)),
               serialization.msgpack_restore(before))
  with pytest.raises(error):
    flax_format.save_file(state, str(tmp_path / "new.flax"))
  assert os.listdir(tmp_path) == ["ckpt.flax"]


def test_save_file_replaces_previous_content_whole(tmp_path):
  path = tmp_path / "ckpt.flax"
  path.write_bytes(b"\xff" * 10_000)  # longer than the new content
  state = _rich_state()
  n = flax_format.save_file(state, str(path))
  want = serialization.to_bytes(state)
  assert n == len(want) and path.read_bytes() == want
  assert os.listdir(tmp_path) == ["ckpt.flax"]


# --------------------------------------------------------------------------
# Import hygiene.
# --------------------------------------------------------------------------


def test_reading_imports_neither_tensorflow_nor_jax(tmp_path):
  path = tmp_path / "h.flax"
  flax_format.save_file(_rich_state(), str(path))
  script = textwrap.dedent(f"""
      import json, sys
      import numpy as np
      import clu_ckpt.flax_format as ff
      state = ff.load_file({str(path)!r})
      infos = ff.inspect_file({str(path)!r})
      params = ff.load_file({str(path)!r}, subtree="params")
      ff.save_file({{"a": np.ones(3), "b": [1, (2, 3)], "c": {{"d": 1.5}}}},
                   {str(tmp_path / "plain.flax")!r})
      heavy = sorted(m for m in sys.modules
                     if m.split(".")[0] in ("tensorflow", "jax", "flax",
                                            "orbax"))
      print(json.dumps({{"heavy": heavy, "leaves": len(infos),
                         "kernel": float(params["Dense_0"]["kernel"].sum()),
                         "step": state["step"]}}))
      """)
  result = subprocess.run([sys.executable, "-c", script], cwd=_REPO,
                          capture_output=True, text=True, check=True)
  report = json.loads(result.stdout.strip().splitlines()[-1])
  assert report == {"heavy": [], "leaves": 14, "kernel": 66.0, "step": 12345}
  plain = {"a": np.ones(3), "b": [1, (2, 3)], "c": {"d": 1.5}}
  assert (tmp_path / "plain.flax").read_bytes() == serialization.to_bytes(
      plain)


def test_str_scalar_with_invalid_code_points_is_a_format_error():
  """Found by the soak fuzzer: numpy raised SystemError on such scalars."""
  data = bytearray(flax_format.save({"s": np.str_("a")}))
  at = data.index("a".encode("utf-32-le"))
  data[at:at + 4] = b"\xff\xff\xff\xff"
  with pytest.raises(flax_format.FlaxFormatError, match="code points"):
    flax_format.load(bytes(data))


def test_str_array_with_invalid_code_points_round_trips():
  """numpy holds such arrays; to_bytes writes them, so load gives them back."""
  arr = np.frombuffer(b"\xff\xff\xff\xff" * 2, dtype="<U1")
  data = flax_format.save({"s": arr})
  assert data == serialization.to_bytes({"s": arr})
  loaded = flax_format.load(data)["s"]
  assert loaded.dtype == arr.dtype and loaded.tobytes() == arr.tobytes()


# --------------------------------------------------------------------------
# FlaxFile: one handle, one parse.
# --------------------------------------------------------------------------


def test_flax_file_hands_out_tree_leaves_and_subtrees(tmp_path, monkeypatch):
  state = _rich_state()
  path = tmp_path / "ckpt-1.flax"
  flax_format.save_file(state, str(path))
  parses = []
  init = flax_format._Reader.__init__  # pylint: disable=protected-access

  def counting(self, *args, **kwargs):
    parses.append(args[1])
    init(self, *args, **kwargs)

  want_tree = flax_format.load_file(str(path))
  want_leaves = flax_format.inspect_file(str(path))
  monkeypatch.setattr(flax_format._Reader, "__init__", counting)  # pylint: disable=protected-access
  with flax_format.open_file(str(path)) as handle:
    assert parses == []  # parsed on first use
    _assert_same(handle.tree, want_tree)
    assert handle.leaves == want_leaves
    assert handle.nbytes == sum(leaf.nbytes for leaf in want_leaves)
    for keys in _key_paths(want_tree):
      _assert_same(handle.subtree(keys), _get(want_tree, keys))
      _assert_same(handle.subtree("/".join(keys)), _get(want_tree, keys))
    with pytest.raises(FlaxFormatError, match="no subtree"):
      handle.subtree("nope")
    leaf = next(p for p in _key_paths(want_tree)
                if not isinstance(_get(want_tree, p), dict))
    with pytest.raises(FlaxFormatError, match="is not a map"):
      handle.subtree(leaf + ("below",))
    arrays = [v for _, v in _leaves(handle.tree) if isinstance(v, np.ndarray)]
    assert arrays and not any(a.flags.writeable for a in arrays)
  assert parses == [str(path)]
  with pytest.raises(ValueError, match="closed"):
    handle.tree  # pylint: disable=pointless-statement


def test_flax_file_missing_empty_and_corrupt_files(tmp_path):
  with pytest.raises(FileNotFoundError):
    flax_format.FlaxFile(str(tmp_path / "missing.flax"))
  (tmp_path / "empty.flax").write_bytes(b"")
  with pytest.raises(FlaxFormatError, match="empty"):
    flax_format.FlaxFile(str(tmp_path / "empty.flax"))
  data = flax_format.save(_rich_state())
  (tmp_path / "cut.flax").write_bytes(data[:-3])
  handle = flax_format.FlaxFile(str(tmp_path / "cut.flax"))
  with pytest.raises(FlaxFormatError, match="truncated"):
    handle.leaves  # pylint: disable=pointless-statement


def test_flax_file_chunked_arrays_are_one_leaf_and_joined(tmp_path,
                                                          monkeypatch):
  monkeypatch.setattr(flax_format, "CHUNK_BYTES", 64)
  state = {"big": np.arange(100, dtype=np.float32).reshape(10, 10),
           "small": {"x": np.arange(3, dtype=np.int8)}}
  path = tmp_path / "chunked.flax"
  flax_format.save_file(state, str(path))
  with flax_format.FlaxFile(str(path)) as handle:
    assert handle.leaves == flax_format.inspect_file(str(path))
    assert [(l.path, l.shape, l.nbytes) for l in handle.leaves] == [
        ("/big", (10, 10), 400), ("/small/x", (3,), 3)]
    _assert_same(handle.tree, state)
  _check_handle(path)


# --------------------------------------------------------------------------
# The dtype codec.
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [d for d in _ALL_DTYPES if d.fields is None], ids=str)
def test_dtype_codec_round_trips_every_dtype(dtype):
  assert flax_format.dtype_from_name(flax_format.dtype_name(dtype)) == dtype
  # What `.flax` files hold (dtype.name), as str and as bytes.
  assert flax_format.dtype_from_name(dtype.name) == dtype
  assert flax_format.dtype_from_name(dtype.name.encode()) == dtype
  if not dtype.type.__module__.startswith("ml_dtypes"):
    # What migrated steps recorded: `.str` forms.
    assert flax_format.dtype_name(dtype) == dtype.str
    assert flax_format.dtype_from_name(dtype.str) == dtype


def test_dtype_codec_keeps_byte_order_and_odd_dtypes():
  for name in (">i8", ">f4", "<M8[s]", "|V4", "<U3", "|S2", "|b1"):
    dtype = np.dtype(name)
    assert flax_format.dtype_name(dtype) == name
    assert flax_format.dtype_from_name(name) == dtype
  assert flax_format.dtype_from_name("bfloat16") == np.dtype(ml_dtypes.bfloat16)
  assert flax_format.dtype_name(ml_dtypes.int4) == "int4"


@pytest.mark.parametrize("name", ["", "nope", "<", "float32 ", "<f4\x00",
                                  "x" * 40, b"\xff"])
def test_dtype_codec_refuses_unknown_names(name):
  with pytest.raises(ValueError, match="unknown dtype"):
    flax_format.dtype_from_name(name)


def test_private_dtype_alias_still_reads_flax_names():
  assert flax_format._dtype_from_name(b"float32") == np.float32  # pylint: disable=protected-access
  assert flax_format._dtype_from_name(b"str128") == np.dtype("U4")  # pylint: disable=protected-access
  assert flax_format._dtype_from_name(b"nope") is None  # pylint: disable=protected-access
