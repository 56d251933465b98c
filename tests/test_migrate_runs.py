"""Tests of migration/migrate_runs.py: the plan, destinations, workers, stops.

The pure parts (what a directory is, the plan of a glob, destinations and
the recorded source root, shards, progress lines, merging reports, the
command line's options) are tested in-process on the script imported from
its path, on directory trees of empty files named as CLU names them (the
plan reads names only). The command line runs in real processes: usage
errors (fast: no worker starts), a fleet of runs written by the real
`clu.checkpoint` with a worker killed mid-run, and stops by SIGINT to the
process group and SIGTERM to the fleet process alone.
"""

import importlib.util
import io
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "migration" / "migrate_runs.py"
_NAME = "migrate_runs_under_test"


@pytest.fixture(scope="module", name="mr")
def fixture_mr():
  """The script as a module."""
  if _NAME not in sys.modules:
    spec = importlib.util.spec_from_file_location(_NAME, SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module  # before: its dataclasses look it up
    spec.loader.exec_module(module)
  return sys.modules[_NAME]


def _environment():
  """os.environ without JOB_COMPLETION_INDEX (it would pick a shard)."""
  return {k: v for k, v in os.environ.items() if k != "JOB_COMPLETION_INDEX"}


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


def _touch(root, *names):
  """Empty files (and their directories) under `root`."""
  for name in names:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")


def _clu_dir(root, name):
  """A directory CLU's `Checkpoint` would leave (names only)."""
  _touch(root, f"{name}/checkpoint", f"{name}/ckpt-1.flax",
         f"{name}/ckpt-1.index")


# --------------------------------------------------------------------------
# What a directory is.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("entries, kind", [
    (None, "not_directory"),
    ({}, "empty"),
    ({"notes.txt": 3, "sub": -1}, "other"),
    ({"checkpoint": 80, "ckpt-1.index": 10}, "clu"),
    ({"ckpt-3.flax": 100}, "clu"),  # a .flax alone: CLU's, whatever else
    ({"checkpoint_100": 100, "checkpoint_200": 100}, "flax_training"),
    ({"checkpoint_100": -1}, "other"),  # a directory: Orbax's, not msgpack
])
def test_classify(mr, entries, kind):
  assert mr.classify(entries) == kind


# --------------------------------------------------------------------------
# The plan: every match a run or skipped with its reason.
# --------------------------------------------------------------------------


@pytest.fixture(name="tree")
def fixture_tree(tmp_path, monkeypatch):
  """runs/{a,b}: CLU dirs; runs/m: a multihost base (hosts only); runs/e:
  empty; runs/o: other files; runs/f: Flax's checkpoints layout."""
  for run in ("a", "b"):
    _clu_dir(tmp_path, f"runs/{run}/checkpoints")
  for host in (0, 1):
    _clu_dir(tmp_path, f"runs/m/checkpoints-{host}")
  (tmp_path / "runs/e/checkpoints").mkdir(parents=True)
  _touch(tmp_path, "runs/o/checkpoints/notes.txt",
         "runs/f/checkpoints/checkpoint_100")
  monkeypatch.chdir(tmp_path)
  return tmp_path


def _summary(plan):
  return ([(r.source, r.kind, [Path(h).name for h in r.hosts], r.error)
           for r in plan.runs],
          [(s.path, s.reason) for s in plan.skipped])


_HOSTS = ["checkpoints-0", "checkpoints-1"]


def test_a_glob_naming_bases_covers_their_hosts_and_lists_the_rest(mr, tree):
  del tree
  runs, skipped = _summary(mr.plan_fleet([], ["runs/*/checkpoints"]))
  assert runs == [
      ("runs/a/checkpoints", "Checkpoint", [], None),
      ("runs/b/checkpoints", "Checkpoint", [], None),
      ("runs/f/checkpoints", "flax_training", [], None),
      ("runs/m/checkpoints", "MultihostCheckpoint", _HOSTS, None)]
  assert skipped == [
      ("runs/e/checkpoints", "empty directory"),
      ("runs/o/checkpoints", "not a checkpoint directory (no `checkpoint` "
       "file, no <name>-<N>.flax)")]


@pytest.mark.parametrize("pattern", ["runs/m/checkpoints-*",
                                     "runs/*/checkpoints-[0-9]",
                                     "runs/m/checkpoints-1"])
