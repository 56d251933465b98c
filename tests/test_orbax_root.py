"""Tests for `clu_ckpt.orbax_root`: Orbax roots described without Orbax."""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest

from clu_ckpt import errors
from clu_ckpt import inspection
from clu_ckpt import orbax_root


def _native_root(root, steps):
  with ocp.CheckpointManager(str(root)) as mngr:
    for step in steps:
      mngr.save(step, args=ocp.args.StandardSave({"w": np.arange(4) * step}))
      mngr.wait_until_finished()


def _orbax_listing(root):
  name_format = ocp.path.step.standard_name_format()
  return sorted(m.step for m in name_format.find_all(str(root)))


def test_list_steps_equals_orbax(tmp_path):
  root = tmp_path / "root"
  _native_root(root, [0, 3, 10, 200])
  os.makedirs(root / "7.orbax-checkpoint-tmp-123")  # an interrupted save
  os.makedirs(root / "notastep")
  (root / "12").write_text("a file, not a step")
  steps, partial = orbax_root.list_steps(str(root))
  assert steps == _orbax_listing(root) == [0, 3, 10, 200]
  assert partial == ["7.orbax-checkpoint-tmp-123"]
  assert orbax_root.is_orbax_root(str(root))
  assert not orbax_root.is_orbax_root(str(tmp_path / "notthere"))


def test_native_root_is_described(tmp_path):
  _native_root(tmp_path / "root", [1, 2])
  report = orbax_root.inspect_orbax_root(str(tmp_path / "root"))
  assert [row["step"] for row in report["steps"]] == [1, 2]
  result = orbax_root.verify_orbax_root(str(tmp_path / "root"))
  assert result["ok"], result


def test_importing_the_module_imports_no_orbax_tensorstore_or_jax():
  code = ("import sys; from clu_ckpt import orbax_root, inspection; "
          "heavy = [m for m in ('orbax', 'tensorstore', 'jax', 'tensorflow') "
          "if m in sys.modules]; print(heavy)")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, check=True)
  assert done.stdout.strip() == "[]", done.stdout + done.stderr


def _tree_root(root):
  """Native steps: Composite(state=StandardSave, extra=JsonSave) at 3,
  default-item StandardSave at 5 of another root, PyTreeSave at 7."""
  tree = {"params": {"w": np.arange(6, dtype=np.float32).reshape(2, 3),
                     "b": np.ones(3, np.int16)},
          "step": np.int64(3), "lr": 0.5}
  with ocp.CheckpointManager(str(root / "composite")) as mngr:
    mngr.save(3, args=ocp.args.Composite(
        state=ocp.args.StandardSave(tree), extra=ocp.args.JsonSave({"a": 1})))
    mngr.wait_until_finished()
  with ocp.CheckpointManager(str(root / "standard")) as mngr:
    mngr.save(5, args=ocp.args.StandardSave(tree))
    mngr.wait_until_finished()
  with ocp.CheckpointManager(str(root / "pytree")) as mngr:
    mngr.save(7, args=ocp.args.PyTreeSave(dict(tree, name="sgd")))
    mngr.wait_until_finished()


def _by_path(report):
  return {(l.get("item"), l["path"]): (l["dtype"], l["shape"], l["bytes"])
          for l in report["tree"]["leaves"]}


def _orbax_says(step_dir, item):
  """What Orbax's own CheckpointManager reports for one item, registered."""
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  registry.add(item, ocp.args.StandardRestore, ocp.StandardCheckpointHandler())
  with ocp.CheckpointManager(str(step_dir), handler_registry=registry) as m:
    meta = m.item_metadata(m.latest_step())[item]
  return {k: (v.dtype.name, list(v.shape)) for k, v in meta.tree.items()
          if hasattr(v, "dtype")}


