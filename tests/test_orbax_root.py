"""Tests for `clu_ckpt.orbax_root`: Orbax roots described without Orbax."""

import os
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest

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
