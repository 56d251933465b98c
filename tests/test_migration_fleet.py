"""Tests of the fleet migration's modules, in-process.

`clu_ckpt.migration.fleet_discovery` (what a directory is, the plan of a
glob), `fleet_assignment` (destinations, the recorded source root,
shards), `fleet_report` (progress lines, reports and their merging),
`fleet_workers.migrate_kwargs` and the command line's options of
`clu_ckpt.migration.fleet`. Directory trees are of empty files named as
CLU names them (the plan reads names only). The command line in real
processes (usage errors, real fleets, worker crashes, signals) is tested in
tests/test_migrate_runs.py.
"""

import argparse
import os
import io
import glob
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fleet_helpers import clu_dir
from fleet_helpers import make_tree
from clu_ckpt import cli
from clu_ckpt import errors
from clu_ckpt.migration import fleet
from clu_ckpt.migration import fleet_assignment
from clu_ckpt.migration import fleet_discovery
from clu_ckpt.migration import fleet_report
from clu_ckpt.migration import fleet_workers


@pytest.fixture(name="tree")
def fixture_tree(tmp_path, monkeypatch):
  """`fleet_helpers.make_tree` in `tmp_path`, the current directory."""
  make_tree(tmp_path)
  monkeypatch.chdir(tmp_path)
  return tmp_path


def _migrate_subparser() -> argparse.ArgumentParser:
  """`clu-ckpt migrate`'s parser, from the `clu-ckpt` command's."""
  # pylint: disable=protected-access
  for action in cli.build_parser()._actions:
    if isinstance(action, argparse._SubParsersAction):
      return action.choices["migrate"]
  raise AssertionError("clu-ckpt has no migrate command")


# --------------------------------------------------------------------------
# What a directory is (fleet_discovery.classify).
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
def test_classify(entries, kind):
  assert fleet_discovery.classify(entries) == kind


# --------------------------------------------------------------------------
# The plan: every match a run or skipped with its reason (fleet_discovery).
# --------------------------------------------------------------------------


def _summary(plan):
  return ([(r.source, r.kind, [Path(h).name for h in r.hosts], r.error)
           for r in plan.runs],
          [(s.path, s.reason) for s in plan.skipped])


_HOSTS = ["checkpoints-0", "checkpoints-1"]


def test_a_glob_naming_bases_covers_their_hosts_and_lists_the_rest(tree):
  del tree
  runs, skipped = _summary(
      fleet_discovery.plan_fleet([], ["runs/*/checkpoints"]))
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
def test_a_glob_matching_host_directories_covers_their_base(tree,
                                                            pattern):
  del tree
  runs, skipped = _summary(fleet_discovery.plan_fleet([], [pattern]))
  assert runs == [("runs/m/checkpoints", "MultihostCheckpoint", _HOSTS,
                   None)]
  # Each host directory the glob matched is listed, with its base.
  matched = [h for h in _HOSTS if re.fullmatch(
      pattern.split("/")[-1].replace("*", ".*").replace("[0-9]", "[0-9]"),
      h)]
  assert skipped == [(f"runs/m/{h}", "host directory of runs/m/checkpoints")
                     for h in matched]


def test_numbered_runs_without_host_0_are_separate_runs(tmp_path,
                                                        monkeypatch):
  clu_dir(tmp_path, "runs/exp-1")
  clu_dir(tmp_path, "runs/exp-2")
  monkeypatch.chdir(tmp_path)
  runs, skipped = _summary(fleet_discovery.plan_fleet([], ["runs/*"]))
  assert [r[:2] for r in runs] == [("runs/exp-1", "Checkpoint"),
                                   ("runs/exp-2", "Checkpoint")]
  assert not skipped


def test_a_named_base_is_a_multihost_run(tree):
  del tree
  runs, _ = _summary(fleet_discovery.plan_fleet(["runs/m/checkpoints"], []))
  assert runs == [("runs/m/checkpoints", "MultihostCheckpoint", _HOSTS,
                   None)]


def test_a_named_path_that_is_not_a_run_is_an_error_not_a_skip(tree):
  del tree
  runs, skipped = _summary(fleet_discovery.plan_fleet(
      ["runs/e/checkpoints", "runs/missing"], []))
  assert runs == [
      ("runs/e/checkpoints", "empty", [], "empty directory"),
      ("runs/missing", "Checkpoint", [], "no such directory, and no "
       "missing-<host_id> directories beside it")]
  assert not skipped


def test_a_glob_matching_nothing_is_named(tree):
  del tree
  with pytest.raises(errors.UsageError,
                     match=re.escape("--source-glob 'runs/*/nope' matched "
                                     "nothing")):
    fleet_discovery.plan_fleet([], ["runs/*/checkpoints", "runs/*/nope"])


def test_a_path_matched_twice_is_one_run(tree):
  del tree
  plan = fleet_discovery.plan_fleet(["runs/a/checkpoints"],
                                    ["runs/*/checkpoints", "runs/a/*"])
  assert [r.source for r in plan.runs].count("runs/a/checkpoints") == 1
  assert len({s.path for s in plan.skipped}) == len(plan.skipped)


# An operator's fleet, attacked for runs left out silently: every path a
# glob matches ends as a run (possibly an error, which fails the exit
# status) or as skipped with a reason that really means "not a run".


def test_the_same_run_named_twice_is_one_run(tree):
  """Relative and absolute spellings, a trailing slash, `./`: one run."""
  absolute = str(tree / "runs" / "a" / "checkpoints") + "/"
  plan = fleet_discovery.plan_fleet(
      ["runs/a/checkpoints/", absolute], ["./runs/*/checkpoints"])
  sources = [r.source for r in plan.runs]
  assert sources.count("runs/a/checkpoints") == 1, sources
  assert absolute.rstrip("/") not in sources
  assert all(r.error is None for r in plan.runs), plan.runs


def test_a_glob_with_a_trailing_slash_finds_the_same_runs(tree):
  del tree
  assert (_summary(fleet_discovery.plan_fleet([], ["runs/*/checkpoints/"]))
          == _summary(fleet_discovery.plan_fleet([], ["runs/*/checkpoints"])))


def test_a_symlinked_run_is_a_run_under_its_own_name(tree):
  clu_dir(tree, "elsewhere/real")
  (tree / "runs" / "l").mkdir()
  (tree / "runs" / "l" / "checkpoints").symlink_to(tree / "elsewhere/real")
  runs, _ = _summary(fleet_discovery.plan_fleet([], ["runs/l/*"]))
  assert runs == [("runs/l/checkpoints", "Checkpoint", [], None)]


def test_a_run_reached_under_two_names_is_one_run(tree):
  """Through a link to a directory of runs, `**` reaches each run twice:
  migrated once, under its name without links; the other name skipped."""
  clu_dir(tree, "runs/team/x/checkpoints")
  (tree / "runs" / "alias").symlink_to(tree / "runs" / "team")
  runs, skipped = _summary(fleet_discovery.plan_fleet(
      [], ["runs/**/checkpoints"]))
  assert [r[0] for r in runs].count("runs/team/x/checkpoints") == 1
  assert "runs/alias/x/checkpoints" not in [r[0] for r in runs]
  assert ("runs/alias/x/checkpoints", "the same run as "
          "runs/team/x/checkpoints (through a symbolic link)") in skipped
  # Named only through the link, it is a run under that name.
  runs, _ = _summary(fleet_discovery.plan_fleet(
      ["runs/alias/x/checkpoints"], []))
  assert [r[0] for r in runs] == ["runs/alias/x/checkpoints"]


def test_a_dangling_symlink_is_an_error_not_a_skip(tree):
  """A run behind a link to an unmounted disk is not "not a directory"."""
  (tree / "runs" / "d").mkdir()
  (tree / "runs" / "d" / "checkpoints").symlink_to("/nonexistent/mount")
  plan = fleet_discovery.plan_fleet([], ["runs/*/checkpoints"])
  dangling = [r for r in plan.runs if r.source == "runs/d/checkpoints"]
  assert [r.error for r in dangling] == [
      "cannot list: a broken symbolic link to /nonexistent/mount"]
  assert "runs/d/checkpoints" not in {s.path for s in plan.skipped}


