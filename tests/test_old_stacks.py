"""Checkpoints written on the oldest supported stack restore exactly.

The frozen fixtures in `../shared/fixtures/old-stacks/tf2.16-flax0.8.5/` were
written by the real `clu` 0.0.12 with flax 0.8.5 on tensorflow-cpu 2.16.2 and
numpy 1.26.4 (see ../shared/README.md): what users of old stacks hold. Each
stack of the support matrix (noxfile.py) restores them with the drop-in and
the TF-free reader, and compares with its own Flax, TensorFlow and `clu`:

- `single_host`: a Python `complex` leaf, which flax 0.8.5 stored as a numpy
  complex128 scalar; the iterator resumes where it was saved.
- `non_ascii_name`: `checkpoint_name="modèl"`, whose name TensorFlow 2.16
  wrote into the `checkpoint` state file with octal escapes.

Synopsis::

  python -m pytest -q tests/test_old_stacks.py
"""

import json
import pathlib
import shutil
from typing import Any

from clu import checkpoint as clu_checkpoint
from flax import serialization
import numpy as np
import pytest
import tensorflow as tf

from clu_ckpt import checkpoint
from clu_ckpt import flax_format
from clu_ckpt import state_file
from conftest import make_writable

OLD_STACK = (pathlib.Path(__file__).resolve().parents[2] / "shared" /
             "fixtures" / "old-stacks" / "tf2.16-flax0.8.5")


@pytest.fixture(name="old_copy")
def old_copy_fixture(tmp_path):
  """Returns `copy(case)`: a writable copy of an old-stack case, and its
  parsed MANIFEST.json; skips when the fixtures are absent."""

  def copy(case: str) -> tuple[pathlib.Path, dict[str, Any]]:
    source = OLD_STACK / case
    if not (source / "MANIFEST.json").is_file():
      pytest.skip(f"old-stack fixture {source} is not available")
    target = tmp_path / case
    shutil.copytree(source, target)
    make_writable(target)
    return target, json.loads((source / "MANIFEST.json").read_text())

  return copy


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  if isinstance(tree, dict):
    out = {}
    for key, value in tree.items():
      out.update(_flatten(value, f"{prefix}/{key}"))
    return out
  return {prefix: tree}


def _assert_manifest(state: Any, tree: dict[str, Any]) -> None:
  """Every leaf has the dtype, shape and sum MANIFEST.json lists."""
  leaves = _flatten(state)
  assert sorted(leaves) == sorted(tree)
  for path, want in tree.items():
    leaf = leaves[path]
    if "python" in want:
      assert repr(leaf) == want["python"], path
      continue
    arr = np.asarray(leaf)
    assert (str(arr.dtype), list(arr.shape)) == (want["dtype"],
                                                 want["shape"]), path
    if isinstance(want["sum"], list):  # complex: [real, imag]
      total = complex(arr.astype(np.complex128).sum())
      assert [total.real, total.imag] == pytest.approx(want["sum"]), path
    else:
      assert float(arr.astype(np.float64).sum()) == pytest.approx(
          want["sum"], rel=1e-6, abs=1e-12), path


def _assert_bit_equal(got: Any, want: Any) -> None:
  got, want = _flatten(got), _flatten(want)
  assert list(got) == list(want)
  for path, leaf in want.items():
    assert type(got[path]) is type(leaf), (path, type(got[path]), type(leaf))
    if isinstance(leaf, (np.ndarray, np.generic)):
      assert got[path].dtype == leaf.dtype, path
      assert np.asarray(got[path]).tobytes() == np.asarray(leaf).tobytes(), path
    else:
      assert got[path] == leaf, path


def _ds_iter():
  return iter(tf.data.Dataset.range(10000).batch(4))


@pytest.mark.parametrize("name", [None, "ckpt-2", "ckpt-3"])
def test_single_host_with_complex_leaf_restores_exactly(old_copy, name):
  base, manifest = old_copy("single_host")
  expected = manifest["checkpoints"][name or "ckpt-3"]
  it = _ds_iter()
  ck = checkpoint.Checkpoint(str(base), dict(ds_iter=it), max_to_keep=2)
  assert ck.latest_checkpoint == f"{base}/ckpt-3"
  state = ck.restore(None, None if name is None else f"{base}/{name}")
  _assert_manifest(state, expected["tree"])
  # The installed Flax reads the file the same way (the complex leaf is the
  # numpy complex128 scalar flax 0.8.5 stored, whatever Flax reads it).
  flax_file = base / f"{name or 'ckpt-3'}.flax"
  _assert_bit_equal(state, serialization.msgpack_restore(flax_file.read_bytes()))
  assert type(state["opt_state"]["1"]["phase"]) is np.complex128
  assert [int(x) for x in next(it)] == expected["next_batch"]
  # Without TensorFlow: the TF-free reader gives the same state dict.
  if name is None:
    _assert_bit_equal(checkpoint.load_state_dict(str(base)), state)


def test_single_host_resumes_and_the_real_clu_reads_the_new_save(old_copy):
  base, manifest = old_copy("single_host")
  it = _ds_iter()
  ck = checkpoint.Checkpoint(str(base), dict(ds_iter=it), max_to_keep=2)
  state = ck.restore(None)
  state["step"] = np.int64(301)
  assert [int(x) for x in next(it)] == (
      manifest["checkpoints"]["ckpt-3"]["next_batch"])
  assert ck.save(state) == f"{base}/ckpt-4"
  # Byte for byte what the installed Flax writes for that state.
  assert (base / "ckpt-4.flax").read_bytes() == serialization.to_bytes(state)
  assert sorted(p.name for p in base.glob("ckpt-*.flax")) == [
      "ckpt-3.flax", "ckpt-4.flax"]
  it2 = _ds_iter()
  restored = clu_checkpoint.Checkpoint(str(base), dict(ds_iter=it2))
  again = restored.restore_dict()
  assert int(again["step"]) == 301
  assert [int(x) for x in next(it2)] == [
      x + 4 for x in manifest["checkpoints"]["ckpt-3"]["next_batch"]]


def test_non_ascii_name_with_octal_escapes_restores_exactly(old_copy):
  base, manifest = old_copy("non_ascii_name")
  raw = (base / "checkpoint").read_text()
  assert r'"mod\303\250l-1"' in raw  # as TensorFlow 2.16 wrote it
  state = state_file.read_checkpoint_state(str(base), strict=True)
  assert state.model_checkpoint_path == f"{base}/modèl-1"
  assert state.all_model_checkpoint_paths == [f"{base}/modèl-1"]
  theirs = tf.train.get_checkpoint_state(str(base))
  assert theirs.model_checkpoint_path == state.model_checkpoint_path
  ck = checkpoint.Checkpoint(str(base), checkpoint_name="modèl")
  assert ck.latest_checkpoint == f"{base}/modèl-1"
  restored = ck.restore(None)
  (name, expected), = manifest["checkpoints"].items()
  _assert_manifest(restored, expected["tree"])
  _assert_bit_equal(restored, serialization.msgpack_restore(
      (base / f"{name}.flax").read_bytes()))
  _assert_bit_equal(checkpoint.load_state_dict(str(base)), restored)
  assert flax_format.load_file(str(base / f"{name}.flax"))["step"] == (
      expected["step"])
