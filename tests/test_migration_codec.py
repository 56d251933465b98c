"""Tests of clu_ckpt.migration.codec: stand-ins, key order, and their records.

Round trips go through real Orbax; the end-to-end tests compare what
`restore_state` returns with what `flax.serialization.msgpack_restore`
returns for the source `.flax`, key order and types included.
"""

import json
import os
import pathlib
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import serialization

from clu_ckpt import flax_format
from clu_ckpt import migration
from clu_ckpt.migration import codec
from migration_helpers import clu_save

REPO = pathlib.Path(__file__).resolve().parents[1]
# A float NaN with a payload: its bits must survive, not just its NaN-ness.
_NAN = struct.unpack("<d", struct.pack("<Q", 0x7FF800000000BEEF))[0]


def _assert_exact(got, want, path="/"):
  """Exact equality: key order at every level, types, dtypes, shapes, bytes."""
  assert type(got) is type(want), (path, type(got), type(want))
  if isinstance(want, dict):
    assert list(got) == list(want), (path, list(got), list(want))
    for key in want:
      _assert_exact(got[key], want[key], f"{path}{key!r}/")
  elif isinstance(want, list):
    assert len(got) == len(want), path
    for i, (x, y) in enumerate(zip(got, want)):
      _assert_exact(x, y, f"{path}{i}/")
  elif isinstance(want, (np.ndarray, np.generic)):
    assert (got.dtype, got.shape) == (want.dtype, want.shape), path
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), path
  elif isinstance(want, (float, complex)):
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), path
  else:
    assert got == want, path


def _orbax_round_trip(tree, directory):
  """`tree` saved and restored by stock Orbax (no target item)."""
  path = pathlib.Path(directory) / "item"
  checkpointer = ocp.PyTreeCheckpointer()
  checkpointer.save(path, tree)
  return checkpointer.restore(path)


def _through_orbax(state, directory):
  """encode -> JSON encodings -> stock Orbax -> decode."""
  stored, encodings = codec.encode_state(state)
  encodings = json.loads(json.dumps(encodings))  # as the metadata item
  return codec.decode_state(_orbax_round_trip(stored, directory), encodings)


# A tree with every kind of leaf and key that Orbax does not give back as is.
_STATE = {
    "zeta": np.arange(4, dtype=np.float32),
    "a/b": np.float16(1.5),  # a numpy scalar, beside a -> b
    "a": {"b": np.arange(3, dtype=np.int8), "c/": b"\x00\x01"},
    "opt": {str(i): np.full(2, i, np.int32) for i in range(12)},
    "big_endian": np.arange(3, dtype=">i8"),
    "bf16": np.ones(2, ml_dtypes.bfloat16),
    "u4": np.arange(4).astype(ml_dtypes.uint4),
    "text": np.array(["ab", "c"]),
    "empty": np.zeros((0, 3), np.int16),
    "np": {"f32": np.float32(2.5), "i64": np.int64(-3), "f64": np.float64(0.1),
           "bool": np.bool_(True), "c128": np.complex128(1 - 2j),
           "str": np.str_("hé")},
    "py": {"int": -7, "big": 2**64 - 1, "float": _NAN, "zero": -0.0,
           "true": True, "one": 1, "none": None, "str": "héllo",
           "bytes": b"\xff", "no_bytes": b"", "complex": 3 - 4j},
    "Empty": {},
    "lists": [[], {}, [{"y": 1, "x": np.float32(2)}], None, (1, "0")],
    "no_list": [],
    "when": np.array([1, 2], "datetime64[s]"),
}


# --------------------------------------------------------------------------
# Encoding and decoding, through real Orbax.
# --------------------------------------------------------------------------


def test_round_trip_through_orbax_is_exact(tmp_path):
  want = dict(_STATE, lists=[[], {}, [{"y": 1, "x": np.float32(2)}], None,
                             [1, "0"]])  # Orbax keeps tuples as lists
  _assert_exact(_through_orbax(_STATE, tmp_path), want)


