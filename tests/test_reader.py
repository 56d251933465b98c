"""`load_state_dict` of every layout, in processes without TensorFlow.

Sources are written by the real `clu.checkpoint` (CLU runs) and the real
`flax.training.checkpoints` (Flax's own files, Orbax checkpointing off),
migrated by `clu_ckpt.migration`, and read back in a child process where
`import tensorflow` fails. The child writes what it read with
`flax_format.save_file` (msgpack keeps key order, Python int vs numpy
scalar, float, str, None, bytes, complex and array dtypes apart), and the
parent compares it exactly (`same_tree`) with what the oracle returns: real
clu's `load_state_dict` of the source, or Flax's `restore_checkpoint`.
"""

import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import flax
import ml_dtypes
import numpy as np
import pytest
from clu import checkpoint as clu_checkpoint
from flax import serialization
from flax.training import checkpoints as flax_checkpoints

from clu_ckpt import checkpoint
from clu_ckpt import errors
from clu_ckpt import flax_format
from clu_ckpt import migration
from clu_ckpt import orbax_read
from clu_ckpt import reader
from migration_helpers import clu_save
from migration_helpers import multihost_save
from migration_helpers import same_tree

pytestmark = pytest.mark.filterwarnings(
    "ignore:Flax Checkpointing will soon be deprecated:DeprecationWarning")

REPO = pathlib.Path(__file__).resolve().parents[1]
OLD_STACK = (REPO.parent / "shared" / "fixtures" / "old-stacks" /
             "tf2.16-flax0.8.5")
if not OLD_STACK.exists():
  OLD_STACK = pathlib.Path(
      "/work/shared/fixtures/old-stacks/tf2.16-flax0.8.5")


def _state(step):
  """A state with every kind of leaf a Flax state dict holds."""
  return {
      "step": step,
      "params": {"Dense_0": {"kernel": np.arange(6, dtype=np.float32)
                             .reshape(2, 3) * step,
                             "bias": np.ones(3, ml_dtypes.bfloat16)},
                 "big_endian": np.arange(3, dtype=">i4"),
                 "empty": np.zeros((0, 2), np.float16)},
      "opt": [{"count": np.int32(step), "lr": 0.5, "name": "adam",
               "flag": None, "on": True}, {"c": complex(1, -2)}],
      "blob": b"\x00\x01",
      "nested": {"empty": {}, "deep": {"x": -7}},
  }


def _flax_save(directory, steps, prefix="checkpoint_", keep=2, chunk=None):
  """Real `flax.training.checkpoints.save_checkpoint`, Orbax off."""
  flax.config.update("flax_use_orbax_checkpointing", False)
  saved = serialization.MAX_CHUNK_SIZE
  if chunk is not None:
    serialization.MAX_CHUNK_SIZE = chunk
  try:
    for step in steps:
      state = {"step": step, "w": np.arange(100, dtype=np.float32) * step,
               "opt": [{"mu": np.ones(3)}, "sgd"]}
      flax_checkpoints.save_checkpoint(str(directory), state, step,
                                       prefix=prefix, keep=keep)
  finally:
    serialization.MAX_CHUNK_SIZE = saved


def _flax_restore(directory, prefix="checkpoint_", step=None):
  flax.config.update("flax_use_orbax_checkpointing", False)
  return flax_checkpoints.restore_checkpoint(str(directory), None, step=step,
                                             prefix=prefix)


_CHILD = textwrap.dedent("""
    import importlib.abc, json, sys

    class BlockTensorFlow(importlib.abc.MetaPathFinder):
      def find_spec(self, name, path=None, target=None):
        if name == "tensorflow" or name.startswith("tensorflow."):
          raise ImportError(f"No module named {name!r} (blocked)")
        return None

    sys.meta_path.insert(0, BlockTensorFlow())
    from clu_ckpt import checkpoint, flax_format
    calls = json.loads(sys.argv[1])
    out = {}
    for i, (args, kwargs) in enumerate(calls):
      value = checkpoint.load_state_dict(*args, **kwargs)
      flax_format.save_file({"v": value}, f"{sys.argv[2]}/{i}.flax")
    try:
      import tensorflow
      out["tf_importable"] = True
    except ImportError:
      out["tf_importable"] = False
    out["modules"] = sorted(m for m in ("tensorflow", "jax", "orbax", "flax")
                            if m in sys.modules)
    print(json.dumps(out))
""")


