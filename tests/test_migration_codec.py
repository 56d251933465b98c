"""Tests of clu_ckpt.migration.codec: stand-ins and their dtype records."""

import ml_dtypes
import numpy as np
import pytest

from clu_ckpt import flax_format
from clu_ckpt import migration
from clu_ckpt.migration import codec


def _same(a, b):
  if isinstance(a, dict):
    return (isinstance(b, dict) and list(a) == list(b) and
            all(_same(a[k], b[k]) for k in a))
  return migration.same_leaf(a, b)


def _leaf_paths(tree, prefix=""):
  for key, value in tree.items():
    if isinstance(value, dict) and value:
      yield from _leaf_paths(value, f"{prefix}/{key}")
    else:
      yield f"{prefix}/{key}"


_STATE = {
    "f": np.arange(4, dtype=np.float32),
    "big_endian": np.arange(3, dtype=">i8"),
    "bf16": np.ones(2, ml_dtypes.bfloat16),
    "u4": np.arange(4).astype(ml_dtypes.uint4),
    "text": np.array(["ab", "c"]),
    "empty": np.zeros((0, 3), np.int16),
    "scalar": np.float16(1.5),
    "raw": b"\x00\x01",
    "c": 1 + 2j,
    "when": np.array([1, 2], "datetime64[s]"),
}


def test_encode_decode_round_trip_exactly():
  stored, encodings = codec.encode_state(_STATE)
  for record in encodings.values():
    if "dtype" in record:
      # Names from the package's one codec.
      assert flax_format.dtype_from_name(record["dtype"]) is not None
  restored = codec.decode_state(stored, encodings, list(_leaf_paths(_STATE)))
  assert _same(restored, _STATE)
  assert encodings["/text"]["dtype"] == "<U2"
  assert encodings["/u4"]["dtype"] == "uint4"


def test_records_of_older_migrations_still_decode():
  # Older steps recorded numpy `.str` names; Flax names decode too.
  for name in ("<f2", "float16"):
    record = {"kind": "npscalar", "dtype": name, "shape": []}
    got = codec.decode_state({"x": np.asarray(1.5, np.float16)},
                             {"/x": record})["x"]
    assert migration.same_leaf(got, np.float16(1.5))
  for name in ("<U2", "str64"):
    record = {"kind": "ndarray", "dtype": name, "shape": [1],
              "stored_as": "raw_bytes"}
    raw = np.frombuffer(np.array(["ab"]).tobytes(), np.uint8)
    got = codec.decode_state({"x": raw}, {"/x": record})["x"]
    assert migration.same_leaf(got, np.array(["ab"]))
  record = {"kind": "ndarray", "dtype": "bfloat16", "shape": [0],
            "stored_as": "none"}
  got = codec.decode_state({"x": None}, {"/x": record})["x"]
  assert got.dtype == ml_dtypes.bfloat16 and got.shape == (0,)


def test_encode_refuses_colliding_orbax_names():
  with pytest.raises(migration.MigrationError, match="Orbax name"):
    codec.encode_state({"a.b": 1, "a": {"b": 2}})