def test_an_unlistable_path_is_an_error_of_its_own(tree):
  """A symbolic link loop (as a directory without permission): its own
  error; the other runs are planned."""
  (tree / "runs" / "x").mkdir()
  (tree / "runs" / "x" / "checkpoints").symlink_to("checkpoints")
  plan = fleet_discovery.plan_fleet([], ["runs/*/checkpoints"])
  errors_ = {r.source: r.error for r in plan.runs if r.error}
  assert errors_ == {
      "runs/x/checkpoints": "cannot list: Too many levels of symbolic links"}
  assert len(plan.runs) == 5


def test_host_directories_with_a_gap_are_an_error(tree):
  """`<base>-0` and `<base>-2` without `<base>-1`: a host's checkpoints are
  missing (or misnamed); migrating the others alone would drop them."""
  clu_dir(tree, "runs/g/checkpoints-0")
  clu_dir(tree, "runs/g/checkpoints-2")
  plan = fleet_discovery.plan_fleet([], ["runs/g/checkpoints"])
  assert [(r.source, r.kind, r.error) for r in plan.runs] == [
      ("runs/g/checkpoints", "MultihostCheckpoint",
       "host directory runs/g/checkpoints-1 missing (found hosts 0, 2): "
       "restore it, or migrate the hosts found with clu-ckpt migrate")]


def test_a_recursive_glob_finds_runs_at_every_depth(tree):
  """`**` (as in a shell with globstar) matched one level only: the runs
  deeper down were left out without a word."""
  clu_dir(tree, "runs/team/x/checkpoints")
  for host in (0, 1):
    clu_dir(tree, f"runs/team/y/deep/checkpoints-{host}")
  runs, _ = _summary(fleet_discovery.plan_fleet([], ["runs/**/checkpoints"]))
  assert [r[:2] for r in runs] == [
      ("runs/a/checkpoints", "Checkpoint"),
      ("runs/b/checkpoints", "Checkpoint"),
      ("runs/f/checkpoints", "flax_training"),
      ("runs/m/checkpoints", "MultihostCheckpoint"),
      ("runs/team/x/checkpoints", "Checkpoint"),
      ("runs/team/y/deep/checkpoints", "MultihostCheckpoint")]


@pytest.mark.parametrize("pattern", ["runs/*/checkpoints",
                                     "runs/**/checkpoints", "runs/?h*/*"])
def test_a_run_in_a_hidden_directory_is_found(tree, pattern):
  """A wildcard matches names beginning with "." locally as it does in a
  bucket: a shell's glob (and `glob.glob`) would leave such a run out
  unseen, neither migrated nor listed as skipped."""
  clu_dir(tree, "runs/.hidden/checkpoints")
  (tree / "runs" / ".cache").mkdir()
  runs, skipped = _summary(fleet_discovery.plan_fleet([], [pattern]))
  assert ("runs/.hidden/checkpoints", "Checkpoint", [], None) in runs
  assert "runs/.cache" not in [path for path, _ in skipped]


def test_local_glob_is_glob_with_hidden_names(tree):
  clu_dir(tree, "runs/team/x/checkpoints")
  (tree / "runs" / "link").symlink_to(tree / "runs" / "team")
  for pattern in ["runs/*/checkpoints", "runs/**/checkpoints", "runs/**",
                  "runs/[ab]/*", "runs/m/checkpoints-[0-9]*", "runs",
                  "runs/nothing/*", "*/a", str(tree / "runs" / "*")]:
    expected = sorted(p.rstrip("/") for p in glob.glob(pattern,
                                                       recursive=True))
    assert fleet_discovery.local_glob(pattern) == expected, pattern
  # A link back up (a loop) is listed, not followed around.
  (tree / "runs" / "team" / "up").symlink_to(tree / "runs")
  found = fleet_discovery.local_glob("runs/**/checkpoints")
  assert "runs/team/up/a/checkpoints" not in found
  assert "runs/link/x/checkpoints" in found


def test_a_padded_number_is_not_a_host(tmp_path, monkeypatch):
  """`checkpoints-00` beside `checkpoints-0`: both read as host 0, one
  replaced the other (the wrong one migrated as host 0, the other never
  mentioned). CLU never pads a host number: `-00` is not a host."""
  for name in ("checkpoints-0", "checkpoints-1", "checkpoints-00"):
    clu_dir(tmp_path, f"runs/z/{name}")
  monkeypatch.chdir(tmp_path)
  runs, _ = _summary(fleet_discovery.plan_fleet([], ["runs/z/checkpoints"]))
  assert runs == [("runs/z/checkpoints", "MultihostCheckpoint", _HOSTS,
                   None)]
  runs, _ = _summary(fleet_discovery.plan_fleet([],
                                                ["runs/z/checkpoints-*"]))
  assert runs == [
      ("runs/z/checkpoints", "MultihostCheckpoint", _HOSTS, None),
      ("runs/z/checkpoints-00", "Checkpoint", [], None)]


def test_links_between_siblings_are_not_walked_around(tmp_path,
                                                      monkeypatch):
  """`a/l -> ../b` and `b/l -> ../a`: `**` went `a/l/l/l/...` some 40
  levels deep (until the system refused), listing 40 names of one run,
  the last of them "cannot list"; a link to a directory it was reached
  through is a loop, listed, not entered."""
  clu_dir(tmp_path, "runs/a/checkpoints")
  (tmp_path / "runs/b").mkdir()
  (tmp_path / "runs/a/l").symlink_to("../b")
  (tmp_path / "runs/b/l").symlink_to("../a")
  monkeypatch.chdir(tmp_path)
  unsearched = {}
  assert fleet_discovery.local_glob("runs/**/checkpoints", unsearched) == [
      "runs/a/checkpoints", "runs/a/l/l/checkpoints", "runs/b/l/checkpoints"]
  assert not unsearched
  plan = fleet_discovery.plan_fleet([], ["runs/**/checkpoints"])
  assert [(r.source, r.error) for r in plan.runs] == [
      ("runs/a/checkpoints", None)]


def test_a_host_like_directory_beside_a_run_is_a_run(tree):
  """`runs/a/checkpoints` is a run and `runs/a/checkpoints-0` another: a
  glob matching only the latter made it a host of the former, so the former
  (not matched) would have been migrated and the latter left out."""
  clu_dir(tree, "runs/a/checkpoints-0")
  runs, skipped = _summary(
      fleet_discovery.plan_fleet([], ["runs/a/checkpoints-*"]))
  assert runs == [("runs/a/checkpoints-0", "Checkpoint", [], None)]
  assert not skipped


def test_a_name_with_spaces_and_glob_characters(tree):
  clu_dir(tree, "runs/my run [1]/checkpoints")
  named = fleet_discovery.plan_fleet(["runs/my run [1]/checkpoints"], [])
  globbed = fleet_discovery.plan_fleet([], ["runs/my run*/checkpoints"])
  assert ([(r.source, r.error) for r in named.runs] ==
          [(r.source, r.error) for r in globbed.runs] ==
          [("runs/my run [1]/checkpoints", None)])


def test_a_sources_file_keeps_a_hash_inside_a_path(tmp_path):
  listing = tmp_path / "sources.txt"
  listing.write_bytes("\ufeffruns/exp#3/checkpoints\r\n"  # an editor's BOM
                      "# a comment line\n"
                      "  runs/b/checkpoints   # a comment after a path\n"
                      "\n".encode("utf-8"))
  assert fleet_discovery.read_sources_file(str(listing)) == [
      "runs/exp#3/checkpoints", "runs/b/checkpoints"]



def test_classify_decides_for_the_plan(tree):
  """Flax's `checkpoint_<step>` files are a run of their own kind."""
  del tree
  runs, _ = _summary(fleet_discovery.plan_fleet([], ["runs/f/*"]))
  assert runs == [("runs/f/checkpoints", "flax_training", [], None)]