def test_native_composite_root_reports_its_items_and_orbax_metadata(tmp_path):
  _tree_root(tmp_path)
  report = orbax_root.inspect_orbax_root(str(tmp_path / "composite"))
  assert report["steps"][0]["items"] == ["extra", "state"]  # no "metadata"
  assert report["problems"] == []
  tree = report["tree"]
  assert tree["source"] == "orbax" and tree["number"] == 3
  leaves = _by_path(report)
  assert leaves[("state", "/params/w")] == ("float32", [2, 3], 24)
  assert leaves[("state", "/params/b")] == ("int16", [3], 6)
  assert leaves[("state", "/step")] == ("int64", [], 8)
  assert leaves[("state", "/lr")] == ("float64", [], 8)
  assert tree["total_bytes"] == 46
  assert tree["items"]["extra"]["unknown"].startswith("not a tree item")
  assert _orbax_says(tmp_path / "composite", "state")["step"] == (
      "int64", [])
  text = inspection.format_inspect(report)
  assert "metadata item" not in text and "jax.Array" not in text
  assert re.search(r"state +/params/w +float32 +\(2, 3\) +24 B", text)


def test_native_default_item_roots(tmp_path):
  _tree_root(tmp_path)
  standard = orbax_root.inspect_orbax_root(str(tmp_path / "standard"))
  assert standard["steps"][0]["items"] == ["default"]
  assert _by_path(standard)[("default", "/params/w")] == (
      "float32", [2, 3], 24)
  pytree = orbax_root.inspect_orbax_root(str(tmp_path / "pytree"))
  leaves = _by_path(pytree)
  assert leaves[("default", "/params/b")] == ("int16", [3], 6)
  assert leaves[("default", "/name")] == (None, None, None)
  assert pytree["tree"]["total_bytes"] is None  # a string's size: unknown
  assert "unknown" in inspection.format_inspect(pytree)


def test_without_orbax_native_leaves_are_unknown(tmp_path):
  _tree_root(tmp_path)
  code = ("import sys, json; sys.modules['orbax'] = None\n"
          "from clu_ckpt import inspection\n"
          f"r = inspection.inspect_path({str(tmp_path / 'composite')!r})\n"
          "print(json.dumps(r['tree']))\n"
          "print(inspection.format_inspect(r))\n")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, check=True)
  tree = json.loads(done.stdout.splitlines()[0])
  assert sorted(l["path"] for l in tree["leaves"]) == [
      "/lr", "/params/b", "/params/w", "/step"]
  assert all(l["dtype"] is None and l["bytes"] is None
             for l in tree["leaves"])
  assert "Orbax is not installed" in tree["items"]["state"]["unknown"]
  assert re.search(r"state +/params/w +unknown +unknown +unknown",
                   done.stdout)


def test_cli_inspect_native_root(tmp_path):
  _tree_root(tmp_path)
  done = subprocess.run(
      [sys.executable, "-m", "clu_ckpt", "inspect",
       str(tmp_path / "composite"), "--json"],
      capture_output=True, text=True)
  assert done.returncode == 0, done.stderr
  report = json.loads(done.stdout)
  assert report["steps"][0]["items"] == ["extra", "state"]
  assert _by_path(report)[("state", "/params/w")] == ("float32", [2, 3], 24)


@pytest.mark.parametrize("name", ["5.orbax-checkpoint-tmp-1", "5"])
def test_unfinished_and_finished_names(tmp_path, name):
  os.makedirs(tmp_path / name)
  steps, partial = orbax_root.list_steps(str(tmp_path))
  assert (steps, partial) == (([5], []) if name == "5" else ([], [name]))


# --------------------------------------------------------------------------
# Step naming options: as a CheckpointManager with the same options.
# --------------------------------------------------------------------------


def _manager_steps(root, prefix, length):
  options = ocp.CheckpointManagerOptions(step_prefix=prefix,
                                         step_format_fixed_length=length)
  with ocp.CheckpointManager(str(root), options=options) as mngr:
    return sorted(mngr.all_steps())


