"""Tests of migration/migrate_runs.py: shards, merged reports, flags, progress.

The pure parts (shard assignment, validation, progress lines, merging) are
tested in-process on the script imported from its path; the command line in
subprocesses: usage errors (fast: no migration starts), and one fleet of
two tiny runs written by the real `clu.checkpoint`, migrated as two shards
at once and merged.
"""

import importlib.util
import io
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "migration" / "migrate_runs.py"
_NAME = "migrate_runs_under_test"


@pytest.fixture(scope="module", name="mr")
def fixture_mr():
  """The script as a module (imported once: it defines absl flags)."""
  if _NAME not in sys.modules:
    spec = importlib.util.spec_from_file_location(_NAME, SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[_NAME] = module
  return sys.modules[_NAME]


def _environment():
  """os.environ without JOB_COMPLETION_INDEX (it would pick a shard)."""
  return {k: v for k, v in os.environ.items() if k != "JOB_COMPLETION_INDEX"}


def _start(*args, cwd):
  """Starts the script; the process (text output piped)."""
  return subprocess.Popen([sys.executable, str(SCRIPT), *args],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, cwd=cwd, env=_environment())


def _finish(process):
  """Waits for a `_start`ed process; a CompletedProcess."""
  stdout, stderr = process.communicate(timeout=600)
  return subprocess.CompletedProcess(process.args, process.returncode,
                                     stdout, stderr)


def _script(*args, cwd):
  """Runs the script; the completed process (text output)."""
  return _finish(_start(*args, cwd=cwd))


# --------------------------------------------------------------------------
# Shards.
# --------------------------------------------------------------------------

_FLEET = [f"/runs/exp{i}/checkpoints" for i in range(40)]


def test_shards_partition_the_fleet(mr):
  shards = [mr.shard_sources(_FLEET, 3, i) for i in range(3)]
  everything = [s for shard in shards for s in shard]
  assert sorted(everything) == sorted(_FLEET)  # each in exactly one shard
  assert all(shards), [len(s) for s in shards]


def test_shards_do_not_depend_on_the_order_of_sources(mr):
  shuffled = list(_FLEET)
  random.Random(0).shuffle(shuffled)
  for i in range(3):
    assert mr.shard_sources(shuffled, 3, i) == mr.shard_sources(_FLEET, 3, i)


def test_adding_a_run_moves_no_other_run(mr):
  before = {s: mr.shard_of(s, 3) for s in _FLEET}
  grown = _FLEET + ["/runs/new/checkpoints"]
  after = {s: i for i in range(3) for s in mr.shard_sources(grown, 3, i)}
  assert {s: after[s] for s in _FLEET} == before


def test_shard_of_is_the_same_on_every_machine(mr):
  # Pinned values: a per-process hash (Python's `hash`) would change them.
  assert mr.shard_of("/runs/a/checkpoints", 1000) == 437
  assert mr.shard_of("/runs/b/checkpoints", 1000) == 768
  assert mr.shard_of("gs://bucket/x/checkpoints", 1000) == 92
  assert mr.shard_of("/runs/a/checkpoints", 1) == 0


@pytest.mark.parametrize("num_shards, index, environ, expected", [
    (1, None, {}, 0),
    (1, None, {"JOB_COMPLETION_INDEX": "5"}, 0),  # unsharded: env ignored
    (3, 2, {}, 2),
    (3, None, {"JOB_COMPLETION_INDEX": "1"}, 1),
    (3, 0, {"JOB_COMPLETION_INDEX": "1"}, 0),  # the flag wins
])
def test_resolve_shard(mr, num_shards, index, environ, expected):
  assert mr.resolve_shard(num_shards, index, environ) == expected


@pytest.mark.parametrize("num_shards, index, environ, message", [
    (0, None, {}, "--num-shards must be >= 1"),
    (3, 3, {}, "--shard-index must be in [0, 3)"),
    (3, -1, {}, "--shard-index must be in [0, 3)"),
    (1, 1, {}, "--shard-index must be in [0, 1)"),
    (3, None, {}, "needs --shard-index"),
    (3, None, {"JOB_COMPLETION_INDEX": "x"}, "is not an integer"),
    (3, None, {"JOB_COMPLETION_INDEX": "7"}, "--shard-index must be in"),
])
def test_resolve_shard_refuses(mr, num_shards, index, environ, message):
  with pytest.raises(mr.UsageError, match=re.escape(message)):
    mr.resolve_shard(num_shards, index, environ)


@pytest.mark.parametrize("args", [
    ["--num-shards=3", "--shard-index=3"],
    ["--num_shards=0"],
    ["--num-shards=2"],  # no index, no $JOB_COMPLETION_INDEX
    ["--num-shards=two"],  # an absl parsing error
])
def test_bad_shards_exit_2_with_one_line(tmp_path, args):
  run = _script("--sources=/nonexistent/run", "--destination-root=out",
                *args, cwd=tmp_path)
  assert run.returncode == 2, run.stderr
  assert len(run.stderr.strip().splitlines()) == 1, run.stderr
  assert "shard" in run.stderr
  assert not run.stdout
  assert not list(tmp_path.iterdir())  # no report, nothing migrated


# --------------------------------------------------------------------------
# Progress.
# --------------------------------------------------------------------------


def _entry(source, status="ok", seconds=35.0, steps=(("migrated", 2**30),),
           error=None):
  summary = {"steps": [{"status": s, "nbytes": n} for s, n in steps]}
  return dict(source=source, status=status, seconds=seconds, summary=summary,
              **({"error": error} if error else {}))


class _Clock:
  """A clock advanced by hand."""

  def __init__(self):
    self.now = 1000.0

  def __call__(self):
    return self.now


class _Terminal(io.StringIO):

  def isatty(self):
    return True


def test_progress_not_on_a_terminal_is_one_line_per_run(mr):
  out, clock = io.StringIO(), _Clock()
  progress = mr.ProgressPrinter(3, out, clock)
  clock.now += 60
  progress.run_done(_entry("/runs/a", steps=[("migrated", 2**30)] * 4))
  clock.now += 60
  progress.run_done(_entry("/runs/b", "failed", 5,
                           [("skipped", 10), ("migrated", 1500)],
                           error="ckpt-3: truncated"))
  clock.now += 60
  progress.run_done({"source": "/runs/c", "status": "error", "seconds": 2,
                     "error": "exit code -9"})  # no summary: seconds only
  progress.close()
  assert out.getvalue().splitlines() == [
      "[1/3] /runs/a ok (4 steps, 4.0 GiB, 35 s); ETA 2 min",
      "[2/3] /runs/b failed (2 steps, 1 skipped, 1.5 KiB, 5 s): ckpt-3: "
      "truncated; ETA 1 min",
      "[3/3] /runs/c error (2 s): exit code -9; all done in 3 min",
  ]


def test_progress_on_a_terminal_rewrites_one_line(mr):
  out = _Terminal()
  progress = mr.ProgressPrinter(3, out, _Clock())
  progress.run_done(_entry("/runs/a"))
  progress.run_done(_entry("/runs/b", "error", error="no such directory"))
  progress.run_done(_entry("/runs/c"))
  progress.close()
  lines = out.getvalue().split("\n")
  # The failed run keeps its own line; the ok ones overwrite each other.
  assert len(lines) == 3 and lines[-1] == "", lines
  assert lines[0].startswith("\r\x1b[K[1/3] /runs/a ok")
  assert "\r\x1b[K[2/3] /runs/b error" in lines[0]
  assert lines[1].startswith("\r\x1b[K[3/3] /runs/c ok")


# --------------------------------------------------------------------------
# Merging reports.
# --------------------------------------------------------------------------


def _report(root, index, num_shards, sources, created, status="ok",
            fleet_size=3):
  return {"created": created, "destination_root": root,
          "fleet_size": fleet_size, "num_shards": num_shards,
          "shard_index": index,
          "runs": [{"source": s, "status": status, "shard": index}
                   for s in sources]}


def test_merge_gives_every_run_with_its_shard(mr):
  merged = mr.merge_reports([
      ("r1.json", _report("/o", 1, 2, ["/r/b"], "2024-01-01T00:00:00")),
      ("r0.json", _report("/o/", 0, 2, ["/r/a", "/r/c"],
                          "2024-01-01T00:00:05")),
  ])
  assert [(r["source"], r["shard"], r["report"]) for r in merged["runs"]] == [
      ("/r/a", 0, "r0.json"), ("/r/b", 1, "r1.json"), ("/r/c", 0, "r0.json")]
  assert merged["ok"] and merged["missing_shards"] == []
  assert merged["counts"] == {"ok": 3, "failed": 0, "error": 0}
  assert [m["shard_index"] for m in merged["merged_from"]] == [1, 0]


def test_merge_lists_missing_shards_and_keeps_the_newest_entry(mr):
  merged = mr.merge_reports([
      ("new.json", _report("/o", 0, 3, ["/r/a"], "2024-01-02T00:00:00")),
      ("old.json", _report("/o", 0, 3, ["/r/a"], "2024-01-01T00:00:00",
                           status="failed")),
  ])
  assert merged["missing_shards"] == [1, 2]
  assert [(r["status"], r["report"]) for r in merged["runs"]] == [
      ("ok", "new.json")]
  assert not merged["ok"]


def test_merge_refuses_different_destination_roots(mr):
  with pytest.raises(mr.UsageError, match="different fleets.*r1.json"):
    mr.merge_reports([
        ("r0.json", _report("/orbax", 0, 2, ["/r/a"], "t")),
        ("r1.json", _report("/elsewhere", 1, 2, ["/r/b"], "t")),
    ])


# --------------------------------------------------------------------------
# The command line, on real CLU runs.
# --------------------------------------------------------------------------

# With --num-shards=2: shard 0 holds runs/a, shard 1 runs/b (pinned by
# test_shards_of_the_fleet_below). Two runs only: each migration subprocess
# costs seconds of imports.
_RUNS = ["runs/a/checkpoints", "runs/b/checkpoints"]


def test_shards_of_the_fleet_below(mr):
  assert mr.shard_sources(_RUNS, 2, 0) == [_RUNS[0]]
  assert mr.shard_sources(_RUNS, 2, 1) == [_RUNS[1]]


@pytest.fixture(scope="module", name="fleet")
def fixture_fleet(tmp_path_factory):
  """Two runs written by clu, migrated as two shards at once (hyphenated
  flags for shard 0, underscored ones for shard 1, sources in different
  orders).

  Returns:
    (directory, {shard index: completed process}).
  """
  from migration_helpers import clu_save  # pylint: disable=g-import-not-at-top
  from migration_helpers import example_state  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp("fleet")
  for i, run in enumerate(_RUNS):
    clu_save(root / run, [example_state(10 + i)])
  # At the same time, as on two machines.
  shard0 = _start(f"--sources={','.join(_RUNS)}", "--destination-root=orbax",
                  "--num-shards=2", "--shard-index=0", "--parallelism=2",
                  "--report=shard0.json", "--step-naming=state", cwd=root)
  shard1 = _start(f"--sources={','.join(reversed(_RUNS))}",
                  "--destination_root=orbax", "--num_shards", "2",
                  "--shard_index=1", "--report=shard1.json",
                  "--step_naming=state", cwd=root)
  return root, {0: _finish(shard0), 1: _finish(shard1)}


@pytest.mark.thorough
@pytest.mark.parametrize("index", [0, 1])
def test_each_shard_migrates_its_runs(fleet, index):
  root, runs = fleet
  assert runs[index].returncode == 0, runs[index].stderr[-2000:]
  report = json.loads((root / f"shard{index}.json").read_text())
  assert [(r["source"], r["status"], r["shard"]) for r in report["runs"]] == [
      (_RUNS[index], "ok", index)]
  assert (report["num_shards"], report["shard_index"]) == (2, index)
  assert report["fleet_size"] == 2
  # Destinations come from the whole fleet: orbax/<a|b>/checkpoints/<step>.
  run_name = _RUNS[index].split("/")[1]
  assert (root / "orbax" / run_name / "checkpoints" / str(10 + index)).is_dir()


@pytest.mark.thorough
@pytest.mark.parametrize("index", [0, 1])
def test_output_has_one_line_per_run(fleet, index):
  _, runs = fleet
  lines = [l for l in runs[index].stdout.splitlines() if l.startswith("[")]
  assert re.fullmatch(
      rf"shard {index} of 2: migrating 1 of 2 run\(s\) into orbax, \d at a "
      "time", runs[index].stdout.splitlines()[0]), runs[index].stdout
  assert len(lines) == 1, runs[index].stdout
  assert re.fullmatch(
      rf"\[1/1\] {_RUNS[index]} ok \(1 step, \d+(\.\d)? K?i?B, \d+ s\); "
      r"all done in .+", lines[0]), lines[0]


@pytest.mark.thorough
def test_merged_shard_reports_list_every_run(fleet):
  root, _ = fleet
  run = _script("--merge-reports", "all.json", "shard1.json", "shard0.json",
                cwd=root)
  assert run.returncode == 0, run.stderr
  merged = json.loads((root / "all.json").read_text())
  assert [(r["source"], r["shard"], r["status"]) for r in merged["runs"]] == [
      (_RUNS[0], 0, "ok"), (_RUNS[1], 1, "ok")]
  assert merged["ok"] and merged["destination_root"] == "orbax"


@pytest.mark.thorough
def test_merging_another_fleet_exits_2_with_one_line(fleet):
  root, _ = fleet
  other = json.loads((root / "shard1.json").read_text())
  other["destination_root"] = "/somewhere/else"
  (root / "other.json").write_text(json.dumps(other))
  run = _script("--merge_reports=refused.json", "shard0.json", "other.json",
                cwd=root)
  assert run.returncode == 2
  assert len(run.stderr.strip().splitlines()) == 1, run.stderr
  assert "different fleets" in run.stderr
  assert not (root / "refused.json").exists()


# --------------------------------------------------------------------------
# --template.
# --------------------------------------------------------------------------


def test_template_that_is_not_module_function_exits_2(tmp_path):
  run = _script("--sources=/nonexistent/run", "--destination-root=out",
                "--template=no_colon", cwd=tmp_path)
  assert run.returncode == 2, run.stderr
  assert len(run.stderr.strip().splitlines()) == 1, run.stderr
  assert "--template 'no_colon': expected MODULE:FUNCTION" in run.stderr
  assert not run.stdout
  assert not list(tmp_path.iterdir())


@pytest.mark.thorough
def test_template_is_passed_to_each_migration(tmp_path):
  from migration_helpers import clu_save  # pylint: disable=g-import-not-at-top
  from migration_helpers import example_state  # pylint: disable=g-import-not-at-top
  clu_save(tmp_path / "runs" / "a", [example_state(10)])
  # The module is found in the current directory; its function fails, which
  # only `clu-ckpt migrate --template` can report.
  (tmp_path / "tmpl.py").write_text(
      "def template():\n  raise RuntimeError('template called')\n")
  run = _script("--sources=runs/a", "--destination-root=orbax",
                "--template=tmpl:template", "--report=report.json",
                cwd=tmp_path)
  assert run.returncode == 1, run.stderr
  report = json.loads((tmp_path / "report.json").read_text())
  assert "--template" in report["options"]
  [entry] = report["runs"]
  assert entry["status"] == "error"
  assert entry["error"] == ("clu-ckpt migrate: error: --template "
                            "tmpl:template: RuntimeError: template called")
