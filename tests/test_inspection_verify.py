"""`verify` never says OK wrongly, on every layout it checks.

Each case breaks one thing a sound checkpoint needs and `verify` must report
it, naming the file: a listed checkpoint whose `.index` is missing (a CLU
directory, a multihost base, the source of a migrated root), extra or
missing leaves in a migrated step (`verify ROOT --source`), hosts whose
states differ in one float's bits (`migrate`'s host comparison).
"""

import os
import shutil

import numpy as np
import pytest

from clu_ckpt import flax_format
from clu_ckpt import inspection
from clu_ckpt import migration
from migration_helpers import example_state
from migration_helpers import multihost_save


def _problems_naming(result, text):
  assert not result["ok"], result
  return [p for p in result["problems"] if text in p]


def test_a_clu_directory_with_a_listed_index_missing(golden_copy):
  d = golden_copy("single_host")
  assert inspection.verify_path(str(d))["ok"]
  (d / "ckpt-4.index").unlink()
  result = inspection.verify_path(str(d))
  assert _problems_naming(result, str(d / "ckpt-4.index"))


def test_a_multihost_base_with_a_listed_index_missing(golden_copy):
  d = golden_copy("multihost")
  base = d / "checkpoints"
  assert inspection.verify_path(str(base))["ok"]
  victim = sorted((d / "checkpoints-1").glob("ckpt-*.index"))[-1]
  victim.unlink()
  result = inspection.verify_path(str(base))
  assert _problems_naming(result, str(victim))


@pytest.fixture(name="migrated_base")
def migrated_base_fixture(tmp_path):
  base = tmp_path / "mh" / "ckpts"
  multihost_save(base, [[example_state(1), example_state(2)]] * 2)
  assert migration.migrate(str(base), str(tmp_path / "dst")).ok
  root = str(tmp_path / "dst")
  assert inspection.verify_orbax_root(root, str(base))["ok"]
  return base, root


def test_a_migrated_root_whose_source_lost_an_index(migrated_base):
  base, root = migrated_base
  victim = base.parent / "ckpts-1" / "ckpt-2.index"
  victim.unlink()
  result = inspection.verify_orbax_root(root, str(base))
  assert _problems_naming(result, str(victim))


@pytest.mark.parametrize("change", ["fewer_in_source", "more_in_source"])
def test_a_migrated_root_with_other_leaves_than_its_source(migrated_base,
                                                           change):
  base, root = migrated_base
  victim = base.parent / "ckpts-0" / "ckpt-1.flax"
  state = flax_format.load_file(str(victim), writable=True)
  if change == "fewer_in_source":  # the step holds a leaf the source lacks
    state["opt"].pop("flag")
  else:
    state["opt"]["extra"] = np.zeros(2, np.float32)
  flax_format.save_file(state, str(victim))
  result = inspection.verify_orbax_root(root, str(base))
  assert _problems_naming(result, str(victim))


@pytest.mark.parametrize("case", ["negative_zero", "nan_payload"])
def test_hosts_differing_in_float_bits_are_not_the_same(tmp_path, case):
  base = tmp_path / "mh" / "ckpts"
  other = example_state(1)
  if case == "negative_zero":
    other["params"]["w"][0, 0] = np.float32(-0.0)
    zero = example_state(1)
  else:
    zero = example_state(1)
    zero["params"]["w"][0, 0] = np.nan
    other["params"]["w"][0, 0] = np.uint32(0x7FC00001).view(np.float32)
  multihost_save(base, [[zero], [other]])
  summary = migration.migrate(str(base), str(tmp_path / "dst"))
  assert not summary.ok
  assert "hosts 0 and 1" in summary.steps[0].error
  assert "/params/w" in summary.steps[0].error


# ---------------------------------------------------------------------------
# What verify reads, exactly: the listed checkpoints (contained), each file
# (inside, regular), every shard, every host's tree, a file's every header.
# ---------------------------------------------------------------------------


def _write_state(directory, latest, paths):
  lines = [f'model_checkpoint_path: "{latest}"'] + [
      f'all_model_checkpoint_paths: "{p}"' for p in paths]
  (directory / "checkpoint").write_text("\n".join(lines) + "\n")