def test_slash_keys_are_not_confused_with_nesting(tmp_path):
  # Records keyed "/a/b" made both leaves decode with one record: wrong
  # values, or "cannot reshape array of size 2 into shape ()".
  state = {"a/b": np.float32(1), "a": {"b": np.zeros(2, ml_dtypes.uint4)},
           "l": [b"\x07"], "l/0": {"0": np.int8(1)}}
  stored, encodings = codec.encode_state(state)
  records = encodings["records"]
  assert records['["a/b"]']["kind"] == "npscalar"
  assert records['["a", "b"]']["stored_as"] == "raw_bytes"
  assert records['["l", 0]']["kind"] == "bytes"
  assert records['["l/0", "0"]']["kind"] == "npscalar"
  assert len(records) == 4
  _assert_exact(_through_orbax(state, tmp_path), state)


def test_key_order_of_every_dict_comes_back(tmp_path):
  state = {"opt": {str(i): {"mu": np.float32(i), "count": i}
                   for i in range(12)},
           "z": {}, "é": [], "B": {"y": {}, "x": {"2": 1, "10": 2}}, "a": 0}
  restored = _orbax_round_trip(codec.encode_state(state)[0], tmp_path)
  assert list(restored["opt"]) != list(state["opt"])  # Orbax sorts them
  _assert_exact(_through_orbax(state, tmp_path / "2"), state)


def test_empty_subtrees_orbax_drops_are_put_back():
  # Orbax 0.12.8 keeps them; an Orbax that drops them (or gives None)
  # still restores exactly.
  state = {"a": {}, "b": [], "c": {"d": {}}, "e": 1}
  stored, encodings = codec.encode_state(state)
  _assert_exact(codec.decode_state({"c": {}, "e": 1}, encodings), state)
  _assert_exact(codec.decode_state({"a": None, "b": None, "c": {"d": None},
                                    "e": 1}, encodings), state)
  assert stored == state


def test_encodings_are_json_and_small():
  state = {f"k{i}": {"w": np.zeros(2, np.float32), "s": np.float32(i)}
           for i in range(500)}
  stored, encodings = codec.encode_state(state)
  text = json.dumps(encodings)
  assert json.loads(text) == encodings
  # One record per numpy scalar; "order" holds each key once, and a dict's
  # key once more (no full paths).
  assert len(encodings["records"]) == 500
  order = json.dumps(encodings["order"])
  assert len(order) < 2 * len(json.dumps(list(state))) + 500 * 40
  assert encodings["version"] == 2
  assert "sub" not in encodings["order"]["sub"]["k0"]  # leaves have no node
  assert stored["k0"]["s"].shape == ()


def test_encode_does_not_copy_arrays():
  raw = b"\x01" * 64
  state = {"f": np.arange(8, dtype=np.float32),
           "t": np.array(["ab", "cd"]), "b": raw,
           "u4": np.arange(4).astype(ml_dtypes.uint4)}
  stored, _ = codec.encode_state(state)
  assert stored["f"] is state["f"]
  assert np.shares_memory(stored["t"], state["t"])
  assert np.shares_memory(stored["u4"], state["u4"])
  assert np.shares_memory(stored["b"], np.frombuffer(raw, np.uint8))


def test_dtype_records_use_the_package_codec():
  _, encodings = codec.encode_state(_STATE)
  records = encodings["records"]
  for record in records.values():
    if "dtype" in record:
      assert flax_format.dtype_from_name(record["dtype"]) is not None
  assert records['["text"]']["dtype"] == "<U2"
  assert records['["u4"]']["dtype"] == "uint4"
  assert records['["big_endian"]']["stored_as"] == "raw_bytes"
  assert records['["np", "f64"]']["kind"] == "npscalar"
  assert records['["np", "str"]']["kind"] == "npscalar"


def test_decode_subtree_of_one_unit(tmp_path):
  state = {"p": {"l": [{"b": np.float16(1), "a": 2}], "s": b"x"}}
  stored, encodings = codec.encode_state(state)
  restored = _orbax_round_trip(stored, tmp_path)
  encodings = json.loads(json.dumps(encodings))
  _assert_exact(codec.decode_subtree(restored["p"]["l"], ["p", "l"],
                                     encodings), state["p"]["l"])
  _assert_exact(codec.decode_subtree(restored["p"]["s"], ("p", "s"),
                                     encodings), b"x")


def test_colliding_orbax_names_are_refused():
  with pytest.raises(migration.MigrationError,
                     match="/a.b and /a/b .*Orbax name 'a.b'"):
    codec.encode_state({"a.b": 1, "a": {"b": 2}})
  # TensorStore stores "x/" and "x" as one array: Orbax would fail or
  # silently keep one value for both.
  with pytest.raises(migration.MigrationError,
                     match=r'\["x/"\] and /x .*one array'):
    codec.encode_state({"x/": 1, "x": 2})
  with pytest.raises(migration.MigrationError, match="key 3"):
    codec.encode_state({"a": {3: np.ones(1)}})


