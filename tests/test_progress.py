"""Tests of clu_ckpt.progress: what `verify` and `migrate` show as they go."""

import io
import os
import re
import subprocess
import sys
import time

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


class _Event:
  """A `migration.Progress` as the report reads it (attributes only)."""

  def __init__(self, event, number, nbytes=0, count=3, total_nbytes=0,
               step=None, message=""):
    self.event, self.number, self.nbytes = event, number, nbytes
    self.count, self.total_nbytes, self.message = count, total_nbytes, message
    self.step = number * 100 if step is None else step


def test_migration_total_follows_the_events_to_what_was_done():
  # A bucket's checkpoints are planned at their file size (3 x 320 B) and
  # counted at their array bytes (138 B each) once read.
  out = io.StringIO()
  report = progress.MigrationReport(out, tty=False, clock=lambda: 0.0)
  total = 960
  for number in (3, 4, 5):
    total += 138 - 320
    report(_Event("start", number, 138, total_nbytes=total))
    report(_Event("done", number, 138, total_nbytes=total))
  report.close()
  last = out.getvalue().splitlines()[-1]
  assert last.endswith("[3/3, 414 B of 414 B]"), last


def test_migration_eta_counts_only_what_this_run_wrote():
  now = [0.0]
  out = io.StringIO()
  report = progress.MigrationReport(out, tty=False, clock=lambda: now[0])
  gib = 2**30
  # Two checkpoints already in the destination, skipped in no time.
  report(_Event("skipped", 1, gib, count=4, total_nbytes=4 * gib))
  report(_Event("skipped", 2, gib, count=4, total_nbytes=4 * gib))
  now[0] = 100.0  # the skips' checks took a while; writing starts now
  report(_Event("start", 3, gib, count=4, total_nbytes=4 * gib))
  now[0] = 110.0
  report(_Event("done", 3, gib, count=4, total_nbytes=4 * gib))
  lines = out.getvalue().splitlines()
  assert lines[1].endswith("[2/4, 2.00 GiB of 4.00 GiB]"), lines[1]  # no ETA
  # 1 GiB in 10 s, 1 GiB left: 10 s (not 0 s from the skipped bytes, nor
  # 110 s from the time before writing began).
  assert lines[-1].endswith("[3/4, 3.00 GiB of 4.00 GiB, ETA 10 s]"), lines


def test_migration_bar_uses_binary_units_like_the_lines():
  out = io.StringIO()
  report = progress.MigrationReport(out, tty=True)
  mib = 2**20
  report(_Event("skipped", 1, 4 * mib, count=2, total_nbytes=12 * mib))
  report(_Event("start", 2, 8 * mib, count=2, total_nbytes=12 * mib))
  for _ in range(8):
    time.sleep(0.12)  # past the bar's redraw interval: it shows a rate
    report(_Event("bytes", 2, mib, count=2, total_nbytes=12 * mib))
  report(_Event("done", 2, 8 * mib, count=2, total_nbytes=12 * mib))
  report.close()
  text = out.getvalue()
  assert "MiB/s" in text and "8.0 MiB of 8.0 MiB" in text, text
  assert not re.search(r"\d[kMG]B", text), text  # no tqdm decimal units
  assert "[2/2, 12.0 MiB of 12.0 MiB" in text, text


def test_bucket_migration_ends_with_the_total_done(gcs, golden_copy, tmp_path):
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  url = gcs.upload(golden_copy("single_host"), "run1")
  out = io.StringIO()
  report = progress.MigrationReport(out, tty=False)
  migration.migrate(url, str(tmp_path / "orbax"), progress=report)
  report.close()
  last = out.getvalue().splitlines()[-1]
  done, total = re.search(r"\[3/3, (.*) of (.*?)[,\]]", last).groups()
  assert done == total, last