def test_one_bucket_listing_per_glob(gcs, monkeypatch):
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  bucket = gcs.bucket()
  fs = gcs.fs()
  for name in ["runs/a/checkpoints/checkpoint",
               "runs/a/checkpoints/ckpt-1.flax",
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
  plan = fleet_discovery.plan_fleet([], [f"gs://{bucket}/runs/*/checkpoints"])
  monkeypatch.undo()
  assert calls == ["find"]
  base = f"gs://{bucket}/runs"
  assert [(r.source, r.kind, r.hosts) for r in plan.runs] == [
      (f"{base}/a/checkpoints", "Checkpoint", []),
      (f"{base}/m/checkpoints", "MultihostCheckpoint",
       [f"{base}/m/checkpoints-0", f"{base}/m/checkpoints-1"])]
  assert [(s.path, s.reason.split(" (")[0]) for s in plan.skipped] == [
      (f"{base}/o/checkpoints", "not a checkpoint directory")]


def test_a_recursive_glob_in_a_bucket(gcs):
  bucket = gcs.bucket()
  fs = gcs.fs()
  for name in ["runs/a/checkpoints/checkpoint",
               "runs/team/x/checkpoints/ckpt-1.flax",
               "runs/team/y/deep/checkpoints-0/checkpoint",
               "runs/team/y/deep/checkpoints-1/checkpoint"]:
    fs.pipe_file(f"{bucket}/{name}", b"x")
  base = f"gs://{bucket}/runs"
  plan = fleet_discovery.plan_fleet([], [f"{base}/**/checkpoints"])
  assert [(r.source, r.kind) for r in plan.runs] == [
      (f"{base}/a/checkpoints", "Checkpoint"),
      (f"{base}/team/x/checkpoints", "Checkpoint"),
      (f"{base}/team/y/deep/checkpoints", "MultihostCheckpoint")]
  # A host-like directory beside a run (as locally): a run of its own.
  fs.pipe_file(f"{bucket}/runs/a/checkpoints-0/checkpoint", b"x")
  plan = fleet_discovery.plan_fleet([], [f"{base}/a/checkpoints-*"])
  assert [(r.source, r.kind) for r in plan.runs] == [
      (f"{base}/a/checkpoints-0", "Checkpoint")]


# --------------------------------------------------------------------------
# Destinations and the recorded source root (fleet_assignment).
# --------------------------------------------------------------------------


@pytest.mark.parametrize("pattern, prefix", [
    ("/runs/*/checkpoints", "/runs"),
    ("runs/exp?/ckpt", "runs"),
    ("/runs/a/checkpoints", "/runs/a"),  # no wildcard: its parent
    ("gs://b/x/run-*/ckpt", "gs://b/x"),
    ("gs://b/*/ckpt", "gs://b"),
])
def test_glob_prefix(pattern, prefix):
  assert fleet_discovery.glob_prefix(pattern) == prefix


def _destinations(sources, root, destination_root="/orbax"):
  runs = [fleet_discovery.Run(s, "Checkpoint") for s in sources]
  fleet_assignment.assign_destinations(runs, root, destination_root)
  return {r.source: r.destination for r in runs}


def test_a_destination_depends_on_the_run_alone():
  fleet = _destinations(["/runs/a/checkpoints", "/runs/b/checkpoints",
                         "/runs/c/checkpoints"], "/runs")
  retry = _destinations(["/runs/c/checkpoints"], "/runs")
  assert fleet["/runs/c/checkpoints"] == retry["/runs/c/checkpoints"] == (
      "/orbax/c/checkpoints")


def test_the_source_root_explicit_recorded_or_from_the_globs():
  glob = ["/runs/*/checkpoints"]
  assert fleet_assignment.choose_source_root(None, None, glob) == "/runs"
  choose = fleet_assignment.choose_source_root
  assert choose(None, None, glob + ["/more/*/c"]) == "/"
  assert choose(None, None, glob, ["/runs/x/c"]) == "/runs"
  # A retry naming one run finds the fleet's root recorded.
  assert fleet_assignment.choose_source_root(None, "/runs", []) == "/runs"
  assert choose(None, "/runs", ["/runs/c/*"]) == "/runs"
  assert fleet_assignment.choose_source_root("/runs/", "/runs", []) == "/runs"
  with pytest.raises(errors.UsageError, match="mirrors /runs"):
    fleet_assignment.choose_source_root("/elsewhere", "/runs", [])
  with pytest.raises(errors.UsageError, match="needs --source-root"):
    fleet_assignment.choose_source_root(None, None, [])


@pytest.mark.parametrize("sources, message", [
    (["/runs/a", "/runs//a"], "would both migrate into /orbax/a"),
    (["/runs/a", "/runs/a/inner"], "is inside that of /runs/a"),
    (["/other/a"], "not inside the source root /runs"),
    (["/runs"], "not inside the source root /runs"),
])
def test_clashing_destinations_are_refused(sources, message):
  with pytest.raises(errors.UsageError, match=re.escape(message)):
    _destinations(sources, "/runs")


def test_a_destination_root_inside_a_source_is_refused():
  with pytest.raises(errors.UsageError, match="inside the source /runs/a"):
    _destinations(["/runs/a"], "/runs", "/runs/a/orbax")


@pytest.mark.parametrize("link_to", ["runs/a", "runs/a/checkpoints"])
def test_a_destination_root_linked_into_a_source_is_refused(tmp_path,
                                                           link_to):
  """Deleting the sources after the migration would delete its steps."""
  source = tmp_path / "runs" / "a" / "checkpoints"
  source.mkdir(parents=True)
  (tmp_path / "out").symlink_to(tmp_path / link_to)
  destination_root = str(tmp_path / "out" / "orbax")
  runs = {"runs/a": [str(tmp_path / "runs" / "a")],
          "runs/a/checkpoints": [str(source)]}[link_to]
  with pytest.raises(errors.UsageError) as refused:
    _destinations(runs, str(tmp_path / "runs"), destination_root)
  assert str(refused.value) == (
      f"--destination-root={destination_root} is inside the source "
      f"{runs[0]} (through symbolic links it is "
      f"{tmp_path / link_to / 'orbax'})")
  # A link elsewhere is no reason to refuse.
  (tmp_path / "elsewhere").mkdir()
  (tmp_path / "out2").symlink_to(tmp_path / "elsewhere")
  assert _destinations(runs, str(tmp_path / "runs"),
                       str(tmp_path / "out2" / "orbax"))


def test_the_root_is_recorded_once_and_guards_the_destination(tmp_path):
  destination = str(tmp_path / "orbax")
  assert fleet_assignment.read_recorded_root(destination) is None
  fleet_assignment.record_root(destination, "/runs")
  # A second shard: the same root.
  fleet_assignment.record_root(destination, "/runs")
  assert fleet_assignment.read_recorded_root(destination) == "/runs"
  with pytest.raises(errors.UsageError, match="mirrors source root /runs"):
    fleet_assignment.record_root(destination, "/elsewhere")
  assert fleet_assignment.read_recorded_root(destination) == "/runs"


# --------------------------------------------------------------------------
# Shards (fleet_assignment).
# --------------------------------------------------------------------------


_FLEET = [f"/runs/exp{i}/checkpoints" for i in range(40)]


def test_shards_partition_the_fleet():
  shards = [fleet_assignment.shard_sources(_FLEET, 3, i) for i in range(3)]
  everything = [s for shard in shards for s in shard]
  assert sorted(everything) == sorted(_FLEET)  # each in exactly one shard
  assert all(shards), [len(s) for s in shards]


def test_shards_do_not_depend_on_the_order_of_sources():
  shuffled = list(_FLEET)
  random.Random(0).shuffle(shuffled)
  for i in range(3):
    assert (fleet_assignment.shard_sources(shuffled, 3, i) ==
            fleet_assignment.shard_sources(_FLEET, 3, i))


def test_adding_a_run_moves_no_other_run():
  before = {s: fleet_assignment.shard_of(s, 3) for s in _FLEET}
  grown = _FLEET + ["/runs/new/checkpoints"]
  after = {s: i for i in range(3)
           for s in fleet_assignment.shard_sources(grown, 3, i)}
  assert {s: after[s] for s in _FLEET} == before


def test_shard_of_is_the_same_on_every_machine():
  # Pinned values: a per-process hash (Python's `hash`) would change them.
  assert fleet_assignment.shard_of("/runs/a/checkpoints", 1000) == 437
  assert fleet_assignment.shard_of("/runs/b/checkpoints", 1000) == 768
  assert fleet_assignment.shard_of("gs://bucket/x/checkpoints", 1000) == 92
  assert fleet_assignment.shard_of("/runs/a/checkpoints", 1) == 0


@pytest.mark.parametrize("num_shards, index, environ, expected", [
    (1, None, {}, 0),
    (1, None, {"JOB_COMPLETION_INDEX": "5"}, 0),  # unsharded: env ignored
    (3, 2, {}, 2),
    (3, None, {"JOB_COMPLETION_INDEX": "1"}, 1),
    (3, 0, {"JOB_COMPLETION_INDEX": "1"}, 0),  # the flag wins
])
def test_resolve_shard(num_shards, index, environ, expected):
  assert fleet_assignment.resolve_shard(num_shards, index, environ) == expected


@pytest.mark.parametrize("num_shards, index, environ, message", [
    (0, None, {}, "--num-shards must be >= 1"),
    (3, 3, {}, "--shard-index must be in [0, 3)"),
    (3, -1, {}, "--shard-index must be in [0, 3)"),
    (1, 1, {}, "--shard-index must be in [0, 1)"),
    (3, None, {}, "needs --shard-index"),
    (3, None, {"JOB_COMPLETION_INDEX": "x"}, "is not an integer"),
    (3, None, {"JOB_COMPLETION_INDEX": "7"}, "--shard-index must be in"),
])
def test_resolve_shard_refuses(num_shards, index, environ, message):
  with pytest.raises(errors.UsageError, match=re.escape(message)):
    fleet_assignment.resolve_shard(num_shards, index, environ)


# --------------------------------------------------------------------------
# The command line's options (fleet, clu_ckpt.cli, fleet_workers).
# --------------------------------------------------------------------------


def test_every_migrate_option_is_accepted():
  """From `clu-ckpt migrate`'s own parser: a new option appears here too."""
  parser, dests = fleet.build_parser()
  # pylint: disable=protected-access
  theirs = {o for a in _migrate_subparser()._actions
            for o in a.option_strings if a.dest not in fleet.NOT_PASSED}
  ours = {o for a in parser._actions for o in a.option_strings}
  # pylint: enable=protected-access
  assert theirs <= ours
  assert {"allow_other_sources", "state_host", "step_prefix",
          "step_format_fixed_length", "numbers", "template"} <= set(dests)
  args = parser.parse_args(fleet.normalize_argv([
      "--sources=x", "--number=3", "--number", "5", "--state_host=1",
      "--step-prefix=ckpt", "--step_format_fixed_length=8",
      "--allow-other-sources", "--max-inflight-mib=0", "--compression=none",
      "--verify", "--step-naming=number"]))
  kwargs = fleet_workers.migrate_kwargs(fleet.migrate_options(args, dests))
  assert kwargs == {
      "checkpoints": [3, 5], "state_host": 1, "step_prefix": "ckpt",
      "step_format_fixed_length": 8, "allow_other_sources": True,
      "inflight_bytes": 2**20, "compression": "none", "verify": True,
      "step_naming": "number"}
  latest = parser.parse_args(["--checkpoints=latest"])
  assert fleet_workers.migrate_kwargs(fleet.migrate_options(latest, dests))[
      "checkpoints"] == "latest"


def test_host_directories_skipped_are_one_line_when_migrating(tree):
  """A glob matching host directories (`checkpoints-*`) of a big fleet
  would print a line for every host before the first run: one line says
  how many (the dry run and the report list each)."""
  clu_dir(tree, "runs/g/checkpoints-0")
  plan = fleet_discovery.plan_fleet([], ["runs/*/checkpoints-*"])
  out = io.StringIO()
  fleet.print_plan(plan, plan.runs, out, dry_run=False)
  assert out.getvalue().splitlines() == [
      "skipped 3 host directories of the runs listed (each in the report)"]
  out = io.StringIO()
  fleet.print_plan(plan, plan.runs, out, dry_run=True)
  assert out.getvalue().splitlines()[:3] == [
      "skipped runs/g/checkpoints-0: host directory of runs/g/checkpoints",
      "skipped runs/m/checkpoints-0: host directory of runs/m/checkpoints",
      "skipped runs/m/checkpoints-1: host directory of runs/m/checkpoints"]


def test_an_option_the_fleet_cannot_pass_is_refused():
  with pytest.raises(errors.UsageError, match="--new-flag is not supported"):
    fleet_workers.migrate_kwargs({"new_flag": True})
  assert fleet_workers.migrate_kwargs({"new_flag": None})[
      "checkpoints"] == "all"


def test_normalize_argv():
  assert fleet.normalize_argv(["--destination_root=a_b", "--num_shards", "2",
                               "x_y", "--", "--a_b"]) == [
                                   "--destination-root=a_b", "--num-shards",
                                   "2", "x_y", "--", "--a_b"]


# --------------------------------------------------------------------------
# Reports and progress (fleet_report).
# --------------------------------------------------------------------------


def test_report_directory_is_made_before_any_work(tmp_path):
  path = tmp_path / "new" / "dir" / "report.json"
  fleet_report.prepare_report(str(path))
  assert path.parent.is_dir() and not path.exists()
  (tmp_path / "file").write_text("")
  with pytest.raises(errors.UsageError, match="cannot make"):
    fleet_report.prepare_report(str(tmp_path / "file" / "report.json"))


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


def test_progress_shows_runs_bytes_failures_and_eta():
  out, clock = io.StringIO(), _Clock()
  progress = fleet_report.ProgressPrinter(3, out, clock, total_bytes=4 * 2**30)
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


def test_progress_without_sizes_counts_runs():
  out, clock = io.StringIO(), _Clock()
  progress = fleet_report.ProgressPrinter(4, out, clock)
  clock.now += 30
  progress.run_done(_entry("/runs/a"))
  assert out.getvalue() == ("[1/4] /runs/a ok (1 step, 1.0 GiB, 35 s); "
                            "0 failures, ETA 2 min\n")


def test_progress_on_a_terminal_rewrites_one_line():
  out = _Terminal()
  progress = fleet_report.ProgressPrinter(3, out, _Clock())
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
# Merging reports (fleet_report).
# --------------------------------------------------------------------------


def _report(root, index, num_shards, sources, created, status="ok",
            fleet_size=3):
  return {"created": created, "destination_root": root,
          "launch": {"fingerprint": f"launch of {num_shards}", "id": None},
          "fleet_size": fleet_size, "num_shards": num_shards,
          "shard_index": index,
          "runs": [{"source": s, "status": status, "shard": index}
                   for s in sources]}


def test_merge_gives_every_run_with_its_shard():
  merged = fleet_report.merge_reports([
      ("r1.json", _report("/o", 1, 2, ["/r/b"], "2024-01-01T00:00:00")),
      ("r0.json", _report("/o/", 0, 2, ["/r/a", "/r/c"],
                          "2024-01-01T00:00:05")),
  ])
  assert [(r["source"], r["shard"], r["report"]) for r in merged["runs"]] == [
      ("/r/a", 0, "r0.json"), ("/r/b", 1, "r1.json"), ("/r/c", 0, "r0.json")]
  assert merged["ok"] and merged["missing_shards"] == []
  assert merged["counts"] == {"ok": 3, "failed": 0, "error": 0}
  assert [m["shard_index"] for m in merged["merged_from"]] == [1, 0]


def test_merge_lists_missing_shards_and_keeps_the_newest_entry():
  merged = fleet_report.merge_reports([
      ("new.json", _report("/o", 0, 3, ["/r/a"], "2024-01-02T00:00:00")),
      ("old.json", _report("/o", 0, 3, ["/r/a"], "2024-01-01T00:00:00",
                           status="failed")),
  ])
  assert merged["missing_shards"] == [1, 2]
  assert [(r["status"], r["report"]) for r in merged["runs"]] == [
      ("ok", "new.json")]
  assert not merged["ok"]


def test_merge_accepts_partial_reports():
  """A killed shard's report: finished runs count, unfinished ones show."""
  finished = _report("/o", 0, 1, ["/r/a"], "2024-01-01T00:00:00",
                     fleet_size=2)
  partial = dict(_report("/o", 0, 1, ["/r/a"], "2024-01-02T00:00:00",
                         status="pending", fleet_size=2), complete=False)
  partial["runs"].append({"source": "/r/b", "status": "interrupted"})
  partial["skipped"] = [{"path": "/r/e", "reason": "empty directory"}]
  merged = fleet_report.merge_reports([("old.json", finished),
                                       ("partial.json", partial)])
  assert [(r["source"], r["status"]) for r in merged["runs"]] == [
      ("/r/a", "ok"), ("/r/b", "interrupted")]
  assert merged["counts"] == {"ok": 1, "failed": 0, "error": 0,
                              "interrupted": 1}
  assert not merged["complete"] and not merged["ok"]
  assert merged["skipped"] == partial["skipped"]


def test_merge_refuses_different_destination_roots():
  with pytest.raises(errors.UsageError, match="different fleets.*r1.json"):
    fleet_report.merge_reports([
        ("r0.json", _report("/orbax", 0, 2, ["/r/a"], "t")),
        ("r1.json", _report("/elsewhere", 1, 2, ["/r/b"], "t")),
    ])



def test_a_sources_file_in_a_bucket(gcs):
  path = f"gs://{gcs.bucket()}/lists/sources.txt"
  gcs.fs().pipe_file(path[len("gs://"):], b"gs://b/runs/a/checkpoints\n")
  assert fleet_discovery.read_sources_file(path) == [
      "gs://b/runs/a/checkpoints"]


def test_merging_a_merged_report_keeps_the_missing_shards():
  """`--merge-reports=all.json /reports/*.json` finds the last all.json too:
  the shards it holds count as themselves, not as one unsharded report."""
  shards = [("s0.json", _report("/o", 0, 3, ["/r/a"], "t1")),
            ("s1.json", _report("/o", 1, 3, ["/r/b"], "t1"))]
  merged = fleet_report.merge_reports(shards)
  assert merged["missing_shards"] == [2]
  again = fleet_report.merge_reports([("all.json", merged)] + shards)
  assert again["missing_shards"] == [2] and not again["ok"]
  assert sorted(m["report"] for m in again["merged_from"]) == [
      "s0.json", "s0.json", "s1.json", "s1.json"]
  done = fleet_report.merge_reports(
      [("all.json", merged), ("s2.json", _report("/o", 2, 3, ["/r/c"], "t2"))])
  assert done["missing_shards"] == [] and done["ok"], done


def test_reports_in_a_bucket(gcs):
  """`--report` and `--merge-reports` on gs:// paths."""
  root = f"gs://{gcs.bucket()}/reports"
  fleet_report.prepare_report(f"{root}/shard-0.json")
  fleet_report.write_report(f"{root}/shard-0.json",
                            _report("/o", 0, 1, ["/r/a"], "t", fleet_size=1))
  loaded = fleet_report.load_report(f"{root}/shard-0.json")
  assert loaded["runs"] == [{"source": "/r/a", "status": "ok", "shard": 0}]
  with pytest.raises(errors.UsageError, match="cannot read report"):
    fleet_report.load_report(f"{root}/missing.json")


def test_the_fleet_process_imports_no_migration_machinery(tmp_path):
  """The parent plans, dispatches and reports; its workers migrate. Its
  start-up delays every worker, so it imports neither NumPy nor Orbax,
  JAX or TensorFlow (importing `clu_ckpt.migration` imports none of them
  until a name of it is used)."""
  make_tree(tmp_path)
  code = ("import sys\n"
          "from clu_ckpt.migration import fleet, fleet_discovery\n"
          "fleet.build_parser()\n"
          "fleet_discovery.plan_fleet([], ['runs/*/checkpoints'])\n"
          "print(sorted(m for m in ('numpy', 'jax', 'orbax', 'tensorflow')\n"
          "             if m in sys.modules))\n")
  done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                        capture_output=True, text=True, check=True)
  assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_merge_reports_makes_the_directory_of_its_output(tmp_path):
  shard = tmp_path / "shard-0.json"
  fleet_report.write_report(str(shard), _report("/o", 0, 1, ["/r/a"], "t",
                                                fleet_size=1))
  out = tmp_path / "new" / "dir" / "all.json"
  parser, _ = fleet.build_parser()
  args = parser.parse_args([f"--merge-reports={out}", str(shard)])
  assert fleet.run_merge(args) == 0
  assert fleet_report.load_report(str(out))["ok"]
  (tmp_path / "file").write_text("")
  args = parser.parse_args([f"--merge-reports={tmp_path}/file/all.json",
                            str(shard)])
  with pytest.raises(errors.UsageError, match="--merge-reports .*cannot make"):
    fleet.run_merge(args)


