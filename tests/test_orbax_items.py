"""Tests for clu_ckpt.orbax_items: tf.data iterator state as an Orbax item."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorflow as tf

import clu_ckpt
from clu_ckpt import orbax_items
from clu_ckpt import tf_bundle


def _iterator(start=0):
  it = iter(tf.data.Dataset.range(10_000).batch(4))
  for _ in range(start):
    next(it)
  return it


def _next(it):
  return next(it).numpy().tolist()


def _save(directory, step, it, state=None):
  with ocp.CheckpointManager(directory) as mngr:
    mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state or {"w": np.arange(3.0)}),
        dataset=clu_ckpt.TfStateSave(dict(ds_iter=it))))
    mngr.wait_until_finished()


def test_iterator_resumes_after_save_and_restore(tmp_path):
  it = _iterator(start=3)
  _save(tmp_path / "ckpt", 7, it)
  expected = _next(it)  # What the iterator yields right after the save.
  for _ in range(5):
    next(it)

  fresh = _iterator()
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    restored = mngr.restore(7, args=ocp.args.Composite(
        state=ocp.args.StandardRestore({"w": np.zeros(3)}),
        dataset=clu_ckpt.TfStateRestore(dict(ds_iter=fresh))))
  assert _next(fresh) == expected == [12, 13, 14, 15]
  np.testing.assert_array_equal(restored["state"]["w"], np.arange(3.0))
  assert restored["dataset"]["ds_iter"] is fresh


def test_same_manager_saves_twice_and_restores_each_step(tmp_path):
  it = _iterator()
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    expected = {}
    for step in (1, 2):
      mngr.save(step, args=ocp.args.Composite(
          dataset=clu_ckpt.TfStateSave(dict(ds_iter=it))))
      mngr.wait_until_finished()
      expected[step] = _next(it)
    for step in (2, 1):
      fresh = _iterator()
      mngr.restore(step, args=ocp.args.Composite(
          dataset=clu_ckpt.TfStateRestore(dict(ds_iter=fresh))))
      assert _next(fresh) == expected[step]
    # Without args the item comes back in its stored form.
    raw = mngr.restore(2)["dataset"]
  assert list(raw) == ["process_0"]
  assert raw["process_0"]["index"].dtype == np.uint8


def test_stock_orbax_restores_without_clu_ckpt(tmp_path):
  it = _iterator(start=2)
  _save(tmp_path / "ckpt", 3, it)
  expected = _next(it)
  script = textwrap.dedent("""
      import json, sys
      import orbax.checkpoint as ocp
      mngr = ocp.CheckpointManager(sys.argv[1])
      restored = mngr.restore(mngr.latest_step())
      assert "clu_ckpt" not in sys.modules
      files = restored["dataset"]["process_0"]
      out = {"steps": list(mngr.all_steps()), "items": sorted(restored),
             "files": {k: [str(v.dtype), bytes(v).hex()]
                       for k, v in files.items()}}
      print(json.dumps(out))
  """)
  out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ckpt")],
                       check=True, capture_output=True, text=True,
                       cwd=tmp_path)
  got = json.loads(out.stdout.strip().splitlines()[-1])
  assert got["steps"] == [3]
  assert got["items"] == ["dataset", "state"]
  assert "index" in got["files"]
  assert {dtype for dtype, _ in got["files"].values()} == {"uint8"}
  # The stock form alone is enough to resume the iterator.
  files = {k: np.frombuffer(bytes.fromhex(h), np.uint8)
           for k, (_, h) in got["files"].items()}
  fresh = _iterator()
  orbax_items.restore_tf_state(dict(ds_iter=fresh), files)
  assert _next(fresh) == expected


def test_wrong_tf_state_key_is_a_clear_error(tmp_path):
  _save(tmp_path / "ckpt", 1, _iterator())
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    with pytest.raises(ValueError, match=r"\['iterator'\].*\['ds_iter'\]"):
      mngr.restore(1, args=ocp.args.Composite(
          dataset=clu_ckpt.TfStateRestore(dict(iterator=_iterator()))))


def test_missing_process_is_a_clear_error(tmp_path):
  _save(tmp_path / "ckpt", 1, _iterator())
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    with pytest.raises(KeyError, match=r"process 3.*\[0\]"):
      mngr.restore(1, args=ocp.args.Composite(
          dataset=clu_ckpt.TfStateRestore(dict(ds_iter=_iterator()),
                                          process_index=3)))


def test_clu_written_files_restore_the_iterator(golden_copy):
  src = golden_copy("single_host")
  manifest = json.loads((src / "MANIFEST.json").read_text())
  for name, entry in manifest["checkpoints"].items():
    files = orbax_items.read_tf_files(str(src / name))
    assert set(files) == {"index", "data-00000-of-00001"}
    assert files["index"].tobytes() == (src / f"{name}.index").read_bytes()
    fresh = _iterator()
    orbax_items.restore_tf_state(dict(ds_iter=fresh), files)
    assert _next(fresh) == entry["next_batch"]


def test_tf_state_names(golden_copy):
  single = golden_copy("single_host")
  flax_only = golden_copy("flax_only")
  assert orbax_items.tf_state_names(str(single / "ckpt-3"), check=True) == [
      "ds_iter"]
  # CLU writes a TensorFlow checkpoint without tf_state too: only the counter.
  assert orbax_items.tf_state_names(str(flax_only / "model-1")) == []


def test_corrupt_tf_files_are_reported_with_their_name(golden_copy):
  src = golden_copy("single_host")
  data = src / "ckpt-3.data-00000-of-00001"
  raw = bytearray(data.read_bytes())
  raw[len(raw) // 2] ^= 0xFF
  data.write_bytes(bytes(raw))
  with pytest.raises(ValueError, match="ckpt-3.data"):
    orbax_items.tf_state_names(str(src / "ckpt-3"), check=True)

  index = src / "ckpt-4.index"
  index.write_bytes(index.read_bytes()[:20])
  with pytest.raises(ValueError, match="ckpt-4.index"):
    orbax_items.tf_state_names(str(src / "ckpt-4"))

  os.remove(src / "ckpt-5.data-00000-of-00001")
  with pytest.raises(FileNotFoundError, match=r"ckpt-5\.data"):
    orbax_items.read_tf_files(str(src / "ckpt-5"))


def test_names_and_checks_without_tensorflow(golden_copy, monkeypatch):
  def no_tensorflow():
    raise ImportError("blocked")
  monkeypatch.setattr(orbax_items, "_tensorflow", no_tensorflow)
  src = golden_copy("single_host")
  assert orbax_items.tf_state_names(str(src / "ckpt-3"), check=True) == [
      "ds_iter"]
  entries = tf_bundle.index_entries(str(src / "ckpt-3"))[1]
  data = src / "ckpt-3.data-00000-of-00001"
  raw = bytearray(data.read_bytes())
  # The save counter's bytes: checked without TensorFlow (its crc32c).
  counter = entries["save_counter/.ATTRIBUTES/VARIABLE_VALUE"]
  raw[counter["offset"]] ^= 0x01
  data.write_bytes(bytes(raw))
  with pytest.raises(ValueError, match=r"ckpt-3\.data.*save_counter.*checksum"):
    orbax_items.tf_state_names(str(src / "ckpt-3"), check=True)
  # A truncated shard.
  data4 = src / "ckpt-4.data-00000-of-00001"
  data4.write_bytes(data4.read_bytes()[:100])
  with pytest.raises(ValueError, match=r"ckpt-4\.data.*beyond the file"):
    orbax_items.tf_state_names(str(src / "ckpt-4"), check=True)
  # A flipped bit in the index: its block checksum.
  index = src / "ckpt-5.index"
  raw = bytearray(index.read_bytes())
  raw[20] ^= 0x01
  index.write_bytes(bytes(raw))
  with pytest.raises(ValueError, match=r"ckpt-5\.index"):
    orbax_items.tf_state_names(str(src / "ckpt-5"))
  index.write_bytes(b"not a table" * 10)
  with pytest.raises(ValueError, match="bad magic"):
    orbax_items.tf_state_names(str(src / "ckpt-5"))


def test_gather_packing_roundtrip():
  files = {"index": np.frombuffer(b"\x00\x01idx", np.uint8),
           "data-00000-of-00001": np.arange(300, dtype=np.uint8)}
  # pylint: disable-next=protected-access
  unpacked = orbax_items._unpack(orbax_items._pack(files))
  assert list(unpacked) == list(files)
  for key, value in files.items():
    np.testing.assert_array_equal(unpacked[key], value)


def test_process_keys():
  assert orbax_items.process_key(12) == "process_12"
  tree = {"process_1": {}, "process_0": {}, "other": {}, "process_x": {}}
  assert orbax_items.process_indices(tree) == [0, 1]


_TWO_PROCESS_SCRIPT = """
import json, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=sys.argv[2], num_processes=2,
                           process_id=int(sys.argv[1]))