def test_a_glob_matching_host_directories_covers_their_base(mr, tree,
                                                            pattern):
  del tree
  runs, skipped = _summary(mr.plan_fleet([], [pattern]))
  assert runs == [("runs/m/checkpoints", "MultihostCheckpoint", _HOSTS,
                   None)]
  # Each host directory the glob matched is listed, with its base.
  matched = [h for h in _HOSTS if re.fullmatch(
      pattern.split("/")[-1].replace("*", ".*").replace("[0-9]", "[0-9]"),
      h)]
  assert skipped == [(f"runs/m/{h}", "host directory of runs/m/checkpoints")
                     for h in matched]


def test_numbered_runs_without_host_0_are_separate_runs(mr, tmp_path,
                                                        monkeypatch):
  _clu_dir(tmp_path, "runs/exp-1")
  _clu_dir(tmp_path, "runs/exp-2")
  monkeypatch.chdir(tmp_path)
  runs, skipped = _summary(mr.plan_fleet([], ["runs/*"]))
  assert [r[:2] for r in runs] == [("runs/exp-1", "Checkpoint"),
                                   ("runs/exp-2", "Checkpoint")]
  assert not skipped


def test_a_named_base_is_a_multihost_run(mr, tree):
  del tree
  runs, _ = _summary(mr.plan_fleet(["runs/m/checkpoints"], []))
  assert runs == [("runs/m/checkpoints", "MultihostCheckpoint", _HOSTS,
                   None)]


def test_a_named_path_that_is_not_a_run_is_an_error_not_a_skip(mr, tree):
  del tree
  runs, skipped = _summary(mr.plan_fleet(
      ["runs/e/checkpoints", "runs/missing"], []))
  assert runs == [
      ("runs/e/checkpoints", "empty", [], "empty directory"),
      ("runs/missing", "Checkpoint", [], "no such directory, and no "
       "missing-<host_id> directories beside it")]
  assert not skipped


def test_a_glob_matching_nothing_is_named(mr, tree):
  del tree
  with pytest.raises(mr.UsageError,
                     match=re.escape("--source-glob 'runs/*/nope' matched "
                                     "nothing")):
    mr.plan_fleet([], ["runs/*/checkpoints", "runs/*/nope"])


def test_a_path_matched_twice_is_one_run(mr, tree):
  del tree
  plan = mr.plan_fleet(["runs/a/checkpoints"],
                       ["runs/*/checkpoints", "runs/a/*"])
  assert [r.source for r in plan.runs].count("runs/a/checkpoints") == 1
  assert len({s.path for s in plan.skipped}) == len(plan.skipped)


def test_classify_decides_for_the_plan(mr, tree):
  """Flax's `checkpoint_<step>` files are a run of their own kind."""
  del tree
  runs, _ = _summary(mr.plan_fleet([], ["runs/f/*"]))
  assert runs == [("runs/f/checkpoints", "flax_training", [], None)]


def test_one_bucket_listing_per_glob(mr, gcs, monkeypatch):
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  bucket = gcs.bucket()
  fs = gcs.fs()
  for name in ["runs/a/checkpoints/checkpoint", "runs/a/checkpoints/ckpt-1.flax",
               "runs/m/checkpoints-0/checkpoint",
               "runs/m/checkpoints-1/checkpoint",
               "runs/o/checkpoints/notes.txt"]:
    fs.pipe_file(f"{bucket}/{name}", b"x")
  backend = storage.filesystem(f"gs://{bucket}")
  calls = []
  real = backend.fs
  for method in ("find", "ls", "glob", "info", "exists", "isdir"):
    # monkeypatch puts back what was there: gcsfs's own per-instance
    # methods (removing them would leave fsspec's NotImplementedError ones).
    original = getattr(real, method)

    def counted(*a, _name=method, _original=original, **k):
      calls.append(_name)
      return _original(*a, **k)
    monkeypatch.setattr(real, method, counted)
  plan = mr.plan_fleet([], [f"gs://{bucket}/runs/*/checkpoints"])
  monkeypatch.undo()
  assert calls == ["find"]
  base = f"gs://{bucket}/runs"
  assert [(r.source, r.kind, r.hosts) for r in plan.runs] == [
      (f"{base}/a/checkpoints", "Checkpoint", []),
      (f"{base}/m/checkpoints", "MultihostCheckpoint",
       [f"{base}/m/checkpoints-0", f"{base}/m/checkpoints-1"])]
  assert [(s.path, s.reason.split(" (")[0]) for s in plan.skipped] == [
      (f"{base}/o/checkpoints", "not a checkpoint directory")]


