"""Soak: fuzz the `.flax` reader with hostile input; only FlaxFormatError.

Inputs are mutations of real, valid `.flax` files (the golden fixtures
written by clu 0.0.12 when present, plus files written by `flax_format.save`
covering every leaf kind, Flax's chunked form and deep trees): truncations,
bit flips, interesting bytes, huge declared lengths (in the fields of real
headers), deep nesting, unknown ext type codes, wrong types in real
positions (re-encoded), splices, adversarial shapes spliced in (below), and
with atheris also libFuzzer's own mutations guided by coverage of
`clu_ckpt.flax_format`.

Each input goes through `load`, `load(writable=True)`, `inspect`,
`load(subtree=...)` (and every 64th input through `load_file`,
`inspect_file` and `inspection.verify_path` from a file). Allowed outcomes:
a value or `FlaxFormatError`. Anything else is a failure, recorded with the
input. Per input: a time cap (SIGALRM) and a memory cap: the tracemalloc
peak must stay under the reader's documented bound, `--mem-factor` (default
`flax_format.MEMORY_FACTOR`) x the input size + `flax_format.MEMORY_BASE`.
One input in three is measured (in blocks of 500; tracemalloc slows the
reader about sevenfold); the process' max RSS is checked after every input.

Adversarial shapes (`ADVERSARIAL`: millions of empty containers or nils,
deep or long keys repeated in every path, wide maps, tiny ndarray exts,
nested chunked-array maps that make a re-reading reader quadratic or
exponential, chunked arrays of impossible shapes, map keys of one hash, and
mixes of them) are built to cost the reader the most per byte. Besides the
`adversarial` mutator, `--adversarial N` of them (64 B to
`--adversarial-max-bytes`) go through a child process that reports, per
operation, the peak RSS growth and wall time: each must stay under
MEMORY_FACTOR x size + MEMORY_BASE and `ADVERSARIAL_SECONDS` +
`ADVERSARIAL_SECONDS_PER_MIB` x size, or the input is a failure (a child
that does not answer is killed: a hang).

Usage::

  python tests/soak/soak_fuzz_reader.py --inputs 100000 [--engine atheris]
      [--seed 0] [--time-cap 5] [--adversarial 200] [--workdir DIR]
  python tests/soak/soak_fuzz_reader.py --inputs 2000 --adversarial 30 \
      --engine random                                  # short: ~2 minutes

Prints a JSON summary (inputs, outcomes, failures by kind with an example
file each, slowest input, largest memory ratio, RSS, and the adversarial
phase's figures per family); exits 1 on failures.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import resource
import signal
import struct
import subprocess
import sys
import tempfile
import time
import tracemalloc
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import msgpack
import numpy as np

FIXTURES = (Path(__file__).resolve().parents[3] / "shared" / "fixtures" /
            "clu-0.0.12")
REPO = Path(__file__).resolve().parents[2]

flax_format = None  # imported in main(), under atheris' instrumentation
inspection = None


def _import_library(instrument: bool) -> None:
  global flax_format, inspection
  sys.path.insert(0, str(REPO))
  if instrument:
    import atheris  # pylint: disable=g-import-not-at-top
    with atheris.instrument_imports(include=["clu_ckpt"]):
      from clu_ckpt import flax_format as ff  # pylint: disable=g-import-not-at-top
      from clu_ckpt import inspection as insp  # pylint: disable=g-import-not-at-top
  else:
    from clu_ckpt import flax_format as ff  # pylint: disable=g-import-not-at-top
    from clu_ckpt import inspection as insp  # pylint: disable=g-import-not-at-top
  flax_format, inspection = ff, insp


# --------------------------------------------------------------------------
# Seeds: real, valid files.
# --------------------------------------------------------------------------


def seed_states() -> list[Any]:
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  deep: Any = {"leaf": np.arange(3, dtype=np.int8)}
  for i in range(60):
    deep = {f"level{i}": deep, "x": i}
  return [
      {"params": {"Dense_0": {"kernel": rng.random((4, 3), np.float32),
                              "bias": np.zeros(3, np.float32)},
                  "emb": rng.random((5, 2)).astype(ml_dtypes.bfloat16),
                  "half": np.ones((2, 2), np.float16)},
       "opt_state": {"count": np.int32(7), "lr": 0.001, "name": "adam",
                     "mu": [np.ones(2), None, "x"], "flag": True},
       "step": 12},
      {"ints": {str(t): (np.arange(6) % 2).astype(t).reshape(2, 3) for t in
                ("int8", "uint8", "int16", "uint16", "int32", "uint32",
                 "int64", "uint64", "bool")},
       "f8": np.zeros(4, ml_dtypes.float8_e4m3fn),
       "i4": np.zeros(4, ml_dtypes.int4),
       "c64": np.array([1 + 2j], np.complex64), "c": complex(1, -2),
       "scalars": [np.float64(1.5), np.uint8(3), np.bool_(True)],
       "empty": np.zeros((0, 3), np.float32), "zero_d": np.array(5.0),
       "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
       "bytes": b"\x00\xff", "unicode": "h\u00e9\u4e2d", "big": 2**63,
       "neg": -2**63, "none": None, "f": float("inf")},
      deep,
      {"a": np.arange(1000, dtype=np.float32), "b": list(range(40)),
       "c": {str(i): str(i) * 3 for i in range(30)}},
  ]


def chunked_seed() -> bytes:
  """Flax's chunked form (written for arrays over 1 GiB), on a small array.

  The writer's chunk size is a module constant; it is lowered only in this
  process and only to produce this seed.
  """
  saved = flax_format.CHUNK_BYTES
  flax_format.CHUNK_BYTES = 64
  try:
    data = flax_format.save({"w": np.arange(50, dtype=np.float32).reshape(5, 10),
                             "v": np.arange(3, dtype=np.int8)})
  finally:
    flax_format.CHUNK_BYTES = saved
  assert b"__msgpack_chunked_array__" in data
  np.testing.assert_array_equal(flax_format.load(data)["w"],
                                np.arange(50, dtype=np.float32).reshape(5, 10))
  return data


def seeds() -> list[bytes]:
  out = [flax_format.save(s) for s in seed_states()] + [chunked_seed()]
  if FIXTURES.is_dir():
    for path in sorted(FIXTURES.rglob("*.flax")):
      data = path.read_bytes()
      try:
        flax_format.load(data)
      except flax_format.FlaxFormatError:
        continue  # the deliberately torn fixture is not a seed
      out.append(data)
  for data in out:
    flax_format.load(data)  # every seed is valid
  return out


# --------------------------------------------------------------------------
# Where the headers are: a tolerant walk over (mostly) valid msgpack.
# --------------------------------------------------------------------------

_LEN_FIELDS = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4,
               0xDC: 2, 0xDD: 4, 0xDE: 2, 0xDF: 4, 0xC7: 1, 0xC8: 2,
               0xC9: 4}
_FIXED = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4,
          0xD3: 8, 0xCA: 4, 0xCB: 8}


def walk(data: bytes, limit: int = 5000) -> list[tuple[int, int, int]]:
  """(offset, length-field size, kind) of headers; kind 'c' = container,
  's' = str/bin, 'e' = ext (the code byte follows the length field), 'x' =
  fixext, 'f' = fix container/str (length in the tag)."""
  nodes: list[tuple[int, int, str]] = []

  def one(pos: int, depth: int) -> int:
    if pos >= len(data) or len(nodes) > limit or depth > 300:
      raise IndexError
    tag = data[pos]
    if tag <= 0x7F or tag >= 0xE0 or tag in (0xC0, 0xC2, 0xC3):
      return pos + 1
    if tag in _FIXED:
      return pos + 1 + _FIXED[tag]
    if 0x80 <= tag <= 0x9F:
      nodes.append((pos, 0, "f"))
      n = (tag & 0x0F) * (2 if tag < 0x90 else 1)
      pos += 1
      for _ in range(n):
        pos = one(pos, depth + 1)
      return pos
    if 0xA0 <= tag <= 0xBF:
      nodes.append((pos, 0, "f"))
      return pos + 1 + (tag & 0x1F)
    if 0xD4 <= tag <= 0xD8:
      nodes.append((pos, 0, "x"))
      inner = pos + 2
      end = inner + (1 << (tag - 0xD4))
      _walk_ext(data[pos + 1], inner, end, depth)
      return end
    if tag in _LEN_FIELDS:
      size = _LEN_FIELDS[tag]
      n = int.from_bytes(data[pos + 1:pos + 1 + size], "big")
      if tag in (0xDC, 0xDD, 0xDE, 0xDF):
        nodes.append((pos, size, "c"))
        pos += 1 + size
        for _ in range(n * (2 if tag >= 0xDE else 1)):
          pos = one(pos, depth + 1)
        return pos
      if tag in (0xC7, 0xC8, 0xC9):
        nodes.append((pos, size, "e"))
        inner = pos + 2 + size
        _walk_ext(data[pos + 1 + size], inner, inner + n, depth)
        return inner + n
      nodes.append((pos, size, "s"))
      return pos + 1 + size + n
    raise IndexError

  def _walk_ext(code: int, start: int, end: int, depth: int) -> None:
    if code in (1, 2, 3):
      pos = start
      while pos < end:
        pos = one(pos, depth + 1)

  try:
    one(0, 0)
  except (IndexError, ValueError):
    pass
  return nodes


# --------------------------------------------------------------------------
# Mutators.
# --------------------------------------------------------------------------

_INTERESTING = [0x00, 0x01, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xBF, 0xC0, 0xC1,
                0xC4, 0xC6, 0xC7, 0xC9, 0xCF, 0xD3, 0xD4, 0xD8, 0xDB, 0xDD,
                0xDF, 0xE0, 0xFF]
_DTYPE_NAMES = ["float32", "bfloat16", "int4", "float8_e4m3fn", "O", "V0",
                "void8", "str0", "str32", "bytes8", "U", "S", "a", "M8",
                "datetime64[ns]", "m8[xx]", "<f4", ">i8", "float1024",
                "int", "object", "", "\u00e9", "f" * 40, "[", "(2,)f4",
                "complex256", "float128", "uint4", "float4_e2m1fn"]


def m_truncate(rng: random.Random, data: bytes) -> bytes:
  return data[:rng.randrange(len(data))] if data else data


def m_bitflip(rng: random.Random, data: bytes) -> bytes:
  if not data:
    return data
  out = bytearray(data)
  for _ in range(rng.randint(1, 8)):
    i = rng.randrange(len(out))
    out[i] ^= 1 << rng.randrange(8)
  return bytes(out)


def m_interesting(rng: random.Random, data: bytes) -> bytes:
  if not data:
    return data
  out = bytearray(data)
  nodes = walk(data)
  for _ in range(rng.randint(1, 3)):
    i = (rng.choice(nodes)[0] if nodes and rng.random() < 0.7 else
         rng.randrange(len(out)))
    out[i] = rng.choice(_INTERESTING)
  return bytes(out)


def m_huge_length(rng: random.Random, data: bytes) -> bytes:
  """Declares a huge (or off-by-some) length in a real header."""
  nodes = [n for n in walk(data) if n[2] in "cse"]
  if not nodes:
    return m_interesting(rng, data)
  pos, size, _ = rng.choice(nodes)
  current = int.from_bytes(data[pos + 1:pos + 1 + size], "big")
  top = (1 << (8 * size)) - 1
  value = rng.choice([top, top - 1, 1 << (8 * size - 1), current + 1,
                      current + rng.randint(2, 1000), max(0, current - 1), 0,
                      len(data), len(data) + 1])
  value = min(max(value, 0), top)
  return data[:pos + 1] + value.to_bytes(size, "big") + data[pos + 1 + size:]


def m_widen(rng: random.Random, data: bytes) -> bytes:
  """Rewrites a fix-size header as its 32-bit form with a huge length."""
  nodes = [n for n in walk(data) if n[2] == "f"]
  if not nodes:
    return m_huge_length(rng, data)
  pos = rng.choice(nodes)[0]
  tag = data[pos]
  wide = 0xDF if tag < 0x90 else 0xDD if tag < 0xA0 else 0xDB
  n = rng.choice([0xFFFFFFFF, 0x7FFFFFFF, 2**20, len(data)])
  return data[:pos] + bytes([wide]) + struct.pack(">I", n) + data[pos + 1:]


def m_deep(rng: random.Random, data: bytes) -> bytes:
  depth = rng.choice([200, 255, 256, 257, 258, 300, 1000, 10**4, 10**5])
  kind = rng.randrange(4)
  if kind == 0:
    return b"\x91" * depth + data
  if kind == 1:
    return b"\x81\xa1k" * depth + data
  if kind == 2:  # nesting inside a complex ext payload
    payload = b"\x92" + b"\x91" * depth + b"\x01" + b"\x02"
    return (b"\x81\xa1c" + b"\xc9" + struct.pack(">I", len(payload)) +
            b"\x02" + payload)
  # deep nesting inside an ndarray shape
  return (b"\x81\xa1a\xc9" + struct.pack(">I", depth + 20) + b"\x01" +
          b"\x93" + b"\x91" * depth + b"\x01\xa7float32\xc4\x04\x00\x00\x00\x00")


def m_ext_code(rng: random.Random, data: bytes) -> bytes:
  nodes = [n for n in walk(data) if n[2] in "ex"]
  if not nodes:
    return m_bitflip(rng, data)
  pos, size, kind = rng.choice(nodes)
  code_at = pos + 1 + size
  code = rng.choice([0, 2, 3, 4, 5, 127, -1, -128, 1])
  return data[:code_at] + struct.pack(">b", code) + data[code_at + 1:]


def _random_value(rng: random.Random, depth: int = 0) -> Any:
  choice = rng.randrange(14 if depth < 3 else 9)
  if choice == 0:
    return rng.choice([0, -1, 2**64 - 1, -2**63, 2**31])
  if choice == 1:
    return rng.choice([0.0, float("nan"), float("-inf"), 1e308])
  if choice == 2:
    return rng.choice(["", "float32", "\u00e9", "x" * 300])
  if choice == 3:
    return rng.choice([b"", b"\x00" * 7, bytes(range(256))])
  if choice == 4:
    return None
  if choice == 5:
    return rng.choice([True, False])
  if choice == 6:
    return msgpack.ExtType(rng.choice([1, 2, 3, 0, 9, 127]),
                           bytes(rng.randrange(256)
                                 for _ in range(rng.randrange(12))))
  if choice == 7:  # a (shape, dtype, data) triple with a wrong part
    shape = rng.choice([[2, 2], [], [-1], [2**64 - 1], [0, 2**64 - 1],
                        [0, 2**62, 2**62], [2**32, 2**32], [1] * 65,
                        [3], "3", None, [1.5], [[2]]])
    dtype = rng.choice(_DTYPE_NAMES + [b"float32", 3, None])
    nbytes = rng.choice([0, 1, 4, 8, 16, 15])
    payload = msgpack.packb([shape, dtype, b"\x01" * nbytes])
    return msgpack.ExtType(rng.choice([1, 3, 1]), payload)
  if choice == 8:  # complex with wrong parts
    parts = rng.choice([[1.0], [1.0, 2.0, 3.0], ["a", 1.0], [True, 1.0],
                        [2**64 - 1, 1.0], {"0": 1.0}, [None, None]])
    return msgpack.ExtType(2, msgpack.packb(parts))
  if choice == 9:
    return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
  if choice == 10:
    return {rng.choice(["a", "0", "chunks", "shape"]): _random_value(
        rng, depth + 1) for _ in range(rng.randrange(4))}
  if choice == 11:  # a chunked-array map with wrong parts
    return {"__msgpack_chunked_array__": rng.choice([True, 1, "yes"]),
            "shape": rng.choice([{"0": 4}, {"0": -1}, {"1": 4}, [4],
                                 {"0": 2**64 - 1}, {"0": 0, "1": 2**64 - 1},
                                 {}, {"0": 4.0}]),
            "chunks": rng.choice([{}, {"0": _random_value(rng, 9)},
                                  {"1": _random_value(rng, 9)}, [1],
                                  {"0": np_ext(np.arange(4, dtype=np.int8))},
                                  {"0": np_ext(np.arange(2, dtype=np.int8)),
                                   "1": np_ext(np.arange(2.0))}])}
  if choice == 12:
    return {1: 2, None: 3, 1.5: 4, b"k": 5, True: 6}
  return {"0": _random_value(rng, depth + 1)}


def np_ext(arr: np.ndarray) -> msgpack.ExtType:
  return msgpack.ExtType(1, msgpack.packb(
      [list(arr.shape), arr.dtype.name, arr.tobytes()]))


_UNDECODABLE = object()


def _decode(data: bytes) -> Any:
  """The msgpack tree of `data` (exts kept as `_Ext`), or `_UNDECODABLE`."""
  try:
    return msgpack.unpackb(data, strict_map_key=False, raw=False,
                           ext_hook=_ext_hook)
  except Exception:  # pylint: disable=broad-except
    return _UNDECODABLE


def m_wrong_type(rng: random.Random, data: bytes) -> bytes:
  """Decodes, replaces a random node by a value of another type, re-encodes."""
  tree = _decode(data)
  if tree is _UNDECODABLE or _depth(tree) > 100:
    return m_bitflip(rng, data)
  slots: list[tuple[Any, Any]] = []

  def collect(node: Any, depth: int) -> None:
    if depth > 100:
      return
    if isinstance(node, dict):
      for key, value in node.items():
        slots.append((node, key))
        collect(value, depth + 1)
    elif isinstance(node, list):
      for i, value in enumerate(node):
        slots.append((node, i))
        collect(value, depth + 1)
    elif isinstance(node, _Ext) and node.tree is not None:
      slots.append((node, None))
      collect(node.tree, depth + 1)

  collect(tree, 0)
  if not slots:
    return msgpack.packb(_random_value(rng))
  parent, key = rng.choice(slots)
  if isinstance(parent, _Ext):
    parent.tree = _random_value(rng)
  else:
    parent[key] = _random_value(rng)
  return msgpack.packb(tree, default=_ext_default, strict_types=False)


def _depth(node: Any, limit: int = 101) -> int:
  """Nesting depth of a decoded tree, counted up to `limit`."""
  stack, deepest = [(node, 0)], 0
  while stack:
    node, d = stack.pop()
    deepest = max(deepest, d)
    if d >= limit:
      return d
    if isinstance(node, dict):
      stack.extend((v, d + 1) for v in node.values())
    elif isinstance(node, list):
      stack.extend((v, d + 1) for v in node)
    elif isinstance(node, _Ext) and node.tree is not None:
      stack.append((node.tree, d + 1))
  return deepest


class _Ext:
  """An ext value whose payload is itself msgpack (ndarray, complex)."""

  def __init__(self, code: int, payload: bytes):
    self.code = code
    self.payload = payload
    try:
      self.tree = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception:  # pylint: disable=broad-except
      self.tree = None


def _ext_hook(code: int, payload: bytes) -> Any:
  return _Ext(code, payload)


def _ext_default(obj: Any) -> Any:
  if isinstance(obj, _Ext):
    payload = obj.payload if obj.tree is None else msgpack.packb(obj.tree)
    return msgpack.ExtType(obj.code & 0x7F, payload)
  raise TypeError(type(obj))


def m_bad_array(rng: random.Random, data: bytes) -> bytes:
  """Replaces a real array's (shape, dtype, data) by a crafted wrong one."""
  tree = _decode(data)
  if tree is _UNDECODABLE:
    return m_ext_code(rng, data)
  exts: list[_Ext] = []
  stack = [(tree, 0)]
  while stack:
    node, d = stack.pop()
    if d > 100:
      continue
    if isinstance(node, dict):
      stack.extend((v, d + 1) for v in node.values())
    elif isinstance(node, list):
      stack.extend((v, d + 1) for v in node)
    elif isinstance(node, _Ext) and node.code in (1, 3):
      exts.append(node)
  if not exts:
    return m_wrong_type(rng, data)
  ext = rng.choice(exts)
  dtype = rng.choice(["float32", "int8", "bfloat16", "int4", "bool"] +
                     _DTYPE_NAMES)
  itemsize = 1 if dtype in ("int8", "int4", "bool") else 2 if (
      dtype == "bfloat16") else 4
  shape = rng.choice([
      [0, 2**64 - 1], [2**64 - 1, 0], [0, 2**63], [0, 2**63 - 1],
      [0, 2**62, 2**62], [0] + [2**40] * 3, [2**32, 2**32], [2**63],
      [1] * 64, [1] * 65, [0] * 64, [-1], [3, -2], [],
      [rng.randrange(5) for _ in range(rng.randrange(4))]])
  count = 1
  for dim in shape:
    count *= dim
  nbytes = max(0, count * itemsize) if count * itemsize < 4096 else 0
  nbytes = rng.choice([nbytes, nbytes, nbytes + 1, max(0, nbytes - 1)])
  ext.tree = [shape, dtype, b"\x01" * nbytes]
  ext.code = rng.choice([1, 1, 3])
  return msgpack.packb(tree, default=_ext_default, strict_types=False)