import orbax.checkpoint as ocp
import tensorflow as tf
import clu_ckpt
me = jax.process_index()
it = iter(tf.data.Dataset.range(1000).batch(4))
for _ in range(1 + 2 * me):  # Each process is at another position.
  next(it)
with ocp.CheckpointManager(sys.argv[3]) as mngr:
  mngr.save(1, args=ocp.args.Composite(
      dataset=clu_ckpt.TfStateSave(dict(ds_iter=it))))
  mngr.wait_until_finished()
  expected = next(it).numpy().tolist()
  fresh = iter(tf.data.Dataset.range(1000).batch(4))
  mngr.restore(1, args=ocp.args.Composite(
      dataset=clu_ckpt.TfStateRestore(dict(ds_iter=fresh))))
  print(json.dumps([me, expected, next(fresh).numpy().tolist()]))
"""


@pytest.mark.thorough
def test_every_process_keeps_its_own_iterator(tmp_path):
  # Two real JAX processes (CPU, gloo collectives) save one step together.
  import socket  # pylint: disable=g-import-not-at-top
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  script = tmp_path / "two.py"
  script.write_text(_TWO_PROCESS_SCRIPT)
  procs = [subprocess.Popen(
      [sys.executable, str(script), str(i), f"localhost:{port}",
       str(tmp_path / "ckpt")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True, cwd=tmp_path) for i in range(2)]
  results = {}
  for proc in procs:
    try:
      out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
      for p in procs:
        p.kill()
      pytest.fail("two-process save timed out")
    assert proc.returncode == 0, err[-2000:]
    me, expected, got = json.loads(out.strip().splitlines()[-1])
    results[me] = (expected, got)
  assert results == {0: ([4, 5, 6, 7], [4, 5, 6, 7]),
                     1: ([12, 13, 14, 15], [12, 13, 14, 15])}
  # One process can read either host's state (e.g. after resharding).
  with ocp.CheckpointManager(
      tmp_path / "ckpt",
      handler_registry=orbax_items.handler_registry()) as mngr:
    assert sorted(mngr.restore(1)["dataset"]) == ["process_0", "process_1"]
    fresh = _iterator()
    mngr.restore(1, args=ocp.args.Composite(
        dataset=clu_ckpt.TfStateRestore(dict(ds_iter=fresh),
                                        process_index=1)))
    assert _next(fresh) == [12, 13, 14, 15]