def test_listed_checkpoints_outside_are_refused_and_dropped(golden_copy):
  d = golden_copy("single_host")
  _write_state(d, "/elsewhere/ckpt-9",
               ["ckpt-3", "../other/ckpt-8", "ckpt-5", "/elsewhere/ckpt-9"])
  problems = []
  state = inspection.read_state(str(d), problems)
  assert problems == [
      f"{d}/checkpoint: lists {d}/../other/ckpt-8, which is outside {d}; "
      "refused",
      f"{d}/checkpoint: lists /elsewhere/ckpt-9, which is outside {d}; "
      "refused"]  # each once, though listed twice
  assert state.all_model_checkpoint_paths == [f"{d}/ckpt-3", f"{d}/ckpt-5"]
  assert state.model_checkpoint_path is None  # the latest is elsewhere
  result = inspection.verify_path(str(d))
  assert not result["ok"] and result["checked"] == 2
  assert result["problems"] == problems
  # The latest inside is kept.
  _write_state(d, "ckpt-5", ["ckpt-3", "ckpt-5"])
  problems = []
  state = inspection.read_state(str(d), problems)
  assert problems == [] and state.model_checkpoint_path == f"{d}/ckpt-5"
  assert state.all_model_checkpoint_paths == [f"{d}/ckpt-3", f"{d}/ckpt-5"]


def test_an_unparsable_state_file_is_a_problem_not_an_empty_directory(
    golden_copy):
  d = golden_copy("single_host")
  (d / "checkpoint").write_text('model_checkpoint_path: "ckpt-5\n')
  problems = []
  assert inspection.read_state(str(d), problems) is None
  assert len(problems) == 1 and str(d / "checkpoint") in problems[0]
  rows = inspection.list_checkpoints(str(d))
  assert [r["number"] for r in rows] == [3, 4, 5]
  assert not any(r["committed"] or r["latest"] for r in rows)
  result = inspection.verify_path(str(d))
  assert result == dict(ok=False, checked=0, problems=[
      problems[0], f"{d}: no committed checkpoint found"])
  (d / "checkpoint").unlink()  # no state file: nothing listed, no problem
  problems = []
  assert inspection.read_state(str(d), problems) is None and problems == []


def test_list_checkpoints_describes_each_file(golden_copy):
  import shutil  # pylint: disable=g-import-not-at-top
  d = golden_copy("single_host")
  shutil.copy(d / "ckpt-5.flax", d / "ckpt-10.flax")   # unlisted, no TF files
  shutil.copy(d / "ckpt-5.flax", d / "ckpt-2.flax")
  shutil.copy(d / "ckpt-5.index", d / "ckpt-2.index")  # unlisted, an .index
  (d / "ckpt-4.index").unlink()                         # listed, no .index
  (d / "ckpt-x.flax").write_bytes(b"")                  # not a number
  (d / "notes.txt").write_text("")
  (d / "ckpt-5.flaxy").write_text("")
  problems = []
  rows = inspection.list_checkpoints(str(d), problems)
  assert problems == []
  assert [r["number"] for r in rows] == [2, 3, 4, 5, 10]
  by = {r["number"]: r for r in rows}
  from clu_ckpt import layout  # pylint: disable=g-import-not-at-top
  state = layout.read_checkpoint_state(str(d))
  recorded = dict(zip(state.all_model_checkpoint_paths,
                      state.all_model_checkpoint_timestamps))
  for number, row in by.items():
    flax = d / f"ckpt-{number}.flax"
    tf_files = sorted(p.name for p in d.glob(f"ckpt-{number}.*")
                      if p.suffix == ".index" or ".data-" in p.name)
    assert row["name"] == "ckpt" and row["prefix"] == f"{d}/ckpt-{number}"
    assert row["readable"] is True and row["tf_files"] == tf_files
    assert row["flax_bytes"] == flax.stat().st_size
    assert row["tf_bytes"] == sum((d / f).stat().st_size for f in tf_files)
    assert row["mtime"] == inspection._iso(flax.stat().st_mtime)  # pylint: disable=protected-access
    stamp = recorded.get(f"{d}/ckpt-{number}")
    assert row["saved"] == (None if stamp is None else
                            inspection._iso(stamp))  # pylint: disable=protected-access
    assert row["committed"] is (number in (3, 5))
    assert row["latest"] is (number == 5)
  assert by[10]["tf_files"] == [] and by[10]["tf_bytes"] == 0
  assert by[2]["tf_files"] == ["ckpt-2.index"]


