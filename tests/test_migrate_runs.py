"""Tests of migration/migrate_runs.py, the fleet command, in real processes.

Usage errors (fast: no worker starts), `--help` and `--version`, the dry
run, a retry's destination, a fleet of runs written by the real
`clu.checkpoint` with a worker killed mid-run, and stops by SIGINT to the
process group and SIGTERM to the fleet process alone. The modules under
the script (`clu_ckpt.migration.fleet*`: the plan, destinations, shards,
progress, reports) are tested in-process in tests/test_migration_fleet.py.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleet_helpers import clu_dir
from fleet_helpers import make_tree
import clu_ckpt

SCRIPT = Path(__file__).resolve().parents[1] / "migration" / "migrate_runs.py"


def _environment():
  """os.environ without JOB_COMPLETION_INDEX (it would pick a shard) and
  the launch ids a scheduler sets."""
  return {k: v for k, v in os.environ.items() if k not in (
      "JOB_COMPLETION_INDEX", "SLURM_ARRAY_JOB_ID",
      "CLU_CKPT_FLEET_LAUNCH_ID")}


def _start(*args, cwd, **kwargs):
  """Starts the script; the process (text output piped)."""
  return subprocess.Popen([sys.executable, str(SCRIPT), *args],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, cwd=cwd, env=_environment(), **kwargs)


def _finish(process, timeout=600):
  """Waits for a `_start`ed process; a CompletedProcess."""
  stdout, stderr = process.communicate(timeout=timeout)
  return subprocess.CompletedProcess(process.args, process.returncode,
                                     stdout, stderr)


def _script(*args, cwd):
  """Runs the script; the completed process (text output)."""
  return _finish(_start(*args, cwd=cwd))


@pytest.fixture(name="tree")
def fixture_tree(tmp_path):
  """`fleet_helpers.make_tree` in `tmp_path` (the processes' directory)."""
  make_tree(tmp_path)
  return tmp_path


# --------------------------------------------------------------------------
# Destinations.
# --------------------------------------------------------------------------


def test_a_retry_writes_into_the_fleets_root(tmp_path):
  """The command line: a fleet's dry run, then a retry of one run."""
  for run in ("a", "b", "c"):
    clu_dir(tmp_path, f"runs/{run}/checkpoints")
  (tmp_path / "orbax").mkdir()
  (tmp_path / "orbax" / "clu_ckpt_fleet.json").write_text(json.dumps(
      {"source_root": str(tmp_path / "runs")}))
  fleet = _script("--source-glob=runs/*/checkpoints",
                  "--destination-root=orbax", "--dry-run", cwd=tmp_path)
  retry = _script("--sources=runs/c/checkpoints", "--destination-root=orbax",
                  "--dry-run", cwd=tmp_path)
  line = "would migrate runs/c/checkpoints -> orbax/c/checkpoints"
  assert line in fleet.stdout and line in retry.stdout, retry.stdout
  assert retry.returncode == fleet.returncode == 0, retry.stderr
  other = _script("--sources=runs/c/checkpoints", "--destination-root=orbax",
                  "--source-root=runs/c", "--dry-run", cwd=tmp_path)
  assert other.returncode == 2
  assert "the destination root mirrors" in other.stderr


# --------------------------------------------------------------------------
# Shards.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("args", [
    ["--num-shards=3", "--shard-index=3"],
    ["--num_shards=0"],
    ["--num-shards=2"],  # no index, no $JOB_COMPLETION_INDEX
    ["--num-shards=two"],  # a parsing error
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
# The command line.
# --------------------------------------------------------------------------


def test_help_and_version_exit_0(tmp_path):
  helped = _script("--help", cwd=tmp_path)
  assert helped.returncode == 0, helped.stderr
  assert "--source-root" in helped.stdout
  assert "--allow-other-sources" in helped.stdout
  version = _script("--version", cwd=tmp_path)
  assert version.returncode == 0
  assert version.stdout.strip() == (
      f"migrate_runs.py (clu-ckpt {clu_ckpt.__version__})")
  # The same command as a module of the package.
  module = subprocess.run(
      [sys.executable, "-m", "clu_ckpt.migration.fleet", "--version"],
      capture_output=True, text=True, cwd=tmp_path, env=_environment())
  assert module.returncode == 0, module.stderr
  assert module.stdout.strip() == (
      f"python -m clu_ckpt.migration.fleet (clu-ckpt {clu_ckpt.__version__})")


def test_dry_run_prints_the_plan_and_writes_nothing(tree):
  run = _script("--source-glob=runs/*/checkpoints", "--destination-root=out",
                "--report=reports/r.json", "--dry-run", cwd=tree)
  assert run.returncode == 0, run.stderr
  assert run.stdout.splitlines() == [
      "skipped runs/e/checkpoints: empty directory",
      "skipped runs/o/checkpoints: not a checkpoint directory (no "
      "`checkpoint` file, no <name>-<N>.flax)",
      "would migrate runs/a/checkpoints -> out/a/checkpoints (Checkpoint, "
      "0 B)",
      "would migrate runs/b/checkpoints -> out/b/checkpoints (Checkpoint, "
      "0 B)",
      "would migrate runs/f/checkpoints -> out/f/checkpoints "
      "(flax_training, 0 B)",
      "would migrate runs/m/checkpoints -> out/m/checkpoints "
      "(MultihostCheckpoint, 2 hosts, 0 B)",
      f"dry run: would migrate 4 run(s) (0 B) into out (source root "
      f"{tree / 'runs'}); 2 path(s) skipped; wrote nothing"]
  assert not (tree / "out").exists() and not (tree / "reports").exists()


def test_a_run_named_with_a_comma_is_one_run(tree):
  # Runs named by their hyperparameters: `--sources` must not split one.
  clu_dir(tree, "runs/lr=0.1,bs=32/checkpoints")
  run = _script("--sources=runs/lr=0.1,bs=32/checkpoints,runs/a/checkpoints",
                "--sources=runs/lr=0.1,bs=32/checkpoints",
                "--source-root=runs", "--destination-root=out", "--dry-run",
                cwd=tree)
  assert run.returncode == 0, run.stderr
  assert run.stdout.splitlines()[:2] == [
      "would migrate runs/a/checkpoints -> out/a/checkpoints (Checkpoint, "
      "0 B)",
      "would migrate runs/lr=0.1,bs=32/checkpoints -> "
      "out/lr=0.1,bs=32/checkpoints (Checkpoint, 0 B)"], run.stdout


@pytest.mark.parametrize("args, message", [
    (["--source-glob=runs/*/none"], "--source-glob 'runs/*/none' matched "
     "nothing"),
    (["--sources=runs/a/checkpoints"], "needs --source-root"),
    (["--source-glob=runs/*/checkpoints", "--report=runs"],
     "--report runs: is a directory"),
    (["--source-glob=runs/*/checkpoints", "--template=no_colon"],
     "--template 'no_colon': expected MODULE:FUNCTION"),
    (["--source-glob=runs/*/checkpoints", "--bogus"],
     "unrecognized arguments: --bogus"),
])
def test_usage_errors_exit_2_with_one_line_before_any_work(tree, args,
                                                           message):
  run = _script("--destination-root=out", *args, cwd=tree)
  assert run.returncode == 2, run.stderr
  assert len(run.stderr.strip().splitlines()) == 1, run.stderr
  assert message in run.stderr
  assert not run.stdout
  assert not (tree / "out").exists()


@pytest.mark.parametrize("verbose", [False, True])
def test_errors_are_one_line_tracebacks_only_with_verbose(tree, verbose):
  (tree / "afile").write_text("")
  run = _script("--source-glob=runs/*/checkpoints",
                "--destination-root=afile/orbax", "--report=r.json",
                *(["--verbose"] if verbose else []), cwd=tree)
  assert run.returncode == 1, run.stderr
  assert run.stderr.strip().splitlines()[-1].startswith(
      "migrate_runs.py: error: afile")
  assert ("Traceback" in run.stderr) == verbose, run.stderr
  if not verbose:
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr


# --------------------------------------------------------------------------
# Real fleets: runs written by clu, long-lived workers, a worker killed.
# --------------------------------------------------------------------------

# A template function that kills its worker (as the kernel's OOM killer
# would) the first time it is called, then lets the runs migrate.
_KILLER = """
import os, signal
def template():
  if os.path.exists("kill-once"):
    os.remove("kill-once")
    os.kill(os.getpid(), signal.SIGKILL)
  return None
"""


@pytest.fixture(scope="module", name="clu_fleet")
def fixture_clu_fleet(tmp_path_factory):
  """Runs written by clu: runs/{a,b,c}/checkpoints, and runs/m/checkpoints a
  MultihostCheckpoint (hosts only); runs/f/checkpoints Flax's own
  `flax.training.checkpoints` files; runs/e/checkpoints empty;
  runs/d/checkpoints a symbolic link to a missing disk2/d. Migrated at
  --parallelism=1 with a template killing the first run's worker, the
  report in a directory that does not exist yet, from a directory holding
  a `numpy.py`.

  Returns:
    (directory, completed process, report).
  """
  from migration_helpers import clu_save  # pylint: disable=g-import-not-at-top
  from migration_helpers import example_state  # pylint: disable=g-import-not-at-top
  from clu import checkpoint as clu_checkpoint  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp("fleet")
  for i, run in enumerate("abc"):
    clu_save(root / "runs" / run / "checkpoints", [example_state(10 + i)])
  for host in (0, 1):  # without a dataset: the workers need no TensorFlow
    clu_checkpoint.MultihostCheckpoint(
        str(root / "runs" / "m" / "checkpoints"), host_id=host).save(
            example_state(7))
  import flax  # pylint: disable=g-import-not-at-top
  from flax.training import checkpoints  # pylint: disable=g-import-not-at-top
  import warnings  # pylint: disable=g-import-not-at-top
  flax.config.update("flax_use_orbax_checkpointing", False)
  with warnings.catch_warnings():  # Flax's own deprecation notice
    warnings.simplefilter("ignore", DeprecationWarning)
    for step in (5, 10):
      checkpoints.save_checkpoint(str(root / "runs" / "f" / "checkpoints"),
                                  example_state(step), step, keep=2)
  (root / "runs" / "e" / "checkpoints").mkdir(parents=True)
  (root / "runs" / "d").mkdir()  # a run on a disk not mounted
  (root / "runs" / "d" / "checkpoints").symlink_to(root / "disk2" / "d")
  (root / "killer.py").write_text(_KILLER)
  (root / "kill-once").write_text("")
  # A module of the operator's directory does not shadow a library in the
  # fleet's processes (only `--template` imports from there).
  (root / "numpy.py").write_text("raise ImportError('numpy.py of the "
                                 "current directory imported')\n")
  run = _script("--source-glob=runs/*/checkpoints", "--destination-root=orbax",
                "--report=reports/new/report.json", "--parallelism=1",
                "--template=killer:template", "--step_naming=state",
                cwd=root)
  report = json.loads((root / "reports/new/report.json").read_text())
  return root, run, report


def test_a_killed_worker_fails_only_its_run(clu_fleet):
  root, run, report = clu_fleet
  assert run.returncode == 1, run.stderr[-3000:]
  statuses = {r["source"]: r["status"] for r in report["runs"]}
  # The first run (sorted) lost its worker; a new worker took the others.
  assert statuses == {"runs/a/checkpoints": "error",
                      "runs/b/checkpoints": "ok", "runs/c/checkpoints": "ok",
                      "runs/d/checkpoints": "error",
                      "runs/f/checkpoints": "ok",
                      "runs/m/checkpoints": "ok"}, report
  error = report["runs"][0]["error"]
  assert error.startswith("worker process died (killed by SIGKILL (out of "
                          "memory?)) while migrating this run"), error
  assert not (root / "orbax" / "a" / "checkpoints" / "10").exists()
  assert report["runs"][3]["error"] == (
      f"cannot list: a broken symbolic link to {root / 'disk2' / 'd'}")
  assert report["complete"] and report["counts"]["error"] == 2
  assert report["skipped"] == [{"path": "runs/e/checkpoints",
                                "reason": "empty directory",
                                "glob": "runs/*/checkpoints"}]


def test_the_fleet_migrates_every_run_with_its_hosts(clu_fleet):
  from migration_helpers import example_state  # pylint: disable=g-import-not-at-top
  from migration_helpers import orbax_restore  # pylint: disable=g-import-not-at-top
  from migration_helpers import same_tree  # pylint: disable=g-import-not-at-top
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  root, _, report = clu_fleet
  multihost = next(r for r in report["runs"]
                   if r["source"] == "runs/m/checkpoints")
  assert multihost["summary"]["hosts"] == [0, 1]
  assert multihost["destination"] == "orbax/m/checkpoints"
  restored = orbax_restore(root / "orbax" / "b" / "checkpoints", 11)
  assert set(restored) >= {"state"}
  assert same_tree(
      migration.restore_state(str(root / "orbax" / "m" / "checkpoints")),
      example_state(7))
  # Flax's own files: steps named by Flax's step numbers, read back as
  # Flax reads its files.
  from flax.training import checkpoints  # pylint: disable=g-import-not-at-top
  from clu_ckpt import checkpoint  # pylint: disable=g-import-not-at-top
  flax_run = next(r for r in report["runs"]
                  if r["source"] == "runs/f/checkpoints")
  assert flax_run["kind"] == "flax_training"
  assert [s["step"] for s in flax_run["summary"]["steps"]] == [5, 10]
  assert same_tree(
      checkpoint.load_state_dict(str(root / "orbax" / "f" / "checkpoints")),
      checkpoints.restore_checkpoint(str(root / "runs" / "f" / "checkpoints"),
                                     None))
  recorded = json.loads((root / "orbax" / "clu_ckpt_fleet.json").read_text())
  assert recorded["source_root"] == str(root / "runs")


def test_the_fleet_prints_the_skipped_and_one_line_per_run(clu_fleet):
  _, run, _ = clu_fleet
  lines = run.stdout.splitlines()
  assert lines[0] == "skipped runs/e/checkpoints: empty directory"
  assert re.fullmatch(r"migrating 6 run\(s\) \(\d+\.\d KiB\) into orbax, 1 "
                      r"at a time; 1 path\(s\) skipped", lines[1]), lines[1]
  progress = [l for l in lines if l.startswith("[")]
  assert len(progress) == 6, run.stdout
  assert progress[0].startswith("[1/6] runs/d/checkpoints error (0 s): cannot "
                                "list: a broken symbolic link to "), progress
  # Not a terminal (a pipe, a log): plain lines, nothing rewritten.
  assert "\r" not in run.stdout and "\x1b" not in run.stdout
  assert re.fullmatch(r"\[6/6\] runs/m/checkpoints ok \(1 step, \d+ B, \d+ "
                      r"(s|min)\); [\d.]+ KiB of [\d.]+ KiB, 2 failures, all "
                      r"done in \d+ (s|min)", progress[-1]), progress[-1]
  assert lines[-1] == ("4 ok, 0 failed, 2 error; report: "
                       "reports/new/report.json")


def test_a_run_ok_whose_source_keeps_checkpoints_is_named(tmp_path):
  """`--latest` migrates one checkpoint: the run is "ok", but deleting its
  source would lose the others, and the report and the last line say so."""
  from migration_helpers import clu_save  # pylint: disable=g-import-not-at-top
  from migration_helpers import example_state  # pylint: disable=g-import-not-at-top
  clu_save(tmp_path / "runs" / "a" / "checkpoints",
           [example_state(1), example_state(2), example_state(3)])
  clu_save(tmp_path / "runs" / "b" / "checkpoints", [example_state(4)])
  run = _script("--source-glob=runs/*/checkpoints", "--destination-root=orbax",
                "--report=r.json", "--latest", cwd=tmp_path)
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.loads((tmp_path / "r.json").read_text())
  runs = {r["source"]: r for r in report["runs"]}
  assert runs["runs/a/checkpoints"]["status"] == "ok"
  assert runs["runs/a/checkpoints"]["source_not_migrated"] == [
      "ckpt-1", "ckpt-2"]
  assert "source_not_migrated" not in runs["runs/b/checkpoints"]
  assert report["sources_to_keep"] == ["runs/a/checkpoints"]
  assert ("the source keeps 2 of 3 checkpoint(s) not migrated (ckpt-1, "
          "ckpt-2): do not delete it") in run.stdout, run.stdout
  assert run.stdout.splitlines()[-1] == (
      '1 source(s) keep checkpoints not migrated ("sources_to_keep" in the '
      "report): do not delete them")
  merged = _script("--merge-reports=m.json", "r.json", cwd=tmp_path)
  assert merged.returncode == 0, merged.stderr
  assert json.loads((tmp_path / "m.json").read_text())[
      "sources_to_keep"] == ["runs/a/checkpoints"]
  assert merged.stdout.splitlines()[-1].startswith("1 source(s) keep")


def test_a_run_whose_migrated_step_was_removed_keeps_its_source(tmp_path):
  """A step removed from the destination after its migration (by hand, or
  a manager's max_to_keep) is not written again by a re-run: the source
  holds the only copy of its checkpoint, and the fleet says so."""
  import shutil  # pylint: disable=g-import-not-at-top
  from migration_helpers import clu_save  # pylint: disable=g-import-not-at-top
  from migration_helpers import example_state  # pylint: disable=g-import-not-at-top
  clu_save(tmp_path / "runs" / "a" / "checkpoints",
           [example_state(1), example_state(2)])
  args = ("--source-glob=runs/*/checkpoints", "--destination-root=orbax",
          "--report=r.json")
  run = _script(*args, cwd=tmp_path)
  assert run.returncode == 0, run.stderr[-3000:]
  assert json.loads((tmp_path / "r.json").read_text())[
      "sources_to_keep"] == []
  steps = sorted((tmp_path / "orbax" / "a" / "checkpoints").glob("[0-9]*"))
  assert len(steps) == 2, steps
  shutil.rmtree(steps[-1])  # the newest
  run = _script(*args, cwd=tmp_path)
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.loads((tmp_path / "r.json").read_text())
  (entry,) = report["runs"]
  assert entry["status"] == "ok"
  assert entry["source_not_migrated"] == [
      f"ckpt-2 (step {steps[-1].name})"], entry
  assert report["sources_to_keep"] == ["runs/a/checkpoints"]
  assert ("the source keeps 1 checkpoint(s) whose step the destination no "
          f"longer holds (ckpt-2 (step {steps[-1].name})): do not delete "
          "it") in run.stdout, run.stdout


def test_a_run_ok_whose_source_holds_what_it_did_not_read_is_named(tmp_path):
  """An Orbax step saved into the run by `Checkpoint(layout="orbax")`, a run
  inside the run: not migrated, so the source is one to keep."""
  from migration_helpers import clu_save  # pylint: disable=g-import-not-at-top
  from migration_helpers import example_state  # pylint: disable=g-import-not-at-top
  a = tmp_path / "runs" / "a" / "checkpoints"
  clu_save(a, [example_state(1)])
  clu_save(tmp_path / "runs" / "b" / "checkpoints", [example_state(2)])
  (a / "7").mkdir()
  (a / "finetune").mkdir()
  run = _script("--source-glob=runs/*/checkpoints", "--destination-root=orbax",
                "--report=r.json", cwd=tmp_path)
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.loads((tmp_path / "r.json").read_text())
  runs = {r["source"]: r for r in report["runs"]}
  assert runs["runs/a/checkpoints"]["source_not_migrated"] == [
      "7/", "finetune/"]
  assert "source_not_migrated" not in runs["runs/b/checkpoints"]
  assert report["sources_to_keep"] == ["runs/a/checkpoints"]
  assert ("the source keeps 2 other entries not migrated (7/, finetune/): "
          "do not delete it") in run.stdout, run.stdout
  assert run.stdout.splitlines()[-1].startswith("1 source(s) keep")


def _golden(case, target):
  """A writable copy of golden case `case` (`multihost/checkpoints-1`: one
  of its directories) at `target`, without its MANIFEST.json."""
  import shutil  # pylint: disable=g-import-not-at-top
  from conftest import golden_case  # pylint: disable=g-import-not-at-top
  from conftest import make_writable  # pylint: disable=g-import-not-at-top
  name, _, sub = case.partition("/")
  shutil.copytree(golden_case(name) / sub, target,
                  ignore=shutil.ignore_patterns("MANIFEST.json"))
  make_writable(target)


def _forked_runs(tmp_path):
  """runs/seed-0, runs/seed-1: single-host runs forked from one, seed-1
  stopped at ckpt-4 (seed-0 has ckpt-5 too)."""
  _golden("single_host", tmp_path / "runs/seed-0")
  _golden("single_host", tmp_path / "runs/seed-1")
  for name in ("ckpt-5.flax", "ckpt-5.index", "ckpt-5.data-00000-of-00001"):
    (tmp_path / "runs/seed-1" / name).unlink()
  state = tmp_path / "runs/seed-1/checkpoint"
  lines = state.read_text().replace('"ckpt-5"', '"ckpt-4"').splitlines()
  state.write_text("\n".join(dict.fromkeys(lines)) + "\n")


def test_hosts_reached_only_through_their_directories_keep_their_source(
    tmp_path):
  """`runs/seed-*` names host-like directories only: `seed-0`, `seed-1` are
  read as the hosts of a MultihostCheckpoint `runs/seed`, yet they may be
  single-host runs of their own. ckpt-5, which only seed-0 keeps, was
  dropped as "not on every host" and the run said ok with nothing to keep:
  deleting the sources lost it. Now the run's entry lists it, the source
  is kept and the line says how to name them. A genuine MultihostCheckpoint
  preempted mid-save (host 1 has ckpt-3, host 0 not), its base named, still
  migrates without anything to keep."""
  _forked_runs(tmp_path)
  for host in (0, 1):
    _golden(f"multihost/checkpoints-{host}",
            tmp_path / f"mh/a/checkpoints-{host}")
  run = _script("--source-glob=runs/seed-*", "--sources=mh/a/checkpoints",
                "--source-root=.", "--destination-root=orbax",
                "--report=r.json", cwd=tmp_path)
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.loads((tmp_path / "r.json").read_text())
  runs = {r["source"]: r for r in report["runs"]}
  seed = runs["runs/seed"]
  assert seed["status"] == "ok", seed
  assert seed["source_not_migrated"] == ["ckpt-5"]
  assert report["sources_to_keep"] == ["runs/seed"]
  assert ("not on every host, not migrated: ckpt-5 (reached through "
          "runs/seed-0, runs/seed-1 only, no glob or path naming runs/seed: "
          "the hosts of one MultihostCheckpoint, or runs of their own whose "
          "own checkpoints these are? Kept: do not delete it. Name them with "
          "--sources=runs/seed (one run) or "
          "--sources=runs/seed-0,runs/seed-1 (runs of their own))"
          ) == seed["warning"]
  genuine = runs["mh/a/checkpoints"]
  assert genuine["status"] == "ok", genuine
  assert genuine["warning"] == "not on every host, not migrated: ckpt-3"
  assert "source_not_migrated" not in genuine
  assert run.stdout.splitlines()[-1].startswith("1 source(s) keep")


@pytest.mark.thorough
def test_hosts_reached_through_their_directories_with_state_host(tmp_path):
  """--state-host takes host 0's state without comparing: seed-1's own
  state, if it is a run of its own, is not migrated either: kept."""
  _forked_runs(tmp_path)
  run = _script("--source-glob=runs/seed-*", "--source-root=.",
                "--destination-root=orbax2", "--report=r2.json",
                "--state-host=0", cwd=tmp_path)
  assert run.returncode == 0, run.stderr[-3000:]
  seed, = json.loads((tmp_path / "r2.json").read_text())["runs"]
  assert seed["source_not_migrated"] == [
      "ckpt-5", "state of runs/seed-1 (not compared: --state-host)"]


def test_a_named_base_migrated_with_state_host_keeps_its_source(tmp_path):
  """--state-host takes one host's state without comparing the others: a
  named MultihostCheckpoint whose hosts hold other states loses them if its
  source is deleted, so the fleet keeps it."""
  from migration_helpers import example_state  # pylint: disable=g-import-not-at-top
  from migration_helpers import multihost_save  # pylint: disable=g-import-not-at-top
  multihost_save(tmp_path / "runs" / "m" / "checkpoints",
                 [[example_state(1)], [example_state(1, scale=2.0)]])
  run = _script("--source-glob=runs/*/checkpoints", "--destination-root=o",
                "--report=r.json", "--state-host=1", cwd=tmp_path)
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.loads((tmp_path / "r.json").read_text())
  (entry,) = report["runs"]
  assert entry["status"] == "ok", entry
  assert entry["source_not_migrated"] == [
      "state of runs/m/checkpoints-0 (not compared: --state-host)"], entry
  assert report["sources_to_keep"] == ["runs/m/checkpoints"]


@pytest.mark.thorough
def test_a_rerun_finishes_the_fleet(clu_fleet):
  """Once the missing disk is back, a re-run migrates what is left."""
  from migration_helpers import clu_save  # pylint: disable=g-import-not-at-top
  from migration_helpers import example_state  # pylint: disable=g-import-not-at-top
  root, _, _ = clu_fleet
  clu_save(root / "disk2" / "d", [example_state(20)])
  run = _script("--source-glob=runs/*/checkpoints", "--destination-root=orbax",
                "--report=rerun.json", "--step-naming=state", cwd=root)
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.loads((root / "rerun.json").read_text())
  assert report["counts"] == {"ok": 6, "failed": 0, "error": 0}
  assert (root / "orbax" / "a" / "checkpoints" / "10").is_dir()


# --------------------------------------------------------------------------
# Clean stops, in real processes.
# --------------------------------------------------------------------------

# A template that marks its run started, then waits (a long migration).
_SLOW = """
import os, time
def template():
  open(f"started-{os.getpid()}", "w").close()
  time.sleep(120)
"""


# One whose run takes long to abandon, too.
_STUBBORN = """
import os, time
def template():
  open(f"started-{os.getpid()}", "w").close()
  try:
    time.sleep(120)
  except KeyboardInterrupt:
    time.sleep(120)
"""


def _stoppable_fleet(tmp_path, runs=5, template=_SLOW):
  """Runs written by clu_ckpt behind a template that waits; the fleet
  process in its own process group."""
  from migration_helpers import example_state  # pylint: disable=g-import-not-at-top
  from clu_ckpt import checkpoint  # pylint: disable=g-import-not-at-top
  for i in range(runs):
    checkpoint.Checkpoint(str(tmp_path / "runs" / f"r{i}")).save(
        example_state(i + 1))
  (tmp_path / "slow.py").write_text(template)
  return _start("--source-glob=runs/*", "--destination-root=orbax",
                "--report=report.json", "--parallelism=2",
                "--template=slow:template", cwd=tmp_path,
                start_new_session=True)


def _wait_for_runs(tmp_path, process, count, timeout=120):
  deadline = time.monotonic() + timeout
  while len(list(tmp_path.glob("started-*"))) < count:
    assert process.poll() is None, _finish(process).stderr
    assert time.monotonic() < deadline, "the runs did not start"
    time.sleep(0.1)


def _workers_in(directory):
  """Pids of the fleet's worker processes running in `directory`."""
  from clu_ckpt.migration import fleet_workers  # pylint: disable=g-import-not-at-top
  command = [a.encode() for a in fleet_workers.WORKER_ARGS]
  found = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
      cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
      continue
    if args[1:1 + len(command)] == command and cwd == str(directory):
      found.append(int(pid))
  return found


def _assert_stopped(tmp_path, run, status, seconds):
  assert run.returncode == status, run.stderr
  assert seconds < 10, seconds
  report = json.loads((tmp_path / "report.json").read_text())
  statuses = sorted(r["status"] for r in report["runs"])
  # Two runs under way were interrupted; no new run started.
  assert statuses == ["interrupted"] * 2 + ["pending"] * 3, report
  assert len(list(tmp_path.glob("started-*"))) == 2
  assert not report["complete"]
  assert "re-run the same command to resume" in run.stderr
  assert len(run.stderr.strip().splitlines()) == 1, run.stderr


@pytest.mark.parametrize("stop", [
    "ctrl-c",
    pytest.param("sigterm", marks=pytest.mark.thorough),
    pytest.param("sighup", marks=pytest.mark.thorough),
])
def test_a_stop_starts_no_new_run_and_writes_the_report(tmp_path, stop):
  process = _stoppable_fleet(tmp_path)
  _wait_for_runs(tmp_path, process, 2)
  assert len(_workers_in(tmp_path)) == 2
  start = time.monotonic()
  if stop == "ctrl-c":  # a terminal signals the whole process group
    os.killpg(process.pid, signal.SIGINT)
  elif stop == "sighup":  # the terminal hung up (its foreground group)
    os.killpg(process.pid, signal.SIGHUP)
  else:  # Kubernetes signals the container's main process
    process.send_signal(signal.SIGTERM)
  run = _finish(process, timeout=60)
  _assert_stopped(tmp_path, run,
                  {"ctrl-c": 130, "sigterm": 143, "sighup": 129}[stop],
                  time.monotonic() - start)
  # No worker is left behind.
  time.sleep(0.5)
  assert not _workers_in(tmp_path)


def test_file_urls_are_local_paths(tree):
  url = f"file://{tree}"
  run = _script(f"--source-glob={url}/runs/*/checkpoints",
                f"--sources={url}/runs/a/checkpoints,{url}/runs/b/checkpoints",
                f"--destination-root={url}/orbax", "--dry-run", cwd=tree)
  assert run.returncode == 0, run.stderr
  plain = _script(f"--source-glob={tree}/runs/*/checkpoints",
                  f"--destination-root={tree}/orbax", "--dry-run", cwd=tree)
  assert run.stdout == plain.stdout
  assert f"would migrate {tree}/runs/a/checkpoints -> {tree}/orbax/a/" in (
      run.stdout)


def test_a_closed_output_stops_no_run(tmp_path):
  """`migrate_runs.py ... | head -1`, a dead log collector: the output is
  gone after the first line; every run is still migrated and reported."""
  from migration_helpers import example_state  # pylint: disable=g-import-not-at-top
  from clu_ckpt import checkpoint  # pylint: disable=g-import-not-at-top
  for i in range(3):
    checkpoint.Checkpoint(str(tmp_path / "runs" / f"r{i}")).save(
        example_state(i + 1))
  process = _start("--source-glob=runs/*", "--destination-root=orbax",
                   "--report=report.json", "--parallelism=1", cwd=tmp_path)
  assert process.stdout.readline().startswith("migrating 3 run(s)")
  process.stdout.close()
  process.stderr.close()
  assert process.wait(timeout=300) == 0
  report = json.loads((tmp_path / "report.json").read_text())
  assert report["complete"] and report["counts"] == {
      "ok": 3, "failed": 0, "error": 0}, report
  for i in range(3):
    assert (tmp_path / "orbax" / f"r{i}" / str(i + 1)).is_dir()


def _big_run(path, step):
  """A CLU checkpoint of 4 x 24 MiB arrays (seconds to migrate)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from clu_ckpt import checkpoint  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(step)
  state = {"step": np.int64(step),
           "params": {f"w{i}": rng.random((6, 2**20), np.float32)
                      for i in range(4)}}
  checkpoint.Checkpoint(str(path)).save(state)


@pytest.mark.thorough
def test_a_stop_abandons_the_step_being_written(tmp_path):
  """Real writes stopped: nothing partial listed, a re-run completes."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  for i in range(4):
    for step in (1, 2, 3):
      _big_run(tmp_path / "runs" / f"r{i}", step)
  process = _start("--source-glob=runs/*", "--destination-root=orbax",
                   "--report=report.json", "--compression=none",
                   cwd=tmp_path, start_new_session=True)
  deadline = time.monotonic() + 120
  while not list((tmp_path / "orbax").glob("*/*.orbax-checkpoint-tmp*")):
    assert process.poll() is None and time.monotonic() < deadline
    time.sleep(0.05)
  start = time.monotonic()
  os.killpg(process.pid, signal.SIGINT)
  run = _finish(process, timeout=60)
  assert run.returncode == 130, run.stderr
  assert time.monotonic() - start < 10
  report = json.loads((tmp_path / "report.json").read_text())
  assert "interrupted" in {r["status"] for r in report["runs"]}
  assert not list((tmp_path / "orbax").glob("*/*tmp*"))
  for destination in (tmp_path / "orbax").glob("r*"):
    with ocp.CheckpointManager(destination) as mngr:
      for step in mngr.all_steps():
        assert mngr.restore(step)["state"]["step"] == step
  rerun = _script("--source-glob=runs/*", "--destination-root=orbax",
                  "--report=report.json", "--compression=none", cwd=tmp_path)
  assert rerun.returncode == 0, rerun.stderr


@pytest.mark.thorough
def test_a_second_ctrl_c_stops_at_once(tmp_path):
  # The runs take long to abandon: the second Ctrl-C must not wait for them.
  process = _stoppable_fleet(tmp_path, template=_STUBBORN)
  _wait_for_runs(tmp_path, process, 2)
  start = time.monotonic()
  os.killpg(process.pid, signal.SIGINT)
  time.sleep(1)
  os.killpg(process.pid, signal.SIGINT)
  run = _finish(process, timeout=60)
  assert run.returncode == 130, run.stderr
  assert time.monotonic() - start < 5
  report = json.loads((tmp_path / "report.json").read_text())
  assert {r["status"] for r in report["runs"]} <= {"interrupted", "pending"}


@pytest.mark.thorough
def test_a_killed_fleet_leaves_the_report_of_what_finished(tmp_path):
  """SIGKILL (nothing runs) while the second run is being written."""
  from migration_helpers import example_state  # pylint: disable=g-import-not-at-top
  from clu_ckpt import checkpoint  # pylint: disable=g-import-not-at-top
  checkpoint.Checkpoint(str(tmp_path / "runs" / "r0")).save(example_state(1))
  for step in (1, 2, 3):
    _big_run(tmp_path / "runs" / "r1", step)
  checkpoint.Checkpoint(str(tmp_path / "runs" / "r2")).save(example_state(1))
  process = _start("--source-glob=runs/*", "--destination-root=orbax",
                   "--report=report.json", "--parallelism=1", cwd=tmp_path,
                   start_new_session=True)
  report_path = tmp_path / "report.json"
  deadline = time.monotonic() + 120
  while True:
    assert process.poll() is None and time.monotonic() < deadline
    if report_path.exists() and json.loads(report_path.read_text())[
        "counts"]["ok"]:  # written whole (atomically) or not at all
      break
    time.sleep(0.02)
  workers = _workers_in(tmp_path)
  process.kill()  # SIGKILL: no handler runs
  process.wait(timeout=60)
  report = json.loads(report_path.read_text())
  assert [(r["source"], r["status"]) for r in report["runs"]] == [
      ("runs/r0", "ok"), ("runs/r1", "pending"), ("runs/r2", "pending")]
  assert not report["complete"]
  # The orphaned worker was told to stop (SIGTERM when its parent died).
  assert len(workers) == 1
  deadline = time.monotonic() + 30
  while _workers_in(tmp_path):
    assert time.monotonic() < deadline, "the worker outlived the fleet"
    time.sleep(0.1)


def _bytes_named_fleet(tmp_path):
  """runs/ok and runs/b"bad\\xff": real CLU runs; the second's name (as
  Python lists it: "bad\\udcff")."""
  from clu_ckpt import checkpoint  # pylint: disable=g-import-not-at-top
  from migration_helpers import example_state  # pylint: disable=g-import-not-at-top
  bad = os.fsdecode(b"bad\xff")
  for name in ("ok", "other"):
    checkpoint.Checkpoint(str(tmp_path / "runs" / name)).save(
        example_state(1))
  os.rename(tmp_path / "runs" / "other", tmp_path / "runs" / bad)
  return bad


def _strict_script(*args, cwd):
  """`_script` with an output that refuses what is not UTF-8 (a UTF-8
  locale's; C.UTF-8 would pass the bytes)."""
  return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd,
                        capture_output=True, text=True, timeout=300,
                        env=dict(_environment(),
                                 PYTHONIOENCODING="utf-8:strict"))


