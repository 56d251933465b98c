"""Tests of clu_ckpt.progress: what `verify` and `migrate` show as they go."""

import io
import os
import re
import subprocess
import sys

from clu_ckpt import progress


def test_verify_report_writes_a_line_per_file_with_position_and_eta():
  now = [0.0]
  out = io.StringIO()
  report = progress.VerifyReport(out, tty=False, clock=lambda: now[0])
  now[0] = 10.0
  report(1, 4, "ckpt-1.flax", 2**30, 4 * 2**30)
  now[0] = 20.0
  report(2, 4, "ckpt-2.flax", 2**30, 4 * 2**30)
  report(4, 4, "ckpt-4.flax", 2 * 2**30, 4 * 2**30)
  report.close()
  assert out.getvalue().splitlines() == [
      "verified ckpt-1.flax [1/4, 1.00 GiB of 4.00 GiB, ETA 30 s]",
      "verified ckpt-2.flax [2/4, 2.00 GiB of 4.00 GiB, ETA 20 s]",
      "verified ckpt-4.flax [4/4, 4.00 GiB of 4.00 GiB]",
  ]


def test_verify_report_draws_one_bar_on_a_terminal():
  out = io.StringIO()
  report = progress.VerifyReport(out, tty=True)
  for i in range(1, 4):
    report(i, 3, f"ckpt-{i}.flax", 10, 30)
  report.close()
  assert "verified" not in out.getvalue()
  assert "/3 [" in out.getvalue()   # one bar over the 3 files


def test_cli_verify_shows_progress_on_stderr(golden_copy):
  src = golden_copy("single_host")
  done = subprocess.run([sys.executable, "-m", "clu_ckpt", "verify", str(src)],
                        capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
  assert done.returncode == 0, done.stderr
  lines = done.stderr.strip().splitlines()
  assert [re.sub(r" \[.*", "", line) for line in lines] == [
      "verified ckpt-3.flax", "verified ckpt-4.flax", "verified ckpt-5.flax"]
  assert "[3/3, " in lines[-1] and "ETA" not in lines[-1]
  assert "3 checked, 0 problems: OK" in done.stdout