def test_a_report_reads_back_with_a_run_a_line(tmp_path):
  report = dict(_report("/o", 0, 1, ["/r/a", "/r/b"], "t"),
                skipped=[{"path": "/r/e", "reason": "empty directory"}],
                counts={"ok": 2}, empty=[])
  for durable in (True, False):
    path = tmp_path / f"report-{durable}.json"
    fleet_report.write_report(str(path), report, durable=durable)
    assert json.loads(path.read_text()) == report
    lines = path.read_text().splitlines()
    assert '  {"source": "/r/a", "status": "ok", "shard": 0},' in lines
    assert not list(tmp_path.glob("*.tmp*"))


def test_the_report_writer_bounds_the_time_it_takes():
  """A rewrite taking 1 s: the next waits 10 s (10 x its duration), then
  goes out at the next update or idle tick; the final one always."""
  now = [0.0]
  writes = []

  def write(path, report, durable):
    writes.append((now[0], report["n"], durable))
    now[0] += 1.0  # each write takes a second

  state = {"n": 0}
  writer = fleet_report.ReportWriter("r.json", lambda: dict(state),
                                     clock=lambda: now[0], write=write)
  writer.update()                      # at 0: written, until 1; next at 11
  state["n"] = 1
  now[0] = 5.0
  writer.update()                      # too soon: not written
  writer.flush_due()
  assert writes == [(0.0, 0, False)]
  now[0] = 11.0
  writer.flush_due()                   # the idle tick after the pause
  assert writes[-1] == (11.0, 1, False)
  writer.flush_due()                   # nothing changed: nothing written
  writer.close({"n": 2})
  assert writes == [(0.0, 0, False), (11.0, 1, False), (12.0, 2, True)]