def test_unknown_encodings_version_is_refused():
  with pytest.raises(migration.MigrationError, match="version 3"):
    codec.decode_state({"x": 1}, {"version": 3, "records": {}})


# --------------------------------------------------------------------------
# Version 1 records, as earlier releases wrote them.
# --------------------------------------------------------------------------


def test_version_1_records_still_decode(tmp_path):
  # Written by hand as the previous codec wrote them: records keyed by
  # "/"-joined paths, order from metadata["leaves"].
  state = {"z": {"c": np.float16(1.5), "a": b"\x01\x02"},
           "t": np.array(["ab"]), "e": np.zeros((0, 2), np.int8),
           "k": 1 + 2j, "m": np.arange(2, dtype=np.int32)}
  stored = {"z": {"c": np.asarray(np.float16(1.5)),
                  "a": np.frombuffer(b"\x01\x02", np.uint8)},
            "t": np.frombuffer(np.array(["ab"]).tobytes(), np.uint8),
            "e": None, "k": np.asarray(1 + 2j), "m": state["m"]}
  v1 = {"/z/c": {"kind": "npscalar", "dtype": "<f2", "shape": []},
        "/z/a": {"kind": "bytes", "dtype": "|u1", "shape": [2]},
        "/t": {"kind": "ndarray", "dtype": "<U2", "shape": [1],
               "stored_as": "raw_bytes"},
        "/e": {"kind": "ndarray", "dtype": "|i1", "shape": [0, 2],
               "stored_as": "none"},
        "/k": {"kind": "complex"}}
  leaf_paths = ["/z/c", "/z/a", "/t", "/e", "/k", "/m"]
  restored = _orbax_round_trip(stored, tmp_path)
  _assert_exact(codec.decode_state(restored, v1, leaf_paths), state)
  _assert_exact(codec.decode_subtree(restored["z"], ["z"], v1),
                {"a": b"\x01\x02", "c": np.float16(1.5)})  # Orbax's order


def test_version_1_dtype_names_still_decode():
  # Older steps recorded numpy `.str` names; Flax names decode too.
  for name in ("<f2", "float16"):
    record = {"kind": "npscalar", "dtype": name, "shape": []}
    got = codec.decode_state({"x": np.asarray(1.5, np.float16)},
                             {"/x": record})["x"]
    _assert_exact(got, np.float16(1.5))
  for name in ("<U2", "str64"):
    record = {"kind": "ndarray", "dtype": name, "shape": [1],
              "stored_as": "raw_bytes"}
    raw = np.frombuffer(np.array(["ab"]).tobytes(), np.uint8)
    got = codec.decode_state({"x": raw}, {"/x": record})["x"]
    _assert_exact(got, np.array(["ab"]))


def test_step_migrated_with_version_1_records_restores(tmp_path):
  state = {"w": np.ones(2, np.float32), "n": {"s": np.int64(3), "b": b"q"}}
  clu_save(tmp_path / "src", [state])
  assert migration.migrate(str(tmp_path / "src"), str(tmp_path / "dst")).ok
  # Rewrite the step's metadata as an earlier release wrote it.
  meta_file = tmp_path / "dst" / "1" / "metadata" / "metadata"
  meta = json.loads(meta_file.read_text())
  meta["encoded"] = {"/n/s": {"kind": "npscalar", "dtype": "<i8",
                              "shape": []},
                     "/n/b": {"kind": "bytes", "dtype": "|u1",
                              "shape": [1]}}
  meta_file.write_text(json.dumps(meta))
  _assert_exact(migration.restore_state(str(tmp_path / "dst"), 1),
                serialization.msgpack_restore(
                    (tmp_path / "src" / "ckpt-1.flax").read_bytes()))


# --------------------------------------------------------------------------
# End to end: restore_state returns exactly what msgpack_restore returns.
# --------------------------------------------------------------------------