# --------------------------------------------------------------------------
# Destinations.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("pattern, prefix", [
    ("/runs/*/checkpoints", "/runs"),
    ("runs/exp?/ckpt", "runs"),
    ("/runs/a/checkpoints", "/runs/a"),  # no wildcard: its parent
    ("gs://b/x/run-*/ckpt", "gs://b/x"),
    ("gs://b/*/ckpt", "gs://b"),
])
def test_glob_prefix(mr, pattern, prefix):
  assert mr.glob_prefix(pattern) == prefix


def _destinations(mr, sources, root, destination_root="/orbax"):
  runs = [mr.Run(s, "Checkpoint") for s in sources]
  mr.assign_destinations(runs, root, destination_root)
  return {r.source: r.destination for r in runs}


def test_a_destination_depends_on_the_run_alone(mr):
  fleet = _destinations(mr, ["/runs/a/checkpoints", "/runs/b/checkpoints",
                             "/runs/c/checkpoints"], "/runs")
  retry = _destinations(mr, ["/runs/c/checkpoints"], "/runs")
  assert fleet["/runs/c/checkpoints"] == retry["/runs/c/checkpoints"] == (
      "/orbax/c/checkpoints")


def test_the_source_root_explicit_recorded_or_from_the_globs(mr):
  glob = ["/runs/*/checkpoints"]
  assert mr.choose_source_root(None, None, glob) == "/runs"
  assert mr.choose_source_root(None, None, glob + ["/more/*/c"]) == "/"
  assert mr.choose_source_root(None, None, glob, ["/runs/x/c"]) == "/runs"
  # A retry naming one run finds the fleet's root recorded.
  assert mr.choose_source_root(None, "/runs", []) == "/runs"
  assert mr.choose_source_root(None, "/runs", ["/runs/c/*"]) == "/runs"
  assert mr.choose_source_root("/runs/", "/runs", []) == "/runs"
  with pytest.raises(mr.UsageError, match="mirrors /runs"):
    mr.choose_source_root("/elsewhere", "/runs", [])
  with pytest.raises(mr.UsageError, match="needs --source-root"):
    mr.choose_source_root(None, None, [])


@pytest.mark.parametrize("sources, message", [
    (["/runs/a", "/runs//a"], "would both migrate into /orbax/a"),
    (["/runs/a", "/runs/a/inner"], "is inside that of /runs/a"),
    (["/other/a"], "not inside the source root /runs"),
    (["/runs"], "not inside the source root /runs"),
])
def test_clashing_destinations_are_refused(mr, sources, message):
  with pytest.raises(mr.UsageError, match=re.escape(message)):
    _destinations(mr, sources, "/runs")


def test_a_destination_root_inside_a_source_is_refused(mr):
  with pytest.raises(mr.UsageError, match="inside the source /runs/a"):
    _destinations(mr, ["/runs/a"], "/runs", "/runs/a/orbax")


def test_the_root_is_recorded_once_and_guards_the_destination(mr, tmp_path):
  destination = str(tmp_path / "orbax")
  assert mr.read_recorded_root(destination) is None
  mr.record_root(destination, "/runs")
  mr.record_root(destination, "/runs")  # a second shard: the same root
  assert mr.read_recorded_root(destination) == "/runs"
  with pytest.raises(mr.UsageError, match="mirrors source root /runs"):
    mr.record_root(destination, "/elsewhere")
  assert mr.read_recorded_root(destination) == "/runs"


def test_a_retry_writes_into_the_fleets_root(tmp_path):
  """The command line: a fleet's dry run, then a retry of one run."""
  for run in ("a", "b", "c"):
    _clu_dir(tmp_path, f"runs/{run}/checkpoints")
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


def test_help_and_version_exit_0(tmp_path, mr):
  helped = _script("--help", cwd=tmp_path)
  assert helped.returncode == 0, helped.stderr
  assert "--source-root" in helped.stdout
  assert "--allow-other-sources" in helped.stdout
  version = _script("--version", cwd=tmp_path)
  assert version.returncode == 0
  assert version.stdout.strip() == f"migrate_runs.py (clu-ckpt {mr._version()})"  # pylint: disable=protected-access


