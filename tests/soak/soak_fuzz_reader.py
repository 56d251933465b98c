"""Soak: fuzz the `.flax` reader with hostile input; only FlaxFormatError.

Inputs are mutations of real, valid `.flax` files (the golden fixtures
written by clu 0.0.12 when present, plus files written by `flax_format.save`
covering every leaf kind, Flax's chunked form and deep trees): truncations,
bit flips, interesting bytes, huge declared lengths (in the fields of real
headers), deep nesting, unknown ext type codes, wrong types in real
positions (re-encoded), splices, and with atheris also libFuzzer's own
mutations guided by coverage of `clu_ckpt.flax_format`.

Each input goes through `load`, `load(writable=True)`, `inspect`,
`load(subtree=...)` (and every 64th input through `load_file`,
`inspect_file` and `inspection.verify_path` from a file). Allowed outcomes:
a value or `FlaxFormatError`. Anything else is a failure, recorded with the
input. Per input: a time cap (SIGALRM) and a memory cap: the tracemalloc
peak must stay under `--mem-factor` x the input size + 2 MiB (decoded Python
objects cost more than their msgpack bytes, and MAX_DEPTH levels of recursion
cost Python frames, but nothing may grow with a *declared* length). One
input in three is measured (in blocks of 500; tracemalloc slows the reader
about sevenfold); the process' max RSS is checked after every input.

Usage::

  python tests/soak/soak_fuzz_reader.py --inputs 100000 [--engine atheris]
      [--seed 0] [--time-cap 5] [--workdir DIR]

Prints a JSON summary (inputs, outcomes, failures by kind with an example
file each, slowest input, largest memory ratio, RSS); exits 1 on failures.
"""

from __future__ import annotations

import argparse
import collections
import json
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


MUTATORS: dict[str, Callable[..., bytes]] = {
    "truncate": m_truncate, "bitflip": m_bitflip,
    "interesting": m_interesting, "huge_length": m_huge_length,
    "widen": m_widen, "deep": m_deep, "ext_code": m_ext_code,
    "wrong_type": m_wrong_type, "bad_array": m_bad_array, "block": m_block,
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
# Allowed on top of `--mem-factor` x size: the Python frames of MAX_DEPTH
# levels of recursion (about 0.2 MiB in all, over 1 MiB under atheris'
# instrumentation).
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
    if peak > self.mem_factor * len(data) + MEMORY_SLACK:
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
  parser.add_argument("--mem-factor", type=float, default=256.0,
                      help="tracemalloc peak allowed per input byte")
  parser.add_argument("--workdir", type=Path, default=None)
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
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
  corpus = seeds()
  runner = Runner(args.workdir, args.time_cap, args.mem_factor)
  start = time.monotonic()
  rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  if args.engine == "atheris":
    run_atheris(args, runner, corpus)
    return 0
  run_random(args, runner, corpus)
  retention = runner.retention(random.Random(args.seed + 7), corpus)
  summary = dict(engine="random", seeds=len(corpus), retention=retention,
                 seconds=round(time.monotonic() - start, 1),
                 rss_start_mib=round(rss_start, 1), **runner.summary())
  print(json.dumps(summary, indent=2))
  return 1 if summary["failures"] else 0


def _supervise_atheris(args: argparse.Namespace) -> int:
  """Runs the atheris worker in a child (libFuzzer exits the process)."""
  start = time.monotonic()
  argv = [sys.executable, __file__, "--worker", "--engine", "atheris",
          "--inputs", str(args.inputs), "--seed", str(args.seed),
          "--time-cap", str(args.time_cap), "--mem-factor",
          str(args.mem_factor), "--workdir", str(args.workdir)]
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
  summary = dict(engine="atheris", seconds=round(time.monotonic() - start, 1),
                 worker_returncode=proc.returncode, **summary)
  complete = summary["inputs"] >= args.inputs
  if not complete:
    summary["incomplete"] = proc.stderr[-3000:]
  print(json.dumps(summary, indent=2))
  print(f"work directory: {args.workdir}")
  return 1 if summary["failures"] or not complete else 0


if __name__ == "__main__":
  sys.exit(main())