def _tricky_state():
  """What users migrate, with every case a Flax state dict can hold.

  Flax writes unicode arrays but cannot read them back (`np.dtype("str64")`
  fails): they are added where the source is read with `flax_format`.
  """
  return {
      "a/b": np.float32(1.5),
      "a": {"b": np.arange(2, dtype=np.int64), "c": b"xy"},
      "opt_state": tuple(np.full(2, i, np.float32) for i in range(12)),
      "np": {"f32": np.float32(-1), "i64": np.int64(2**40), "f64":
             np.float64(0.25), "bool": np.bool_(False), "u8": np.uint8(7)},
      "py": {"int": 3, "big": 2**64 - 1, "float": 0.5, "nan": _NAN,
             "true": True, "zero": 0, "none": None, "str": "héllo",
             "bytes": b"\x00\xff", "no_bytes": b"", "complex": 1 - 2j},
      "zz_empty_dict": {},
      "empty_list": [],
      "bf16": np.array([1.5, -2.25], ml_dtypes.bfloat16),
      "zero_size": np.zeros((0, 3), np.float32),
      "u4": np.array([1, 15], ml_dtypes.uint4),
      "when": np.array([1, 2], "datetime64[s]"),
      "Z": {"y": 1, "x": {"é": 2, "e": 3}},
      "dots.key": 1,
  }


def _with_unicode(state):
  return dict(state, unicode=np.array(["ab", "cde"]),
              z_scalar=np.str_("hé"))


def test_restore_state_is_exactly_what_flax_restores(tmp_path):
  clu_save(tmp_path / "src", [_tricky_state(), _with_unicode(_tricky_state())])
  summary = migration.migrate(str(tmp_path / "src"), str(tmp_path / "dst"),
                              verify=True)
  assert summary.ok, summary.failed
  assert [s.step for s in summary.steps] == [1, 2]
  assert all(s.verified for s in summary.steps)
  raw = (tmp_path / "src" / "ckpt-1.flax").read_bytes()
  want = serialization.msgpack_restore(raw)
  _assert_exact(migration.restore_state(str(tmp_path / "dst"), 1), want)
  assert list(want["opt_state"]) == [str(i) for i in range(12)]
  assert type(want["np"]["f64"]) is np.float64
  assert want["empty_list"] == {}  # to_bytes writes an empty list as {}
  # The package's reader is what Flax returns, where Flax can read it...
  _assert_exact(flax_format.load_file(str(tmp_path / "src" / "ckpt-1.flax")),
                want)
  # ... and stands in for it where it cannot: unicode arrays and scalars.
  source = flax_format.load_file(str(tmp_path / "src" / "ckpt-2.flax"))
  assert type(source["z_scalar"]) is np.str_
  _assert_exact(migration.restore_state(str(tmp_path / "dst"), 2), source)


def test_restore_state_of_lists_written_by_msgpack_serialize(tmp_path):
  # msgpack_serialize (unlike to_bytes) keeps lists as msgpack arrays; in
  # place, it keeps the keys' order too.
  clu_save(tmp_path / "src", [{"x": 1}])
  flax = tmp_path / "src" / "ckpt-1.flax"
  flax.write_bytes(serialization.msgpack_serialize({
      "l": [{"b": np.float32(1), "a": b"z"}, [], {}, [np.int8(2), None]],
      "e": [], "s/": {"1": [1.5, "x"]}}, in_place=True))
  summary = migration.migrate(str(tmp_path / "src"), str(tmp_path / "dst"),
                              verify=True)
  assert summary.ok, summary.failed
  want = serialization.msgpack_restore(flax.read_bytes())
  assert list(want) == ["l", "e", "s/"] and list(want["l"][0]) == ["b", "a"]
  _assert_exact(migration.restore_state(str(tmp_path / "dst")), want)


@pytest.mark.thorough
def test_cli_migrate_verify_on_the_tricky_state(tmp_path):
  clu_save(tmp_path / "src", [_with_unicode(_tricky_state())])
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
             TF_CPP_MIN_LOG_LEVEL="3")
  run = subprocess.run(
      [sys.executable, "-m", "clu_ckpt", "migrate", str(tmp_path / "src"),
       str(tmp_path / "dst"), "--verify"], capture_output=True, text=True,
      cwd=tmp_path, env=env, timeout=600)
  assert run.returncode == 0, run.stdout + run.stderr
  assert "verified" in run.stdout + run.stderr
  _assert_exact(migration.restore_state(str(tmp_path / "dst")),
                flax_format.load_file(str(tmp_path / "src" / "ckpt-1.flax")))
