"""Tests for clu_ckpt.migration.run: how `migrate` runs.

Resuming a killed run, skipping steps already done, refusing a step another
source wrote, failing one checkpoint alone, dry runs, progress, multihost
sources, and writing through a given `Target`. Results are read back with
stock `orbax.checkpoint.CheckpointManager`.
"""

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import orbax.checkpoint as ocp
import pytest

from clu_ckpt import errors
from clu_ckpt import flax_format
from clu_ckpt import layout
from clu_ckpt import migration
from clu_ckpt.migration import destination
from clu_ckpt.migration import orbax_target
from migration_helpers import clu_save
from migration_helpers import example_state
from migration_helpers import multihost_save
from migration_helpers import orbax_restore
from migration_helpers import same_tree


# --------------------------------------------------------------------------
# Multihost sources.
# --------------------------------------------------------------------------


def test_multihost_identical_hosts(tmp_path):
  base = tmp_path / "src" / "ckpts"
  multihost_save(base, [[example_state(1), example_state(2)],
                        [example_state(1), example_state(2)]])
  summary = migration.migrate(str(base), str(tmp_path / "dst"), verify=True)
  assert summary.ok, summary.failed
  assert summary.kind == "MultihostCheckpoint"
  assert summary.hosts == [0, 1]
  assert [s.step for s in summary.steps] == [1, 2]
  meta = migration.read_metadata(str(tmp_path / "dst"), 2)
  assert meta["hosts_compared"] is True and meta["host_ids"] == [0, 1]


# --------------------------------------------------------------------------
# Failures, atomicity, resumption, progress.
# --------------------------------------------------------------------------


def test_corrupt_sources_fail_alone_and_leave_no_step(tmp_path, golden_copy):
  src = golden_copy("single_host")
  flax = src / "ckpt-4.flax"
  flax.write_bytes(flax.read_bytes()[:-10])
  index = src / "ckpt-5.index"
  index.write_bytes(b"not an index")
  summary = migration.migrate(str(src), str(tmp_path / "dst"))
  by_number = {s.number: s for s in summary.steps}
  assert by_number[3].status == "migrated"
  assert by_number[4].status == "failed"
  assert str(flax) in by_number[4].error
  assert by_number[5].status == "failed"
  assert "ckpt-5.index" in by_number[5].error
  with ocp.CheckpointManager(tmp_path / "dst") as mngr:
    assert list(mngr.all_steps()) == [300]
  assert sorted(os.listdir(tmp_path / "dst")) == [
      ".clu_ckpt.lock", "300", "clu_ckpt_manifest.json"]


def test_interrupted_migration_is_invisible_and_resumes(tmp_path, golden_copy):
  src = golden_copy("single_host")
  dst = tmp_path / "dst"
  # A real process dies (os._exit) in the middle of writing ckpt-4's arrays.
  script = textwrap.dedent("""
      import os, sys
      from clu_ckpt import migration
      def progress(p):
        if p.event == "bytes" and p.number == 4:
          os._exit(9)
      migration.migrate(sys.argv[1], sys.argv[2], progress=progress)
  """)
  run = subprocess.run([sys.executable, "-c", script, str(src), str(dst)],
                       capture_output=True, cwd=tmp_path)
  assert run.returncode == 9
  leftovers = [p for p in os.listdir(dst) if p.startswith("400.")]
  assert leftovers, os.listdir(dst)  # Orbax's temporary directory.
  with ocp.CheckpointManager(dst) as mngr:
    assert list(mngr.all_steps()) == [300]

  summary = migration.migrate(str(src), str(dst), verify=True)
  assert [s.status for s in summary.steps] == ["skipped", "migrated",
                                               "migrated"]
  assert all(s.verified for s in summary.steps)
  assert sorted(os.listdir(dst)) == [".clu_ckpt.lock", "300", "400", "500",
                                    "clu_ckpt_manifest.json"]
  again = migration.migrate(str(src), str(dst))
  assert [s.status for s in again.steps] == ["skipped"] * 3