def test_a_run_whose_checkpoints_are_not_on_every_host_says_so(tmp_path):
  """A checkpoint some host lacks is not migrated (as MultihostCheckpoint
  would not restore it): the entry says which; and a run where no
  checkpoint is on every host is not "ok" with nothing migrated."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from migration_helpers import multihost_save  # pylint: disable=g-import-not-at-top
  state = lambda step: {"step": step, "w": np.full(3, step, np.float32)}
  multihost_save(tmp_path / "a", [[state(1), state(2)], [state(1)]])
  worker = fleet_workers._Worker()  # pylint: disable=protected-access
  entry = worker.migrate({"source": str(tmp_path / "a"),
                          "destination": str(tmp_path / "out_a")}, {})
  assert entry["status"] == "ok", entry
  assert entry["warning"] == "not on every host, not migrated: ckpt-2"
  multihost_save(tmp_path / "b", [[state(1)], []])
  (tmp_path / "b-1").mkdir(exist_ok=True)
  entry = worker.migrate({"source": str(tmp_path / "b"),
                          "destination": str(tmp_path / "out_b")}, {})
  assert entry["status"] == "failed", entry
  assert "ckpt-1" in entry["error"] and "not on every host" in entry["error"]


def test_a_merge_missing_a_shard_is_not_complete():
  merged = fleet_report.merge_reports([
      ("s0.json", dict(_report("/o", 0, 2, ["/r/a"], "t1"), complete=True))])
  assert merged["missing_shards"] == [1]
  assert not merged["complete"] and not merged["ok"]


def test_flax_files_of_another_prefix_are_a_run(tmp_path, monkeypatch):
  """`flax.training.checkpoints` files saved with `prefix="model_"`: a run,
  as `clu-ckpt migrate` finds them, not "not a checkpoint directory"."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from clu_ckpt import flax_format  # pylint: disable=g-import-not-at-top
  run = tmp_path / "runs" / "p"
  run.mkdir(parents=True)
  for step in (5, 10):
    flax_format.save_file({"step": step, "w": np.ones(2, np.float32)},
                          str(run / f"model_{step}"))
  (tmp_path / "runs" / "q").mkdir()
  (tmp_path / "runs" / "q" / "notes_2024").write_text("not a state")
  monkeypatch.chdir(tmp_path)
  runs, skipped = _summary(fleet_discovery.plan_fleet([], ["runs/*"]))
  assert runs == [("runs/p", "flax_training", [], None)]
  assert [path for path, _ in skipped] == ["runs/q"]
  entry = fleet_workers._Worker().migrate(  # pylint: disable=protected-access
      {"source": str(run), "destination": str(tmp_path / "out")}, {})
  assert entry["status"] == "ok", entry
  assert [s["step"] for s in entry["summary"]["steps"]] == [5, 10]


