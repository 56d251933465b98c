"""Tests of clu_ckpt.orbax_read beyond tests/test_reader.py's round trips."""

import json

import numpy as np
import pytest

from clu_ckpt import checkpoint
from clu_ckpt import errors
from clu_ckpt import migration
from clu_ckpt import orbax_read
from migration_helpers import clu_save
from migration_helpers import example_state


@pytest.fixture(scope="module", name="step_dir")
def fixture_step_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("orbax_read")
  clu_save(root / "src", [example_state(3)])
  summary = migration.migrate(str(root / "src"), str(root / "dst"),
                              step_naming="number")
  assert summary.ok, summary.failed
  return root / "dst" / "1"


def test_metadata_and_keys(step_dir, tmp_path):
  assert orbax_read.migration_metadata(str(step_dir))["step"] == 1
  assert orbax_read.migration_metadata(str(tmp_path)) is None
  assert orbax_read.subtree_keys("params//w/") == ("params", "w")
  assert orbax_read.subtree_keys(["a", 0]) == ("a", "0")
  assert orbax_read.describe_keys([f"k{i}" for i in range(25)], 3) == (
      "'k0', 'k1', 'k2' and 22 more")


def test_a_leaf_is_not_a_map(step_dir):
  with pytest.raises(errors.SubtreeNotFoundError, match="/step is a leaf"):
    orbax_read.read_state(str(step_dir), subtree="step/x")


def test_without_the_skeleton_the_keys_come_from_orbax(step_dir, tmp_path):
  # Steps of earlier releases (version 1 encodings) have no key skeleton.
  import shutil  # pylint: disable=g-import-not-at-top
  copy = tmp_path / "1"
  shutil.copytree(step_dir, copy)
  meta_file = copy / "metadata" / "metadata"
  meta = json.loads(meta_file.read_text())
  meta["encoded"] = {"/opt/count": meta["encoded"]["records"][
      '["opt", "count"]']}
  meta_file.write_text(json.dumps(meta))
  with pytest.raises(errors.SubtreeNotFoundError) as raised:
    orbax_read.read_state(str(copy), subtree="params/q")
  assert "'e'" in str(raised.value) and "'w'" in str(raised.value)
  got = orbax_read.read_state(str(copy))
  assert got["opt"]["count"] == np.int32(3)
  assert isinstance(got["opt"]["count"], np.int32)


def test_damaged_step_names_the_file(step_dir, tmp_path):
  import shutil  # pylint: disable=g-import-not-at-top
  copy = tmp_path / "1"
  shutil.copytree(step_dir, copy)
  (copy / "state" / "_METADATA").write_text("{")
  with pytest.raises(errors.InvalidCheckpointError, match="_METADATA"):
    orbax_read.read_state(str(copy))
  with pytest.raises(errors.CheckpointNotFoundError, match="not a step"):
    orbax_read.read_state(str(tmp_path))
  assert checkpoint.load_state_dict(str(step_dir.parent))["step"] == 3