def test_a_dry_run_names_a_run_not_utf8_escaped(tmp_path):
  """Its plan (shards hash the name's bytes) and lines name it `\\xff`."""
  clu_dir(tmp_path, "runs/ok")
  clu_dir(tmp_path, os.fsdecode(b"runs/bad\xff"))
  run = _strict_script("--source-glob=runs/*", "--destination-root=orbax",
                       "--num-shards=2", "--shard-index=0", "--dry-run",
                       cwd=tmp_path)
  other = _strict_script("--source-glob=runs/*", "--destination-root=orbax",
                         "--num-shards=2", "--shard-index=1", "--dry-run",
                         cwd=tmp_path)
  assert not run.stderr and not other.stderr, run.stderr + other.stderr
  lines = run.stdout.splitlines() + other.stdout.splitlines()
  assert [l for l in lines if "bad" in l] == [
      "cannot migrate runs/bad\\xff: its destination orbax/bad\\xff is not "
      "valid UTF-8 (the source's name holds bytes that are not): Orbax's "
      "TensorStore writes UTF-8 names only; rename the source and migrate it "
      "again"], lines
  assert "would migrate runs/ok -> orbax/ok (Checkpoint, " in run.stdout + (
      other.stdout)


@pytest.mark.thorough
def test_a_run_named_in_bytes_not_utf8_is_an_error_naming_it(tmp_path):
  """The fleet goes on with the others; that run is an error naming it,
  escaped (`\\xff` in the lines, the surrogate `\\udcff` in the JSON
  report, from which `os.fsencode` gives the bytes back), even where the
  output refuses what is not UTF-8."""
  bad = _bytes_named_fleet(tmp_path)
  run = _strict_script("--source-glob=runs/*", "--destination-root=orbax",
                       "--report=report.json", "--parallelism=1",
                       cwd=tmp_path)
  assert run.returncode == 1 and not run.stderr, run.stderr
  text = (tmp_path / "report.json").read_text()
  assert "runs/bad\\udcff" in text  # the JSON escape of the surrogate
  runs = {r["source"]: r for r in json.loads(text)["runs"]}
  assert sorted(runs) == [f"runs/{bad}", "runs/ok"]
  assert os.fsencode(runs[f"runs/{bad}"]["source"]) == b"runs/bad\xff"
  assert runs[f"runs/{bad}"]["status"] == "error"
  assert "not valid UTF-8" in runs[f"runs/{bad}"]["error"]
  assert runs["runs/ok"]["status"] == "ok"
  assert (tmp_path / "orbax" / "ok" / "1").is_dir()
  assert not (tmp_path / "orbax" / bad).exists()
  assert re.search(r"\] runs/bad\\xff error \(0 s\): its destination "
                   r"orbax/bad\\xff is not valid UTF-8", run.stdout), run.stdout