# --------------------------------------------------------------------------
# Runs that discovery must not leave out: real fleets of golden checkpoints.
# --------------------------------------------------------------------------


def _golden_run(name, target):
  """A writable copy of golden case `name`'s directory (or host directory
  `name` = "multihost/checkpoints-1") at `target`."""
  import shutil  # pylint: disable=g-import-not-at-top
  from conftest import golden_case  # pylint: disable=g-import-not-at-top
  from conftest import make_writable  # pylint: disable=g-import-not-at-top
  case, _, sub = name.partition("/")
  shutil.copytree(golden_case(case) / sub, target,
                  ignore=shutil.ignore_patterns("MANIFEST.json"))
  make_writable(target)


def _host_dirs(root):
  return sorted(str(p.relative_to(root)) for p in root.glob("runs/*/*-[0-9]"))


def test_host_directories_a_matched_base_implies_end_as_runs_or_errors(
    tmp_path, monkeypatch):
  """`runs/*/checkpoints` names bases whose host directories are not a
  MultihostCheckpoint as found: host 0 missing (b), host 0 empty (d), host
  directories beside a base that is itself a checkpoint directory (c).
  They were neither runs nor skipped: the fleet said ok and exit 0."""
  _golden_run("multihost/checkpoints-1", tmp_path / "runs/b/checkpoints-1")
  _golden_run("single_host", tmp_path / "runs/c/checkpoints")
  _golden_run("multihost/checkpoints-0", tmp_path / "runs/c/checkpoints-0")
  _golden_run("multihost/checkpoints-1", tmp_path / "runs/c/checkpoints-1")
  (tmp_path / "runs/d/checkpoints-0").mkdir(parents=True)
  _golden_run("multihost/checkpoints-1", tmp_path / "runs/d/checkpoints-1")
  _golden_run("multihost/checkpoints-1", tmp_path / "runs/o/checkpoints-1")
  (tmp_path / "runs/o/checkpoints-0").mkdir()
  (tmp_path / "runs/o/checkpoints-0/notes.txt").write_text("not a state")
  _golden_run("single_host", tmp_path / "runs/e/checkpoints")
  (tmp_path / "runs/x/checkpoints-0").mkdir(parents=True)  # nothing saved
  monkeypatch.chdir(tmp_path)
  plan = fleet_discovery.plan_fleet([], ["runs/*/checkpoints"])
  runs = {r.source: (r.kind, r.error) for r in plan.runs}
  assert runs == {
      "runs/b/checkpoints": ("MultihostCheckpoint", (
          "host directory runs/b/checkpoints-0 missing (found hosts 1): "
          "restore it, or migrate the hosts found with clu-ckpt migrate")),
      "runs/c/checkpoints": ("Checkpoint", None),
      **{f"runs/c/checkpoints-{h}": ("Checkpoint", (
          "beside runs/c/checkpoints, itself a checkpoint directory: a host "
          "of a MultihostCheckpoint or a run of its own? Name it with "
          "--sources to migrate it as a run of its own, or move "
          "runs/c/checkpoints aside to migrate runs/c/checkpoints-<N> as "
          "one MultihostCheckpoint")) for h in (0, 1)},
      "runs/d/checkpoints": ("MultihostCheckpoint", (
          "host directory runs/d/checkpoints-0 is empty: restore it, or "
          "migrate the hosts found with clu-ckpt migrate")),
      "runs/e/checkpoints": ("Checkpoint", None),
      "runs/o/checkpoints": ("MultihostCheckpoint", (
          "host directory runs/o/checkpoints-0 is not a CLU checkpoint "
          "directory: restore it, or migrate the hosts found with clu-ckpt "
          "migrate"))}
  assert [(s.path, s.reason) for s in plan.skipped] == [
      ("runs/x/checkpoints-0",
       "empty directory (a host directory of runs/x/checkpoints, which "
       "the glob names)")]
  # Every host directory is a run, a host of one, or skipped: none unseen.
  seen = {s.path for s in plan.skipped} | {
      h for r in plan.runs for h in [r.source, *r.hosts]}
  assert set(_host_dirs(tmp_path)) <= seen
  # The fleet fails: its exit status protects the sources.
  out = io.StringIO()
  monkeypatch.setattr(sys, "stdout", out)
  assert fleet.main(["--source-glob=runs/*/checkpoints",
                     "--destination-root=orbax", "--dry-run"]) == 1
  assert "cannot migrate runs/b/checkpoints: host directory" in out.getvalue()
  # What c's error tells to do works: named, `<base>-0` is a run of its own.
  plan = fleet_discovery.plan_fleet(["runs/c/checkpoints-0"], [])
  assert [(r.source, r.kind, r.error) for r in plan.runs] == [
      ("runs/c/checkpoints-0", "Checkpoint", None)]


def test_runs_named_like_hosts_are_not_fused_silently(tmp_path,
                                                      monkeypatch):
  """`runs/*` matches `seed-0` and `seed-1`, two single-host runs: read as
  the hosts of a MultihostCheckpoint `runs/seed`, seed-1's state was never
  migrated and seed-0's newest checkpoint was dropped as "not on every
  host", with exit 0. The glob matching both names cannot tell: an error
  saying how to name them; each naming then plans what it says."""
  _golden_run("single_host", tmp_path / "runs/seed-0")
  _golden_run("single_host", tmp_path / "runs/seed-1")
  for name in ("ckpt-5.flax", "ckpt-5.index", "ckpt-5.data-00000-of-00001"):
    (tmp_path / "runs/seed-1" / name).unlink()
  monkeypatch.chdir(tmp_path)
  plan = fleet_discovery.plan_fleet([], ["runs/*"])
  assert [(r.source, r.hosts, r.error) for r in plan.runs] == [
      ("runs/seed", ["runs/seed-0", "runs/seed-1"], (
          "runs/seed-0, runs/seed-1: the hosts of one MultihostCheckpoint "
          "runs/seed (no such directory), or runs of their own? The glob "
          "matches both names; name them with --sources=runs/seed (one run) "
          "or --sources=runs/seed-0,runs/seed-1 (runs of their own)"))]
  assert not plan.skipped
  apart = fleet_discovery.plan_fleet(["runs/seed-0", "runs/seed-1"], [])
  assert [(r.source, r.kind, r.error) for r in apart.runs] == [
      ("runs/seed-0", "Checkpoint", None), ("runs/seed-1", "Checkpoint", None)]
  fused = fleet_discovery.plan_fleet(["runs/seed"], [])
  assert [(r.source, r.kind, r.error) for r in fused.runs] == [
      ("runs/seed", "MultihostCheckpoint", None)]
  # A glob naming the host directories only still covers their base.
  hosts = fleet_discovery.plan_fleet([], ["runs/seed-*"])
  assert [(r.source, r.kind, r.error) for r in hosts.runs] == [
      ("runs/seed", "MultihostCheckpoint", None)]
  # ... reached through them only: what some hosts lack is then kept.
  assert [r.through_hosts for r in hosts.runs] == [True]
  out = io.StringIO()
  fleet.print_plan(hosts, hosts.runs, out, dry_run=True)
  assert re.search(
      r"\nwould migrate runs/seed ->  \(MultihostCheckpoint, 2 hosts, [\d.]+ "
      r"KiB; reached through its host directories only: a checkpoint some "
      r"of them lack is kept\)\n$", out.getvalue()), out.getvalue()
  assert not fused.runs[0].through_hosts
  for sources, globs in ((["runs/seed"], ["runs/seed-*"]),
                         ([], ["runs/seed-*", "runs/seed"])):
    named = fleet_discovery.plan_fleet(sources, globs)
    assert [(r.source, r.through_hosts) for r in named.runs] == [
        ("runs/seed", False)]