def test_destination_step_from_elsewhere_is_not_overwritten(tmp_path,
                                                            golden_copy):
  a = golden_copy("single_host")
  clu_save(tmp_path / "other", [example_state(300)])
  assert migration.migrate(str(tmp_path / "other"), str(tmp_path / "dst")).ok
  before = sorted(os.listdir(tmp_path / "dst"))
  with pytest.raises(migration.MigrationError, match="already holds the "
                     "migration of .*other.*--allow-other-sources"):
    migration.migrate(str(a), str(tmp_path / "dst"))
  assert sorted(os.listdir(tmp_path / "dst")) == before
  summary = migration.migrate(str(a), str(tmp_path / "dst"),
                              allow_other_sources=True)
  by_number = {s.number: s for s in summary.steps}
  assert by_number[3].status == "failed"
  assert "already exists" in by_number[3].error
  assert by_number[4].status == "migrated"
  meta = migration.read_metadata(str(tmp_path / "dst"), 300)
  assert meta["source"] == str(tmp_path / "other")


def test_dry_run_writes_nothing(tmp_path, golden_copy):
  src = golden_copy("single_host")
  summary = migration.migrate(str(src), str(tmp_path / "dst"), dry_run=True)
  assert [s.status for s in summary.steps] == ["planned"] * 3
  assert summary.step_mapping == {3: 300, 4: 400, 5: 500}
  assert summary.steps[0].nbytes > 0
  assert not (tmp_path / "dst").exists()


def test_progress_reports_every_byte(tmp_path, golden_copy):
  src = golden_copy("single_host")
  events = []
  summary = migration.migrate(str(src), str(tmp_path / "dst"),
                              checkpoints="latest", progress=events.append)
  assert summary.ok
  kinds = [e.event for e in events]
  assert kinds[0] == "start" and kinds[-1] == "done"
  written = sum(e.nbytes for e in events if e.event == "bytes")
  assert written == events[0].nbytes == summary.steps[0].nbytes > 0


# --------------------------------------------------------------------------
# A given target.
# --------------------------------------------------------------------------


