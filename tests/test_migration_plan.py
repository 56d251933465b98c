"""Tests of clu_ckpt.migration.plan: reading a state's step, naming steps."""

import numpy as np
import pytest

from clu_ckpt import flax_format
from clu_ckpt import migration
from clu_ckpt.migration import plan


@pytest.mark.parametrize("step,want", [
    (7, 7), (np.int64(7), 7), (np.uint8(3), 3), (np.asarray(5, np.int32), 5),
    (1.5, None), (np.float32(2), None), (np.arange(2), None), ("7", None),
])
def test_state_step_from_a_path_or_a_handle(step, want, tmp_path):
  path = str(tmp_path / "ckpt-1.flax")
  flax_format.save_file({"step": step, "w": np.ones(3)}, path)
  assert plan.state_step(path) == want
  with flax_format.FlaxFile(path) as handle:
    assert migration.state_step(handle) == want


def test_state_step_without_a_step(tmp_path):
  path = str(tmp_path / "ckpt-1.flax")
  flax_format.save_file({"w": np.ones(3), "nested": {"step": 3}}, path)
  assert plan.state_step(path) is None


def test_state_step_of_a_corrupt_file_raises(tmp_path):
  path = tmp_path / "ckpt-1.flax"
  path.write_bytes(flax_format.save({"step": 1, "w": np.ones(3)})[:-2])
  with pytest.raises(flax_format.FlaxFormatError):
    plan.state_step(str(path))