def test_flax_files_of_several_prefixes_are_an_error_not_a_skip(
    tmp_path, monkeypatch):
  """`model_3` and `ema_10`, Flax states of two prefixes: likely a run (the
  fleet cannot tell which is its state), so an error, not "not a
  checkpoint directory"."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from clu_ckpt import flax_format  # pylint: disable=g-import-not-at-top
  run = tmp_path / "runs" / "two"
  run.mkdir(parents=True)
  for name in ("model_3", "ema_10"):
    flax_format.save_file({"w": np.ones(2, np.float32)}, str(run / name))
  monkeypatch.chdir(tmp_path)
  plan = fleet_discovery.plan_fleet([], ["runs/*"])
  assert [(r.source, r.error) for r in plan.runs] == [(
      "runs/two", "Flax checkpoint files of several prefixes (ema_, "
      "model_): which is the run's state cannot be told; move each "
      "prefix's files into a directory of its own")]
  assert not plan.skipped


def _without_permission_bypass():
  """The command prefix that runs a process without root's permission
  bypass (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH); [] for another user."""
  import os  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  if os.geteuid() != 0:
    return []
  setpriv = shutil.which("setpriv")
  caps = "-dac_override,-dac_read_search"
  if setpriv is None or subprocess.run(
      [setpriv, "--bounding-set", caps, "--inh-caps", caps, "true"],
      check=False).returncode:
    pytest.skip("root, and setpriv cannot drop the permission bypass")
  return [setpriv, "--bounding-set", caps, "--inh-caps", caps]


def _fleet_without_permission_bypass(cwd, *args):
  """The fleet script's dry run as a user that permissions apply to."""
  return subprocess.run(
      [*_without_permission_bypass(), sys.executable,
       str(Path(__file__).resolve().parents[1] / "migration" /
           "migrate_runs.py"), *args, "--destination-root=orbax",
       "--dry-run"], cwd=cwd, capture_output=True, text=True, check=False,
      timeout=120)


@pytest.mark.parametrize("pattern", ["runs/*/checkpoints",
                                     "runs/**/checkpoints"])
def test_a_directory_the_glob_cannot_enter_is_an_error(tmp_path, pattern):
  """Runs under directories the migrating user cannot enter were left out
  without a word (`except OSError: continue`, `os.walk` ignoring errors):
  each such directory is an error naming it and the OS error, in a real
  fleet process (exit status 1); one inside a run that `**` walks into is
  that run's error (a run in it would go with the run's source); the
  glob's own top unlistable is a usage error (exit 2)."""
  _golden_run("single_host", tmp_path / "runs/ok/checkpoints")
  _golden_run("single_host", tmp_path / "runs/p1/checkpoints")
  _golden_run("single_host", tmp_path / "runs/deep/x/checkpoints")
  _golden_run("single_host", tmp_path / "runs/in/checkpoints")
  (tmp_path / "runs/in/checkpoints/sub").mkdir()
  closed = ["runs/p1", "runs/deep", "runs/in/checkpoints/sub"]
  try:
    for path in closed:
      (tmp_path / path).chmod(0o000)
    result = _fleet_without_permission_bypass(tmp_path,
                                              f"--source-glob={pattern}")
    (tmp_path / "runs").chmod(0o000)
    top = _fleet_without_permission_bypass(tmp_path,
                                           f"--source-glob={pattern}")
  finally:
    for path in ["runs", *closed]:
      (tmp_path / path).chmod(0o755)
  assert result.returncode == 1, result
  lines = result.stdout.splitlines()
  for path in closed[:2]:
    assert (f"cannot migrate {path}: cannot list: Permission denied (runs "
            f"below it that {pattern} would match cannot be seen)") in lines
  assert ("would migrate runs/ok/checkpoints -> orbax/ok/checkpoints "
          "(Checkpoint, 4.8 KiB)") in lines
  inside = [l for l in lines if l.startswith(("cannot migrate runs/in/",
                                              "would migrate runs/in/"))]
  assert inside == ([
      "cannot migrate runs/in/checkpoints: cannot list "
      "runs/in/checkpoints/sub: Permission denied (runs below it that "
      f"{pattern} would match cannot be seen)"] if "**" in pattern else [
          "would migrate runs/in/checkpoints -> orbax/in/checkpoints "
          "(Checkpoint, 4.8 KiB)"])
  assert top.returncode == 2, top
  assert f"--source-glob '{pattern}': runs: cannot list: Permission denied" in (
      top.stderr)


# --------------------------------------------------------------------------
# What a migrated source still holds (`destination._other_entries`, through
# which the fleet keeps a source): what cannot be seen is kept.
# --------------------------------------------------------------------------


def _child_without_permission_bypass(code, *args):
  """Python `code` (argv: `args`) in a process that permissions apply to;
  its stdout (it must exit 0)."""
  result = subprocess.run(
      [*_without_permission_bypass(), sys.executable, "-c", code, *args],
      capture_output=True, text=True, check=False, timeout=120)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


def test_an_entry_whose_kind_cannot_be_told_is_kept(tmp_path):
  """`extra`, a link to a directory the migrating user cannot reach:
  `os.path.isdir` says False when it cannot tell, and an entry taken for a
  file not named like a Flax checkpoint was passed over, so the fleet and
  `verify --source` called the source safe to delete. It is listed."""
  source = tmp_path / "runs" / "a"
  _golden_run("single_host", source)
  (tmp_path / "closed" / "target").mkdir(parents=True)
  (source / "extra").symlink_to(tmp_path / "closed" / "target")
  (source / "notes.txt").write_text("a file: not looked at")
  (source / "gone").symlink_to(tmp_path / "nothing")  # a link to nothing
  code = ("import sys\n"
          "from clu_ckpt.migration import destination\n"
          "left = destination.checkpoints_not_migrated(sys.argv[1], "
          "sys.argv[2])\n"
          "print(left.entries)\n")
  (tmp_path / "closed").chmod(0o000)
  try:
    out = _child_without_permission_bypass(code, str(tmp_path / "orbax"),
                                           str(source))
  finally:
    (tmp_path / "closed").chmod(0o755)
  assert out.strip() == "['extra/']"


def test_a_host_directory_that_cannot_be_listed_again_is_kept(tmp_path):
  """A host directory the check after the migration cannot list (its
  permissions changed, an I/O error) was skipped (`continue`): the source
  then looked safe to delete. It is named as not verified."""
  base = tmp_path / "runs" / "checkpoints"
  for host in (0, 1):
    _golden_run(f"multihost/checkpoints-{host}",
                tmp_path / "runs" / f"checkpoints-{host}")
  code = ("import os, sys\n"
          "from clu_ckpt.migration import destination, plan\n"
          "src = plan.discover(sys.argv[1])\n"
          "os.chmod(sys.argv[1] + '-1', 0o311)  # searchable, not listable\n"
          "print(destination._other_entries(src))\n")
  try:
    out = _child_without_permission_bypass(code, str(base))
  finally:
    (tmp_path / "runs" / "checkpoints-1").chmod(0o755)
  assert out.strip() == ("['checkpoints-1/ (not verified: cannot list it: "
                         "Permission denied)']")


def test_a_bucket_path_not_utf8_is_an_error_of_its_own(tmp_path):
  """A `gs://` line of a sources file in another encoding: a run with an
  error naming it (a bucket's names are UTF-8), not a crash of the plan."""
  listing = tmp_path / "list.txt"
  listing.write_bytes(b"gs://b/runs/caf\xe9\n")
  sources = fleet_discovery.read_sources_file(str(listing))
  assert [os.fsencode(s) for s in sources] == [b"gs://b/runs/caf\xe9"]
  plan = fleet_discovery.plan_fleet(sources, [])
  assert [(os.fsencode(r.source), r.error) for r in plan.runs] == [(
      b"gs://b/runs/caf\xe9", "not valid UTF-8 (a line of --sources-file in "
      "another encoding?): a bucket's names are UTF-8")]


# --------------------------------------------------------------------------
# --exclude: runs left out on purpose, each listed as skipped.
# --------------------------------------------------------------------------