def test_unreadable_files_are_named_and_their_checkpoint_not_read(tmp_path,
                                                                  golden_copy):
  d = golden_copy("single_host")
  outside = tmp_path / "outside.flax"
  (d / "ckpt-5.flax").rename(outside)
  (d / "ckpt-5.flax").symlink_to(outside)
  (d / "ckpt-4.index").unlink()
  os.mkfifo(d / "ckpt-4.index")
  problems = []
  rows = {r["number"]: r for r in inspection.list_checkpoints(str(d),
                                                              problems)}
  assert len(problems) == 2
  assert str(d / "ckpt-4.index") in problems[0]
  assert "named pipe" in problems[0]
  assert str(d / "ckpt-5.flax") in problems[1]
  assert str(outside) in problems[1] and "outside" in problems[1]
  for number in (4, 5):
    assert rows[number]["readable"] is False
    assert (rows[number]["flax_bytes"], rows[number]["tf_bytes"]) == (0, 0)
    assert rows[number]["mtime"] == inspection._iso(0.0)  # pylint: disable=protected-access
  assert rows[3]["readable"] is True and rows[3]["flax_bytes"] > 0
  result = inspection.verify_path(str(d))
  assert result == dict(ok=False, checked=1, problems=problems)


def test_every_data_shard_is_required(golden_copy):
  d = golden_copy("single_host")
  (d / "ckpt-5.data-00000-of-00001").rename(d / "ckpt-5.data-00001-of-00003")
  (d / "ckpt-4.data-00000-of-00001").unlink()
  result = inspection.verify_path(str(d))
  assert result == dict(ok=False, checked=3, problems=[
      f"{d}/ckpt-4.data-*: no TensorFlow data file",
      f"{d}/ckpt-5.data-00000-of-00003: missing TensorFlow data shard",
      f"{d}/ckpt-5.data-00002-of-00003: missing TensorFlow data shard"])


def test_a_listed_flax_missing_is_named(golden_copy):
  d = golden_copy("single_host")
  (d / "ckpt-4.flax").unlink()
  result = inspection.verify_path(str(d))
  assert result == dict(ok=False, checked=2, problems=[
      f"{d}/ckpt-4.flax: missing for a checkpoint listed in {d}/checkpoint"])
  (d / "ckpt-5.index").unlink()
  result = inspection.verify_path(str(d))
  assert result["problems"][1:] == [
      f"{d}/ckpt-5.index: missing (TensorFlow files of a committed "
      "checkpoint)"]


@pytest.mark.parametrize("change", ["dtype", "shape", "path"])
def test_hosts_holding_other_trees_are_named(golden_copy, change):
  d = golden_copy("multihost")
  victim = d / "checkpoints-1" / "ckpt-2.flax"
  state = flax_format.load_file(str(victim), writable=True)
  leaves = state["params"]
  key = sorted(k for k in leaves if hasattr(leaves[k], "dtype"))[0] if any(
      hasattr(v, "dtype") for v in leaves.values()) else None
  if change == "path" or key is None:
    leaves["extra"] = np.zeros(1, np.float32)
  elif change == "dtype":
    leaves[key] = leaves[key].astype(np.float64)
  else:
    leaves[key] = np.concatenate([leaves[key].ravel()] * 2)
  flax_format.save_file(state, str(victim))
  result = inspection.verify_path(str(d / "checkpoints"))
  assert result["problems"] == [
      f"{d}/checkpoints-1: checkpoint 2 holds a different tree than "
      f"{d}/checkpoints-0 (paths, dtypes or shapes differ)"]


def test_hosts_without_a_common_checkpoint_are_not_ok(golden_copy):
  d = golden_copy("multihost")
  for name in ("ckpt-1", "ckpt-2"):
    for f in (d / "checkpoints-1").glob(f"{name}.*"):
      f.unlink()
  _write_state(d / "checkpoints-1", "ckpt-3", ["ckpt-3"])
  result = inspection.verify_path(str(d / "checkpoints"))
  assert result == dict(ok=False, checked=3, problems=[
      f"{d}/checkpoints: the 2 host directories have no committed "
      "checkpoint number in common"])


def test_a_single_file_is_decoded_fully_or_named(tmp_path):
  path = tmp_path / "state.flax"
  flax_format.save_file(example_state(3), str(path))
  assert inspection.verify_path(str(path)) == dict(ok=True, checked=1,
                                                   problems=[])
  path.write_bytes(path.read_bytes()[:-3])
  result = inspection.verify_path(str(path))
  assert result["ok"] is False and result["checked"] == 1
  assert len(result["problems"]) == 1 and str(path) in result["problems"][0]
  path.write_text("version https://git-lfs.github.com/spec/v1\n")
  assert inspection.verify_path(str(path)) == dict(ok=False, checked=1, problems=[
      f"{path}: not a Flax checkpoint: starts with text 'version "
      "https://git-lfs.github.com/spec/v1\\n' (a text file, not msgpack)"])
  fifo = tmp_path / "pipe.flax"
  os.mkfifo(fifo)
  result = inspection.verify_path(str(fifo))
  assert result["ok"] is False and result["checked"] == 0
  assert len(result["problems"]) == 1
  assert str(fifo) in result["problems"][0]
  assert "named pipe" in result["problems"][0]


