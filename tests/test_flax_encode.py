"""Tests for `clu_ckpt.flax_encode`: Flax's `MAX_CHUNK_SIZE` is honoured.

`flax.serialization.to_bytes` chunks every array of more than
`flax.serialization.MAX_CHUNK_SIZE` bytes (a module attribute users may
change) into a `{"__msgpack_chunked_array__": True, "shape": ..., "chunks":
...}` map. With Flax loaded and that attribute changed, `flax_format.save` and
`save_file` must still give the bytes `to_bytes` gives, and `flax_format.load`
must read them as `msgpack_restore` does. Flax's own serialization tests are
not shipped in the installed wheel, so the behaviours they check about chunking
(the pieces a chunked array is cut into, round trips through chunked maps) are
checked here in our words, against Flax itself.

Synopsis::

  python -m pytest -q tests/test_flax_encode.py
"""

from __future__ import annotations

import os
from pathlib import Path
import subprocess
import sys
import textwrap
from typing import Any

import flax
from flax import serialization
import jax.numpy as jnp
import ml_dtypes
import msgpack
import numpy as np
import pytest

from clu_ckpt import flax_encode
from clu_ckpt import flax_format

_REPO = Path(__file__).resolve().parents[1]
_KEY = "__msgpack_chunked_array__"


@flax.struct.dataclass
class _Model:
  params: Any
  step: Any


def _states() -> dict[str, Any]:
  rng = np.random.default_rng(0)
  grid = np.arange(3 * 7 * 13, dtype=np.float32).reshape(3, 7, 13)  # 1092 B
  return {
      "multi_dim": {"w": grid, "b": np.arange(13, dtype=np.int16)},
      "odd_sizes": {"a": rng.integers(0, 255, size=(11, 3), dtype=np.uint8),
                    "b": rng.normal(size=(7, 9)),            # 504 bytes
                    "c": np.arange(17, dtype=np.int32),      # 68 bytes
                    "d": rng.normal(size=(9, 17, 2))},       # 2448 bytes
      "bfloat16": {"np": np.arange(2 * 3 * 11 * 9).reshape(2, 3, 11, 9).astype(
                       ml_dtypes.bfloat16),                  # 1188 bytes
                   "jax": jnp.linspace(0, 1, 45, dtype=jnp.bfloat16)},
      "jax": {"k": jnp.arange(325, dtype=jnp.float32).reshape(13, 25),
              "count": jnp.int32(7)},
      "non_contiguous": {"fortran": np.asfortranarray(grid[0]),
                         "strided": np.arange(1000, dtype=np.int64)[::3],
                         "transposed": grid.T},
      "scalars_and_edges": {"zero_d": np.array(2.5), "empty": np.zeros((0, 4)),
                            "np_scalar": np.float64(1.5), "py": [1, 2.0, None],
                            "text": "x", "complex": 1 + 2j,
                            "vec": np.arange(300.0)},
      "top_level_array": np.arange(150, dtype=np.float64).reshape(25, 6),
      "dataclass": _Model(params={"w": np.ones((20, 20), np.float32)}, step=3),
  }


def _assert_same_tree(got: Any, want: Any, path: str = "") -> None:
  """Same keys in the same order; arrays bit-equal with dtype and shape."""
  if isinstance(want, dict):
    assert isinstance(got, dict), path
    assert list(got) == list(want), path
    for key in want:
      _assert_same_tree(got[key], want[key], f"{path}/{key}")
  elif isinstance(want, (np.ndarray, np.generic)):
    got_array, want_array = np.asarray(got), np.asarray(want)
    assert (got_array.dtype, got_array.shape) == (want_array.dtype,
                                                  want_array.shape), path
    assert got_array.tobytes() == want_array.tobytes(), path
  else:
    assert type(got) is type(want) and got == want, path


@pytest.mark.parametrize("max_chunk", [1, 7, 64, 333, 1000, 2049])
@pytest.mark.parametrize("name", list(_states()))
def test_save_follows_flax_max_chunk_size(name, max_chunk, tmp_path,
                                          monkeypatch):
  state = _states()[name]
  monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", max_chunk)
  want = serialization.to_bytes(state)
  assert flax_format.save(state) == want
  path = tmp_path / "state.flax"
  assert flax_format.save_file(state, str(path)) == len(want)
  assert path.read_bytes() == want
  expected = serialization.msgpack_restore(want)
  _assert_same_tree(flax_format.load(want), expected)
  _assert_same_tree(flax_format.load_file(str(path)), expected)


def test_a_changed_max_chunk_size_really_chunks(monkeypatch):
  state = {"w": np.arange(100, dtype=np.float32)}  # 400 bytes
  default = flax_format.save(state)
  assert _KEY.encode() not in default
  monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 64)
  chunked = flax_format.save(state)
  assert chunked != default and _KEY.encode() in chunked
  assert chunked == serialization.to_bytes(state)


def _structure(data: bytes) -> Any:
  """The msgpack tree with map keys in file order; arrays as (shape, dtype)."""

  def ext(code, payload):
    shape, dtype, _ = msgpack.unpackb(payload)
    return (code, tuple(shape), dtype)

  return msgpack.unpackb(data, ext_hook=ext, object_pairs_hook=list,
                         strict_map_key=False)