def m_splice(rng: random.Random, data: bytes, other: bytes) -> bytes:
  if not data or not other:
    return data + other
  i, j = rng.randrange(len(data)), rng.randrange(len(other))
  return data[:i] + other[j:]


def m_block(rng: random.Random, data: bytes) -> bytes:
  if len(data) < 2:
    return data + bytes([rng.randrange(256)])
  i = rng.randrange(len(data))
  j = min(len(data), i + rng.randint(1, 64))
  op = rng.randrange(3)
  if op == 0:
    return data[:i] + data[j:]
  if op == 1:
    return data[:j] + data[i:j] + data[j:]
  return data[:i] + bytes(rng.randrange(256) for _ in range(j - i)) + data[i:]


# --------------------------------------------------------------------------
# Adversarial shapes: inputs built to cost the reader the most per byte.
# --------------------------------------------------------------------------
#
# Each generator returns about `size` bytes of msgpack shaped to amplify
# memory or time: millions of empty containers or nils, paths repeating deep
# or long keys, tiny ndarray exts (a numpy view each), chunked-array maps
# nested so that a reader re-reading them once it knows what they are does
# quadratic or exponential work, chunked arrays of impossible shapes, and map
# keys of one hash. `m_adversarial` splices them into real files for the
# in-process fuzzing; `AdversarialPhase` measures them in a child process,
# where each input's peak RSS and time are asserted against the reader's
# documented bound (MEMORY_FACTOR x size + MEMORY_BASE, linear time).