def test_list_steps_with_naming_options_equals_orbax(tmp_path):
  root = tmp_path / "root"
  options = ocp.CheckpointManagerOptions(step_prefix="step",
                                         step_format_fixed_length=4)
  with ocp.CheckpointManager(str(root), options=options) as mngr:
    for step in (0, 3, 12345):
      mngr.save(step, args=ocp.args.StandardSave({"w": np.arange(2)}))
      mngr.wait_until_finished()
  assert sorted(os.listdir(root)) == ["step_0000", "step_0003", "step_12345"]
  temporary = ["step_0009.orbax-checkpoint-tmp", "8.orbax-checkpoint-tmp-1"]
  ignored = ["step_007", "step_00012", "step_9", "0004", "other_0005",
             "Step_0006", "step_0007x", "step-0008", "stepx0010"]
  odd = ["step_0011\n", "step_1\u0663\u0663\u0663"]  # Orbax's `$` and `\d`
  for name in temporary + ignored + odd:
    os.makedirs(root / name)
  (root / "step_0013").write_text("a file, not a step")
  steps, partial = orbax_root.list_steps(
      str(root), step_prefix="step", step_format_fixed_length=4)
  assert steps == _manager_steps(root, "step", 4) == [0, 3, 11, 1333, 12345]
  assert partial == sorted(temporary)
  # Without the options, as a default manager: none of these.
  assert orbax_root.list_steps(str(root)) == (
      _manager_steps(root, None, None), sorted(temporary)) == (
          [], sorted(temporary))


@pytest.mark.parametrize("prefix,length", [
    (None, 6), ("ckpt", None), ("", None), (None, 0), ("run.v2-a", 2),
    ("step_", 3)])
def test_step_names_and_listing_equal_orbax(tmp_path, prefix, length):
  root = tmp_path / "root"
  options = ocp.CheckpointManagerOptions(step_prefix=prefix,
                                         step_format_fixed_length=length)
  with ocp.CheckpointManager(str(root), options=options) as mngr:
    for step in (1, 20, 300):
      mngr.save(step, args=ocp.args.StandardSave({"w": np.arange(2)}))
      mngr.wait_until_finished()
  assert sorted(os.listdir(root)) == sorted(
      orbax_root.step_name(s, prefix, length) for s in (1, 20, 300))
  assert orbax_root.list_steps(
      str(root), step_prefix=prefix, step_format_fixed_length=length) == (
          _manager_steps(root, prefix, length), [])
  assert _manager_steps(root, prefix, length) == [1, 20, 300]


def test_step_name_examples():
  assert orbax_root.step_name(7) == "7"
  assert orbax_root.step_name(7, "step") == "step_7"
  assert orbax_root.step_name(7, "step", 4) == "step_0007"
  assert orbax_root.step_name(12345, None, 4) == "12345"
  assert orbax_root.step_name(7, "", None) == "_7"


@pytest.mark.parametrize("prefix", ["a/b", "a+", "x(1)", "s[0]", "a|b",
                                    "^s", "s$", "a\\b", "a*", "a?", 3])
def test_prefixes_orbax_cannot_list_are_refused(tmp_path, prefix):
  with pytest.raises(errors.UsageError) as e:
    orbax_root.list_steps(str(tmp_path), step_prefix=prefix)
  assert isinstance(e.value, ValueError)
  assert repr(prefix) in str(e.value)


@pytest.mark.parametrize("length", [-1, True, "4", 2.0])
def test_lengths_orbax_cannot_use_are_refused(tmp_path, length):
  with pytest.raises(errors.UsageError, match="fixed length"):
    orbax_root.list_steps(str(tmp_path), step_format_fixed_length=length)


def test_regex_prefix_is_why_it_is_refused(tmp_path):
  # The fact behind the refusal: Orbax does not list the steps it wrote.
  options = ocp.CheckpointManagerOptions(step_prefix="a+")
  with ocp.CheckpointManager(str(tmp_path / "r"), options=options) as mngr:
    mngr.save(1, args=ocp.args.StandardSave({"w": np.arange(2)}))
    mngr.wait_until_finished()
  assert os.listdir(tmp_path / "r") == ["a+_1"]
  assert _manager_steps(tmp_path / "r", "a+", None) == []