def test_excluded_runs_are_skipped_with_the_pattern(tree):
  """A run an `--exclude` glob matches, or one below a path it matches, is
  skipped naming the pattern (never dropped unseen); a MultihostCheckpoint
  with one host excluded is an error (all its hosts or none)."""
  plan = fleet_discovery.plan_fleet(
      ["runs/b/checkpoints"], ["runs/*/checkpoints"],
      excludes=["runs/a", f"{tree}/runs/b/check*"])
  runs, skipped = _summary(plan)
  assert [r[0] for r in runs] == ["runs/f/checkpoints", "runs/m/checkpoints"]
  assert ("runs/a/checkpoints", "excluded (--exclude runs/a)") in skipped
  assert ("runs/b/checkpoints",
          f"excluded (--exclude {tree}/runs/b/check*)") in skipped
  one_host = fleet_discovery.plan_fleet(
      [], ["runs/m/checkpoints"], excludes=["runs/*/checkpoints-1"])
  assert [(r.source, r.error) for r in one_host.runs] == [(
      "runs/m/checkpoints", "host directory runs/m/checkpoints-1 is excluded "
      "(--exclude runs/*/checkpoints-1): a MultihostCheckpoint is migrated "
      "with all its hosts or not at all; exclude runs/m/checkpoints instead, "
      "or none of its hosts")]
  anywhere = fleet_discovery.plan_fleet([], [f"{tree}/runs/*/checkpoints"],
                                        excludes=["**/a"])
  assert (f"{tree}/runs/a/checkpoints", "excluded (--exclude **/a)") in [
      (s.path, s.reason) for s in anywhere.skipped]
  base = fleet_discovery.plan_fleet([], ["runs/m/checkpoints"],
                                    excludes=["runs/m/checkpoints"])
  assert not base.runs
  assert ("runs/m/checkpoints", "excluded (--exclude runs/m/checkpoints)") in [
      (s.path, s.reason) for s in base.skipped]


def test_an_excluded_run_is_not_migrated_through_a_link_to_it(tree):
  """`--exclude` names a run; a link to it (or the run, when the link is
  excluded) is the same run and is left out too (it was migrated, and
  reported deletable, through the other name)."""
  (tree / "runs" / "alias").symlink_to(tree / "runs" / "a")
  for excluded in ("runs/a", "runs/alias"):
    plan = fleet_discovery.plan_fleet([], ["runs/*/checkpoints"],
                                      excludes=[excluded])
    sources = [os.path.realpath(r.source) for r in plan.runs]
    assert os.path.realpath(tree / "runs" / "a" / "checkpoints") not in (
        sources), (excluded, sources)
    assert any(s.reason == f"excluded (--exclude {excluded})"
               for s in plan.skipped), plan.skipped


@pytest.mark.thorough("runs/**/checkpoints")
@pytest.mark.parametrize("pattern", ["runs/*/checkpoints",
                                     "runs/**/checkpoints"])
def test_a_root_only_directory_can_be_excluded(tmp_path, pattern):
  """`lost+found` (root's alone) under the glob failed a fleet run as
  another user, with no way to leave it out. `--exclude` leaves it out,
  listed as skipped with why, on the terminal and in the report; what is
  below a run stays that run's error."""
  _golden_run("single_host", tmp_path / "runs/ok/checkpoints")
  (tmp_path / "runs/lost+found").mkdir()
  (tmp_path / "runs/lost+found").chmod(0o000)
  try:
    plain = _fleet_without_permission_bypass(
        tmp_path, f"--source-glob={pattern}")
    excluded = _fleet_without_permission_bypass(
        tmp_path, f"--source-glob={pattern}", "--exclude=runs/lost+found",
        "--exclude=runs/*/other")
    report = subprocess.run(
        [*_without_permission_bypass(), sys.executable,
         str(Path(__file__).resolve().parents[1] / "migration" /
             "migrate_runs.py"), f"--source-glob={pattern}",
         "--exclude=**/lost+found", "--destination-root=orbax",
         "--report=r.json"], cwd=tmp_path, capture_output=True, text=True,
        check=False, timeout=300)
  finally:
    (tmp_path / "runs/lost+found").chmod(0o755)
  assert plain.returncode == 1, plain
  assert "cannot migrate runs/lost+found: cannot list: Permission denied" in (
      plain.stdout)
  assert excluded.returncode == 0, excluded
  lines = excluded.stdout.splitlines()
  assert ("skipped runs/lost+found: excluded (--exclude runs/lost+found)"
          in lines), lines
  assert [l.split(" -> ")[0] for l in lines if "migrate" in l][:1] == [
      "would migrate runs/ok/checkpoints"]
  assert report.returncode == 0, report.stdout + report.stderr
  written = json.loads((tmp_path / "r.json").read_text())
  assert [r["source"] for r in written["runs"]] == ["runs/ok/checkpoints"]
  assert [(s["path"], s["reason"]) for s in written["skipped"]] == [
      ("runs/lost+found", "excluded (--exclude **/lost+found)")]


def test_a_source_that_cannot_be_read_again_is_kept(tmp_path):
  """Migrated, then not readable for the check of what it keeps (a
  bucket's outage, a disk gone): the run said ok with nothing to keep."""
  entry = {"source": str(tmp_path / "gone"), "destination": str(tmp_path),
           "status": "ok"}
  fleet_workers._name_what_the_source_keeps(entry, False)  # pylint: disable=protected-access
  assert entry["source_not_migrated"] == [
      "(not verified: the source could not be read again after its "
      "migration)"]
  assert entry["warning"].endswith("is not verified: do not delete it")
  assert fleet_report.sources_to_keep([entry]) == [str(tmp_path / "gone")]


def test_an_unreadable_flax_like_file_is_an_error_not_a_skip(tmp_path):
  """`model_3`, a Flax state the fleet's user cannot read: the directory
  was "skipped: not a checkpoint directory" and the fleet exited 0."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from clu_ckpt import flax_format  # pylint: disable=g-import-not-at-top
  (tmp_path / "runs" / "p").mkdir(parents=True)
  flax_format.save_file({"w": np.ones(2, np.float32)},
                        str(tmp_path / "runs" / "p" / "model_3"))
  (tmp_path / "runs" / "q").mkdir()
  (tmp_path / "runs" / "q" / "notes.txt").write_text("not a state")
  (tmp_path / "runs" / "p" / "model_3").chmod(0o000)
  try:
    result = _fleet_without_permission_bypass(tmp_path, "--source-glob=runs/*")
  finally:
    (tmp_path / "runs" / "p" / "model_3").chmod(0o644)
  assert result.returncode == 1, result
  assert result.stdout.splitlines()[:2] == [
      "skipped runs/q: not a checkpoint directory (no `checkpoint` file, no "
      "<name>-<N>.flax)",
      "cannot migrate runs/p: cannot read model_3 (Permission denied): "
      "whether it is a Flax checkpoint cannot be told"], result.stdout


def test_orbax_era_directories_are_skipped_saying_what_they_hold(tmp_path):
  """A directory of Orbax steps (a root, a MultihostCheckpoint base saved
  with `layout="orbax"`, Flax's Orbax `checkpoint_<n>/` directories) is no
  run of this migration, but checkpoints: its skip says so, so that it is
  not taken for something the fleet covered."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  with ocp.CheckpointManager(str(tmp_path / "runs" / "o" / "checkpoints")) as m:
    m.save(3, args=ocp.args.StandardSave({"w": np.arange(2)}))
    m.wait_until_finished()
  (tmp_path / "runs" / "f" / "checkpoints" / "checkpoint_10").mkdir(
      parents=True)
  (tmp_path / "runs" / "e" / "checkpoints").mkdir(parents=True)
  plan = fleet_discovery.plan_fleet([], [f"{tmp_path}/runs/*/checkpoints"])
  reasons = dict((Path(p).parent.name, r) for p, r in _summary(plan)[1])
  assert "Orbax-era checkpoint directories (3: " in reasons["o"], reasons
  assert "(checkpoint_10: " in reasons["f"], reasons
  assert "keep it" in reasons["o"] and "keep it" in reasons["f"]
  assert reasons["e"] == "empty directory", reasons