def test_a_common_checkpoint_damaged_on_every_host_is_named_not_a_crash(
    golden_copy):
  d = golden_copy("multihost")
  victims = [d / f"checkpoints-{h}" / "ckpt-2.flax" for h in (0, 1)]
  for victim in victims:
    victim.write_bytes(victim.read_bytes()[:-5])
  result = inspection.verify_path(str(d / "checkpoints"))
  assert result["ok"] is False and result["checked"] == 5
  assert len(result["problems"]) == 2
  for victim, problem in zip(victims, result["problems"]):
    assert problem.startswith(f"{victim} at byte ")


def test_the_latest_alone_is_committed_and_verified(golden_copy):
  """A state file naming ckpt-5 as the latest only (not among all paths):
  ckpt-5 is committed, and verify reads it."""
  d = golden_copy("single_host")
  _write_state(d, "ckpt-5", ["ckpt-3"])
  rows = {r["number"]: r for r in inspection.list_checkpoints(str(d))}
  assert [n for n, r in rows.items() if r["committed"]] == [3, 5]
  assert rows[5]["latest"] is True
  (d / "ckpt-5.flax").write_bytes(b"")
  result = inspection.verify_path(str(d))
  assert result["checked"] == 2
  assert result["problems"] == [f"{d / 'ckpt-5.flax'} at byte 0: empty file"]


def _cli_verify(root, source, capsys):
  from clu_ckpt import cli  # pylint: disable=g-import-not-at-top
  code = cli.main(["verify", str(root), "--source", str(source)])
  return code, capsys.readouterr().out


def test_a_checkpoint_pruned_from_the_source_after_its_migration_is_a_note(
    tmp_path, capsys):
  # Training goes on after the migration: CLU's max_to_keep removes the
  # oldest migrated checkpoint. Its step holds the only copy; nothing is
  # lost by deleting the source, and the check before deleting must pass.
  from clu import checkpoint as clu_checkpoint  # pylint: disable=g-import-not-at-top
  src, root = tmp_path / "run", tmp_path / "dst"
  ckpt = clu_checkpoint.Checkpoint(str(src), max_to_keep=2)
  for step in (1, 2):
    ckpt.save(example_state(step))
  assert migration.migrate(str(src), str(root)).ok
  # Another directory that lacks ckpt-1 is not the source whose pruning
  # is noted: its files are missing.
  other = tmp_path / "other"
  shutil.copytree(src, other)
  for f in other.glob("ckpt-1.*"):
    f.unlink()
  result = inspection.verify_orbax_root(str(root), str(other))
  assert _problems_naming(result, str(other / "ckpt-1.index"))
  ckpt.save(example_state(3))  # ckpt-1 pruned
  assert not (src / "ckpt-1.flax").exists()
  assert migration.migrate(str(src), str(root)).ok
  result = inspection.verify_orbax_root(str(root), str(src))
  assert result["ok"], result
  assert any("ckpt-1 is no longer in" in n for n in result["notes"]), result
  code, out = _cli_verify(root, src, capsys)
  assert code == 0, out
  assert "note: " in out and "ckpt-1 is no longer in" in out
  # Gone from one host's files only (the .flax kept): still a problem.
  (src / "ckpt-2.index").unlink()
  result = inspection.verify_orbax_root(str(root), str(src))
  assert _problems_naming(result, str(src / "ckpt-2.index"))


def test_a_checkpoint_still_on_some_hosts_is_compared_not_noted(
    migrated_base):
  base, root = migrated_base
  host1 = base.parent / "ckpts-1"
  for f in host1.glob("ckpt-2.*"):
    f.unlink()
  result = inspection.verify_orbax_root(root, str(base))
  assert _problems_naming(result, str(host1 / "ckpt-2.index"))
  assert not any("ckpt-2 " in n for n in result["notes"]), result


def test_a_root_verified_against_a_source_of_other_hosts(migrated_base):
  base, root = migrated_base
  extra = base.parent / "ckpts-2"
  shutil.copytree(base.parent / "ckpts-1", extra)
  result = inspection.verify_orbax_root(root, str(base))
  assert _problems_naming(result, "migrated from hosts [0, 1], but")
  assert _problems_naming(result, "has hosts [0, 1, 2]")
