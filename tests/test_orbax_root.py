"""Tests for `clu_ckpt.orbax_root`: Orbax roots described without Orbax."""

import os
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest

from clu_ckpt import errors
from clu_ckpt import orbax_root


def _native_root(root, steps):
  with ocp.CheckpointManager(str(root)) as mngr:
    for step in steps:
      mngr.save(step, args=ocp.args.StandardSave({"w": np.arange(4) * step}))
      mngr.wait_until_finished()


def _orbax_listing(root):
  name_format = ocp.path.step.standard_name_format()
  return sorted(m.step for m in name_format.find_all(str(root)))


def test_list_steps_equals_orbax(tmp_path):
  root = tmp_path / "root"
  _native_root(root, [0, 3, 10, 200])
  os.makedirs(root / "7.orbax-checkpoint-tmp-123")  # an interrupted save
  os.makedirs(root / "notastep")
  (root / "12").write_text("a file, not a step")
  steps, partial = orbax_root.list_steps(str(root))
  assert steps == _orbax_listing(root) == [0, 3, 10, 200]
  assert partial == ["7.orbax-checkpoint-tmp-123"]
  assert orbax_root.is_orbax_root(str(root))
  assert not orbax_root.is_orbax_root(str(tmp_path / "notthere"))


def test_native_root_is_described(tmp_path):
  _native_root(tmp_path / "root", [1, 2])
  report = orbax_root.inspect_orbax_root(str(tmp_path / "root"))
  assert [row["step"] for row in report["steps"]] == [1, 2]
  result = orbax_root.verify_orbax_root(str(tmp_path / "root"))
  assert result["ok"], result


def test_imports_no_orbax_tensorstore_or_jax(tmp_path):
  _native_root(tmp_path / "root", [1])
  code = ("import sys; from clu_ckpt import orbax_root; "
          f"orbax_root.inspect_orbax_root({str(tmp_path / 'root')!r}); "
          "heavy = [m for m in ('orbax', 'tensorstore', 'jax', 'tensorflow') "
          "if m in sys.modules]; print(heavy)")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, check=True)
  assert done.stdout.strip() == "[]", done.stdout + done.stderr


@pytest.mark.parametrize("name", ["5.orbax-checkpoint-tmp-1", "5"])
def test_unfinished_and_finished_names(tmp_path, name):
  os.makedirs(tmp_path / name)
  steps, partial = orbax_root.list_steps(str(tmp_path))
  assert (steps, partial) == (([5], []) if name == "5" else ([], [name]))


# --------------------------------------------------------------------------
# Step naming options: as a CheckpointManager with the same options.
# --------------------------------------------------------------------------


def _manager_steps(root, prefix, length):
  options = ocp.CheckpointManagerOptions(step_prefix=prefix,
                                         step_format_fixed_length=length)
  with ocp.CheckpointManager(str(root), options=options) as mngr:
    return sorted(mngr.all_steps())


def test_list_steps_with_naming_options_equals_orbax(tmp_path):
  root = tmp_path / "root"
  options = ocp.CheckpointManagerOptions(step_prefix="step",
                                         step_format_fixed_length=4)
  with ocp.CheckpointManager(str(root), options=options) as mngr:
    for step in (0, 3, 12345):
      mngr.save(step, args=ocp.args.StandardSave({"w": np.arange(2)}))
      mngr.wait_until_finished()
  assert sorted(os.listdir(root)) == ["step_0000", "step_0003", "step_12345"]
  temporary = ["step_0009.orbax-checkpoint-tmp", "8.orbax-checkpoint-tmp-1"]
  ignored = ["step_007", "step_00012", "step_9", "0004", "other_0005",
             "Step_0006", "step_0007x", "step-0008", "stepx0010"]
  odd = ["step_0011\n", "step_1\u0663\u0663\u0663"]  # Orbax's `$` and `\d`
  for name in temporary + ignored + odd:
    os.makedirs(root / name)
  (root / "step_0013").write_text("a file, not a step")
  steps, partial = orbax_root.list_steps(
      str(root), step_prefix="step", step_format_fixed_length=4)
  assert steps == _manager_steps(root, "step", 4) == [0, 3, 11, 1333, 12345]
  assert partial == sorted(temporary)
  # Without the options, as a default manager: none of these.
  assert orbax_root.list_steps(str(root)) == (
      _manager_steps(root, None, None), sorted(temporary)) == (
          [], sorted(temporary))