# --------------------------------------------------------------------------
# Roots: relative paths and file:// URLs.
# --------------------------------------------------------------------------


def test_relative_and_file_url_roots(tmp_path, monkeypatch):
  _native_root(tmp_path / "runs" / "root", [2, 5])
  os.makedirs(tmp_path / "runs" / "root" / "6.orbax-checkpoint-tmp")
  want = ([2, 5], ["6.orbax-checkpoint-tmp"])
  monkeypatch.chdir(tmp_path / "runs")
  assert orbax_root.list_steps("root") == want
  assert orbax_root.list_steps("./root/") == want
  assert orbax_root.list_steps(f"file://{tmp_path}/runs/root") == want
  monkeypatch.chdir(tmp_path)
  assert orbax_root.list_steps("file:root") == ([], [])  # not a URL
  assert orbax_root.list_steps(f"file://{tmp_path}/runs/root/") == want
  with pytest.raises(errors.UsageError):
    orbax_root.list_steps("")


def test_item_names_from_disk_cannot_lead_out_of_the_step(tmp_path):
  root = tmp_path / "root"
  (root / "1" / "state").mkdir(parents=True)
  (root / "1" / "state" / "x").write_text("x")
  (tmp_path / "outside").mkdir()
  (tmp_path / "outside" / "secret").write_text("s")
  (root / "1" / "linked").symlink_to(tmp_path / "outside")
  meta = {"item_handlers": {"../../outside": "h", "linked": "h", "state": "h"}}
  (root / "1" / "_CHECKPOINT_METADATA").write_text(json.dumps(meta))
  assert list(orbax_root._step_items(str(root / "1"), meta)) == ["state"]  # pylint: disable=protected-access
  problems = orbax_root.verify_orbax_root(str(root))["problems"]
  assert sum("leads out of the step" in p for p in problems) == 2


@pytest.mark.parametrize("name", ["step_0300", "0300", "ckpt_7"])
def test_named_directories_without_step_metadata_are_named_in_every_refusal(
    tmp_path, capsys, name):
  """Directories named like steps of a prefix or padding, but without
  Orbax's step metadata, are not taken for steps: each refusal names them
  and says what checks such a root."""
  from clu_ckpt import checkpoint  # pylint: disable=g-import-not-at-top
  from clu_ckpt import cli  # pylint: disable=g-import-not-at-top
  root = tmp_path / "root"
  (root / name / "state").mkdir(parents=True)
  hint = (f"; its entries are named like {name!r} (a step prefix or a fixed "
          "length), which inspect, verify and load_state_dict do not read as "
          "one Orbax root's steps (they need one naming, and Orbax's "
          "_CHECKPOINT_METADATA in the newest step): `clu-ckpt migrate "
          "--verify` with the same --step-prefix / --step-format-fixed-length "
          "checks such a root")
  assert orbax_root.find_step_naming(str(root)) == orbax_root.PLAIN_STEPS
  assert orbax_root.step_naming_hint(str(root)) == hint
  with pytest.raises(errors.CheckpointNotFoundError) as e:
    checkpoint.load_state_dict(str(root))
  assert str(e.value).endswith(hint), e.value
  if name.isdigit():  # listed as an Orbax root, but no step is read
    assert inspection.inspect_path(str(root))["problems"] == [
        f"{root}: no finished step{hint}"]
  else:
    with pytest.raises(errors.CheckpointNotFoundError, match=re.escape(hint)):
      inspection.inspect_path(str(root))
  capsys.readouterr()
  assert cli.main(["verify", str(root)]) == 1
  assert cli.main(["verify", str(root), "--source", str(tmp_path)]) in (1, 2)
  out = capsys.readouterr()
  assert out.out.count(hint) + out.err.count(hint) == 2, out
  # A root of plain step numbers gives no such hint, nor files so named
  # (Flax's own `checkpoint_<step>` files).
  (root / name).rename(root / "300")
  assert orbax_root.step_naming_hint(str(root)) == ""
  (root / "checkpoint_10").write_bytes(b"")
  assert orbax_root.step_naming_hint(str(root)) == ""