_CHUNKED = "__msgpack_chunked_array__"


def _map32(n: int) -> bytes:
  return b"\xdf" + struct.pack(">I", n)


def _array32(n: int) -> bytes:
  return b"\xdd" + struct.pack(">I", n)


def _pk(obj: Any) -> bytes:
  return msgpack.packb(obj, use_bin_type=True)


def _ext(code: int, shape: Any, dtype: Any, data: bytes) -> bytes:
  return _pk(msgpack.ExtType(code, _pk([shape, dtype, data])))


def a_empty_containers(rng: random.Random, size: int) -> bytes:
  """Empty maps, empty lists, nils or zeros, one per byte (in a list) or
  under repeated one-byte keys (in a map: a leaf each for inspect)."""
  item = rng.choice([b"\x80", b"\x90", b"\xc0", b"\x00", b"\xa0", b"\xc4\x00"])
  if rng.random() < 0.5:
    n = max(0, size - 5) // len(item)
    return _array32(n) + item * n
  key = rng.choice([b"\x00", b"\xc0", b"\xc2", b"\xa0"])
  n = max(0, size - 5) // (len(key) + len(item))
  return _map32(n) + (key + item) * n


def a_deep_paths(rng: random.Random, size: int) -> bytes:
  """Nested maps (down to MAX_DEPTH and past it), then many leaves: every
  leaf's path repeats every key above it."""
  depth = rng.choice([1, 16, 100, 200, 250, 254, 255, 256, 300])
  key = _pk("k" * rng.choice([1, 8, 64, 1000]))
  head = (b"\x81" + key) * depth
  n = max(0, size - len(head) - 5) // 2
  return head + _map32(n) + b"\x00\xc0" * n


