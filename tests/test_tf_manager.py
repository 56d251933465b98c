"""Tests for `clu_ckpt.tf_manager`: the one user of TensorFlow's private API."""

import pathlib
import re

import pytest
import tensorflow as tf

from clu_ckpt import errors
from clu_ckpt import tf_manager

REPO = pathlib.Path(__file__).resolve().parents[1]


def _manager(directory, **kwargs):
  return tf_manager.new_manager(
      tf.train.Checkpoint(v=tf.Variable(1)), str(directory),
      max_to_keep=kwargs.get("max_to_keep", 3), checkpoint_name="ckpt")


def test_installed_tensorflow_is_one_the_private_api_was_checked_against():
  version = ".".join(tf.__version__.split(".")[:2])
  assert version in tf_manager.CHECKED_TENSORFLOW, (
      f"TensorFlow {tf.__version__}: re-check tf_manager.PRIVATE_ATTRIBUTES "
      "and add the version to CHECKED_TENSORFLOW")


def test_private_attributes_exist_and_behave(tmp_path):
  manager = _manager(tmp_path)
  for name in tf_manager.PRIVATE_ATTRIBUTES:
    assert hasattr(manager, name), name
  manager.save()
  manager.save()
  # `_maybe_delete` is the ordered path -> timestamp map behind `checkpoints`.
  assert list(manager._maybe_delete) == manager.checkpoints  # pylint: disable=protected-access
  assert callable(manager._record_state)  # pylint: disable=protected-access


def test_a_missing_private_attribute_is_a_clear_error(tmp_path, monkeypatch):
  monkeypatch.setattr(tf_manager, "PRIVATE_ATTRIBUTES",
                      tf_manager.PRIVATE_ATTRIBUTES + ("_gone_in_tf_9",))
  with pytest.raises(errors.PrivateApiError,
                     match=r"_gone_in_tf_9.*TensorFlow .*checked against"):
    _manager(tmp_path)


def test_unlist_rewrites_the_state_file_as_tensorflow_would(tmp_path):
  manager = _manager(tmp_path)
  for _ in range(3):
    manager.save()
  tf_manager.unlist(manager, str(tmp_path), [f"{tmp_path}/ckpt-3"],
                    current=f"{tmp_path}/ckpt-2")
  fresh = _manager(tmp_path)
  assert fresh.checkpoints == [f"{tmp_path}/ckpt-1", f"{tmp_path}/ckpt-2"]
  assert fresh.latest_checkpoint == f"{tmp_path}/ckpt-2"


def test_outside_entries_never_reach_the_prune_list(tmp_path):
  (tmp_path / "run").mkdir()
  manager = _manager(tmp_path / "run")
  manager.save()
  state = (tmp_path / "run" / "checkpoint").read_text()
  stamp = re.search(r"all_model_checkpoint_timestamps: (\S+)", state).group(1)
  outside = tmp_path / "outside" / "ckpt-9"
  state = (f'all_model_checkpoint_paths: "{outside}"\n'
           f"all_model_checkpoint_timestamps: {float(stamp) - 1}\n" + state)
  (tmp_path / "run" / "checkpoint").write_text(state)
  assert str(outside) not in _manager(tmp_path / "run").checkpoints


def test_is_the_only_module_touching_the_private_api():
  pattern = re.compile(r"\._(maybe_delete|latest_checkpoint|record_state|"
                       r"last_preserved_timestamp)\b")
  users = [p.name for p in (REPO / "clu_ckpt").rglob("*.py")
           if pattern.search(p.read_text())]
  assert users == ["tf_manager.py"]


def test_tensorflow_io_errors_become_os_errors():
  error = tf.errors.ResourceExhaustedError(None, None,
                                           "No space left on device")
  assert tf_manager.is_io_error(error)
  converted = tf_manager.as_os_error(error, "Could not write", "/c/ckpt-3")
  assert isinstance(converted, OSError) and converted.errno == 28
  assert converted.filename == "/c/ckpt-3"
  assert not tf_manager.is_io_error(ValueError("bad iterator"))