def _leaves_equal(a, b):
  import jax  # pylint: disable=g-import-not-at-top
  flat_a, tree_a = jax.tree_util.tree_flatten(a)
  flat_b, tree_b = jax.tree_util.tree_flatten(b)
  return tree_a == tree_b and all(
      np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(x, y)
      for x, y in zip(flat_a, flat_b))


NAMINGS = [("step_{:04d}", orbax_root.StepNaming("step", 4)),
           ("{:06d}", orbax_root.StepNaming(None, 6)),
           ("ckpt_{}", orbax_root.StepNaming("ckpt", None)),
           ("_{}", orbax_root.StepNaming("", None)),
           ("my_run_{:04d}", orbax_root.StepNaming("my_run", 4)),
           ("v_{:03d}", orbax_root.StepNaming("v", None))]


def test_migrated_roots_of_named_steps_read_like_plain_ones(tmp_path,
                                                            golden_copy):
  """A root whose steps carry a prefix or a padding (`--step-prefix`,
  `--step-format-fixed-length`, or an Orbax run's own options) is read by
  load_state_dict, inspect and verify as its plain twin, and `verify
  --source` still finds what it lacks."""
  from clu_ckpt import checkpoint  # pylint: disable=g-import-not-at-top
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  from clu_ckpt.migration import destination  # pylint: disable=g-import-not-at-top
  src = golden_copy("single_host")
  plain = tmp_path / "plain"
  migration.migrate(str(src), str(plain))
  steps = orbax_root.list_steps(str(plain))[0]
  assert steps == [300, 400, 500]
  want = checkpoint.load_state_dict(str(plain))
  want_400 = checkpoint.load_state_dict(str(plain), checkpoint=400)
  for form, naming in NAMINGS:
    root = tmp_path / form.replace("{", "").replace("}", "").replace(":", "")
    shutil.copytree(plain, root)
    for step in steps:
      (root / str(step)).rename(root / form.format(step))
    assert orbax_root.find_step_naming(str(root)) == naming, form
    assert orbax_root.read_steps(str(root)) == (naming, steps, []), form
    assert orbax_root.is_orbax_root(str(root)), form
    assert _leaves_equal(checkpoint.load_state_dict(str(root)), want), form
    assert _leaves_equal(checkpoint.load_state_dict(str(root), checkpoint=400),
                         want_400), form
    assert _leaves_equal(
        checkpoint.load_state_dict(str(root), checkpoint="ckpt-4"),
        want_400), form
    report = inspection.inspect_path(str(root))
    assert [r["step"] for r in report["steps"]] == steps, form
    assert report["tree"]["number"] == 500 and report["tree"]["leaves"]
    assert report["step_naming"] == naming.describe() != "", form
    assert "steps named with --step" in inspection.format_inspect(report)
    result = orbax_root.verify_orbax_root(str(root), source=str(src))
    assert result["ok"] and result["checked"] == 3, (form, result)
    left = destination.checkpoints_not_migrated(str(root), str(src))
    assert left.names == [], form
    # Without the manifest, each step's own metadata says what it holds.
    (root / destination.MANIFEST_NAME).unlink()
    shutil.rmtree(root / form.format(500))
    left = destination.checkpoints_not_migrated(str(root), str(src))
    assert left.names == ["ckpt-5"], (form, left)