def _read_without_tf(tmp_path, calls):
  """What `load_state_dict(*args, **kwargs)` gives for each call, in a
  child process that cannot import TensorFlow; and the child's report."""
  out_dir = tmp_path / "child_out"
  out_dir.mkdir()
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  proc = subprocess.run(
      [sys.executable, "-c", _CHILD, json.dumps(calls), str(out_dir)],
      capture_output=True, text=True, env=env, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(proc.stdout.strip().splitlines()[-1])
  values = [flax_format.load_file(str(out_dir / f"{i}.flax"))["v"]
            for i in range(len(calls))]
  return values, report


@pytest.fixture(scope="module", name="runs")
def fixture_runs(tmp_path_factory):
  """A CLU run, a multihost base and a Flax run, each with its migration."""
  root = tmp_path_factory.mktemp("reader_runs")
  clu_save(root / "clu", [_state(10), _state(20), _state(30)],
           max_to_keep=3)
  multihost_save(root / "mh" / "checkpoints",
                 [[_state(1), _state(2)], [_state(1), _state(2)]])
  _flax_save(root / "flax", [5, 10, 15])
  for name, source in (("clu", root / "clu"),
                       ("mh", root / "mh" / "checkpoints"),
                       ("flax", root / "flax")):
    summary = migration.migrate(str(source), str(root / f"{name}_orbax"))
    assert summary.ok, summary.failed
  return root


def test_every_layout_reads_without_tensorflow(runs, tmp_path):
  mh = runs / "mh" / "checkpoints"
  calls = [
      [[str(runs / "clu")], {}],
      [[str(runs / "clu_orbax")], {}],
      [[str(runs / "clu_orbax")], {"step": 20}],
      [[str(runs / "clu_orbax")], {"checkpoint": "ckpt-1"}],
      [[str(runs / "clu_orbax")], {"subtree": "params/Dense_0"}],
      [[str(runs / "clu_orbax")], {"subtree": ["opt", "0"]}],
      [[str(mh)], {}],
      [[str(runs / "mh_orbax")], {}],
      [[str(runs / "flax")], {}],
      [[str(runs / "flax_orbax")], {}],
      [[str(runs / "flax")], {"step": 10}],
      [[str(runs / "flax" / "checkpoint_10")], {}],
      [[str(OLD_STACK / "flax_training_checkpoints")], {}],
      [[str(OLD_STACK / "flax_training_checkpoints_chunked")], {}],
  ]
  got, report = _read_without_tf(tmp_path, calls)
  assert report["tf_importable"] is False
  assert report["modules"] == []   # no TensorFlow, JAX, Orbax or Flax
  clu_latest = clu_checkpoint.load_state_dict(str(runs / "clu"))
  clu_first = clu_checkpoint.Checkpoint(str(runs / "clu")).restore_dict(
      str(runs / "clu" / "ckpt-1"))
  clu_second = clu_checkpoint.Checkpoint(str(runs / "clu")).restore_dict(
      str(runs / "clu" / "ckpt-2"))
  mh_latest = clu_checkpoint.load_state_dict(f"{mh}-0")
  want = [
      clu_latest, clu_latest, clu_second, clu_first,
      clu_latest["params"]["Dense_0"], clu_latest["opt"]["0"],
      mh_latest, mh_latest,
      _flax_restore(runs / "flax"), _flax_restore(runs / "flax"),
      _flax_restore(runs / "flax", step=10),
      _flax_restore(runs / "flax", step=10),
      _flax_restore(OLD_STACK / "flax_training_checkpoints"),
      _flax_restore(OLD_STACK / "flax_training_checkpoints_chunked",
                    prefix="model_"),
  ]
  for i, (g, w) in enumerate(zip(got, want)):
    assert same_tree(g, w), (i, calls[i])
  assert got[0]["step"] == 30 and got[2]["step"] == 20
  assert got[8]["step"] == 15 and got[12]["step"] == 15


def test_frozen_flax_fixtures_match_their_manifest():
  for case, name in (("flax_training_checkpoints", "checkpoint_15"),
                     ("flax_training_checkpoints_chunked", "model_3")):
    manifest = json.loads((OLD_STACK / case / "MANIFEST.json").read_text())
    tree = manifest["checkpoints"][name]["tree"]
    state = checkpoint.load_state_dict(str(OLD_STACK / case))
    for path, leaf in tree.items():
      value = state
      for key in path.split("/")[1:]:
        value = value[key]
      if "sum" in leaf:
        total = np.asarray(value).astype(
            np.complex128 if isinstance(leaf["sum"], list) else np.float64
        ).sum()
        expected = (complex(*leaf["sum"]) if isinstance(leaf["sum"], list)
                    else leaf["sum"])
        assert total == pytest.approx(expected, rel=1e-6), (case, path)
        assert str(np.asarray(value).dtype) == leaf["dtype"], (case, path)


def test_subtree_reads_only_its_arrays(runs, monkeypatch):
  names = []
  real = orbax_read.read_arrays

  def recording(item, wanted, **kwargs):
    names.extend(wanted)
    return real(item, wanted, **kwargs)

  monkeypatch.setattr(orbax_read, "read_arrays", recording)
  got = checkpoint.load_state_dict(str(runs / "clu_orbax"),
                                   subtree="params/Dense_0")
  assert sorted(names) == ["params.Dense_0.bias", "params.Dense_0.kernel"]
  assert list(got) == ["kernel", "bias"]


def test_migrated_with_a_template_reads_as_before(tmp_path):
  jax = pytest.importorskip("jax")
  from flax.training import train_state  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  params = {"Dense_0": {"kernel": np.ones((2, 3), np.float32),
                        "bias": np.zeros(3, np.float32)}}
  state = train_state.TrainState.create(apply_fn=None, params=params,
                                        tx=optax.adam(1e-2))
  clu_save(tmp_path / "src", [state])
  abstract = jax.eval_shape(lambda: state)
  summary = migration.migrate(str(tmp_path / "src"), str(tmp_path / "dst"),
                              template=abstract)
  assert summary.ok, summary.failed
  want = clu_checkpoint.load_state_dict(str(tmp_path / "src"))
  assert same_tree(checkpoint.load_state_dict(str(tmp_path / "dst")), want)
  assert same_tree(checkpoint.load_state_dict(
      str(tmp_path / "dst"), subtree="opt_state/0"), want["opt_state"]["0"])


def test_flax_temporary_files_are_skipped(tmp_path):
  _flax_save(tmp_path, [3, 4])
  shutil.copy(tmp_path / "checkpoint_4", tmp_path / "checkpoint_tmp")
  (tmp_path / "checkpoint_9.orbax-checkpoint-tmp-17").mkdir()
  (tmp_path / "checkpoint_8_gda").mkdir()
  want = _flax_restore(tmp_path)
  assert want["step"] == 4
  assert same_tree(checkpoint.load_state_dict(str(tmp_path)), want)
  assert reader.detect_layout(str(tmp_path)) == "flax_training"


def test_chunked_arrays_of_real_flax(tmp_path):
  _flax_save(tmp_path, [1, 2], prefix="model_", chunk=64)
  raw = (tmp_path / "model_2").read_bytes()
  assert b"__msgpack_chunked_array__" in raw
  want = _flax_restore(tmp_path, prefix="model_")
  assert same_tree(checkpoint.load_state_dict(str(tmp_path)), want)
  assert same_tree(checkpoint.load_state_dict(str(tmp_path), prefix="model_"),
                   want)
  assert same_tree(checkpoint.load_state_dict(str(tmp_path), subtree="w"),
                   want["w"])


def test_detect_layout(runs, tmp_path):
  assert reader.detect_layout(str(runs / "clu")) == "clu"
  assert reader.detect_layout(str(runs / "mh" / "checkpoints")) == (
      "clu_multihost")
  assert reader.detect_layout(str(runs / "clu_orbax")) == "orbax_migrated"
  assert reader.detect_layout(str(runs / "flax")) == "flax_training"
  assert reader.detect_layout(str(tmp_path)) is None
  native = tmp_path / "native"
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  with ocp.CheckpointManager(str(native)) as mngr:
    mngr.save(1, args=ocp.args.StandardSave({"a": np.ones(2)}))
  assert reader.detect_layout(str(native)) == "orbax"
  with pytest.raises(errors.CheckpointNotFoundError, match="clu-ckpt migrate"):
    checkpoint.load_state_dict(str(native))


def test_ambiguous_directory_says_which_layout_was_read(runs, tmp_path,
                                                        caplog):
  both = tmp_path / "both"
  shutil.copytree(runs / "clu", both)
  for name in ("checkpoint_5", "checkpoint_10"):
    shutil.copy(runs / "flax" / "checkpoint_15", both / name)
  assert reader.detect_layouts(str(both)) == ["clu", "flax_training"]
  with caplog.at_level(logging.WARNING, logger="absl"):
    got = checkpoint.load_state_dict(str(both))
  assert got["step"] == 30
  warned = [r.getMessage() for r in caplog.records
            if "several checkpoint layouts" in r.getMessage()]
  assert len(warned) == 1 and "reading the clu" in warned[0]
  flax_read = reader.load_state_dict(str(both), layout_name="flax_training")
  assert flax_read["step"] == 15


@pytest.mark.parametrize("step_naming", ["number", "state"])
def test_newer_clu_checkpoint_beside_a_migrated_root_is_read(tmp_path, caplog,
                                                             step_naming):
  """A run migrated in place that went on saving in CLU's layout: its newest
  state is a CLU checkpoint, not the Orbax root's newest step."""
  run = tmp_path / "run"
  clu_save(run, [_state(10), _state(20)], max_to_keep=5)
  assert migration.migrate(str(run), str(run), step_naming=step_naming).ok
  want_migrated = clu_checkpoint.load_state_dict(str(run))
  assert reader.load_state_dict(str(run))["step"] == want_migrated["step"]
  ckpt = clu_checkpoint.Checkpoint(str(run), max_to_keep=5)
  ckpt.restore_or_initialize(_state(0))
  ckpt.save(_state(30))  # ckpt-3: newer by number and by time
  assert reader.detect_layouts(str(run)) == ["orbax_migrated", "clu"]
  with caplog.at_level(logging.WARNING, logger="absl"):
    got = checkpoint.load_state_dict(str(run))
  assert same_tree(got, clu_checkpoint.load_state_dict(str(run)))
  assert got["step"] == 30
  assert any("ckpt-3 is newer" in r.getMessage() for r in caplog.records)
  # Asked for, the Orbax root is still read.
  assert reader.load_state_dict(
      str(run), layout_name="orbax_migrated")["step"] == 20
  # Saving without restoring starts CLU's numbering over (ckpt-1): the
  # lower number is still the newest save.
  clu_save(run, [_state(40)], max_to_keep=5)
  got = checkpoint.load_state_dict(str(run))
  assert got["step"] == 40
  assert same_tree(got, clu_checkpoint.load_state_dict(str(run)))


@pytest.mark.parametrize("layout", ["clu", "clu_orbax", "flax"])
def test_subtree_typo_names_the_keys_there_are(runs, layout):
  with pytest.raises(errors.SubtreeNotFoundError) as raised:
    checkpoint.load_state_dict(str(runs / layout), subtree="parms")
  text = str(raised.value)
  assert "'parms'" in text and "'step'" in text
  with pytest.raises(flax_format.FlaxFormatError, match="its keys"):
    checkpoint.load_state_dict(
        str(runs / layout), subtree="params/Dense_1" if layout != "flax"
        else "opt/7")


def test_relative_checkpoint_names_the_absolute_path_tried(runs,
                                                           monkeypatch):
  monkeypatch.chdir(runs / "mh")
  with pytest.raises(FileNotFoundError) as raised:
    checkpoint.load_state_dict(str(runs / "clu"), checkpoint="ckpt-2")
  text = str(raised.value)
  assert str(runs / "mh" / "ckpt-2.flax") in text
  assert "current directory" in text and str(runs / "clu" / "ckpt-2") in text
  with pytest.raises(FileNotFoundError) as raised:
    checkpoint.load_state_dict(str(runs / "flax"), checkpoint="checkpoint_7")
  assert str(runs / "mh" / "checkpoint_7") in str(raised.value)


def test_nothing_there_names_the_layouts_looked_for(tmp_path):
  with pytest.raises(FileNotFoundError) as raised:
    checkpoint.load_state_dict(str(tmp_path))
  text = str(raised.value)
  for words in ("Orbax", "CLU Checkpoint", "MultihostCheckpoint",
                "flax.training.checkpoints"):
    assert words in text


def test_migrated_root_and_flax_files_in_a_bucket(runs, gcs):
  bucket = gcs.bucket()
  root = gcs.upload(runs / "clu_orbax", "orbax", bucket=bucket)
  flax_dir = gcs.upload(runs / "flax", "flax", bucket=bucket)
  assert reader.detect_layout(root) == "orbax_migrated"
  assert reader.detect_layout(flax_dir) == "flax_training"
  want = clu_checkpoint.load_state_dict(str(runs / "clu"))
  assert same_tree(checkpoint.load_state_dict(root), want)
  assert same_tree(checkpoint.load_state_dict(root, subtree="opt"),
                   want["opt"])
  assert same_tree(checkpoint.load_state_dict(flax_dir),
                   _flax_restore(runs / "flax"))


def test_inspect_of_a_clu_number_on_a_migrated_root_names_its_step(runs):
  from clu_ckpt import inspection  # pylint: disable=g-import-not-at-top
  with pytest.raises(errors.CheckpointNotFoundError) as raised:
    inspection.inspect_path(str(runs / "clu_orbax"), 2)
  assert "ckpt-2) was migrated to step 20" in str(raised.value)
  assert inspection.inspect_path(str(runs / "clu_orbax"), 20)["tree"][
      "number"] == 20