def test_every_migrate_option_is_accepted(mr):
  """From `clu-ckpt migrate`'s own parser: a new option appears here too."""
  parser, dests = mr.build_parser()
  theirs = {o for a in mr.migrate_parser()._actions  # pylint: disable=protected-access
            for o in a.option_strings if a.dest not in mr._NOT_PASSED}  # pylint: disable=protected-access
  ours = {o for a in parser._actions for o in a.option_strings}  # pylint: disable=protected-access
  assert theirs <= ours
  assert {"allow_other_sources", "state_host", "step_prefix",
          "step_format_fixed_length", "numbers", "template"} <= set(dests)
  args = parser.parse_args(mr.normalize_argv([
      "--sources=x", "--number=3", "--number", "5", "--state_host=1",
      "--step-prefix=ckpt", "--step_format_fixed_length=8",
      "--allow-other-sources", "--max-inflight-mib=0", "--compression=none",
      "--verify", "--step-naming=number"]))
  kwargs = mr.migrate_kwargs(mr.migrate_options(args, dests))
  assert kwargs == {
      "checkpoints": [3, 5], "state_host": 1, "step_prefix": "ckpt",
      "step_format_fixed_length": 8, "allow_other_sources": True,
      "inflight_bytes": 2**20, "compression": "none", "verify": True,
      "step_naming": "number"}
  latest = parser.parse_args(["--checkpoints=latest"])
  assert mr.migrate_kwargs(mr.migrate_options(latest, dests))[
      "checkpoints"] == "latest"


def test_an_option_the_fleet_cannot_pass_is_refused(mr):
  with pytest.raises(mr.UsageError, match="--new-flag is not supported"):
    mr.migrate_kwargs({"new_flag": True})
  assert mr.migrate_kwargs({"new_flag": None})["checkpoints"] == "all"


def test_normalize_argv(mr):
  assert mr.normalize_argv(["--destination_root=a_b", "--num_shards", "2",
                            "x_y", "--", "--a_b"]) == [
                                "--destination-root=a_b", "--num-shards",
                                "2", "x_y", "--", "--a_b"]


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


def test_report_directory_is_made_before_any_work(mr, tmp_path):
  path = tmp_path / "new" / "dir" / "report.json"
  mr.prepare_report(str(path))
  assert path.parent.is_dir() and not path.exists()
  (tmp_path / "file").write_text("")
  with pytest.raises(mr.UsageError, match="cannot make"):
    mr.prepare_report(str(tmp_path / "file" / "report.json"))


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


def test_progress_shows_runs_bytes_failures_and_eta(mr):
  out, clock = io.StringIO(), _Clock()
  progress = mr.ProgressPrinter(3, out, clock, total_bytes=4 * 2**30)
  clock.now += 60
  progress.run_done(_entry("/runs/a", steps=[("migrated", 2**30)] * 4),
                    2**30)
  clock.now += 60
  progress.run_done(_entry("/runs/b", "failed", 5,
                           [("skipped", 10), ("migrated", 1500)],
                           error="ckpt-3: truncated"), 2**30)
  clock.now += 60
  progress.run_done({"source": "/runs/c", "status": "error", "seconds": 2,
                     "error": "worker process died"}, 2 * 2**30)
  progress.close()
  assert out.getvalue().splitlines() == [
      "[1/3] /runs/a ok (4 steps, 4.0 GiB, 35 s); 1.0 GiB of 4.0 GiB, "
      "0 failures, ETA 3 min",
      "[2/3] /runs/b failed (2 steps, 1 skipped, 1.5 KiB, 5 s): ckpt-3: "
      "truncated; 2.0 GiB of 4.0 GiB, 1 failure, ETA 2 min",
      "[3/3] /runs/c error (2 s): worker process died; 4.0 GiB of 4.0 GiB, "
      "2 failures, all done in 3 min",
  ]


def test_progress_without_sizes_counts_runs(mr):
  out, clock = io.StringIO(), _Clock()
  progress = mr.ProgressPrinter(4, out, clock)
  clock.now += 30
  progress.run_done(_entry("/runs/a"))
  assert out.getvalue() == ("[1/4] /runs/a ok (1 step, 1.0 GiB, 35 s); "
                            "0 failures, ETA 2 min\n")


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