def test_named_steps_of_a_native_orbax_run_are_listed_as_orbax_lists_them(
    tmp_path):
  root = tmp_path / "root"
  options = ocp.CheckpointManagerOptions(step_prefix="step",
                                         step_format_fixed_length=5)
  with ocp.CheckpointManager(str(root), options=options) as mngr:
    for step in (7, 120):
      mngr.save(step, args=ocp.args.StandardSave({"w": np.arange(4) * step}))
      mngr.wait_until_finished()
    assert mngr.all_steps() == [7, 120]
  naming, steps, _ = orbax_root.read_steps(str(root))
  assert naming == orbax_root.StepNaming("step", 5) and steps == [7, 120]
  report = inspection.inspect_path(str(root))
  assert [r["step"] for r in report["steps"]] == [7, 120]
  assert orbax_root.verify_orbax_root(str(root))["ok"]


@pytest.mark.parametrize("names,why", [
    (["a_0001", "b_0002"], "two namings"),
    (["step_01", "step_002"], "two paddings"),
    (["run_1", "run_2"], "no step metadata"),
    (["7", "step_0008"], "plain numbers win"),
])
def test_names_that_are_not_one_roots_steps_are_read_as_plain(tmp_path, names,
                                                               why):
  root = tmp_path / "root"
  for name in names:
    (root / name).mkdir(parents=True)
    if why != "no step metadata":
      (root / name / orbax_root.STEP_METADATA).write_text("{}")
  assert orbax_root.find_step_naming(str(root)) == orbax_root.PLAIN_STEPS, why
  if why == "no step metadata":
    assert not orbax_root.is_orbax_root(str(root))
  if why == "two namings":
    assert "'a_0001' and 'b_0002' (two namings)" in (
        orbax_root.step_naming_hint(str(root)))


def test_verify_names_every_broken_step_and_goes_on(tmp_path):
  """Each broken step is named with what is wrong, and the steps after it
  are still checked: an unfinished directory, step metadata missing, an
  item listed but missing, an item listed but empty."""
  root = tmp_path / "root"
  _native_root(root, [1, 2, 3, 4])
  (root / "5.orbax-checkpoint-tmp-77").mkdir()
  (root / "1" / "_CHECKPOINT_METADATA").unlink()
  shutil.rmtree(root / "2" / "default")
  shutil.rmtree(root / "3" / "default")
  (root / "3" / "default").mkdir()
  result = orbax_root.verify_orbax_root(str(root))
  assert result["checked"] == 4 and not result["ok"]
  assert sorted(result["problems"]) == sorted([
      f"{root}/5.orbax-checkpoint-tmp-77: unfinished step directory (an "
      "interrupted save or migration)",
      f"{root}/1/_CHECKPOINT_METADATA: missing or not JSON",
      f"{root}/2/default: item listed in the step metadata is missing or "
      "empty",
      f"{root}/3/default: item listed in the step metadata is missing or "
      "empty"]), result


def test_verify_against_a_source_names_what_cannot_be_compared(
    tmp_path, golden_copy):
  root = tmp_path / "root"
  _native_root(root, [1])
  source = golden_copy("single_host")
  # A native step has no migration metadata: nothing was compared.
  assert orbax_root.verify_orbax_root(str(root), str(source))["problems"] == [
      f"{root}: no migrated step to compare with {source}"]
  # A `metadata` item that is not the migration's.
  with ocp.CheckpointManager(str(tmp_path / "other")) as mngr:
    mngr.save(1, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"w": np.arange(3)}),
        metadata=ocp.args.JsonSave({"written_by": "someone else"})))
    mngr.wait_until_finished()
  other = tmp_path / "other"
  assert orbax_root.verify_orbax_root(str(other), str(source))["problems"] == [
      f"{other}/1: no migration metadata to compare with {source}"]
  # An item named `metadata` that holds no `metadata` file is not compared.
  with ocp.CheckpointManager(str(tmp_path / "third")) as mngr:
    mngr.save(1, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"w": np.arange(3)}),
        metadata=ocp.args.StandardSave({"v": np.arange(2)})))
    mngr.wait_until_finished()
  third = tmp_path / "third"
  assert orbax_root.verify_orbax_root(str(third), str(source))["problems"] == [
      f"{third}: no migrated step to compare with {source}"]
  # Sources that are none: each named with why.
  empty = tmp_path / "empty"
  empty.mkdir()
  for given, why in [
      (str(empty), "no CLU checkpoint here (no `checkpoint` file, and no "
       "`empty-<host_id>` directories), and no flax.training.checkpoints "
       "files"),
      ("", "an empty path")]:
    problems = orbax_root.verify_orbax_root(str(root), given)["problems"]
    assert problems[0] == f"{given}: cannot be read as a CLU source: {why}"


