"""Tests for `clu_ckpt.errors`: one base for every deliberate exception."""

import inspect

import pytest

from clu_ckpt import checkpoint
from clu_ckpt import errors
from clu_ckpt import flax_format
from clu_ckpt import layout
from clu_ckpt import migration
from clu_ckpt import storage


def test_every_error_class_derives_from_the_base():
  classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
             if issubclass(c, BaseException) and c.__module__ == errors.__name__]
  assert len(classes) >= 10
  for cls in classes:
    assert issubclass(cls, errors.CluCkptError), cls


@pytest.mark.parametrize("cls, standard", [
    (errors.FlaxFormatError, ValueError),
    (errors.NotRegularFileError, OSError),
    (errors.CheckpointStateError, ValueError),
    (errors.OutsideDirectoryError, ValueError),
    (errors.InvalidCheckpointError, ValueError),
    (errors.CheckpointNotFoundError, FileNotFoundError),
    (errors.CheckpointWriteError, OSError),
    (errors.UnsupportedLeafError, TypeError),
    (errors.UsageError, ValueError),
])
def test_standard_bases_are_kept(cls, standard):
  assert issubclass(cls, standard)


def test_modules_re_export_the_same_classes():
  assert flax_format.FlaxFormatError is errors.FlaxFormatError
  assert storage.NotRegularFileError is errors.NotRegularFileError
  assert storage.CheckpointStateError is errors.CheckpointStateError
  assert layout.OutsideDirectoryError is errors.OutsideDirectoryError
  assert migration.MigrationError is errors.MigrationError


def test_raised_errors_are_caught_by_the_base(tmp_path):
  with pytest.raises(errors.CluCkptError):
    checkpoint.load_state_dict(str(tmp_path))
  with pytest.raises(errors.CluCkptError):
    checkpoint.CheckpointInfo.from_path("/runs/exp-3/model.ckpt")
  with pytest.raises(errors.CluCkptError):
    flax_format.load(b"\xc1")
  with pytest.raises(errors.CluCkptError):
    flax_format.save({"x": object()})
  with pytest.raises(errors.CluCkptError):
    checkpoint.MultihostCheckpoint(str(tmp_path / "b"), host_id=0,
                                   max_to_keep=1)
  with pytest.raises(errors.CluCkptError):
    migration.migrate(str(tmp_path / "none"), str(tmp_path / "dst"))
  with pytest.raises(errors.CluCkptError):
    layout.check_inside(str(tmp_path), "/elsewhere/ckpt-1")
