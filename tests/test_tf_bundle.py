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