def test_a_damaged_host_file_does_not_stop_the_other_hosts_comparison(
    tmp_path):
  from clu_ckpt import flax_format  # pylint: disable=g-import-not-at-top
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  from migration_helpers import example_state  # pylint: disable=g-import-not-at-top
  from migration_helpers import multihost_save  # pylint: disable=g-import-not-at-top
  base = tmp_path / "mh" / "ckpts"
  multihost_save(base, [[example_state(1)]] * 2)
  root = str(tmp_path / "dst")
  assert migration.migrate(str(base), root).ok
  host0 = base.parent / "ckpts-0" / "ckpt-1.flax"
  host1 = base.parent / "ckpts-1" / "ckpt-1.flax"
  state = flax_format.load_file(str(host1), writable=True)
  state["opt"]["extra"] = np.zeros(2, np.float32)
  flax_format.save_file(state, str(host1))
  host0.write_bytes(b"not msgpack")
  problems = orbax_root.verify_orbax_root(root, str(base))["problems"]
  assert any(p.startswith(f"{host0}: cannot be read to compare: ")
             for p in problems), problems
  assert f"{root}/1: leaves differ from {host1} (paths, dtypes or shapes)" in (
      problems), problems


def test_the_hint_names_two_namings(tmp_path):
  root = tmp_path / "root"
  (root / "step_0001").mkdir(parents=True)
  (root / "ckpt_0001").mkdir()
  assert orbax_root.step_naming_hint(str(root)).startswith(
      "; its entries are named like 'ckpt_0001' and 'step_0001' (two "
      "namings), which inspect")


def _named_root(root, prefix, length, steps):
  options = ocp.CheckpointManagerOptions(step_prefix=prefix,
                                         step_format_fixed_length=length)
  with ocp.CheckpointManager(str(root), options=options) as mngr:
    for step in steps:
      mngr.save(step, args=ocp.args.StandardSave({"w": np.arange(2) * step}))
      mngr.wait_until_finished()


def test_step_naming_reads_past_unfinished_names_and_single_digits(tmp_path):
  root = tmp_path / "root"
  _named_root(root, "step", None, [0, 3, 7])
  names = sorted(os.listdir(root))
  assert names == ["step_0", "step_3", "step_7"], names
  # `step_0` is the step numbered 0, not a padding to one digit.
  assert orbax_root.find_step_naming(str(root)) == (
      orbax_root.StepNaming("step", None))
  # An unfinished directory listed first does not end the reading.
  tmp = "step_9.orbax-checkpoint-tmp-9"
  (root / tmp).mkdir()
  assert orbax_root.find_step_naming(str(root), [tmp] + names) == (
      orbax_root.StepNaming("step", None))


def test_steps_of_a_file_or_missing_root_are_none(tmp_path):
  file = tmp_path / "file"
  file.write_bytes(b"x")
  for path in (file, tmp_path / "missing"):
    assert orbax_root.read_steps(str(path)) == (orbax_root.PLAIN_STEPS, [], [])
    assert orbax_root.list_steps(str(path)) == ([], [])


def test_read_steps_lists_the_root_once(tmp_path, monkeypatch):
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  root = tmp_path / "root"
  _named_root(root, "step", 4, [1, 2])
  listed = []
  real = storage.listdir
  monkeypatch.setattr(storage, "listdir",
                      lambda p: listed.append(p) or real(p))
  naming, steps, _ = orbax_root.read_steps(str(root))
  assert naming == orbax_root.StepNaming("step", 4) and steps == [1, 2]
  assert listed == [str(root)]