# --------------------------------------------------------------------------
# Merging the shard reports of a launch.
# --------------------------------------------------------------------------


def _launch(tmp_path, runs, shards, num_shards, report="reports/shard-{}.json",
            env=None):
  """Runs shards `shards` of a fleet of `runs` (empty directories named by
  `--sources`: each an error run at once, no worker started); asserts each
  ended (exit 1, its runs in error)."""
  for name in runs:
    (tmp_path / "runs" / name).mkdir(parents=True, exist_ok=True)
  for index in shards:
    done = subprocess.run(
        [sys.executable, str(SCRIPT),
         "--sources=" + ",".join(f"runs/{n}" for n in runs),
         "--source-root=runs", "--destination-root=orbax",
         f"--num-shards={num_shards}", f"--shard-index={index}",
         f"--report={report.format(index)}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env=dict(_environment(), **(env or {})))
    assert done.returncode == 1 and not done.stderr, done.stderr


def _merge(tmp_path, *reports):
  """`--merge-reports=reports/all.json REPORT...`: (process, report)."""
  done = _script("--merge-reports=reports/all.json", *reports, cwd=tmp_path)
  assert done.returncode in (0, 1), done.stderr
  return done, json.loads((tmp_path / "reports" / "all.json").read_text())


def test_a_merge_takes_no_stale_shard_report_for_a_shard_never_run(tmp_path):
  """The guide's /reports/shard-$IDX.json, relaunched after a run's source
  was deleted and runs were added: shard 1's pod never starts, its report
  of the first launch is there. Not merged: shard 1 missing, the runs of
  the new plan that shard 1 holds listed as not migrated."""
  first = ["A", "B", "C", "D", "F"]
  _launch(tmp_path, first, [0, 1], 2)
  done, merged = _merge(tmp_path, "reports/shard-0.json",
                        "reports/shard-1.json")
  assert merged.get("stale_reports", []) == [] and merged["complete"]
  assert merged["missing_shards"] == []
  assert len(merged["runs"]) == merged["fleet_size"] == 5
  second = ["B", "C", "D", "F", "E", "K"]
  _launch(tmp_path, second, [0], 2)
  done, merged = _merge(tmp_path, "reports/shard-0.json",
                        "reports/shard-1.json")
  assert done.returncode == 1
  assert not merged["ok"] and not merged["complete"]
  assert merged["missing_shards"] == [1]
  assert [s["report"] for s in merged["stale_reports"]] == [
      "reports/shard-1.json"]
  assert "another run list (5 runs, not 6" in merged["stale_reports"][0][
      "reason"]
  assert ("not merged: reports/shard-1.json: from another launch than "
          "reports/shard-0.json") in done.stdout, done.stdout
  from clu_ckpt.migration import fleet_assignment  # pylint: disable=g-import-not-at-top
  in_shard_1 = sorted(f"runs/{n}" for n in second
                      if fleet_assignment.shard_of(f"runs/{n}", 2) == 1)
  assert in_shard_1  # the fixture's point: shard 1 holds runs of the plan
  runs = {r["source"]: r for r in merged["runs"]}
  assert sorted(runs) == sorted(f"runs/{n}" for n in second)
  assert sorted(s for s, r in runs.items() if r["status"] == "missing") == (
      in_shard_1)
  assert "runs/A" not in runs and merged["fleet_size"] == 6
  assert (f"{len(in_shard_1)} run(s) of the fleet in no report of this "
          "launch, not migrated: ") in done.stdout
  assert "note: this launch has no --launch-id" in done.stdout


def test_a_merge_with_mixed_shard_counts_still_finds_missing_shards(tmp_path):
  """Three shards launched, then two with shard 1 never run: every report
  of the first launch is stale, shard 1 of the second is missing."""
  _launch(tmp_path, ["A", "B", "C", "D"], [0, 1, 2], 3,
          report="reports/launch1-shard-{}.json")
  _launch(tmp_path, ["A", "B", "C", "D", "E"], [0], 2,
          report="reports/launch2-shard-{}.json")
  done, merged = _merge(tmp_path, *sorted(
      str(p.relative_to(tmp_path))
      for p in (tmp_path / "reports").glob("launch*.json")))
  assert done.returncode == 1 and not merged["ok"] and not merged["complete"]
  assert merged["missing_shards"] == [1] and merged["num_shards"] == 2
  assert sorted(s["report"] for s in merged["stale_reports"]) == [
      f"reports/launch1-shard-{i}.json" for i in range(3)]
  assert all("3 shards, not 2" in s["reason"]
             for s in merged["stale_reports"])
  assert [m["report"] for m in merged["merged_from"]] == [
      "reports/launch2-shard-0.json"]


def test_a_merge_tells_launches_apart_by_their_id(tmp_path):
  """The same command launched twice (same runs, same shards): one launch
  unless their ids differ (`$CLU_CKPT_FLEET_LAUNCH_ID`, `--launch-id`)."""
  runs = ["A", "B", "C"]
  _launch(tmp_path, runs, [0, 1], 2, env={"CLU_CKPT_FLEET_LAUNCH_ID": "job-1"})
  done, merged = _merge(tmp_path, "reports/shard-0.json",
                        "reports/shard-1.json")
  assert merged["missing_shards"] == [] and merged["complete"]
  assert merged.get("stale_reports", []) == []
  _launch(tmp_path, runs, [1], 2, env={"CLU_CKPT_FLEET_LAUNCH_ID": "job-2"})
  done, merged = _merge(tmp_path, "reports/shard-0.json",
                        "reports/shard-1.json")
  assert merged["missing_shards"] == [0] and not merged["complete"]
  assert merged["launch"]["id"] == "job-2"
  assert "no --launch-id" not in done.stdout
  assert [(s["report"], s["reason"]) for s in merged["stale_reports"]] == [
      ("reports/shard-0.json", "from another launch than "
       "reports/shard-1.json (the newest): launch id 'job-1', not 'job-2'")]


def test_a_slurm_array_names_its_launch_without_a_flag(tmp_path):
  """Tasks of one Slurm array share `$SLURM_ARRAY_JOB_ID`, the next array
  has another: the launch id without `--launch-id`. An identical relaunch
  (same runs, shards and options) whose shard 0 never ran was one launch
  with the first, whose shard 0 report stood in for it: merged ok."""
  runs = ["A", "B", "C"]
  _launch(tmp_path, runs, [0, 1], 2, env={"SLURM_ARRAY_JOB_ID": "41"})
  done, merged = _merge(tmp_path, "reports/shard-0.json",
                        "reports/shard-1.json")
  assert merged["missing_shards"] == [] and merged["complete"]
  assert merged["launch"]["id"] == "41"
  assert "no --launch-id" not in done.stdout
  _launch(tmp_path, runs, [1], 2, env={"SLURM_ARRAY_JOB_ID": "42"})
  done, merged = _merge(tmp_path, "reports/shard-0.json",
                        "reports/shard-1.json")
  assert done.returncode == 1 and not merged["complete"]
  assert merged["missing_shards"] == [0]
  assert [(s["report"], s["reason"]) for s in merged["stale_reports"]] == [
      ("reports/shard-0.json", "from another launch than "
       "reports/shard-1.json (the newest): launch id '41', not '42'")]
  # --launch-id and $CLU_CKPT_FLEET_LAUNCH_ID still come first.
  _launch(tmp_path, runs, [0], 2, env={"SLURM_ARRAY_JOB_ID": "43",
                                       "CLU_CKPT_FLEET_LAUNCH_ID": "42"})
  done, merged = _merge(tmp_path, "reports/shard-0.json",
                        "reports/shard-1.json")
  assert merged["missing_shards"] == [] and merged["complete"], merged


@pytest.mark.thorough
def test_a_relaunch_with_a_shard_never_run_is_not_ok(tmp_path):
  """Real runs, all migrated ok by the first launch; its shard 1 report
  stays when the relaunch's shard 1 never runs: the merge is neither ok
  nor complete (exit 1) and names the runs that launch did not migrate."""
  from clu_ckpt import checkpoint  # pylint: disable=g-import-not-at-top
  from clu_ckpt.migration import fleet_assignment  # pylint: disable=g-import-not-at-top
  from migration_helpers import example_state  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top

  def launch(shards):
    for index in shards:
      done = _script("--source-glob=runs/*", "--destination-root=orbax",
                     "--num-shards=2", f"--shard-index={index}",
                     "--parallelism=1", f"--report=reports/shard-{index}.json",
                     cwd=tmp_path)
      assert done.returncode == 0, done.stderr[-3000:]

  for name in ("A", "B", "C"):
    checkpoint.Checkpoint(str(tmp_path / "runs" / name)).save(
        example_state(1))
  launch([0, 1])
  done, merged = _merge(tmp_path, "reports/shard-0.json",
                        "reports/shard-1.json")
  assert done.returncode == 0 and merged["ok"] and merged["complete"]
  shutil.rmtree(tmp_path / "runs" / "A")  # migrated ok: deleted
  new = next(f"N{i}" for i in range(100)
             if fleet_assignment.shard_of(f"runs/N{i}", 2) == 1)
  checkpoint.Checkpoint(str(tmp_path / "runs" / new)).save(example_state(2))
  launch([0])
  done, merged = _merge(tmp_path, "reports/shard-0.json",
                        "reports/shard-1.json")
  assert done.returncode == 1 and not merged["ok"] and not merged["complete"]
  assert merged["missing_shards"] == [1]
  runs = {r["source"]: r["status"] for r in merged["runs"]}
  assert runs[f"runs/{new}"] == "missing" and "runs/A" not in runs
  assert not (tmp_path / "orbax" / new).exists()


def test_a_merge_takes_no_report_without_a_launch(tmp_path):
  """A shard report of an earlier version (no "launch"): which launch it
  is from cannot be told; it is listed as stale, not merged."""
  _launch(tmp_path, ["A", "B", "C"], [0, 1], 2)
  path = tmp_path / "reports" / "shard-1.json"
  old = json.loads(path.read_text())
  del old["launch"]
  path.write_text(json.dumps(old))
  done, merged = _merge(tmp_path, "reports/shard-0.json",
                        "reports/shard-1.json")
  assert merged["missing_shards"] == [1] and not merged["complete"]
  assert [s["report"] for s in merged["stale_reports"]] == [
      "reports/shard-1.json"]
  assert "no launch identity" in merged["stale_reports"][0]["reason"]
  assert done.returncode == 1


# --------------------------------------------------------------------------
# A bucket whose listing fails: never a run left out unseen.
# --------------------------------------------------------------------------


class _RefusingProxy:
  """An HTTP proxy on 127.0.0.1 in front of an emulator that answers 403
  to the listings `refuse(prefix)` picks (as a store's policy denying a
  prefix would) and forwards everything else."""

  def __init__(self, emulator, refuse):
    import http.client  # pylint: disable=g-import-not-at-top
    import http.server  # pylint: disable=g-import-not-at-top
    import urllib.parse  # pylint: disable=g-import-not-at-top
    self.refused = []
    proxy, port, gcs = self, emulator.port, emulator.scheme == "gs"

    class Handler(http.server.BaseHTTPRequestHandler):
      protocol_version = "HTTP/1.1"

      def log_message(self, *args):
        del args

      def _answer(self, status, headers, data):
        self.send_response(status)
        for k, v in headers:
          if k.lower() not in ("transfer-encoding", "connection",
                               "content-length"):
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
          self.wfile.write(data)

      def _any(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        url = urllib.parse.urlsplit(self.path)
        prefix = urllib.parse.parse_qs(url.query).get("prefix")
        listing = self.command == "GET" and prefix is not None and (
            url.path.endswith("/o") if gcs else "list-type" in url.query)
        if listing and refuse(prefix[0]):
          proxy.refused.append(prefix[0])
          self._answer(403, [("Content-Type", "application/json")] if gcs
                       else [("Content-Type", "application/xml")],
                       b'{"error": {"code": 403, "message": "denied"}}' if gcs
                       else b"<?xml version='1.0'?><Error><Code>AccessDenied"
                       b"</Code><Message>denied</Message></Error>")
          return
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request(self.command, self.path, body=body, headers={
            k: v for k, v in self.headers.items()
            if k.lower() not in ("host", "connection")})
        response = conn.getresponse()
        self._answer(response.status, response.getheaders(), response.read())
        conn.close()

      do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = _any

    self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.server.daemon_threads = True
    self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

  def __enter__(self):
    import threading  # pylint: disable=g-import-not-at-top
    threading.Thread(target=self.server.serve_forever, daemon=True).start()
    return self

  def __exit__(self, *exc):
    self.server.shutdown()
    self.server.server_close()


def _bucket_fleet(emulator, proxy, *args):
  """The fleet's dry run, its store reached through `proxy`."""
  env = emulator.child_env(PYTHONPATH=str(SCRIPT.parents[1]))
  env.pop("JOB_COMPLETION_INDEX", None)
  for name in (("STORAGE_EMULATOR_HOST",) if emulator.scheme == "gs" else
               ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")):
    env[name] = proxy.url
  return subprocess.run([sys.executable, str(SCRIPT), *args,
                         "--destination-root=orbax", "--dry-run"],
                        capture_output=True, text=True, env=env, timeout=300,
                        check=False, cwd=emulator.root)


def test_a_bucket_listing_refused_is_an_error_naming_it(gcs):
  """The listing of a glob's prefix refused by the store: the fleet said
  `OSError: Forbidden: b/<bucket>/o`, naming neither the glob nor the
  path. It is a usage error naming both (as a local top directory that
  cannot be listed is); a run named with --sources there is an error."""
  from conftest import golden_case  # pylint: disable=g-import-not-at-top
  url = gcs.upload(golden_case("single_host"), "runs/a/checkpoints")
  bucket = url.split("/")[2]
  with _RefusingProxy(gcs, lambda p: p.startswith("runs")) as proxy:
    glob_run = _bucket_fleet(
        gcs, proxy, f"--source-glob=gs://{bucket}/runs/*/checkpoints")
    named = _bucket_fleet(gcs, proxy, f"--sources={url}",
                          f"--source-root=gs://{bucket}/runs")
  assert proxy.refused, "the listing was not refused"
  assert glob_run.returncode == 2, glob_run
  assert glob_run.stderr.splitlines() == [
      f"migrate_runs.py: error: --source-glob 'gs://{bucket}/runs/*/"
      f"checkpoints': gs://{bucket}/runs: cannot list: OSError: Forbidden: "
      f"b/{bucket}/o denied (runs below it that gs://{bucket}/runs/*/"
      "checkpoints would match cannot be seen)"]
  assert named.returncode == 1, named
  assert (f"cannot migrate {url}: cannot list gs://{bucket}/runs/a: "
          "OSError: Forbidden") in named.stdout, named.stdout


def test_a_prefix_whose_listing_fails_leaves_no_run_out(s3):
  """S3 (s3fs) walked a glob's prefixes one listing each, and fsspec's walk
  passes over a listing that fails: with `runs/p1/` refused (a policy
  denying that prefix), run p1 was left out, the dry run said 1 run and
  exit 0. One flat listing of the glob's prefix finds both."""
  from conftest import golden_case  # pylint: disable=g-import-not-at-top
  url = s3.upload(golden_case("single_host"), "runs/a/checkpoints")
  bucket = url.split("/")[2]
  s3.upload(golden_case("single_host"), "runs/p1/checkpoints", bucket=bucket)
  with _RefusingProxy(s3, lambda p: p.startswith("runs/p1")) as proxy:
    result = _bucket_fleet(
        s3, proxy, f"--source-glob=s3://{bucket}/runs/*/checkpoints")
  assert result.returncode == 0, result
  assert [l.split(" -> ")[0] for l in result.stdout.splitlines()
          if l.startswith("would migrate")] == [
              f"would migrate s3://{bucket}/runs/{run}/checkpoints"
              for run in ("a", "p1")]


def test_a_sources_file_line_not_utf8_is_an_error_of_its_own(tmp_path):
  """One line of a sources file in another encoding stopped the whole
  fleet ("not UTF-8 text", exit 2). That line is now a run of its own, an
  error naming it escaped (a name Orbax cannot write, or not there); the
  other lines go on."""
  clu_dir(tmp_path, "runs/a/checkpoints")
  clu_dir(tmp_path, os.fsdecode(b"runs/caf\xe9/checkpoints"))
  (tmp_path / "list.txt").write_bytes(
      b"\xef\xbb\xbfruns/a/checkpoints\nruns/caf\xe9/checkpoints\n"
      b"runs/gone\xff  # a comment\n")
  run = _strict_script("--sources-file=list.txt", "--source-root=runs",
                       "--destination-root=orbax", "--dry-run", cwd=tmp_path)
  assert run.returncode == 1 and not run.stderr, run.stderr
  lines = run.stdout.splitlines()
  assert lines[:3] == [
      "would migrate runs/a/checkpoints -> orbax/a/checkpoints (Checkpoint, "
      "0 B)",
      "cannot migrate runs/caf\\xe9/checkpoints: its destination "
      "orbax/caf\\xe9/checkpoints is not valid UTF-8 (the source's name holds "
      "bytes that are not): Orbax's TensorStore writes UTF-8 names only; "
      "rename the source and migrate it again",
      "cannot migrate runs/gone\\xff: no such directory, and no "
      "gone\\xff-<host_id> directories beside it"], lines
