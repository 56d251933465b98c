"""Tests for `clu_ckpt.flax_decode`: the one walker behind inspect and FlaxFile.

`_Reader.leaves` (what `inspect` lists: `LeafInfo`s alone, values checked and
dropped) and `_Reader.tree_and_leaves` (what `FlaxFile` parses: the state dict
and its `LeafInfo`s in one pass) are one walker in two modes; `_Reader.root`
(what `load` decodes) is the parser's plain decoding. Over valid and damaged
encodings they must agree: the same leaves, the same tree, and the same
refusals. (The format itself, Flax byte identity and the memory and time
bounds are tested through `flax_format` in tests/test_flax_format.py.)

Synopsis::

  python -m pytest -q -x tests/test_flax_decode.py
"""

from __future__ import annotations

import random
import struct
from typing import Any

import numpy as np
import pytest

from conftest import fuzz_examples
from clu_ckpt import flax_decode
from clu_ckpt import flax_format
from clu_ckpt.flax_format import FlaxFormatError


def _states() -> list[Any]:
  return [
      {"params": {"dense": {"kernel": np.arange(12, dtype=np.float32)
                            .reshape(3, 4), "bias": np.zeros(4, np.int8)}},
       "step": 7, "lr": 0.5, "name": "run", "raw": b"\x00\x01", "none": None,
       "flag": True, "z": 1 + 2j, "s": np.float32(3.5), "big": 2**40,
       "u": np.str_("ab"), "list": [1, [2.5, "x"], {"k": np.int64(-3)}]},
      # Chunked arrays (CHUNK_BYTES is 64 while these are encoded).
      {"w": np.arange(100, dtype=np.float32).reshape(10, 10),
       "y": {"x": np.arange(3, dtype=np.uint16)}, "step": np.int32(2)},
  ]


def _encodings(monkeypatch) -> list[bytes]:
  monkeypatch.setattr(flax_format, "CHUNK_BYTES", 64)
  return [flax_format.save(state) for state in _states()]


def _damaged(data: bytes, rng: random.Random) -> bytes:
  out = bytearray(data)
  how = rng.randrange(3)
  if how == 0:
    for _ in range(rng.randrange(1, 4)):
      out[rng.randrange(len(out))] = rng.randrange(256)
  elif how == 1:
    del out[rng.randrange(len(out)):]
  else:
    at = rng.randrange(len(out))
    out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4)))
  return bytes(out)


def _read(data: bytes, how: str) -> Any:
  reader = flax_decode._Reader(  # pylint: disable=protected-access
      data, "damaged.flax", False, memory_factor=flax_format.MEMORY_FACTOR,
      memory_base=flax_format.MEMORY_BASE)
  try:
    if how == "root":
      return "ok", reader.root(())
    return "ok", getattr(reader, how)()
  except FlaxFormatError as e:
    return "refused", str(e)


def _same(a: Any, b: Any) -> bool:
  """Exact equality of two decoded trees: keys in order, types, dtypes, bits."""
  if type(a) is not type(b):
    return False
  if isinstance(a, dict):
    return (list(a) == list(b) and
            all(_same(a[k], b[k]) for k in a))
  if isinstance(a, (list, tuple)):
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
  if isinstance(a, (np.ndarray, np.generic)):
    return (a.dtype == b.dtype and a.shape == b.shape and
            np.asarray(a).tobytes() == np.asarray(b).tobytes())
  if isinstance(a, float):
    return struct.pack(">d", a) == struct.pack(">d", b)
  if isinstance(a, complex):
    return _same(a.real, b.real) and _same(a.imag, b.imag)
  if isinstance(a, flax_format.LeafInfo):
    return a == b
  return a == b


def test_walker_modes_agree_on_valid_encodings(monkeypatch):
  for data in _encodings(monkeypatch):
    (_, tree), (_, (tree2, leaves)) = _read(data, "root"), _read(
        data, "tree_and_leaves")
    assert _same(tree2, tree)
    assert _read(data, "leaves") == ("ok", leaves)
    assert leaves == flax_format.inspect(data)


def test_walker_modes_agree_on_damaged_encodings(monkeypatch):
  rng = random.Random(20261123)
  encodings = _encodings(monkeypatch)
  outcomes = set()
  for _ in range(fuzz_examples(3000)):
    data = _damaged(rng.choice(encodings), rng)
    root = _read(data, "root")
    full = _read(data, "tree_and_leaves")
    only = _read(data, "leaves")
    outcomes.add((root[0], full[0], only[0]))
    # The full walk refuses exactly what load refuses, and builds its tree.
    assert root[0] == full[0], (data, root, full)
    if full[0] == "ok":
      assert _same(full[1][0], root[1]), data
      assert only == ("ok", full[1][1]), data
    elif only[0] == "refused":
      # Inspecting refuses at the same place, for the same reason (it only
      # lets pass what it does not build: the data of numpy scalars).
      assert only == full, data
  assert ("ok", "ok", "ok") in outcomes
  assert ("refused", "refused", "refused") in outcomes


@pytest.mark.parametrize("how", ["leaves", "tree_and_leaves"])
def test_malformed_chunked_array_is_one_refusal_at_its_map(how):
  chunk = flax_format.save({"0": np.arange(3, dtype=np.int8)})[1:]  # "0": ..
  data = (b"\x81\xa1w" + b"\x83\xb9__msgpack_chunked_array__\xc3"
          b"\xa5shape\x81\xa10\x04\xa6chunks\x81" + chunk)  # (4,): 3 items
  assert _read(data, how) == (
      "refused", "damaged.flax at byte 3: chunked array of shape (4,) has 3 "
      "elements")
  assert _read(data, "root")[0] == "refused"
