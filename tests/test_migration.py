"""Tests for clu_ckpt.migration's public API: CLU directories -> Orbax steps.

Sources are the golden fixtures written by clu 0.0.12 and directories written
here by the real `clu.checkpoint`; results are read back with stock
`orbax.checkpoint.CheckpointManager`. How `migrate` runs (resuming, skipping,
failures, progress, targets) is tested in tests/test_migration_run.py; the
checks of a migration (`verify`, hosts compared) in
tests/test_migration_verify.py; shared helpers are in migration_helpers.py.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

import clu_ckpt
from clu_ckpt import flax_format
from clu_ckpt import migration
from migration_helpers import clu_save
from migration_helpers import dataset_iterator
from migration_helpers import example_state
from migration_helpers import orbax_restore
from migration_helpers import same_tree


def _stock_restore_in_fresh_process(tmp_path, *destinations):
  """Restores every step of `destinations` in a process without clu_ckpt."""
  script = textwrap.dedent("""
      import json, sys
      import numpy as np
      import orbax.checkpoint as ocp
      out = {}
      for directory in sys.argv[1:]:
        mngr = ocp.CheckpointManager(directory)
        steps = {}
        for step in mngr.all_steps():
          restored = mngr.restore(step)
          leaves = {}
          def walk(tree, path):
            if isinstance(tree, dict):
              for k, v in tree.items():
                walk(v, f"{path}/{k}")
            elif isinstance(tree, np.ndarray):
              leaves[path] = [str(tree.dtype), list(tree.shape),
                              float(np.asarray(tree, np.float64).sum())]
            else:
              leaves[path] = [type(tree).__name__, repr(tree)]
          walk(restored["state"], "")
          dataset = restored.get("dataset")
          steps[step] = {
              "items": sorted(restored),
              "leaves": leaves,
              "metadata": restored["metadata"],
              "dataset": None if dataset is None else sorted(dataset),
          }
        out[directory] = steps
      assert "clu_ckpt" not in sys.modules
      print(json.dumps(out))
  """)
  out = subprocess.run(
      [sys.executable, "-c", script] + [str(d) for d in destinations],
      check=True, capture_output=True, text=True, cwd=tmp_path)
  return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------
# The golden fixtures.
# --------------------------------------------------------------------------


def test_fixtures_read_by_stock_orbax_in_a_fresh_process(tmp_path, golden_copy):
  single = golden_copy("single_host")
  multi = golden_copy("multihost")
  flax_only = golden_copy("flax_only")
  out = {}
  for name, src in [("single", single), ("multi", multi / "checkpoints"),
                    ("flax_only", flax_only)]:
    out[name] = migration.migrate(str(src), str(tmp_path / name))
    assert out[name].ok, out[name].failed
  got = _stock_restore_in_fresh_process(
      tmp_path, *(tmp_path / n for n in ("single", "multi", "flax_only")))

  manifest = json.loads((single / "MANIFEST.json").read_text())
  single_steps = got[str(tmp_path / "single")]
  assert sorted(map(int, single_steps)) == [300, 400, 500]
  for name, entry in manifest["checkpoints"].items():
    step = single_steps[str(entry["step"])]
    assert step["items"] == ["dataset", "metadata", "state"]
    assert step["dataset"] == ["process_0"]
    assert step["metadata"]["clu_checkpoint"] == name
    assert step["metadata"]["step_mapping"] == {"3": 300, "4": 400, "5": 500}
    for path, leaf in entry["tree"].items():
      if "python" in leaf:  # None
        assert step["leaves"][path] == ["NoneType", "None"]
      elif leaf["dtype"].startswith("<U"):  # a python str in the file
        assert step["leaves"][path][0] == "str"
      elif step["leaves"][path][0] in ("int", "float"):
        # A python scalar in the file (the manifest gives numpy's view of it).
        assert leaf["shape"] == []
        assert float(step["leaves"][path][1]) == leaf["sum"]
      else:
        dtype, shape, total = step["leaves"][path]
        assert (dtype, shape) == (leaf["dtype"], leaf["shape"])
        assert total == pytest.approx(leaf["sum"], rel=1e-6)

  multi_steps = got[str(tmp_path / "multi")]
  assert sorted(map(int, multi_steps)) == [1, 2]  # ckpt-3 is on host 1 only.
  assert out["multi"].not_on_all_hosts == [3]
  assert multi_steps["2"]["dataset"] == ["process_0", "process_1"]
  assert multi_steps["2"]["metadata"]["hosts"] == 2

  flax_steps = got[str(tmp_path / "flax_only")]
  assert sorted(map(int, flax_steps)) == [10, 20]
  assert flax_steps["20"]["items"] == ["metadata", "state"]  # No tf_state.


def test_migrated_iterators_resume_where_clu_left_them(tmp_path, golden_copy):
  single = golden_copy("single_host")
  multi = golden_copy("multihost")
  assert migration.migrate(str(single), str(tmp_path / "single")).ok
  assert migration.migrate(str(multi / "checkpoints"), str(tmp_path / "m")).ok

  manifest = json.loads((single / "MANIFEST.json").read_text())
  with ocp.CheckpointManager(tmp_path / "single") as mngr:
    for entry in manifest["checkpoints"].values():
      it = dataset_iterator()
      mngr.restore(entry["step"], args=ocp.args.Composite(
          dataset=clu_ckpt.TfStateRestore(dict(ds_iter=it))))
      assert next(it).numpy().tolist() == entry["next_batch"]

  expected = json.loads((multi / "MANIFEST.json").read_text())[
      "next_batch_after_restore"]
  with ocp.CheckpointManager(tmp_path / "m") as mngr:
    for host, batch in expected.items():
      it = dataset_iterator()
      mngr.restore(2, args=ocp.args.Composite(
          dataset=clu_ckpt.TfStateRestore(dict(ds_iter=it),
                                          process_index=int(host))))
      assert next(it).numpy().tolist() == batch


@pytest.mark.parametrize("case", ["legacy_optimizer_tree", "incomplete_save"])
def test_other_fixtures_migrate_exactly(tmp_path, case, golden_copy):
  src = golden_copy(case)
  summary = migration.migrate(str(src), str(tmp_path / "dst"), verify=True)
  assert summary.ok, summary.failed
  # incomplete_save: only the committed ckpt-1; the torn ckpt-2.flax is not
  # a checkpoint.
  assert [s.number for s in summary.steps] == [1]
  assert all(s.verified for s in summary.steps)
  step = summary.steps[0].step
  assert same_tree(migration.restore_state(str(tmp_path / "dst"), step),
               flax_format.load_file(str(src / "ckpt-1.flax")))


# --------------------------------------------------------------------------
# Leaves and keys.
# --------------------------------------------------------------------------


def test_every_kind_of_leaf_survives(tmp_path):
  state = {
      "step": 5,
      "f32": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
      "bf16": np.array([1.5, -2.25, np.inf], ml_dtypes.bfloat16),
      "f16": np.array([np.nan, 0.5], np.float16),
      "f8": np.array([1, 2, 3], ml_dtypes.float8_e4m3fn),
      "u4": np.array([1, 15, 7], ml_dtypes.uint4),
      "i8": np.array([-128, 127], np.int8),
      "bool": np.array([True, False, True]),
      "u64": np.array(2**64 - 1, np.uint64),
      "c64": np.array([1 + 2j], np.complex64),
      "text": np.array(["ab", "cde"]),
      "empty": np.zeros((0, 3), np.float32),
      "np_scalar": np.float32(2.5),
      "np_bool": np.bool_(True),
      "py": {"int": -7, "big": 2**63 + 1, "float": 1e-300, "bool": False,
             "str": "héllo", "none": None, "complex": 3 - 4j,
             "bytes": b"\x00\xff", "no_bytes": b""},
      "nested": {"list": [1, 2.0], "empty_dict": {}},
  }
  clu_save(tmp_path / "src", [state])
  summary = migration.migrate(str(tmp_path / "src"), str(tmp_path / "dst"),
                              verify=True)
  assert summary.ok, summary.failed
  assert summary.steps[0].step == 5
  source = flax_format.load_file(str(tmp_path / "src" / "ckpt-1.flax"))
  assert same_tree(migration.restore_state(str(tmp_path / "dst"), 5), source)

  # Stock Orbax alone gets every ordinary leaf exactly, and stand-ins for
  # the rest, which the metadata item describes.
  stock = orbax_restore(tmp_path / "dst", 5)
  for key in ("f32", "bf16", "f16", "f8", "i8", "bool", "u64", "c64"):
    assert same_tree(stock["state"][key], state[key]), key
  assert stock["state"]["py"]["str"] == "héllo"
  assert stock["state"]["py"]["none"] is None
  assert stock["state"]["py"]["big"] == 2**63 + 1
  assert stock["state"]["nested"]["empty_dict"] == {}
  records = stock["metadata"]["encoded"]["records"]
  assert records['["empty"]']["stored_as"] == "none"
  assert records['["u4"]']["stored_as"] == "raw_bytes"
  assert records['["text"]']["stored_as"] == "raw_bytes"
  assert records['["py", "complex"]']["kind"] == "complex"
  assert records['["np_scalar"]']["kind"] == "npscalar"
  leaves = {leaf["path"]: leaf for leaf in stock["metadata"]["leaves"]}
  assert leaves["/bf16"] == {"path": "/bf16", "kind": "ndarray",
                             "dtype": "bfloat16", "shape": [3]}


def test_dotted_key_collision_is_refused(tmp_path):
  clu_save(tmp_path / "src", [{"a.b": np.ones(2), "a": {"b": np.zeros(2)}}])
  summary = migration.migrate(str(tmp_path / "src"), str(tmp_path / "dst"))
  assert not summary.ok
  assert "/a.b" in summary.steps[0].error and "/a/b" in summary.steps[0].error
  assert not (tmp_path / "dst" / "1").exists()


def test_encode_refuses_non_string_keys():
  with pytest.raises(migration.MigrationError, match="key 3"):
    migration.encode_state({"a": {3: np.ones(1)}})


# --------------------------------------------------------------------------
# Step naming.
# --------------------------------------------------------------------------


def test_steps_named_by_state_when_increasing(tmp_path):
  clu_save(tmp_path / "src", [example_state(s) for s in (10, 20, 30)])
  summary = migration.migrate(str(tmp_path / "src"), str(tmp_path / "dst"))
  assert summary.step_naming == "state"
  assert summary.step_mapping == {1: 10, 2: 20, 3: 30}
  with ocp.CheckpointManager(tmp_path / "dst") as mngr:
    assert list(mngr.all_steps()) == [10, 20, 30]


def test_steps_named_by_number_otherwise(tmp_path):
  clu_save(tmp_path / "src", [example_state(s) for s in (10, 10, 5)])
  summary = migration.migrate(str(tmp_path / "src"), str(tmp_path / "dst"),
                              step_naming="auto")
  assert summary.step_naming == "number"
  assert summary.step_mapping == {1: 1, 2: 2, 3: 3}
  meta = migration.read_metadata(str(tmp_path / "dst"), 3)
  assert meta["step_mapping"] == {"1": 1, "2": 2, "3": 3}
  assert meta["step_naming"] == "number"

  with pytest.raises(migration.MigrationError, match="do not increase"):
    migration.migrate(str(tmp_path / "src"), str(tmp_path / "dst2"),
                      step_naming="state")


def test_step_naming_can_be_forced_to_numbers(tmp_path):
  clu_save(tmp_path / "src", [example_state(s) for s in (10, 20)])
  summary = migration.migrate(str(tmp_path / "src"), str(tmp_path / "dst"),
                              step_naming="number")
  assert summary.step_mapping == {1: 1, 2: 2}


def test_state_without_step_is_named_by_number(tmp_path):
  clu_save(tmp_path / "src", [{"w": np.ones(2)}, {"w": np.zeros(2)}])
  summary = migration.migrate(str(tmp_path / "src"), str(tmp_path / "dst"))
  assert summary.step_mapping == {1: 1, 2: 2}
  with pytest.raises(migration.MigrationError, match="no integer"):
    migration.migrate(str(tmp_path / "src"), str(tmp_path / "x"),
                      step_naming="state")


def test_name_steps_rules():
  ckpts = [migration.SourceCheckpoint(n, {0: f"/c/ckpt-{n}"}) for n in (1, 2)]
  assert migration.name_steps(ckpts, {1: 0, 2: 7}) == ("state", {1: 0, 2: 7})
  assert migration.name_steps(ckpts, {1: -1, 2: 7}) == ("number",
                                                         {1: 1, 2: 2})
  assert migration.name_steps(ckpts, {1: 3, 2: None}) == ("number",
                                                           {1: 1, 2: 2})


# --------------------------------------------------------------------------
# Selection and errors of the source.
# --------------------------------------------------------------------------


def test_selection(tmp_path, golden_copy):
  src = golden_copy("single_host")
  latest = migration.migrate(str(src), str(tmp_path / "a"),
                             checkpoints="latest")
  assert [s.number for s in latest.steps] == [5]
  picked = migration.migrate(str(src), str(tmp_path / "b"), checkpoints=[4])
  assert [(s.number, s.step) for s in picked.steps] == [(4, 400)]
  with pytest.raises(migration.MigrationError, match=r"\[2\].*\[3, 4, 5\]"):
    migration.migrate(str(src), str(tmp_path / "c"), checkpoints=[2])


def test_missing_source_is_a_clear_error(tmp_path):
  with pytest.raises(migration.MigrationError, match="no CLU checkpoint"):
    migration.migrate(str(tmp_path / "nothing"), str(tmp_path / "dst"))


# --------------------------------------------------------------------------
# Compression and the memory budget.
# --------------------------------------------------------------------------


def _du(directory):
  return sum(f.stat().st_size for f in Path(directory).rglob("*")
             if f.is_file())


def test_compression_choice(tmp_path):
  clu_save(tmp_path / "src", [{"zeros": np.zeros(2**20, np.float32)}])
  for compression in ("zstd", "none"):
    summary = migration.migrate(str(tmp_path / "src"),
                                str(tmp_path / compression),
                                compression=compression, verify=True)
    assert summary.ok, summary.failed
    meta = migration.read_metadata(str(tmp_path / compression), 1)
    assert meta["compression"] == compression
  assert _du(tmp_path / "zstd") < 2**20 < 4 * 2**20 <= _du(tmp_path / "none")
  with pytest.raises(migration.MigrationError, match="compression"):
    migration.migrate(str(tmp_path / "src"), str(tmp_path / "x"),
                      compression="gzip")


def test_many_arrays_through_a_small_budget(tmp_path):
  state = {f"a{i:02d}": np.full(2**18, i, np.float32) for i in range(24)}
  clu_save(tmp_path / "src", [state])
  events = []
  summary = migration.migrate(str(tmp_path / "src"), str(tmp_path / "dst"),
                              inflight_bytes=2 * 2**20, progress=events.append,
                              verify=True)
  assert summary.ok, summary.failed
  assert sum(e.nbytes for e in events if e.event == "bytes") == 24 * 2**20


# --------------------------------------------------------------------------
# The fleet script.
# --------------------------------------------------------------------------


@pytest.mark.thorough
def test_fleet_script_migrates_runs_and_reports(tmp_path, golden_copy):
  broken = golden_copy("single_host")
  (broken / "ckpt-5.flax").write_bytes(b"\x81")
  multi = golden_copy("multihost")
  script = Path(__file__).resolve().parents[1] / "migration" / "migrate_runs.py"
  report = tmp_path / "report.json"
  run = subprocess.run(
      [sys.executable, str(script), f"--sources={broken}",
       f"--source_glob={multi}/checkpoints-*",
       f"--destination_root={tmp_path / 'orbax'}", "--parallelism=2",
       "--checkpoints=latest", f"--report={report}"],
      capture_output=True, text=True, cwd=tmp_path)
  assert run.returncode == 1, run.stderr[-2000:]
  runs = {Path(r["source"]).name: r
          for r in json.loads(report.read_text())["runs"]}
  # The two host directories matched by the glob are one multihost run.
  assert sorted(runs) == ["checkpoints", "single_host"]
  assert runs["checkpoints"]["status"] == "ok"
  assert runs["checkpoints"]["summary"]["hosts"] == [0, 1]
  assert runs["single_host"]["status"] == "failed"
  assert "ckpt-5.flax" in runs["single_host"]["error"]
  with ocp.CheckpointManager(tmp_path / "orbax" / "multihost" /
                             "checkpoints") as mngr:
    assert list(mngr.all_steps()) == [2]
  assert not (tmp_path / "orbax" / "single_host" / "500").exists()


# --------------------------------------------------------------------------
# The guide's code.
# --------------------------------------------------------------------------


def _guide_blocks():
  text = (Path(__file__).resolve().parents[1] / "migration" /
          "README.md").read_text()
  blocks = {}
  for part in text.split("<!-- guide: ")[1:]:
    name, rest = part.split(" -->", 1)
    code = rest.split("```python\n", 1)[1].split("```", 1)[0]
    blocks[name] = code
  return blocks


def test_guide_code_resumes_training_exactly(tmp_path):
  blocks = _guide_blocks()
  assert {"common", "before", "after"} <= set(blocks)
  ns = {}
  for name in ("common", "before", "after"):
    code = compile(blocks[name], f"README:{name}", "exec")
    exec(code, ns)  # pylint: disable=exec-used
  reference = ns["train_clu"](str(tmp_path / "ref"), 300)
  ns["train_clu"](str(tmp_path / "clu"), 200)
  summary = migration.migrate(str(tmp_path / "clu"), str(tmp_path / "orbax"))
  assert summary.ok and summary.step_naming == "state"
  assert summary.step_mapping == {1: 0, 2: 100, 3: 200}
  resumed = ns["train_orbax"](str(tmp_path / "orbax"), 300)
  import jax  # pylint: disable=g-import-not-at-top
  assert int(resumed.step) == 300
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(reference)):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  with ocp.CheckpointManager(tmp_path / "orbax") as mngr:
    assert list(mngr.all_steps()) == [100, 200, 300]


def test_guide_habit_table_options_behave_as_the_table_says(tmp_path):
  ns = {}
  exec(compile(_guide_blocks()["habits"], "README:habits", "exec"), ns)  # pylint: disable=exec-used
  options = ns["habit_options"]()
  tree = {"w": np.arange(4, dtype=np.float32)}

  def manager(name):
    return ocp.CheckpointManager(tmp_path / name, options=options[name])

  def save(mngr, step, **kwargs):
    saved = mngr.save(step, args=ocp.args.StandardSave(tree), **kwargs)
    mngr.wait_until_finished()
    return saved

  with manager("max_to_keep") as mngr:
    for step in range(7):
      save(mngr, step)
    assert list(mngr.all_steps()) == [2, 3, 4, 5, 6]
  with manager("every_1000_steps") as mngr:
    saved = [step for step in range(0, 2500, 50) if save(mngr, step)]
    assert saved == [0, 1000, 2000] == list(mngr.all_steps())
  with manager("every_10_minutes") as mngr:
    assert save(mngr, 1) and not mngr.should_save(2)
  with manager("temporary_and_permanent") as mngr:
    for step in (10_000, 10_001, 10_002):
      save(mngr, step)
    assert list(mngr.all_steps()) == [10_000, 10_002]
  with manager("best_by_metric") as mngr:
    for step, acc in enumerate([0.5, 0.9, 0.1, 0.8, 0.7]):
      save(mngr, step, metrics={"accuracy": acc})
    assert sorted(mngr.all_steps()) == [1, 3, 4]
  with manager("async") as mngr:
    mngr.save(5, args=ocp.args.StandardSave(tree))
    mngr.wait_until_finished()
    assert list(mngr.all_steps()) == [5]
  with manager("keep_every_6_hours") as mngr:
    for step in range(7):
      save(mngr, step)
    assert len(list(mngr.all_steps())) >= 5