class RecordingTarget(migration.OrbaxTarget):
  """An OrbaxTarget that records the steps (and items) it is asked to write."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.written = []

  def write_step(self, step, items, on_bytes, **kwargs):
    self.written.append((step, sorted(items)))
    super().write_step(step, items, on_bytes, **kwargs)


def test_migrate_writes_through_the_given_target(tmp_path):
  states = [example_state(s, scale=s) for s in (10, 20, 30)]
  clu_save(tmp_path / "src", states)
  dst = tmp_path / "dst"
  target = RecordingTarget(str(dst), use_compression=False)
  assert isinstance(target, migration.Target)
  summary = migration.migrate(str(tmp_path / "src"), str(dst), target=target,
                              verify=True)
  assert summary.ok, summary.failed
  assert summary.destination == str(dst)
  assert [(s.step, s.status, s.verified) for s in summary.steps] == [
      (10, "migrated", True), (20, "migrated", True), (30, "migrated", True)]
  assert target.written == [(step, ["metadata", "state"])
                            for step in (10, 20, 30)]
  # Stock Orbax reads what the target wrote; the target's own settings
  # (no compression) are recorded.
  with ocp.CheckpointManager(dst) as mngr:
    assert list(mngr.all_steps()) == [10, 20, 30]
  for step, state in zip((10, 20, 30), states):
    restored = orbax_restore(dst, step)
    np.testing.assert_array_equal(restored["state"]["params"]["w"],
                                  state["params"]["w"])
    assert restored["metadata"]["step"] == step
    assert restored["metadata"]["compression"] == "none"
  # Re-running through the target writes nothing again.
  again = migration.migrate(str(tmp_path / "src"), str(dst), target=target)
  assert [s.status for s in again.steps] == ["skipped"] * 3
  assert len(target.written) == 3
  # A dry run asks the target for its steps only.
  other = RecordingTarget(str(tmp_path / "dry"))
  planned = migration.migrate(str(tmp_path / "src"), str(tmp_path / "dry"),
                              target=other, dry_run=True)
  assert [s.status for s in planned.steps] == ["planned"] * 3
  assert other.written == [] and not (tmp_path / "dry").exists()


def test_default_target_is_an_orbax_target_on_the_destination(tmp_path,
                                                              monkeypatch):
  made = []

  class Spy(RecordingTarget):

    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      made.append(self)

  monkeypatch.setattr(orbax_target, "OrbaxTarget", Spy)
  clu_save(tmp_path / "src", [example_state(1)])
  assert migration.migrate(str(tmp_path / "src"), str(tmp_path / "dst"),
                           compression="none", inflight_bytes=2**20).ok
  assert len(made) == 1
  assert (made[0].root, made[0].use_compression, made[0].inflight_bytes) == (
      str(tmp_path / "dst"), False, 2**20)
  assert made[0].written == [(1, ["metadata", "state"])]


@pytest.mark.parametrize("kwargs,match", [
    (dict(destination="elsewhere"), "not to the destination"),
    (dict(compression="none"), r"compression='none' configure"),
    (dict(inflight_bytes=2**20), r"inflight_bytes=1048576 configure"),
])
def test_target_contradicted_by_other_arguments_is_refused(tmp_path, kwargs,
                                                           match):
  clu_save(tmp_path / "src", [example_state(1)])
  target = RecordingTarget(str(tmp_path / "dst"))
  destination = str(tmp_path / kwargs.pop("destination", "dst"))
  with pytest.raises(migration.MigrationError, match=match):
    migration.migrate(str(tmp_path / "src"), destination, target=target,
                      **kwargs)
  with pytest.raises(migration.MigrationError, match="not an"):
    migration.migrate(str(tmp_path / "src"), str(tmp_path / "dst"),
                      target=str(tmp_path / "dst"))
  assert target.written == [] and not (tmp_path / "dst").exists()
  assert not (tmp_path / "elsewhere").exists()
  # The same root spelled otherwise is the destination.
  assert migration.migrate(str(tmp_path / "src"),
                           f"{tmp_path}/./dst/", target=target).ok
  assert target.written == [(1, ["metadata", "state"])]


# --------------------------------------------------------------------------
# A fleet's destination: lock, manifest, verification failures, paths.
# --------------------------------------------------------------------------


def test_second_migration_into_a_locked_destination_is_refused(tmp_path,
                                                               golden_copy):
  src = golden_copy("single_host")
  dst = tmp_path / "dst"
  with destination.lock(str(dst)):
    with pytest.raises(errors.DestinationLockedError,
                       match=f"pid {os.getpid()}"):
      migration.migrate(str(src), str(dst))
  assert sorted(os.listdir(dst)) == [".clu_ckpt.lock"]
  assert migration.migrate(str(src), str(dst)).ok


def test_pruned_steps_are_not_brought_back(tmp_path, golden_copy):
  src = golden_copy("single_host")
  dst = tmp_path / "dst"
  assert migration.migrate(str(src), str(dst)).ok
  # Orbax trains on, keeping 2: step 300 is pruned.
  options = ocp.CheckpointManagerOptions(max_to_keep=2)
  with ocp.CheckpointManager(dst, options=options) as mngr:
    mngr.save(600, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"w": np.ones(3)})))
    mngr.wait_until_finished()
    assert list(mngr.all_steps()) == [500, 600]
  summary = migration.migrate(str(src), str(dst))
  assert summary.ok
  assert [(s.number, s.step, s.status) for s in summary.steps] == [
      (3, 300, "skipped"), (4, 400, "skipped"), (5, 500, "skipped")]
  with ocp.CheckpointManager(dst) as mngr:
    assert list(mngr.all_steps()) == [500, 600]


def test_destination_of_an_orbax_run_is_refused(tmp_path, golden_copy):
  src = golden_copy("single_host")
  dst = tmp_path / "dst"
  with ocp.CheckpointManager(dst) as mngr:
    mngr.save(1, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"w": np.ones(3)})))
    mngr.wait_until_finished()
  with pytest.raises(migration.MigrationError, match="step 1: no clu_ckpt"):
    migration.migrate(str(src), str(dst))
  assert sorted(os.listdir(dst)) == [".clu_ckpt.lock", "1"]


def test_manifest_repaired_after_a_kill_between_step_and_record(
    tmp_path, golden_copy):
  src = golden_copy("single_host")
  dst = tmp_path / "dst"
  assert migration.migrate(str(src), str(dst), checkpoints="latest").ok
  (dst / destination.MANIFEST_NAME).unlink()   # as if killed before record
  summary = migration.migrate(str(src), str(dst), checkpoints="latest")
  assert [s.status for s in summary.steps] == ["skipped"]
  recorded = destination.read_manifest(str(dst)).recorded(str(src))
  assert {n: r["step"] for n, r in recorded.items()} == {5: 500}


def test_step_failing_verification_is_removed_and_retried(tmp_path,
                                                          golden_copy):
  src = golden_copy("single_host")
  dst = tmp_path / "dst"
  assert migration.migrate(str(src), str(dst), checkpoints="latest").ok
  # Damage the migrated step: its state no longer matches the source.
  state_dir = dst / "500" / "state"
  for path in sorted(state_dir.rglob("*")):
    if path.is_file() and path.parent.name == "d":
      path.write_bytes(b"\0" * path.stat().st_size)
  summary = migration.migrate(str(src), str(dst), checkpoints="latest",
                              verify=True)
  assert not summary.ok
  assert "verify" in summary.steps[0].error
  assert not (dst / "500").exists()
  assert sorted(os.listdir(dst)) == [".clu_ckpt.lock",
                                     "clu_ckpt_manifest.json"]
  assert destination.read_manifest(str(dst)).recorded(str(src)) == {}
  again = migration.migrate(str(src), str(dst), checkpoints="latest",
                            verify=True)
  assert [(s.status, s.verified) for s in again.steps] == [("migrated", True)]


def test_file_urls_and_relative_paths(tmp_path, golden_copy, monkeypatch):
  src = golden_copy("single_host")
  monkeypatch.chdir(tmp_path)
  summary = migration.migrate(f"file://{src}", "rel/dst",
                              checkpoints="latest")
  assert summary.ok and summary.destination == str(tmp_path / "rel" / "dst")
  assert summary.source == str(src)
  assert not (tmp_path / "file:").exists()
  state = migration.restore_state("rel/dst")
  expected = flax_format.load_file(str(src / "ckpt-5.flax"))
  assert same_tree(state, expected)
  assert same_tree(migration.restore_state(f"file://{tmp_path}/rel/dst"),
                   expected)
  again = migration.migrate(str(src), f"file://{tmp_path}/rel/dst",
                            checkpoints="latest")
  assert [s.status for s in again.steps] == ["skipped"]


def test_step_prefix_and_fixed_length(tmp_path, golden_copy):
  src = golden_copy("single_host")
  dst = tmp_path / "dst"
  summary = migration.migrate(str(src), str(dst), step_prefix="ckpt",
                              step_format_fixed_length=6)
  assert summary.ok
  assert sorted(p for p in os.listdir(dst) if not p.startswith((".", "clu"))
                ) == ["ckpt_000300", "ckpt_000400", "ckpt_000500"]
  options = ocp.CheckpointManagerOptions(step_prefix="ckpt",
                                         step_format_fixed_length=6)
  with ocp.CheckpointManager(dst, options=options) as mngr:
    assert list(mngr.all_steps()) == [300, 400, 500]
  state = migration.restore_state(str(dst), step_prefix="ckpt",
                                  step_format_fixed_length=6)
  assert same_tree(state, flax_format.load_file(str(src / "ckpt-5.flax")))
  again = migration.migrate(str(src), str(dst), step_prefix="ckpt",
                            step_format_fixed_length=6)
  assert [s.status for s in again.steps] == ["skipped"] * 3


def test_steps_carry_the_source_save_time(tmp_path, golden_copy):
  src = golden_copy("single_host")
  dst = tmp_path / "dst"
  assert migration.migrate(str(src), str(dst)).ok
  state = layout.read_checkpoint_state(str(src))
  times = list(state.all_model_checkpoint_timestamps)
  with ocp.CheckpointManager(dst) as mngr:
    for step, saved in zip((300, 400, 500), times):
      meta = mngr.metadata(step)
      assert abs(meta.commit_timestamp_nsecs / 1e9 - saved) < 1e-3
      assert meta.custom_metadata["clu_ckpt"]["source"] == str(src)
      assert meta.custom_metadata["clu_ckpt"]["clu_checkpoint_number"] == (
          step // 100)


def test_progress_events_carry_the_run_size(tmp_path, golden_copy):
  src = golden_copy("single_host")
  events = []
  summary = migration.migrate(str(src), str(tmp_path / "dst"),
                              progress=events.append)
  assert summary.ok and events
  assert {e.count for e in events} == {3}
  assert {e.total_nbytes for e in events} == {
      sum(s.nbytes for s in summary.steps)}


def test_interrupt_abandons_the_step_and_keeps_the_others(tmp_path,
                                                          golden_copy):
  src = golden_copy("single_host")
  dst = tmp_path / "dst"

  def interrupt_the_second(event):
    if event.event == "start" and event.number == 4:
      raise KeyboardInterrupt()

  with pytest.raises(migration.run.MigrationInterrupted) as e:
    migration.migrate(str(src), str(dst), progress=interrupt_the_second)
  assert [(s.number, s.status) for s in e.value.summary.steps] == [
      (3, "migrated"), (4, "interrupted")]
  assert e.value.remaining == [5]
  assert not [p for p in os.listdir(dst) if "orbax-checkpoint-tmp" in p]
  assert migration.migrate(str(src), str(dst)).ok


def test_a_recorded_checkpoint_is_not_written_again_when_the_naming_changes(
    tmp_path, golden_copy):
  """Steps named by the state's `step` (300, 400, 500); then ckpt-5 is
  rewritten with an older state, so that "auto" now names by checkpoint
  number: the recorded checkpoints keep their steps, none is written again
  as 3, 4, 5 beside them."""
  src = golden_copy("single_host")
  dst = tmp_path / "dst"
  first = migration.migrate(str(src), str(dst))
  assert [s.step for s in first.steps] == [300, 400, 500]
  for suffix in ("flax", "index", "data-00000-of-00001"):
    shutil.copy(src / f"ckpt-4.{suffix}", src / f"ckpt-5.{suffix}")
  again = migration.migrate(str(src), str(dst))
  assert [(s.number, s.step, s.status) for s in again.steps] == [
      (3, 300, "skipped"), (4, 400, "skipped"), (5, 500, "skipped")]
  assert sorted(int(n) for n in os.listdir(dst) if n.isdigit()) == [
      300, 400, 500]


def test_a_checkpoint_without_its_tensorflow_files_fails_naming_the_index(
    tmp_path, golden_copy):
  """Its `.flax` alone would migrate without the iterator state, "ok"."""
  src = golden_copy("single_host")
  (src / "ckpt-4.index").unlink()
  summary = migration.migrate(str(src), str(tmp_path / "dst"))
  assert [(s.number, s.status) for s in summary.steps] == [
      (3, "migrated"), (4, "failed"), (5, "migrated")]
  failed = summary.steps[1]
  assert failed.error.startswith(f"{src}/ckpt-4.index: missing: checkpoint "
                                 "ckpt-4 has its .flax but not"), failed.error
  assert orbax_target.list_steps(str(tmp_path / "dst"))[0] == [300, 500]