def a_wide_map(rng: random.Random, size: int) -> bytes:
  """One wide map of tiny values under 1-, 3- or 5-byte int keys."""
  width = rng.choice([1, 3, 5])
  value = rng.choice([b"\x01", b"\xc0", b"\x80", b"\x90", b"\xa1x"])
  n = max(0, size - 5) // (width + len(value))
  if width == 1:
    keys = (bytes([i % 128]) for i in range(n))
  elif width == 3:
    keys = (b"\xcd" + struct.pack(">H", i % 2**16) for i in range(n))
  else:
    keys = (b"\xce" + struct.pack(">I", i) for i in range(n))
  return _map32(n) + b"".join(k + value for k in keys)


def a_long_key(rng: random.Random, size: int) -> bytes:
  """One long key (str, or bytes: its path is its repr, 4 chars a byte) over
  many leaves: each leaf's path holds the key."""
  length = max(1, int(size * rng.choice([0.1, 0.5, 0.9])))
  key = _pk("k" * length) if rng.random() < 0.5 else _pk(b"\xff" * length)
  n = max(0, size - len(key) - 10) // 2
  return b"\x81" + key + _map32(n) + b"\x00\xc0" * n


def a_tiny_arrays(rng: random.Random, size: int) -> bytes:
  """Small ndarray and numpy-scalar exts, a numpy view each: empty, 0-d,
  64-dim, str, void, and shapes only zero sizes keep small."""
  pieces = [_ext(1, [0], "u1", b""), _ext(3, [], "u1", b"\x07"),
            _ext(1, [1] * 64, "u1", b"\x01"), _ext(3, [], "str32", b"a\0\0\0"),
            _ext(1, [2], "void8", b"xy"), _ext(1, [0, 2**40], "f4", b""),
            _ext(1, [0, 2**63 - 1], "u1", b""), _ext(3, [1], "bool", b"\x01")]
  chosen = rng.sample(pieces, rng.randint(1, len(pieces)))
  out, total = [], 5
  while total < size:
    piece = rng.choice(chosen)
    out.append(piece)
    total += len(piece)
  return _array32(len(out)) + b"".join(out)


def _chunk_map(rng: random.Random, inner: bytes, last: bool) -> bytes:
  """A valid chunked array's map with `inner` under an extra key, its
  chunked-array key last (known only after `inner`) or first."""
  fields = [_pk("shape") + _pk({"0": 1}),
            _pk("chunks") + _pk({"0": msgpack.ExtType(
                1, _pk([[1], "u1", b"\x01"]))}),
            _pk(rng.choice(["x", "shape", "chunks", "0"])) + inner]
  flag = _pk(_CHUNKED) + b"\xc3"
  return b"\x84" + (b"".join(fields) + flag if last else
                    flag + b"".join(fields))


def a_rewind(rng: random.Random, size: int) -> bytes:
  """Chunked arrays nested in chunked arrays: under an extra key (a reader
  re-reading each map is quadratic) or as the chunk itself (exponential)."""
  if rng.random() < 0.5:
    levels = rng.choice([1, 10, 60, 120, 200])
    n = max(0, size - 60 * levels)
    data = _array32(n) + b"\x01" * n
    for _ in range(levels):
      data = _chunk_map(rng, data, last=rng.random() < 0.9)
    return data
  levels = rng.choice([2, 12, 40, 80])
  data = _pk({"shape": {"0": 1}, _CHUNKED: True,
              "chunks": {"0": msgpack.ExtType(1, _pk([[1], "u1", b"\x01"]))}})
  for _ in range(levels):
    data = (b"\x83" + _pk("shape") + _pk({"0": 1}) + _pk("chunks") + b"\x81" +
            _pk("0") + data + _pk(_CHUNKED) + b"\xc3")
  return data