@pytest.mark.parametrize("dtype, n, max_chunk, pieces", [
    # (dtype, elements, MAX_CHUNK_SIZE, the chunk lengths Flax cuts)
    (np.float64, 10_000, 91 * 8, [91] * 109 + [81]),
    (np.float64, 100, 91 * 8, [91, 9]),
    (np.int32, 10, 7, [1] * 10),          # 7 bytes < one int32: 1 per chunk
    (np.int32, 10, 9, [2] * 5),           # int(9 / 4) == 2
    (np.int16, 9, 6, [3, 3, 3]),          # exact multiple
    (ml_dtypes.bfloat16, 11, 5, [2] * 5 + [1]),
    (np.uint8, 65, 64, [64, 1]),          # one byte over the limit
])
def test_chunk_boundaries_are_flaxs(dtype, n, max_chunk, pieces, monkeypatch):
  monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", max_chunk)
  arr = np.arange(n).astype(dtype)
  data = flax_format.save({"x": arr})
  assert data == serialization.to_bytes({"x": arr})
  [(key, chunked)] = _structure(data)
  assert key == "x"
  assert [k for k, _ in chunked] == [_KEY, "shape", "chunks"]
  assert dict(chunked)[_KEY] is True
  assert dict(chunked)["shape"] == [("0", n)]
  chunks = dict(chunked)["chunks"]
  assert [k for k, _ in chunks] == [str(i) for i in range(len(pieces))]
  assert [shape for _, (_, shape, _) in chunks] == [(p,) for p in pieces]
  assert sum(pieces) == n
  np.testing.assert_array_equal(flax_format.load(data)["x"], arr)


@pytest.mark.parametrize("dtype", [np.uint8, np.float32, ml_dtypes.bfloat16])
def test_chunking_starts_one_byte_over_the_limit(dtype, monkeypatch):
  itemsize = np.dtype(dtype).itemsize
  monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 12 * itemsize)
  at_limit = {"x": np.ones((3, 4), dtype)}
  over = {"x": np.ones((13,), dtype)}
  assert _KEY.encode() not in flax_format.save(at_limit)
  assert _KEY.encode() in flax_format.save(over)
  for state in (at_limit, over):
    assert flax_format.save(state) == serialization.to_bytes(state)


def test_multi_dim_chunked_round_trip_keeps_the_shape(monkeypatch):
  monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 91 * 8)
  arr = np.random.default_rng(1).uniform(size=(100, 100))
  data = flax_format.save({"a": arr})
  [(_, chunked)] = _structure(data)
  assert dict(chunked)["shape"] == [("0", 100), ("1", 100)]
  restored = flax_format.load(data)["a"]
  assert restored.shape == (100, 100)
  np.testing.assert_array_equal(restored, arr)
  np.testing.assert_array_equal(serialization.msgpack_restore(data)["a"], arr)
  target = {"a": np.zeros((100, 100))}
  np.testing.assert_array_equal(
      serialization.from_bytes(target, data)["a"], arr)


def test_numpy_scalars_are_never_chunked(monkeypatch):
  monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 1)
  state = {"s": np.float64(3.0), "a": np.array(3.0)}
  data = flax_format.save(state)
  assert data == serialization.to_bytes(state)
  assert data.count(_KEY.encode()) == 1  # the 0-d array only
  got = flax_format.load(data)
  assert got["s"] == 3.0 and got["a"].shape == ()


# --------------------------------------------------------------------------
# Precedence: flax_format.CHUNK_BYTES set explicitly, Flax's value, default.
# --------------------------------------------------------------------------


def test_chunk_bytes_precedence(monkeypatch):
  assert flax_format.chunk_bytes() == 2**30
  monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 64)
  assert flax_format.chunk_bytes() == 64
  monkeypatch.setattr(flax_format, "CHUNK_BYTES", 1000)
  assert flax_format.chunk_bytes() == 1000  # an explicit change here wins
  monkeypatch.setattr(flax_format, "CHUNK_BYTES", 2**30)
  assert flax_format.chunk_bytes() == 64  # the default defers to Flax
  monkeypatch.delitem(sys.modules, "flax.serialization")
  assert flax_format.chunk_bytes() == 2**30  # Flax not loaded: the default


def test_explicit_chunk_bytes_wins_over_flax(monkeypatch):
  state = {"w": np.arange(300, dtype=np.int32)}  # 1200 bytes
  monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 7)
  monkeypatch.setattr(flax_format, "CHUNK_BYTES", 500)
  data = flax_format.save(state)
  assert data != serialization.to_bytes(state)
  monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 500)
  assert data == serialization.to_bytes(state)


def test_encode_uses_the_chunk_bytes_it_is_given():
  state = {"w": np.arange(10, dtype=np.int8)}
  out = bytearray()
  n = flax_encode.encode(state, out.extend, chunk_bytes=4)
  assert n == len(out)
  [(_, chunked)] = _structure(bytes(out))
  assert [shape for _, (_, shape, _) in dict(chunked)["chunks"]] == [
      (4,), (4,), (2,)]