def test_merge_accepts_partial_reports(mr):
  """A killed shard's report: finished runs count, unfinished ones show."""
  finished = _report("/o", 0, 1, ["/r/a"], "2024-01-01T00:00:00",
                     fleet_size=2)
  partial = dict(_report("/o", 0, 1, ["/r/a"], "2024-01-02T00:00:00",
                         status="pending", fleet_size=2), complete=False)
  partial["runs"].append({"source": "/r/b", "status": "interrupted"})
  partial["skipped"] = [{"path": "/r/e", "reason": "empty directory"}]
  merged = mr.merge_reports([("old.json", finished),
                             ("partial.json", partial)])
  assert [(r["source"], r["status"]) for r in merged["runs"]] == [
      ("/r/a", "ok"), ("/r/b", "interrupted")]
  assert merged["counts"] == {"ok": 1, "failed": 0, "error": 0,
                              "interrupted": 1}
  assert not merged["complete"] and not merged["ok"]
  assert merged["skipped"] == partial["skipped"]


def test_merge_refuses_different_destination_roots(mr):
  with pytest.raises(mr.UsageError, match="different fleets.*r1.json"):
    mr.merge_reports([
        ("r0.json", _report("/orbax", 0, 2, ["/r/a"], "t")),
        ("r1.json", _report("/elsewhere", 1, 2, ["/r/b"], "t")),
    ])


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
  `flax.training.checkpoints` files; runs/e/checkpoints empty. Migrated at
  --parallelism=1 with a template killing the first run's worker, the
  report in a directory that does not exist yet.

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
  (root / "killer.py").write_text(_KILLER)
  (root / "kill-once").write_text("")
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
                      "runs/f/checkpoints": "ok",
                      "runs/m/checkpoints": "ok"}, report
  error = report["runs"][0]["error"]
  assert error.startswith("worker process died (killed by SIGKILL (out of "
                          "memory?)) while migrating this run"), error
  assert not (root / "orbax" / "a" / "checkpoints" / "10").exists()
  assert report["complete"] and report["counts"]["error"] == 1
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
  assert re.fullmatch(r"migrating 5 run\(s\) \(\d+\.\d KiB\) into orbax, 1 "
                      r"at a time; 1 path\(s\) skipped", lines[1]), lines[1]
  progress = [l for l in lines if l.startswith("[")]
  assert len(progress) == 5, run.stdout
  assert re.fullmatch(r"\[5/5\] runs/m/checkpoints ok \(1 step, \d+ B, \d+ "
                      r"(s|min)\); [\d.]+ KiB of [\d.]+ KiB, 1 failure, all "
                      r"done in \d+ (s|min)", progress[-1]), progress[-1]
  assert lines[-1] == ("4 ok, 0 failed, 1 error; report: "
                       "reports/new/report.json")


@pytest.mark.thorough
def test_a_rerun_finishes_the_fleet(clu_fleet):
  root, _, _ = clu_fleet
  run = _script("--source-glob=runs/*/checkpoints", "--destination-root=orbax",
                "--report=rerun.json", "--step-naming=state", cwd=root)
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.loads((root / "rerun.json").read_text())
  assert report["counts"] == {"ok": 5, "failed": 0, "error": 0}
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
  """Pids of this script's workers running in `directory`."""
  found = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
      cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
      continue
    if str(SCRIPT).encode() in args and b"--worker" in args and (
        cwd == str(directory)):
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
])
def test_a_stop_starts_no_new_run_and_writes_the_report(tmp_path, stop):
  process = _stoppable_fleet(tmp_path)
  _wait_for_runs(tmp_path, process, 2)
  assert len(_workers_in(tmp_path)) == 2
  start = time.monotonic()
  if stop == "ctrl-c":  # a terminal signals the whole process group
    os.killpg(process.pid, signal.SIGINT)
  else:  # Kubernetes signals the container's main process
    process.send_signal(signal.SIGTERM)
  run = _finish(process, timeout=60)
  _assert_stopped(tmp_path, run, 130 if stop == "ctrl-c" else 143,
                  time.monotonic() - start)
  # No worker is left behind.
  time.sleep(0.5)
  assert not _workers_in(tmp_path)


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
