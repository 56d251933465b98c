"""`clu_ckpt.tf_bundle`: TensorFlow's checkpoint index read without TensorFlow,
compared with TensorFlow's own reader on the golden checkpoints written by clu.
"""

import numpy as np
import pytest
import tensorflow as tf

from clu_ckpt import errors
from clu_ckpt import tf_bundle


@pytest.mark.parametrize("case, names", [
    ("single_host", ["ckpt-3", "ckpt-4", "ckpt-5"]),
    ("flax_only", ["model-1", "model-2"]),
    ("multihost", ["checkpoints-0/ckpt-1", "checkpoints-1/ckpt-3"]),
    ("legacy_optimizer_tree", ["ckpt-1"]),
])
def test_index_is_read_as_tensorflow_reads_it(golden_copy, case, names):
  src = golden_copy(case)
  for name in names:
    prefix = str(src / name)
    expected = sorted(tf.train.load_checkpoint(prefix)
                      .get_variable_to_shape_map())
    assert tf_bundle.index_variable_names(prefix) == expected
    shards, entries = tf_bundle.index_entries(prefix)
    assert shards == 1
    reader = tf.train.load_checkpoint(prefix)
    counter = entries["save_counter/.ATTRIBUTES/VARIABLE_VALUE"]
    data = (src / f"{name}.data-00000-of-00001").read_bytes()
    assert np.frombuffer(data[counter["offset"]:counter["offset"] + 8],
                         np.int64)[0] == reader.get_tensor(
                             "save_counter/.ATTRIBUTES/VARIABLE_VALUE")


def test_damaged_index_is_named(tmp_path):
  prefix = str(tmp_path / "ckpt-1")
  (tmp_path / "ckpt-1.index").write_bytes(b"x" * 10)
  with pytest.raises(errors.InvalidCheckpointError, match=r"ckpt-1\.index.*10 bytes"):
    tf_bundle.index_entries(prefix)
  (tmp_path / "ckpt-1.index").write_bytes(b"not a table" * 10)
  with pytest.raises(errors.InvalidCheckpointError, match="bad magic"):
    tf_bundle.index_variable_names(prefix)
  with pytest.raises(FileNotFoundError):
    tf_bundle.index_entries(str(tmp_path / "missing"))


def _corrupt_for_tensorflow(prefix):
  """Whether TensorFlow's own reader refuses a checkpoint's values."""
  reader = tf.train.load_checkpoint(prefix)
  try:
    for name in reader.get_variable_to_shape_map():
      try:
        reader.get_tensor(name)
      except tf.errors.InternalError as e:
        # A variant is read and checksummed, then not turned into numpy.
        if "not convertible to numpy" not in str(e):
          return True
  except tf.errors.OpError:
    return True
  return False


@pytest.mark.parametrize("case, name", [
    ("single_host", "ckpt-3"),
    ("multihost", "checkpoints-1/ckpt-3"),
])
def test_strings_and_variants_are_checked_as_tensorflow_checks_them(
    golden_copy, case, name):
  src = golden_copy(case)
  prefix = str(src / name)
  shards, entries = tf_bundle.index_entries(prefix)
  shapes = tf.train.load_checkpoint(prefix).get_variable_to_shape_map()
  for key, entry in entries.items():
    assert entry["elements"] == int(np.prod(shapes[key], dtype=np.int64))
  assert tf_bundle.check_data(prefix, shards, entries) is True
  framed = {k: e for k, e in entries.items() if e["dtype"] in (7, 21)}
  assert {e["dtype"] for e in framed.values()} == {7, 21}  # both kinds
  data = src / f"{name}.data-00000-of-00001"
  clean = data.read_bytes()
  for key, entry in framed.items():
    for pos in range(entry["offset"], entry["offset"] + entry["size"], 5):
      raw = bytearray(clean)
      raw[pos] ^= 0x01
      data.write_bytes(bytes(raw))
      with pytest.raises(errors.InvalidCheckpointError, match=key):
        tf_bundle.check_data(prefix, shards, entries)
      assert _corrupt_for_tensorflow(prefix), (key, pos)
  data.write_bytes(clean)
  assert not _corrupt_for_tensorflow(prefix)