def test_saving_a_plain_dict_does_not_import_flax(tmp_path):
  script = textwrap.dedent(f"""
      import sys
      import numpy as np
      from clu_ckpt import flax_format
      from clu_ckpt import flax_encode
      state = {{"w": np.arange(300, dtype=np.float32), "n": [1, 2],
                "z": 1 + 2j}}
      print("version:", flax_encode.installed_flax_version())
      data = flax_format.save(state)
      flax_format.save_file(state, {str(tmp_path / "x.flax")!r})
      assert flax_format.chunk_bytes() == 2**30
      assert b"__msgpack_chunked_array__" not in data
      loaded = [m for m in sys.modules if m == "flax" or
                m.startswith("flax.")]
      print("flax modules:", loaded)
      assert not loaded, loaded
  """)
  env = dict(os.environ, PYTHONPATH=str(_REPO), JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", script], env=env,
                          capture_output=True, text=True, timeout=120,
                          check=False)
  assert result.returncode == 0, result.stderr
  assert "flax modules: []" in result.stdout
  assert f"version: {_flax_version()}" in result.stdout


# --------------------------------------------------------------------------
# Leaves whose bytes depend on the Flax version (flax 0.8.x against 0.9.0+).
# --------------------------------------------------------------------------

_OLD_STACK = (Path(__file__).resolve().parents[2] / "shared" / "fixtures" /
              "old-stacks" / "tf2.16-flax0.8.5")


def _flax_version() -> tuple[int, ...]:
  # Asked of Flax itself (the module reads the package metadata instead).
  return tuple(int(n) for n in flax.__version__.split(".")[:3])


def _ext_codes(data: bytes) -> list[int]:
  codes = []
  msgpack.unpackb(data, ext_hook=lambda c, p: codes.append(c) or None,
                  strict_map_key=False)
  return codes


def test_installed_flax_version_is_read_without_importing_it():
  assert flax_encode.installed_flax_version() == _flax_version()
  assert flax_encode.legacy_flax_leaves() == (_flax_version() < (0, 9, 0))


@pytest.mark.parametrize("value", [1 + 2j, complex(float("nan"), -0.0), -1j])
def test_python_complex_is_written_as_the_installed_flax_writes_it(value):
  for state in ({"z": value}, {"l": [value, 2.5, "s"]}, value):
    data = flax_format.save(state)
    assert data == serialization.to_bytes(state)
  # Flax 0.8.x: a numpy complex128 scalar (ext 3); 0.9.0 on: ext 2.
  assert _ext_codes(flax_format.save({"z": value})) == (
      [3] if _flax_version() < (0, 9, 0) else [2])


@pytest.mark.parametrize("value", [2**64, -2**63 - 1, 10**30])
def test_out_of_range_ints_are_refused_as_the_installed_flax_refuses(
    value, tmp_path):
  state = {"a": np.ones(3), "i": [value]}
  with pytest.raises((ValueError, OverflowError)) as flax_raised:
    serialization.to_bytes(state)
  # ValueError on Flax 0.8.x, OverflowError from 0.9.0.
  expected = type(flax_raised.value)
  assert expected is (ValueError if _flax_version() < (0, 9, 0) else
                      OverflowError)
  with pytest.raises(expected):
    flax_format.save(state)
  with pytest.raises(expected):
    flax_format.save_file(state, str(tmp_path / "x.flax"))
  assert not os.listdir(tmp_path)


def _with_python_complex(tree: Any) -> Any:
  if isinstance(tree, dict):
    return {k: _with_python_complex(v) for k, v in tree.items()}
  if isinstance(tree, np.complex128):
    return complex(tree)
  return tree


@pytest.mark.parametrize("name", ["ckpt-2", "ckpt-3"])
def test_flax_0_8_5_files_are_rewritten_byte_for_byte(name, monkeypatch):
  # A file written by flax 0.8.5 (its state holds a Python complex) is what
  # clu_ckpt writes for that state under Flax 0.8.x rules, on any stack.
  path = _OLD_STACK / "single_host" / f"{name}.flax"
  if not path.is_file():
    pytest.skip(f"old-stack fixture {path} is not available")
  written_by_flax_0_8_5 = path.read_bytes()
  state = _with_python_complex(flax_format.load(written_by_flax_0_8_5))
  assert type(state["opt_state"]["1"]["phase"]) is complex
  monkeypatch.setattr(flax_encode, "installed_flax_version", lambda: (0, 8, 5))
  assert flax_format.save(state) == written_by_flax_0_8_5
  monkeypatch.setattr(flax_encode, "installed_flax_version", lambda: None)
  native = flax_format.save(state)  # no Flax: the current (native) form
  assert native != written_by_flax_0_8_5
  assert flax_format.load(native)["opt_state"]["1"]["phase"] == complex(1, -2)
  monkeypatch.setattr(flax_encode, "installed_flax_version",
                      lambda: (0, 9, 0))
  assert flax_format.save(state) == native