@pytest.mark.parametrize("prefix,length", [
    (None, 6), ("ckpt", None), ("", None), (None, 0), ("run.v2-a", 2),
    ("step_", 3)])
def test_step_names_and_listing_equal_orbax(tmp_path, prefix, length):
  root = tmp_path / "root"
  options = ocp.CheckpointManagerOptions(step_prefix=prefix,
                                         step_format_fixed_length=length)
  with ocp.CheckpointManager(str(root), options=options) as mngr:
    for step in (1, 20, 300):
      mngr.save(step, args=ocp.args.StandardSave({"w": np.arange(2)}))
      mngr.wait_until_finished()
  assert sorted(os.listdir(root)) == sorted(
      orbax_root.step_name(s, prefix, length) for s in (1, 20, 300))
  assert orbax_root.list_steps(
      str(root), step_prefix=prefix, step_format_fixed_length=length) == (
          _manager_steps(root, prefix, length), [])
  assert _manager_steps(root, prefix, length) == [1, 20, 300]


def test_step_name_examples():
  assert orbax_root.step_name(7) == "7"
  assert orbax_root.step_name(7, "step") == "step_7"
  assert orbax_root.step_name(7, "step", 4) == "step_0007"
  assert orbax_root.step_name(12345, None, 4) == "12345"
  assert orbax_root.step_name(7, "", None) == "_7"


@pytest.mark.parametrize("prefix", ["a/b", "a+", "x(1)", "s[0]", "a|b",
                                    "^s", "s$", "a\\b", "a*", "a?", 3])
def test_prefixes_orbax_cannot_list_are_refused(tmp_path, prefix):
  with pytest.raises(errors.UsageError) as e:
    orbax_root.list_steps(str(tmp_path), step_prefix=prefix)
  assert isinstance(e.value, ValueError)
  assert repr(prefix) in str(e.value)


@pytest.mark.parametrize("length", [-1, True, "4", 2.0])
def test_lengths_orbax_cannot_use_are_refused(tmp_path, length):
  with pytest.raises(errors.UsageError, match="fixed length"):
    orbax_root.list_steps(str(tmp_path), step_format_fixed_length=length)


def test_regex_prefix_is_why_it_is_refused(tmp_path):
  # The fact behind the refusal: Orbax does not list the steps it wrote.
  options = ocp.CheckpointManagerOptions(step_prefix="a+")
  with ocp.CheckpointManager(str(tmp_path / "r"), options=options) as mngr:
    mngr.save(1, args=ocp.args.StandardSave({"w": np.arange(2)}))
    mngr.wait_until_finished()
  assert os.listdir(tmp_path / "r") == ["a+_1"]
  assert _manager_steps(tmp_path / "r", "a+", None) == []


# --------------------------------------------------------------------------
# Roots: relative paths and file:// URLs.
# --------------------------------------------------------------------------


def test_relative_and_file_url_roots(tmp_path, monkeypatch):
  _native_root(tmp_path / "runs" / "root", [2, 5])
  os.makedirs(tmp_path / "runs" / "root" / "6.orbax-checkpoint-tmp")
  want = ([2, 5], ["6.orbax-checkpoint-tmp"])
  monkeypatch.chdir(tmp_path / "runs")
  assert orbax_root.list_steps("root") == want
  assert orbax_root.list_steps("./root/") == want
  assert orbax_root.list_steps(f"file://{tmp_path}/runs/root") == want
  monkeypatch.chdir(tmp_path)
  assert orbax_root.list_steps("file:root") == ([], [])  # not a URL
  assert orbax_root.list_steps(f"file://{tmp_path}/runs/root/") == want
  with pytest.raises(errors.UsageError):
    orbax_root.list_steps("")
