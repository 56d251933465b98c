"""Runs examples/demo.py at a tiny size: train, kill, resume, migrate, Orbax."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"


# A soak (run with --soak): the steps are each covered by faster tests.
@pytest.mark.soak
def test_demo_end_to_end(tmp_path):
  proc = subprocess.run(
      [sys.executable, str(DEMO), "--tiny", "--workdir", str(tmp_path)],
      capture_output=True, text=True, timeout=600,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
  assert proc.returncode == 0, proc.stdout + proc.stderr
  lines = proc.stdout.splitlines()
  assert any("SIGKILLed at step 5" in l for l in lines), proc.stdout
  assert any("resumed at step 4, iterator at element 32" in l
             for l in lines), proc.stdout
  assert any("steps [4, 6, 8], verified" in l for l in lines), proc.stdout
  assert any("resumed under stock Orbax at step 8, iterator at element 64"
             in l for l in lines), proc.stdout
  steps = sorted(int(p.name) for p in (tmp_path / "orbax").iterdir()
                 if p.name.isdigit())
  assert steps[-1] == 12, steps