def a_chunked(rng: random.Random, size: int) -> bytes:
  """A chunked array of many 1-element chunks, its shape right or
  impossible (too many elements, zero times huge, over 64 dims) and its
  dtypes one or mixed."""
  chunk = _ext(1, [1], "u1", b"\x05")
  other = _ext(1, [1], "i1", b"\x05")
  n = max(1, (size - 200) // (len(chunk) + 8))
  shape = rng.choice([{"0": n}, {"0": n}, {"0": 10**12}, {"0": 0, "1": 2**63},
                      {"0": n, "1": 1}, {str(i): 1 for i in range(65)},
                      {"0": n + 1}, {"1": n}])
  mixed = rng.random() < 0.2
  chunks = b"".join(_pk(str(i)) + (other if mixed and i == n - 1 else chunk)
                    for i in range(n))
  return (b"\x83" + _pk(_CHUNKED) + b"\xc3" + _pk("shape") + _pk(shape) +
          _pk("chunks") + _map32(n) + chunks)


def a_colliding_keys(rng: random.Random, size: int) -> bytes:
  """Complex or float keys of one hash: a dict of them is quadratic."""
  n = max(1, (size - 5) // 23)
  if rng.random() < 0.5:
    top = 1000003 * (n + 1)  # hash(a + bj) = hash(a) + 1000003 hash(b)
    keys = (_pk(msgpack.ExtType(2, msgpack.packb(
        [float(top - 1000003 * k), float(k)]))) for k in range(1, n + 1))
  else:  # 2.0 * 2**(61 j) all hash to 2 (hashes are mod 2**61 - 1)
    keys = (_pk(math.ldexp(1.0, 61 * (k % 16) + 1)) for k in range(n))
  return _map32(n) + b"".join(k + b"\x01" for k in keys)


def a_mix(rng: random.Random, size: int) -> bytes:
  """A map of several of the above, each a part of the size."""
  parts = rng.randint(2, 5)
  names = [name for name in ADVERSARIAL if name != "mix"]
  return bytes([0x80 | parts]) + b"".join(
      _pk(f"p{i}") + ADVERSARIAL[rng.choice(names)](rng, size // parts)
      for i in range(parts))


ADVERSARIAL: dict[str, Callable[[random.Random, int], bytes]] = {
    "empty_containers": a_empty_containers, "deep_paths": a_deep_paths,
    "wide_map": a_wide_map, "long_key": a_long_key,
    "tiny_arrays": a_tiny_arrays, "rewind": a_rewind, "chunked": a_chunked,
    "colliding_keys": a_colliding_keys, "mix": a_mix,
}

_PLACEHOLDER = "\x00adversarial-placeholder\x00"


def m_adversarial(rng: random.Random, data: bytes) -> bytes:
  """An adversarial shape (up to 16 KiB) in place of a value of `data`, under
  "params" (which the subtree reads decode), or alone."""
  name = rng.choice(list(ADVERSARIAL))
  payload = ADVERSARIAL[name](rng, rng.choice([16, 256, 4096, 16384]))
  where = rng.random()
  if where < 0.3:
    return payload
  if where < 0.6:
    return b"\x82" + _pk("params") + payload + _pk("step") + b"\x01"
  tree = _decode(data)
  if tree is _UNDECODABLE or not isinstance(tree, dict) or _depth(tree) > 100:
    return b"\x81" + _pk("params") + payload
  slots: list[tuple[Any, Any]] = []
  stack = [tree]
  while stack:
    node = stack.pop()
    for key in (node if isinstance(node, dict) else ()):
      slots.append((node, key))
      if isinstance(node[key], dict):
        stack.append(node[key])
  parent, key = rng.choice(slots)
  parent[key] = _PLACEHOLDER
  packed = msgpack.packb(tree, default=_ext_default, strict_types=False)
  return packed.replace(_pk(_PLACEHOLDER), payload, 1)


MUTATORS: dict[str, Callable[..., bytes]] = {
    "truncate": m_truncate, "bitflip": m_bitflip,
    "interesting": m_interesting, "huge_length": m_huge_length,
    "widen": m_widen, "deep": m_deep, "ext_code": m_ext_code,
    "wrong_type": m_wrong_type, "bad_array": m_bad_array, "block": m_block,
    "adversarial": m_adversarial,
}


MUTATOR_ERRORS: collections.Counter = collections.Counter()


def mutate(rng: random.Random, data: bytes, corpus: list[bytes]) -> tuple[bytes, str]:
  names = []
  for _ in range(rng.choice([1, 1, 1, 2, 3])):
    if rng.random() < 0.08:
      data, name = m_splice(rng, data, rng.choice(corpus)), "splice"
    else:
      name = rng.choice(list(MUTATORS))
      try:
        data = MUTATORS[name](rng, data)
      except (ValueError, TypeError, OverflowError, RecursionError):
        MUTATOR_ERRORS[name] += 1   # e.g. msgpack cannot re-encode a tree
        data, name = m_bitflip(rng, data), f"{name}>bitflip"
    names.append(name)
  return data, "+".join(names)


# --------------------------------------------------------------------------
# One input through the reader.
# --------------------------------------------------------------------------


# One block of TRACE_BLOCK inputs in `Runner.trace_every` is measured with
# tracemalloc (which slows the reader about sevenfold).
TRACE_BLOCK = 500
# Memory the library may keep across inputs (caches; see `retention`).
MEMORY_SLACK = 2 * 2**20


class InputTimeout(BaseException):
  """Raised by SIGALRM when one input runs past the time cap."""


def _alarm(signum, frame):  # pylint: disable=unused-argument
  raise InputTimeout()


class Runner:
  """Feeds inputs to the reader and keeps the books."""

  def __init__(self, workdir: Path, time_cap: float, mem_factor: float,
               file_every: int = 64):
    self.workdir = workdir
    self.time_cap = time_cap
    self.mem_factor = mem_factor
    self.file_every = file_every
    self.count = 0
    self.outcomes: collections.Counter = collections.Counter()
    self.per_op: collections.Counter = collections.Counter()
    self.by_mutator: collections.Counter = collections.Counter()
    self.failures: dict[str, dict[str, Any]] = {}
    self.failed_inputs = 0
    self._last_failed_input = -1
    self.trace_every = 3
    self.traced = 0
    # Max RSS may not pass this; raised by 64 MiB at each report.
    self.rss_limit = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss *
                      1024 + 256 * 2**20)
    self.slowest = (0.0, 0)
    self.max_ratio = (0.0, 0, 0)   # (peak / size, peak, size)
    self.max_peak = (0, 0)          # (peak, size)
    self.bytes_total = 0
    (workdir / "failures").mkdir(parents=True, exist_ok=True)
    self._file = workdir / "input.flax"
    signal.signal(signal.SIGALRM, _alarm)

  def run(self, data: bytes, mutator: str = "") -> None:
    self.count += 1
    self.bytes_total += len(data)
    self.by_mutator[mutator.split("+")[0]] += 1
    ops = self._ops(data)
    # Traced in blocks: each tracemalloc.start()/stop() cycle costs ~9 KiB of
    # RSS that CPython never returns, so cycles must be few.
    traced = (self.count // TRACE_BLOCK) % self.trace_every == 0
    if traced and not tracemalloc.is_tracing():
      tracemalloc.start()
    elif not traced and tracemalloc.is_tracing():
      tracemalloc.stop()
    if traced:
      self.traced += 1
      tracemalloc.reset_peak()
      base = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    signal.setitimer(signal.ITIMER_REAL, self.time_cap)
    outcome = "decoded"
    errors: list[tuple[str, str, Optional[BaseException]]] = []
    try:
      for name, op in ops:
        try:
          result = op()
          del result
          self.per_op[f"{name}: value"] += 1
        except flax_format.FlaxFormatError:
          self.per_op[f"{name}: FlaxFormatError"] += 1
          if name == "load":
            outcome = "FlaxFormatError"
        except InputTimeout:
          raise
        except Exception as e:  # pylint: disable=broad-except
          errors.append((type(e).__name__, name, e))
    except InputTimeout:
      errors.append(("timeout", "", None))
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)
    seconds = time.perf_counter() - start
    if traced and any(kind == "timeout" for kind, _, _ in errors):
      # tracemalloc slows allocation-heavy inputs 30-60x: the time cap is
      # for the library, so such an input is timed again untraced.
      errors = [e for e in errors if e[0] != "timeout"]
      untraced = self._untraced_seconds(ops)
      if untraced is None:
        errors.append(("timeout", "", None))
      else:
        seconds = untraced
    peak = 0
    if traced:
      peak = tracemalloc.get_traced_memory()[1] - base
    for kind, name, error in errors:
      self._fail(kind, name, data, mutator, error)
      outcome = "failure"
    self.outcomes[outcome] += 1
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if rss > self.rss_limit:
      self._fail("rss", f"max RSS {rss} B", data, mutator, None)
      self.rss_limit = rss + 64 * 2**20
    if seconds > self.slowest[0]:
      self.slowest = (seconds, len(data))
      (self.workdir / "slowest.bin").write_bytes(data)
    ratio = peak / max(1, len(data))
    if ratio > self.max_ratio[0]:
      self.max_ratio = (ratio, peak, len(data))
    if peak > self.max_peak[0]:
      self.max_peak = (peak, len(data))
      (self.workdir / "max_peak.bin").write_bytes(data)
    if peak > self.mem_factor * len(data) + flax_format.MEMORY_BASE:
      self._fail("memory", f"peak {peak} B", data, mutator, None)

  def _ops(self, data: bytes) -> list[tuple[str, Callable[[], Any]]]:
    ops = [("load", lambda: flax_format.load(data)),
           ("load_writable", lambda: flax_format.load(data, writable=True)),
           ("inspect", lambda: flax_format.inspect(data)),
           ("load_subtree", lambda: flax_format.load(data, subtree="params")),
           ("load_subtree2",
            lambda: flax_format.load(data, subtree=("opt_state", "mu")))]
    if self.count % self.file_every == 0:
      self._file.write_bytes(data)
      path = str(self._file)
      ops += [("load_file", lambda: flax_format.load_file(path)),
              ("inspect_file", lambda: flax_format.inspect_file(path)),
              ("verify_path", lambda: inspection.verify_path(path))]
    return ops

  def _untraced_seconds(self, ops: list) -> Optional[float]:
    """Runs `ops` again without tracemalloc; their time, or None past the cap."""
    tracemalloc.stop()
    start = time.perf_counter()
    signal.setitimer(signal.ITIMER_REAL, self.time_cap)
    try:
      for _, op in ops:
        try:
          op()
        except InputTimeout:
          raise
        except Exception:  # pylint: disable=broad-except
          pass  # outcomes were counted on the first run
    except InputTimeout:
      return None
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)
      tracemalloc.start()
    return time.perf_counter() - start

  def _fail(self, kind: str, where: str, data: bytes, mutator: str,
            error: Optional[BaseException]) -> None:
    frame = ""
    if error is not None:
      tb = traceback.extract_tb(error.__traceback__)
      inner = [f for f in tb if "clu_ckpt" in f.filename] or tb
      frame = f"{Path(inner[-1].filename).name}:{inner[-1].lineno}"
    key = f"{kind} at {frame}" if frame else kind
    entry = self.failures.setdefault(key, dict(
        count=0, operations=[], message=str(error)[:300] if error else where,
        mutator=mutator, example=None))
    if self._last_failed_input != self.count:
      entry["count"] += 1
      self.failed_inputs += 1
      self._last_failed_input = self.count
    if where not in entry["operations"] and error is not None:
      entry["operations"].append(where)
    if entry["example"] is None:
      name = f"failure-{len(self.failures):03d}.bin"
      (self.workdir / "failures" / name).write_bytes(data)
      entry["example"] = str(self.workdir / "failures" / name)

  def retention(self, rng: random.Random, corpus: list[bytes],
                n: int = 3000) -> dict[str, Any]:
    """Memory kept by the library across inputs (it must not grow with them).

    Reads `n` inputs, a third of them with distinct 4 KiB dtype names, with
    tracemalloc on, and compares the traced memory before and after (after
    garbage collection): a reader may cache, but not without bound.
    """
    import gc  # pylint: disable=g-import-not-at-top
    if tracemalloc.is_tracing():
      tracemalloc.stop()
    inputs = []
    for i in range(n):
      if i % 3 == 0:
        name = (f"dtype{i}" * 600)[:4096].encode()
        payload = msgpack.packb([[1], name, b"\0"])
        inputs.append(msgpack.packb({"a": msgpack.ExtType(1, payload)}))
      else:
        inputs.append(mutate(rng, rng.choice(corpus), corpus)[0])
    tracemalloc.start()
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    for data in inputs:
      for _, op in self._ops(data)[:3]:
        try:
          op()
        except Exception:  # pylint: disable=broad-except
          pass
    gc.collect()
    retained = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    ok = retained < MEMORY_SLACK
    if not ok:
      self.failures["retained memory"] = dict(
          count=1, operations=["load", "inspect"],
          message=f"{retained} bytes kept after {n} inputs",
          mutator="retention", example=None)
      self.failed_inputs += 1
    return dict(inputs=n, retained_bytes=retained, ok=ok)

  def summary(self) -> dict[str, Any]:
    return dict(
        inputs=self.count, inputs_measured_with_tracemalloc=self.traced,
        outcomes_of_load=dict(self.outcomes),
        outcomes_per_operation=dict(sorted(self.per_op.items())),
        inputs_per_mutator=dict(self.by_mutator),
        mutator_fallbacks=dict(MUTATOR_ERRORS),
        mean_input_bytes=round(self.bytes_total / max(1, self.count)),
        failures=self.failed_inputs,
        failure_kinds=self.failures,
        slowest_input_s=round(self.slowest[0], 4),
        slowest_input_bytes=self.slowest[1],
        max_peak_over_size=round(self.max_ratio[0], 1),
        max_peak_over_size_at=dict(peak=self.max_ratio[1],
                                   size=self.max_ratio[2]),
        max_peak_bytes=self.max_peak[0], max_peak_input_bytes=self.max_peak[1],
        rss_max_mib=round(resource.getrusage(
            resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        # The reader's module-level dtype cache (diagnostic; private).
        dtype_cache_entries=len(getattr(flax_format, "_DTYPE_CACHE", {})),
        dtype_cache_key_bytes=sum(
            len(k) for k in getattr(flax_format, "_DTYPE_CACHE", {})))


# --------------------------------------------------------------------------
# Adversarial shapes in a child: peak RSS and time per input.
# --------------------------------------------------------------------------

# Per operation: at most this many seconds + this many per MiB of input (the
# reader parses ~1 MiB of the worst shapes per second on a laptop core).
ADVERSARIAL_SECONDS = 3.0
ADVERSARIAL_SECONDS_PER_MIB = 10.0


def _proc_status(key: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(key + ":"):
        return int(line.split()[1]) * 1024
  raise KeyError(key)


def _reset_peak_rss() -> bool:
  """Resets VmHWM (Linux >= 4.0); False where that is not allowed."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def _adversarial_ops(data: bytes,
                     path: str) -> list[tuple[str, Callable[[], Any]]]:
  return [("load", lambda: flax_format.load(data)),
          ("load_writable", lambda: flax_format.load(data, writable=True)),
          ("load_subtree", lambda: flax_format.load(data, subtree="params")),
          ("inspect", lambda: flax_format.inspect(data)),
          ("load_file", lambda: flax_format.load_file(path)),
          ("inspect_file", lambda: flax_format.inspect_file(path))]


def adversarial_worker() -> int:
  """The child: reads a file name per line, answers a JSON line per file.

  Per operation it reports the outcome, the peak RSS growth (VmHWM, reset
  before each operation, minus VmRSS before it) and the wall time. The
  address space is capped at 2 x the reader's bound + 1 GiB per input, so an
  unbounded reader meets MemoryError, not the machine's OOM killer.
  """
  import gc  # pylint: disable=g-import-not-at-top
  _import_library(instrument=False)
  import ml_dtypes  # pylint: disable=g-import-not-at-top,unused-import
  _, hard = resource.getrlimit(resource.RLIMIT_AS)
  warm = flax_format.save({"w": np.ones(2, np.float32), "s": [1, "x", 0.5],
                           "n": np.int8(1), "c": 1j, "e": {}})
  flax_format.inspect(warm), flax_format.load(warm, writable=True)
  reset = _reset_peak_rss()
  for line in sys.stdin:
    path = line.rstrip("\n")
    data = Path(path).read_bytes()
    bound = flax_format.MEMORY_FACTOR * len(data) + flax_format.MEMORY_BASE
    cap = _proc_status("VmSize") + 2 * bound + 2**30
    if hard != resource.RLIM_INFINITY:
      cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    report = {}
    for name, op in _adversarial_ops(data, path):
      gc.collect()
      _reset_peak_rss()
      before = _proc_status("VmRSS")
      start = time.perf_counter()
      try:
        result = op()
        outcome = "value"
      except flax_format.FlaxFormatError:
        outcome = "FlaxFormatError"
      except Exception as e:  # pylint: disable=broad-except
        outcome = f"{type(e).__name__}: {e}"[:300]
      seconds = time.perf_counter() - start
      peak = _proc_status("VmHWM") - before
      result = None  # pylint: disable=unused-variable
      report[name] = dict(outcome=outcome, peak=peak, seconds=seconds)
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
    print(json.dumps(dict(reset=reset, ops=report)), flush=True)
  return 0


class AdversarialPhase:
  """Runs `count` adversarial inputs through a child, asserting per input.

  Every operation must return or raise FlaxFormatError, with a peak RSS
  growth of at most MEMORY_FACTOR x size + MEMORY_BASE and at most
  ADVERSARIAL_SECONDS + ADVERSARIAL_SECONDS_PER_MIB x size in MiB. A child
  that does not answer in time is killed (a hang) and replaced. Where the
  peak RSS cannot be reset, each input gets a fresh child.
  """

  def __init__(self, workdir: Path, seed: int, count: int, max_bytes: int):
    self.workdir = workdir
    self.rng = random.Random(seed)
    self.count = count
    self.max_bytes = max_bytes
    self.failures: dict[str, dict[str, Any]] = {}
    self.failed_inputs = 0
    self.per_family: dict[str, dict[str, Any]] = {}
    self.restarts = 0
    self._proc: Optional[subprocess.Popen] = None
    self._fresh_each_input = False
    self._file = workdir / "adversarial.flax"
    (workdir / "failures").mkdir(parents=True, exist_ok=True)

  def _start(self) -> subprocess.Popen:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, __file__, "--adversarial-worker"], cwd=REPO,
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

  def _stop(self) -> None:
    if self._proc is not None:
      self._proc.kill()
      self._proc.wait()
      self._proc = None

  def _ask(self, path: Path, timeout: float) -> tuple[Optional[dict], str]:
    """The child's report on `path`, or None and why there is none."""
    import select  # pylint: disable=g-import-not-at-top
    if self._proc is None:
      self._proc = self._start()
      self.restarts += 1
    try:
      self._proc.stdin.write(f"{path}\n")
      self._proc.stdin.flush()
      ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
      line = self._proc.stdout.readline() if ready else ""
    except OSError:
      line = ""
    if not line:
      code = self._proc.poll()
      self._stop()
      if code is None:
        return None, f"timeout: no answer within {timeout:.0f} s"
      return None, f"crash: the child exited with {code}"
    answer = json.loads(line)
    if not answer["reset"]:
      self._fresh_each_input = True
    if self._fresh_each_input:
      self._stop()
    return answer, ""

  def _size(self) -> int:
    return int(math.exp(self.rng.uniform(math.log(64),
                                         math.log(self.max_bytes))))

  def run(self) -> dict[str, Any]:
    start = time.monotonic()
    try:
      for i in range(self.count):
        family = self.rng.choice(list(ADVERSARIAL))
        data = ADVERSARIAL[family](self.rng, self._size())
        if self.rng.random() < 0.5:
          data = b"\x82" + _pk("params") + data + _pk("step") + b"\x01"
        self._one(family, data)
        if (i + 1) % 25 == 0:
          print(f"adversarial: {i + 1} inputs, {self.failed_inputs} failed",
                file=sys.stderr, flush=True)
    finally:
      self._stop()
    return dict(inputs=self.count, seconds=round(time.monotonic() - start, 1),
                per_family=self.per_family, failures=self.failed_inputs,
                failure_kinds=self.failures, child_starts=self.restarts)

  def _one(self, family: str, data: bytes) -> None:
    self._file.write_bytes(data)
    size = len(data)
    bound = flax_format.MEMORY_FACTOR * size + flax_format.MEMORY_BASE
    seconds = ADVERSARIAL_SECONDS + ADVERSARIAL_SECONDS_PER_MIB * size / 2**20
    book = self.per_family.setdefault(family, dict(
        inputs=0, bytes=0, load_refused=0, max_peak_over_size=0.0,
        max_peak_over_bound=0.0, max_seconds=0.0))
    book["inputs"] += 1
    book["bytes"] += size
    timeout = 6 * seconds + 10  # six operations, and the child's start
    answer, why = self._ask(self._file, timeout)
    problems = []
    if answer is None:
      problems.append((why.split(":")[0], why))
    else:
      for op, got in answer["ops"].items():
        if got["outcome"] not in ("value", "FlaxFormatError"):
          problems.append((f"{op}: {got['outcome'].split(':')[0]}",
                           got["outcome"]))
        if op == "load" and got["outcome"] == "FlaxFormatError":
          book["load_refused"] += 1
        book["max_peak_over_size"] = round(max(book["max_peak_over_size"],
                                               got["peak"] / size), 1)
        book["max_peak_over_bound"] = round(max(book["max_peak_over_bound"],
                                                got["peak"] / bound), 3)
        book["max_seconds"] = round(max(book["max_seconds"],
                                        got["seconds"]), 3)
        if got["peak"] > bound:
          problems.append((f"{op}: memory", f"peak RSS growth {got['peak']} B "
                           f"> {bound} B for {size} B"))
        if got["seconds"] > seconds:
          problems.append((f"{op}: time", f"{got['seconds']:.1f} s > "
                           f"{seconds:.1f} s for {size} B"))
    if problems:
      self.failed_inputs += 1
    for kind, message in problems:
      key = f"adversarial {family}: {kind}"
      entry = self.failures.setdefault(key, dict(count=0, message=message,
                                                 example=None))
      entry["count"] += 1
      if entry["example"] is None:
        name = f"adversarial-{len(self.failures):03d}.bin"
        (self.workdir / "failures" / name).write_bytes(data)
        entry["example"] = str(self.workdir / "failures" / name)


# --------------------------------------------------------------------------
# Engines.
# --------------------------------------------------------------------------


def run_random(args: argparse.Namespace, runner: Runner,
               corpus: list[bytes]) -> None:
  rng = random.Random(args.seed)
  for data in corpus:
    runner.run(data, "seed")
  while runner.count < args.inputs:
    data, name = mutate(rng, rng.choice(corpus), corpus)
    runner.run(data, name)
    if runner.count % 10000 == 0:
      _progress(runner)


def _progress(runner: Runner) -> None:
  print(f"{runner.count} inputs, {dict(runner.outcomes)}, "
        f"{len(runner.failures)} failure kinds", file=sys.stderr, flush=True)


def run_atheris(args: argparse.Namespace, runner: Runner,
                corpus: list[bytes]) -> None:
  """libFuzzer with coverage of clu_ckpt, plus the structured mutators."""
  import atheris  # pylint: disable=g-import-not-at-top
  corpus_dir = args.workdir / "corpus"
  corpus_dir.mkdir(parents=True, exist_ok=True)
  for i, data in enumerate(corpus):
    (corpus_dir / f"seed-{i:03d}").write_bytes(data)
  summary_path = args.workdir / "summary.json"

  def test_one_input(data: bytes) -> None:
    runner.run(data, test_one_input.mutator)
    test_one_input.mutator = "libfuzzer"
    if runner.count % 10000 == 0:
      _progress(runner)
      summary_path.write_text(json.dumps(runner.summary()))
    if runner.count >= args.inputs:
      retention = runner.retention(random.Random(args.seed + 7), corpus)
      summary_path.write_text(json.dumps(dict(retention=retention,
                                              **runner.summary())))
      os._exit(0)  # pylint: disable=protected-access

  test_one_input.mutator = "seed"
  rng = random.Random(args.seed)

  def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    rng.seed(seed)
    if rng.random() < 0.4:
      test_one_input.mutator = "libfuzzer"
      return atheris.Mutate(data, max_size)
    out, name = mutate(rng, data or rng.choice(corpus), corpus)
    test_one_input.mutator = name
    return out[:max_size]

  argv = [sys.argv[0], str(corpus_dir), f"-runs={args.inputs * 2}",
          f"-seed={args.seed + 1}", f"-timeout={int(args.time_cap) + 5}",
          "-rss_limit_mb=8192", "-max_len=16384", "-print_final_stats=1"]
  atheris.Setup(argv, test_one_input, custom_mutator=custom_mutator)
  atheris.Fuzz()


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--inputs", type=int, default=100_000)
  parser.add_argument("--engine", choices=["auto", "atheris", "random"],
                      default="auto")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--time-cap", type=float, default=5.0,
                      help="seconds allowed per input")
  parser.add_argument("--mem-factor", type=float, default=None,
                      help="tracemalloc peak allowed per input byte "
                      "(default: flax_format.MEMORY_FACTOR)")
  parser.add_argument("--adversarial", type=int, default=200,
                      help="adversarial-shape inputs measured in a child")
  parser.add_argument("--adversarial-max-bytes", type=int, default=2**20)
  parser.add_argument("--workdir", type=Path, default=None)
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--adversarial-worker", action="store_true",
                      help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.adversarial_worker:
    return adversarial_worker()
  if args.engine == "auto":
    try:
      import atheris  # pylint: disable=g-import-not-at-top,unused-import
      args.engine = "atheris"
    except ImportError:
      args.engine = "random"
  args.workdir = args.workdir or Path(tempfile.mkdtemp(prefix="soak-fuzz-"))
  args.workdir.mkdir(parents=True, exist_ok=True)
  if args.engine == "atheris" and not args.worker:
    return _supervise_atheris(args)
  _import_library(instrument=args.engine == "atheris")
  if args.mem_factor is None:
    args.mem_factor = float(flax_format.MEMORY_FACTOR)
  corpus = seeds()
  runner = Runner(args.workdir, args.time_cap, args.mem_factor)
  start = time.monotonic()
  rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  if args.engine == "atheris":
    run_atheris(args, runner, corpus)
    return 0
  run_random(args, runner, corpus)
  retention = runner.retention(random.Random(args.seed + 7), corpus)
  adversarial = AdversarialPhase(args.workdir, args.seed + 11,
                                 args.adversarial,
                                 args.adversarial_max_bytes).run()
  summary = dict(engine="random", seeds=len(corpus), retention=retention,
                 seconds=round(time.monotonic() - start, 1),
                 rss_start_mib=round(rss_start, 1), **runner.summary(),
                 adversarial=adversarial)
  print(json.dumps(summary, indent=2))
  return 1 if summary["failures"] or adversarial["failures"] else 0


def _supervise_atheris(args: argparse.Namespace) -> int:
  """Runs the atheris worker in a child (libFuzzer exits the process)."""
  start = time.monotonic()
  argv = [sys.executable, __file__, "--worker", "--engine", "atheris",
          "--inputs", str(args.inputs), "--seed", str(args.seed),
          "--time-cap", str(args.time_cap), "--workdir", str(args.workdir)]
  if args.mem_factor is not None:
    argv += ["--mem-factor", str(args.mem_factor)]
  proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        text=True, check=False)
  (args.workdir / "libfuzzer.log").write_text(proc.stderr)
  summary_path = args.workdir / "summary.json"
  if not summary_path.exists():
    print(proc.stderr[-5000:])
    print(json.dumps(dict(engine="atheris", crashed=True,
                          returncode=proc.returncode)))
    return 1
  summary = json.loads(summary_path.read_text())
  _import_library(instrument=False)  # for the adversarial phase, here
  adversarial = AdversarialPhase(args.workdir, args.seed + 11,
                                 args.adversarial,
                                 args.adversarial_max_bytes).run()
  summary = dict(engine="atheris", seconds=round(time.monotonic() - start, 1),
                 worker_returncode=proc.returncode, **summary,
                 adversarial=adversarial)
  complete = summary["inputs"] >= args.inputs
  if not complete:
    summary["incomplete"] = proc.stderr[-3000:]
  print(json.dumps(summary, indent=2))
  print(f"work directory: {args.workdir}")
  return 1 if (summary["failures"] or adversarial["failures"] or
               not complete) else 0


if __name__ == "__main__":
  sys.exit(main())
