"""Tests of clu_ckpt.flax_training: the names of Flax's own checkpoint files."""

import numpy as np
from flax import serialization

from clu_ckpt import flax_training


def _write(path, state):
  path.write_bytes(serialization.to_bytes(state))


def test_list_steps_skips_what_flax_skips(tmp_path):
  for step in (2, 10, 7):
    _write(tmp_path / f"checkpoint_{step}", {"step": step})
  _write(tmp_path / "checkpoint_tmp", {"step": 99})
  _write(tmp_path / "checkpoint_5.5", {"step": 5})
  (tmp_path / "checkpoint_11").mkdir()   # an Orbax-format Flax checkpoint
  (tmp_path / "checkpoint_12.orbax-checkpoint-tmp-3").mkdir()
  (tmp_path / "checkpoint_10_gda").mkdir()
  steps = flax_training.list_steps(str(tmp_path))
  assert list(steps) == [2, 7, 10]
  assert steps[10] == str(tmp_path / "checkpoint_10")
  assert flax_training.latest(str(tmp_path)) == str(tmp_path / "checkpoint_10")
  assert flax_training.orbax_step_directories(str(tmp_path)) == [
      str(tmp_path / "checkpoint_11")]
  assert flax_training.split_name(str(tmp_path / "checkpoint_7")) == 7
  assert flax_training.split_name("x/checkpoint_tmp") is None
  assert flax_training.latest(str(tmp_path / "missing")) is None


def test_find_prefix(tmp_path):
  assert flax_training.find_prefix(str(tmp_path)) is None
  _write(tmp_path / "model_3", {"w": np.ones(2)})
  _write(tmp_path / "model_12", {"w": np.ones(2)})
  (tmp_path / "notes_1").write_text("not msgpack")
  (tmp_path / "ckpt-4.flax").write_bytes(b"\x80")
  assert flax_training.find_prefix(str(tmp_path)) == "model_"
  _write(tmp_path / "other_1", {"w": 1})
  assert flax_training.find_prefix(str(tmp_path)) is None   # two prefixes
  _write(tmp_path / "checkpoint_1", {"w": 1})
  assert flax_training.find_prefix(str(tmp_path)) == "checkpoint_"
