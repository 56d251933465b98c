"""Tests for `clu_ckpt.checkpoint`, the drop-in replacement of `clu.checkpoint`.

The oracles are the real `clu` 0.0.12 (run side by side on the same operations,
or reading and writing the same directories), Flax's own serialization, and the
golden directories written by clu in `../shared/fixtures/clu-0.0.12/`.

Groups, in file order: the public surface; the golden fixtures; compatibility
with clu both ways (byte-identical files included); behaviour compared with clu
operation by operation; exceptions; `MultihostCheckpoint`; crash safety; a
subprocess in which `import tensorflow` fails.
"""

import errno
import inspect
import json
import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import time
from typing import Any, Callable

from clu import checkpoint as clu_checkpoint
import flax
from flax import serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf

from clu_ckpt import checkpoint
from clu_ckpt import errors
from clu_ckpt import flax_format

REPO = pathlib.Path(__file__).resolve().parents[1]
PUBLIC_METHODS = ("save", "restore_or_initialize", "restore", "restore_dict",
                  "load_state", "get_latest_checkpoint_to_restore_from")


@flax.struct.dataclass
class TrainState:
  params: Any
  opt_state: Any
  step: Any


def make_state(step: int) -> TrainState:
  """A TrainState with jax arrays (bfloat16 too), python scalars, str, None."""
  rng = np.random.default_rng(step)
  return TrainState(
      params={
          "Dense_0": {
              "kernel": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
              "bias": jnp.full((3,), step, jnp.float32),
          },
          "Embed_0": {
              "embedding": jnp.asarray(rng.normal(size=(5, 2)), jnp.bfloat16)
          },
          "LayerNorm_0": {"scale": jnp.ones((3,), jnp.float16)},
      },
      opt_state={
          "count": jnp.int32(step),
          "mu": np.arange(6, dtype=np.int64).reshape(2, 3) * step,
          "hyper": {"lr": 1e-3 * (step + 1), "name": "adam",
                    "betas": [0.9, 0.999], "flag": None, "nesterov": False},
      },
      step=step)


def dataset_iterator():
  return iter(tf.data.Dataset.range(10000).batch(4))


def quiet_iterator():
  """`dataset_iterator` without tf.data's background work (injected prefetch,
  autotuning): the bytes of its saved state do not depend on how far a
  background thread got, so two saves of it are byte for byte the same even
  under CPU load (with the defaults, 2 distinct `.data` files in 30 saves)."""
  options = tf.data.Options()
  options.autotune.enabled = False
  options.experimental_optimization.inject_prefetch = False
  return iter(tf.data.Dataset.range(10000).batch(4).with_options(options))


def batch(it) -> list[int]:
  return next(it).numpy().tolist()


def flatten(tree: Any) -> dict[str, Any]:
  """{"/a/b": leaf} of a state (dataclass, dict, list ...); None is a leaf."""
  out = {}

  def walk(node, path):
    if isinstance(node, dict) and node:
      for key, value in node.items():
        walk(value, f"{path}/{key}")
    else:
      out[path] = node

  walk(serialization.to_state_dict(tree), "")
  return out


def assert_trees_equal(actual: Any, expected: Any, *,
                       same_array_types: bool = True) -> None:
  """Same paths; arrays bit-equal (dtype, shape); scalars equal, same type."""
  got, want = flatten(actual), flatten(expected)
  assert sorted(got) == sorted(want)
  for path, expected_leaf in want.items():
    leaf = got[path]
    if isinstance(expected_leaf, (np.ndarray, np.generic, jax.Array)):
      a, b = np.asarray(leaf), np.asarray(expected_leaf)
      assert (a.dtype, a.shape) == (b.dtype, b.shape), path
      assert a.tobytes() == b.tobytes(), path
      if same_array_types:
        assert type(leaf) is type(expected_leaf), path
    else:
      assert type(leaf) is type(expected_leaf), path
      assert leaf == expected_leaf, path


def assert_matches_manifest(state: Any, tree: dict[str, Any]) -> None:
  """Every leaf has the dtype, shape and sum MANIFEST.json lists."""
  leaves = flatten(state)
  assert sorted(leaves) == sorted(tree)
  for path, want in tree.items():
    leaf = leaves[path]
    if "python" in want:
      assert repr(leaf) == want["python"], path
      continue
    arr = np.asarray(leaf)
    assert str(arr.dtype) == want["dtype"], path
    assert list(arr.shape) == want["shape"], path
    if want["sum"] is None:
      assert isinstance(leaf, str) and arr.dtype.kind == "U", path
    else:
      total = float(arr.astype(np.float64).sum())
      assert total == pytest.approx(want["sum"], rel=1e-6, abs=1e-12), path


def flax_oracle(flax_file: pathlib.Path) -> Any:
  return serialization.msgpack_restore(flax_file.read_bytes())


def template_from_manifest(tree: dict[str, Any]) -> TrainState:
  """A TrainState template with the manifest's structure and zero leaves."""
  root: dict[str, Any] = {}
  for path, want in tree.items():
    *parents, name = path.strip("/").split("/")
    node = root
    for key in parents:
      node = node.setdefault(key, {})
    if "python" in want:
      node[name] = None
    elif want["sum"] is None:
      node[name] = ""
    else:
      node[name] = np.zeros(want["shape"], np.float32)
  return TrainState(**root)


def files(directory: pathlib.Path) -> list[str]:
  return sorted(p.name for p in directory.iterdir())


def tf_state_paths(directory: str) -> tuple[str, list[str]]:
  """(latest, all paths) from TF's own reader of the `checkpoint` file."""
  state = tf.train.get_checkpoint_state(directory)
  return state.model_checkpoint_path, list(state.all_model_checkpoint_paths)


def listed_without_files(directory: str) -> list[str]:
  """Checkpoints TF's `checkpoint` file lists whose `.index` is missing."""
  _, paths = tf_state_paths(directory)
  local = directory.replace("file://", "")
  return [p for p in paths
          if not os.path.exists(os.path.join(local, os.path.basename(p))
                                + ".index")]


def without_ghosts(log: list[Any]) -> list[Any]:
  """`log` with ghost checkpoints (listed, no files) dropped from listings.

  clu keeps listing the checkpoints it deletes after restoring an older one;
  clu_ckpt unlists them first (see `Checkpoint.save`). Nothing else differs.
  """
  out = []
  for entry in log:
    if entry[0] == "tf_state":
      (latest, paths), ghosts = entry[1], entry[2]
      entry = ("tf_state", (latest, [p for p in paths if p not in ghosts]))
    out.append(entry)
  return out


def _only_ckpt1(entry: Any) -> Any:
  """A scenario log entry with checkpoints other than 1 left out."""
  keep = lambda name: not re.match(r"ckpt-(?!1\b)", os.path.basename(name))
  if entry[0] == "files":
    return ("files", [f for f in entry[1] if keep(f)])
  if entry[0] == "tf_state":
    latest, paths = entry[1]
    return ("tf_state", (latest, [p for p in paths if keep(p)]))
  return entry


def no_temp_files(directory: pathlib.Path) -> bool:
  return not [p for p in directory.rglob("*") if ".tmp-" in p.name]


# ---------------------------------------------------------------------------
# Public surface.
# ---------------------------------------------------------------------------


def _params(fn: Callable) -> list[tuple[str, Any, Any]]:
  return [(p.name, p.kind, p.default)
          for p in inspect.signature(fn).parameters.values()]


def test_public_names():
  for name in ("Checkpoint", "MultihostCheckpoint", "load_state_dict",
               "CheckpointInfo", "safe_normpath"):
    assert hasattr(checkpoint, name), name
  # pylint: disable-next=g-import-not-at-top,import-outside-toplevel
  from clu_ckpt import Checkpoint, MultihostCheckpoint, load_state_dict
  assert Checkpoint is checkpoint.Checkpoint
  assert MultihostCheckpoint is checkpoint.MultihostCheckpoint
  assert load_state_dict is checkpoint.load_state_dict
  assert issubclass(checkpoint.MultihostCheckpoint, checkpoint.Checkpoint)


@pytest.mark.parametrize("cls", ["Checkpoint", "MultihostCheckpoint"])
@pytest.mark.parametrize("method", ("__init__",) + PUBLIC_METHODS)
def test_signatures_equal_clu(cls, method):
  ours = getattr(getattr(checkpoint, cls), method)
  theirs = getattr(getattr(clu_checkpoint, cls), method)
  if method == "__init__":
    # One keyword-only extension, `layout` (tests/test_checkpoint_orbax_layout.py).
    assert _params(ours)[-1] == ("layout", inspect.Parameter.KEYWORD_ONLY,
                                 None)
    assert _params(ours)[:-1] == _params(theirs)
  else:
    assert _params(ours) == _params(theirs)


def test_load_state_dict_signature_extends_clu():
  ours = _params(checkpoint.load_state_dict)
  theirs = _params(clu_checkpoint.load_state_dict)
  assert ours[:len(theirs)] == theirs
  for name, kind, default in ours[len(theirs):]:
    assert kind is inspect.Parameter.KEYWORD_ONLY, name
    assert default is not inspect.Parameter.empty, name


def test_attributes_and_properties(tmp_path):
  base = str(tmp_path / "ckpts")
  ours_iter = dataset_iterator()
  ours = checkpoint.Checkpoint(base + "//", dict(ds_iter=ours_iter),
                               max_to_keep=4, checkpoint_name="model")
  theirs = clu_checkpoint.Checkpoint(base + "//",
                                     dict(ds_iter=dataset_iterator()),
                                     max_to_keep=4, checkpoint_name="model")
  for ck in (ours, theirs):
    assert ck.base_directory == base
    assert ck.max_to_keep == 4
    assert ck.checkpoint_name == "model"
    assert ck.restored_from is None
    assert ck.latest_checkpoint is None
    assert ck.current_checkpoint is None
    assert ck.get_latest_checkpoint_to_restore_from() is None
    assert isinstance(ck.tf_checkpoint, tf.train.Checkpoint)
    assert isinstance(ck.tf_checkpoint_manager, tf.train.CheckpointManager)
    assert ck.tf_checkpoint_manager.directory == base
    assert ck.tf_checkpoint_manager.checkpoints == []
  assert ours.tf_checkpoint.ds_iter is ours_iter


def test_tf_attributes_without_tf_state(tmp_path):
  ck = checkpoint.Checkpoint(str(tmp_path))
  assert isinstance(ck.tf_checkpoint, tf.train.Checkpoint)
  assert isinstance(ck.tf_checkpoint_manager, tf.train.CheckpointManager)
  assert ck.tf_checkpoint_manager.directory == str(tmp_path)


@pytest.mark.parametrize("path", [
    "gs://bucket//run/./ckpt/", "/a//b/../c/", "rel/./x/", "file:///tmp//x",
    "x", "/", "s3://b/k", "./a",
])
def test_safe_normpath_equals_clu(path):
  assert checkpoint.safe_normpath(path) == clu_checkpoint.safe_normpath(path)


@pytest.mark.parametrize("path", ["/ckpts/ckpt-7", "gs://b/r/model-12",
                                  "rel/ckpt-0", "/a-1/ckpt-10"])
def test_checkpoint_info_equals_clu(path):
  ours = checkpoint.CheckpointInfo.from_path(path)
  theirs = clu_checkpoint.CheckpointInfo.from_path(path)
  assert tuple(ours) == tuple(theirs)
  assert str(ours) == str(theirs) == path
  assert str(ours.increment()) == str(theirs.increment())
  assert (tuple(checkpoint.CheckpointInfo.initialize("/b", "x")) ==
          tuple(clu_checkpoint.CheckpointInfo.initialize("/b", "x")))


# ---------------------------------------------------------------------------
# Golden fixtures written by clu 0.0.12.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", [None, "ckpt-3", "ckpt-4", "ckpt-5"])
def test_golden_single_host(golden_copy, golden_manifest, name):
  base = golden_copy("single_host")
  manifest = golden_manifest("single_host")["checkpoints"]
  it = dataset_iterator()
  ck = checkpoint.Checkpoint(str(base), dict(ds_iter=it), max_to_keep=3)
  assert ck.latest_checkpoint == f"{base}/ckpt-5"
  assert ck.current_checkpoint == f"{base}/ckpt-0"
  requested = None if name is None else f"{base}/{name}"
  state = ck.restore(None, requested)
  name = name or "ckpt-5"
  assert_matches_manifest(state, manifest[name]["tree"])
  assert state["step"] == manifest[name]["step"]
  assert_trees_equal(state, flax_oracle(base / f"{name}.flax"))
  assert batch(it) == manifest[name]["next_batch"]
  assert ck.restored_from == f"{base}/{name}"
  assert ck.current_checkpoint == f"{base}/{name}"
  assert ck.latest_checkpoint == f"{base}/ckpt-5"


def test_golden_single_host_resume_training(golden_copy, golden_manifest):
  base = golden_copy("single_host")
  manifest = golden_manifest("single_host")["checkpoints"]["ckpt-5"]
  before = files(base)
  it = dataset_iterator()
  ck = checkpoint.Checkpoint(str(base), dict(ds_iter=it), max_to_keep=3)
  state = ck.restore_or_initialize(template_from_manifest(manifest["tree"]))
  assert isinstance(state, TrainState)
  assert_matches_manifest(state, manifest["tree"])
  assert files(base) == before  # restored, nothing written
  assert batch(it) == manifest["next_batch"]
  assert ck.save(state.replace(step=501)) == f"{base}/ckpt-6"
  kept = [f"ckpt-{n}{ext}" for n in (4, 5, 6)
          for ext in (".data-00000-of-00001", ".flax", ".index")]
  assert files(base) == sorted(kept + ["MANIFEST.json", "checkpoint"])
  assert no_temp_files(base)
  it2 = dataset_iterator()
  again = clu_checkpoint.Checkpoint(str(base), dict(ds_iter=it2))
  assert again.restore_dict()["step"] == 501
  assert batch(it2) == [x + 4 for x in manifest["next_batch"]]


def test_golden_flax_only(golden_copy, golden_manifest):
  base = golden_copy("flax_only")
  manifest = golden_manifest("flax_only")["checkpoints"]
  ck = checkpoint.Checkpoint(str(base), checkpoint_name="model", max_to_keep=2)
  assert ck.latest_checkpoint == f"{base}/model-2"
  state = ck.restore_dict()
  assert_matches_manifest(state, manifest["model-2"]["tree"])
  assert state["step"] == manifest["model-2"]["step"]
  assert ck.restored_from == f"{base}/model-2"
  assert_trees_equal(checkpoint.load_state_dict(str(base)), state)
  assert_trees_equal(ck.load_state(None), flax_oracle(base / "model-2.flax"))
  assert ck.save(dict(state, step=21)) == f"{base}/model-3"
  assert not (base / "model-1.flax").exists()
  assert not (base / "model-1.index").exists()
  assert checkpoint.load_state_dict(str(base))["step"] == 21


def test_golden_multihost(golden_copy, golden_manifest):
  root = golden_copy("multihost")
  manifest = golden_manifest("multihost")
  multihost_base = str(root / manifest["base"])
  iterators, hosts = {}, {}
  for host in range(manifest["hosts"]):
    iterators[host] = dataset_iterator()
    hosts[host] = checkpoint.MultihostCheckpoint(
        multihost_base, dict(ds_iter=iterators[host]), host_id=host)
  assert hosts[1].latest_checkpoint == f"{multihost_base}-1/ckpt-3"
  for host, ck in hosts.items():
    common = f"{multihost_base}-{host}/{manifest['common_latest']}"
    assert ck.get_latest_checkpoint_to_restore_from() == common
    state = ck.restore(None)
    assert state["step"] == manifest["restored_step"]
    assert ck.current_checkpoint == ck.restored_from == common
    assert batch(iterators[host]) == manifest["next_batch_after_restore"][
        str(host)]
  # The preempted host re-joins: its next save overwrites its own ckpt-3.
  for host in (1, 0):
    assert hosts[host].save(make_state(3)) == f"{multihost_base}-{host}/ckpt-3"
  for host in hosts:
    fresh = checkpoint.MultihostCheckpoint(multihost_base, host_id=host)
    assert (fresh.get_latest_checkpoint_to_restore_from() ==
            f"{multihost_base}-{host}/ckpt-3")
    assert_trees_equal(fresh.restore(make_state(0)), make_state(3),
                       same_array_types=False)


def test_golden_incomplete_save(golden_copy, golden_manifest):
  base = golden_copy("incomplete_save")
  manifest = golden_manifest("incomplete_save")
  ck = checkpoint.Checkpoint(str(base))
  assert ck.latest_checkpoint == f"{base}/{manifest['latest_committed']}"
  assert checkpoint.load_state_dict(str(base))["step"] == manifest[
      "restored_step"]
  with pytest.raises(flax_format.FlaxFormatError):
    ck.load_state(None, f"{base}/ckpt-2")  # the torn write itself
  template = TrainState(**flax_oracle(base / "ckpt-1.flax"))
  state = ck.restore_or_initialize(template)
  assert isinstance(state, TrainState)
  assert state.step == manifest["restored_step"]
  assert ck.current_checkpoint == f"{base}/ckpt-1"
  new = make_state(2)
  assert ck.save(new) == f"{base}/ckpt-2"
  assert (base / "ckpt-2.flax").read_bytes() == serialization.to_bytes(new)
  assert tf_state_paths(str(base)) == (f"{base}/ckpt-2",
                                       [f"{base}/ckpt-1", f"{base}/ckpt-2"])
  assert_trees_equal(clu_checkpoint.Checkpoint(str(base)).restore(new), new,
                     same_array_types=False)
  assert no_temp_files(base)


def test_golden_legacy_optimizer_tree(golden_copy, golden_manifest):
  base = golden_copy("legacy_optimizer_tree")
  manifest = golden_manifest("legacy_optimizer_tree")["checkpoints"]["ckpt-1"]
  state = checkpoint.load_state_dict(str(base))
  assert_matches_manifest(state, manifest["tree"])
  assert state["step"] == manifest["step"]
  assert_trees_equal(state, flax_oracle(base / "ckpt-1.flax"))
  params = checkpoint.load_state_dict(str(base),
                                      subtree="optimizer/target/params")
  assert_trees_equal(params, state["optimizer"]["target"]["params"])
  explicit = checkpoint.load_state_dict(str(base),
                                        checkpoint=f"{base}/ckpt-1")
  assert_trees_equal(explicit, state)


# ---------------------------------------------------------------------------
# Compatibility with clu, both ways.
# ---------------------------------------------------------------------------

_LIBS = {"clu": clu_checkpoint, "ours": checkpoint}


def _write(lib, base: str, steps: int, max_to_keep: int = 3) -> None:
  it = dataset_iterator()
  ck = lib.Checkpoint(base, dict(ds_iter=it), max_to_keep=max_to_keep)
  for step in range(1, steps + 1):
    for _ in range(step % 2 + 1):  # 2, 1, 2, 1 ... batches per step
      next(it)
    ck.save(make_state(step))


@pytest.mark.parametrize("writer,reader", [("clu", "ours"), ("ours", "clu")])
def test_cross_compatible(tmp_path, writer, reader):
  base = str(tmp_path / "ckpts")
  _write(_LIBS[writer], base, steps=4)
  results = {}
  for name, lib in _LIBS.items():  # the writer's library reading is the oracle
    it = dataset_iterator()
    ck = lib.Checkpoint(base, dict(ds_iter=it), max_to_keep=3)
    state = ck.restore_or_initialize(make_state(0))
    results[name] = (state, batch(it), ck.current_checkpoint,
                     ck.latest_checkpoint)
    it_old = dataset_iterator()
    older = lib.Checkpoint(base, dict(ds_iter=it_old))
    results[name] += (older.restore(make_state(0), f"{base}/ckpt-2"),
                      batch(it_old), older.current_checkpoint)
  got, want = results[reader], results[writer]
  assert isinstance(got[0], TrainState)
  assert_trees_equal(got[0], want[0])
  assert_trees_equal(got[0], make_state(4), same_array_types=False)
  assert got[1] == want[1] == [24, 25, 26, 27]  # 6 batches consumed
  assert got[2:4] == want[2:4] == (f"{base}/ckpt-4", f"{base}/ckpt-4")
  assert_trees_equal(got[4], want[4])
  assert_trees_equal(got[4], make_state(2), same_array_types=False)
  assert got[5] == want[5] == [12, 13, 14, 15]
  assert got[6] == want[6] == f"{base}/ckpt-2"


def _tricky_state() -> dict[str, Any]:
  fortran = np.asfortranarray(np.arange(24, dtype=np.float64).reshape(4, 6))
  return {
      "fortran": fortran,
      "strided": np.arange(40, dtype=np.int16).reshape(5, 8)[::2, 1::3],
      "empty": np.zeros((0, 3), np.float32),
      "scalars": [np.float32(1.5), np.int8(-3), np.uint64(2**64 - 1),
                  np.bool_(True), jnp.bfloat16(0.25)],
      "python": (1, -2**63, 2**64 - 1, 3.25, True, None, "süß", b"raw",
                 complex(1, -2)),
      "jax": {"f32": jnp.linspace(0, 1, 7), "i32": jnp.arange(5),
              "bool": jnp.array([True, False]), "zero_d": jnp.float16(2.0)},
      "nested": {"empty": {}, "list": [[1, 2], {"a": None}], 3: "int key"},
      "unicode_κey": np.array(["ab", "c"]),
  }


@pytest.mark.parametrize("state_fn", [lambda: make_state(7), _tricky_state],
                         ids=["train_state", "tricky"])
def test_byte_identical_files(tmp_path, state_fn):
  state = state_fn()
  dirs = {}
  for name, lib in _LIBS.items():
    dirs[name] = tmp_path / name
    it = quiet_iterator()
    next(it)
    ck = lib.Checkpoint(str(dirs[name]), dict(ds_iter=it))
    assert ck.save(state) == f"{dirs[name]}/ckpt-1"
  assert files(dirs["clu"]) == files(dirs["ours"])
  for name in files(dirs["clu"]):
    if name != "checkpoint":  # holds timestamps
      assert (dirs["ours"] / name).read_bytes() == (dirs["clu"] /
                                                    name).read_bytes(), name
  assert (dirs["ours"] / "ckpt-1.flax").read_bytes() == serialization.to_bytes(
      state)
  assert (tf.train.get_checkpoint_state(str(dirs["ours"])).model_checkpoint_path
          == f"{dirs['ours']}/ckpt-1")
  assert no_temp_files(dirs["ours"])


# ---------------------------------------------------------------------------
# Behaviour, compared with clu operation by operation.
# ---------------------------------------------------------------------------


def _outcome(fn: Callable[[], Any]) -> Any:
  """The result of fn(), or (exception type, first sentence of its message).

  clu_ckpt's exceptions derive from `CluCkptError` and the standard type clu
  raises; the standard type is what is compared.
  """
  try:
    return fn()
  except Exception as e:  # pylint: disable=broad-except
    kind = next(c for c in type(e).__mro__
                if c.__module__ == "builtins" or "clu_ckpt" not in c.__module__)
    return kind.__name__, str(e).split(" (")[0]


def _scenario(lib, base: str, empty: str) -> list[Any]:
  """Drives `lib` through a restart/preemption sequence, logging everything."""
  log: list[Any] = []
  it = dataset_iterator()
  ck = lib.Checkpoint(base, dict(ds_iter=it), max_to_keep=3)
  log.append(("init", ck.latest_checkpoint, ck.current_checkpoint))
  template = make_state(0)
  log.append(("init_state", ck.restore_or_initialize(template) is template))
  log.append(("after_init", ck.latest_checkpoint, ck.current_checkpoint,
              ck.restored_from))
  for step in range(1, 5):
    next(it)
    log.append(("save", ck.save(make_state(step)), ck.latest_checkpoint,
                ck.current_checkpoint))
  local = base.replace("file://", "")
  log.append(("files", sorted(os.listdir(local))))
  log.append(("tf_state", tf_state_paths(base), listed_without_files(base)))

  it2 = dataset_iterator()
  ck2 = lib.Checkpoint(base, dict(ds_iter=it2), max_to_keep=3)
  log.append(("restart", ck2.latest_checkpoint, ck2.current_checkpoint))
  older = f"{checkpoint.safe_normpath(base)}/ckpt-3"
  state = ck2.restore(make_state(0), older)
  log.append(("restore_older", int(state.step), batch(it2),
              ck2.current_checkpoint, ck2.latest_checkpoint,
              ck2.restored_from))
  log.append(("save_after_older", ck2.save(make_state(10)),
              ck2.current_checkpoint, ck2.latest_checkpoint))
  log.append(("files", sorted(os.listdir(local))))
  log.append(("tf_state", tf_state_paths(base), listed_without_files(base)))

  it3 = dataset_iterator()
  ck3 = lib.Checkpoint(base, dict(ds_iter=it3), max_to_keep=3)
  log.append(("restore_dict", ck3.restore_dict()["step"], batch(it3),
              ck3.current_checkpoint))
  log.append(("missing", _outcome(
      lambda: ck3.restore(None, f"{ck3.base_directory}/ckpt-99"))))
  log.append(("empty", _outcome(lambda: lib.Checkpoint(empty).restore(None)),
              _outcome(lambda: lib.load_state_dict(empty))))

  # A fresh object that saves without restoring starts over at ckpt-1.
  ck4 = lib.Checkpoint(base, max_to_keep=3)
  log.append(("save_without_restore", ck4.save({"fresh": 1}),
              ck4.current_checkpoint, ck4.latest_checkpoint))
  log.append(("files", sorted(os.listdir(local))))
  log.append(("tf_state", tf_state_paths(base), listed_without_files(base)))
  log.append(("load", lib.load_state_dict(base)))
  return log


@pytest.mark.parametrize("form", ["absolute", "relative", "file_url"])
def test_same_behaviour_as_clu(tmp_path, monkeypatch, form):
  monkeypatch.chdir(tmp_path)
  run = tmp_path / "run"
  base = {"absolute": f"{run}/ckpts/", "relative": "./run//ckpts",
          "file_url": f"file://{run}/ckpts"}[form]
  empty = str(tmp_path / "empty")
  logs, trees = {}, {}
  for name, lib in _LIBS.items():  # both libraries see the very same paths
    logs[name] = _scenario(lib, base, empty)
    run.rename(tmp_path / f"run_{name}")
    trees[name] = {p.relative_to(tmp_path / f"run_{name}").as_posix()
                   for p in (tmp_path / f"run_{name}").rglob("*")}
  # The differences: (1) after the restore of ckpt-3, clu keeps listing the
  # ckpt-5 whose files it deleted; (2) a save without restore starts over at
  # ckpt-1 and deletes every newer checkpoint; clu deletes only ckpt-1, 2, ...
  # up to the first missing number, so it keeps ckpt-4 (while its ghost
  # ckpt-5 holds a max_to_keep slot and ckpt-3 is pruned).
  ghosts = {name: [[os.path.basename(p) for p in e[2]]
                   for e in log if e[0] == "tf_state"]
            for name, log in logs.items()}
  assert ghosts == {"ours": [[], [], []],
                    "clu": [[], ["ckpt-5"], ["ckpt-5"]]}
  fresh_start = [e[0] for e in logs["ours"]].index("save_without_restore")
  assert without_ghosts(logs["ours"][:fresh_start]) == without_ghosts(
      logs["clu"][:fresh_start])
  after = {name: [_only_ckpt1(e) for e in without_ghosts(log[fresh_start:])]
           for name, log in logs.items()}
  assert after["ours"] == after["clu"]
  assert after["ours"] == without_ghosts(logs["ours"][fresh_start:])
  assert after["clu"] != without_ghosts(logs["clu"][fresh_start:])
  newer = {t for t in trees["clu"]
           if re.match(r"ckpt-(?!1\.)", os.path.basename(t))}
  assert newer and trees["ours"] == trees["clu"] - newer
  # Sanity of the log itself: pruning and overwriting happened.
  files_logged = [entry[1] for entry in logs["ours"] if entry[0] == "files"]
  assert "ckpt-1.flax" not in files_logged[0]
  assert "ckpt-5.flax" not in files_logged[1]
  assert "ckpt-1.flax" in files_logged[2]


def test_numbering_and_pruning(tmp_path):
  base = tmp_path / "ckpts"
  ck = checkpoint.Checkpoint(str(base), max_to_keep=2)
  returned = [ck.save({"step": step}) for step in range(1, 5)]
  assert returned == [f"{base}/ckpt-{n}" for n in range(1, 5)]
  assert files(base) == ["checkpoint", "ckpt-3.data-00000-of-00001",
                         "ckpt-3.flax", "ckpt-3.index",
                         "ckpt-4.data-00000-of-00001", "ckpt-4.flax",
                         "ckpt-4.index"]
  assert ck.tf_checkpoint_manager.checkpoints == returned[2:]
  for n in (3, 4):
    assert checkpoint.load_state_dict(
        str(base), checkpoint=f"{base}/ckpt-{n}") == {"step": n}
  assert no_temp_files(base)


def test_restore_or_initialize_on_empty_directory(tmp_path):
  base = tmp_path / "new" / "ckpts"
  it = dataset_iterator()
  ck = checkpoint.Checkpoint(str(base), dict(ds_iter=it))
  state = make_state(5)
  assert ck.restore_or_initialize(state) is state
  assert ck.latest_checkpoint == ck.current_checkpoint == f"{base}/ckpt-1"
  assert ck.restored_from is None
  assert files(base) == ["checkpoint", "ckpt-1.data-00000-of-00001",
                         "ckpt-1.flax", "ckpt-1.index"]
  assert_trees_equal(checkpoint.load_state_dict(str(base)),
                     serialization.msgpack_restore(
                         serialization.to_bytes(state)))


def test_load_state_dict_lists_become_dicts(tmp_path):
  ck = checkpoint.Checkpoint(str(tmp_path))
  ck.save({"layers": [np.ones(2), {"w": [3, 4]}], "t": (1, "x")})
  state = checkpoint.load_state_dict(str(tmp_path))
  assert list(state["layers"]) == ["0", "1"]
  assert state["layers"]["1"] == {"w": {"0": 3, "1": 4}}
  assert state["t"] == {"0": 1, "1": "x"}
  assert_trees_equal(state, clu_checkpoint.load_state_dict(str(tmp_path)))


def test_restore_without_tf_state_tracks_save_counter(tmp_path):
  base = str(tmp_path)
  writer = checkpoint.Checkpoint(base)
  for step in range(1, 4):
    writer.save({"step": step})
  results = {}
  for name, lib in _LIBS.items():
    ck = lib.Checkpoint(base)
    restored = ck.restore_dict(f"{base}/ckpt-2")
    results[name] = (restored, ck.current_checkpoint, ck.restored_from,
                     ck.latest_checkpoint)
  assert results["ours"] == results["clu"]
  assert results["ours"][0] == {"step": 2}


# ---------------------------------------------------------------------------
# Exceptions.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("call", [
    lambda ck: ck.restore(None), lambda ck: ck.restore_dict(),
    lambda ck: ck.load_state(None), lambda ck: ck.restore(make_state(0)),
])
def test_no_checkpoint_found(tmp_path, call):
  for base in (tmp_path / "missing", tmp_path):
    ck = checkpoint.Checkpoint(str(base))
    with pytest.raises(FileNotFoundError) as ours:
      call(ck)
    with pytest.raises(FileNotFoundError) as theirs:
      call(clu_checkpoint.Checkpoint(str(base)))
    assert str(ours.value) == str(theirs.value) == (
        f"No checkpoint found at {base}")
  with pytest.raises(FileNotFoundError, match="^No checkpoint found at "):
    checkpoint.load_state_dict(str(tmp_path))


def test_checkpoint_does_not_exist(tmp_path):
  ck = checkpoint.Checkpoint(str(tmp_path))
  ck.save({"a": 1})
  missing = f"{tmp_path}/ckpt-7"
  for call in (lambda: ck.restore(None, missing),
               lambda: ck.load_state(None, missing),
               lambda: ck.restore_dict(missing),
               lambda: checkpoint.load_state_dict(str(tmp_path),
                                                  checkpoint=missing)):
    with pytest.raises(FileNotFoundError) as e:
      call()
    assert str(e.value).startswith(f"Checkpoint {missing} does not exist")
  assert ck.restored_from is None


def test_template_mismatch_names_the_path(tmp_path):
  ck = checkpoint.Checkpoint(str(tmp_path))
  ck.save(make_state(1))
  wrong = make_state(1).replace(
      params=dict(make_state(1).params, Dense_9={"kernel": np.zeros(2)}))
  for lib in _LIBS.values():
    with pytest.raises(ValueError) as e:
      lib.Checkpoint(str(tmp_path)).restore(wrong)
    assert "Dense_9" in str(e.value) and "params" in str(e.value)
  with pytest.raises(ValueError, match="Dense_9"):
    ck.load_state(wrong)


class Unregistered:
  pass


def test_unregistered_type_raises_type_error(tmp_path):
  state = {"params": {"w": np.ones(2), "odd": Unregistered()}}
  with pytest.raises(TypeError):
    clu_checkpoint.Checkpoint(str(tmp_path / "clu")).save(state)
  base = tmp_path / "ours"
  ck = checkpoint.Checkpoint(str(base))
  with pytest.raises(TypeError, match="odd"):
    ck.save(state)
  assert ck.latest_checkpoint is None
  assert not base.exists() or files(base) == []
  assert ck.save({"ok": 1}) == f"{base}/ckpt-1"


# ---------------------------------------------------------------------------
# MultihostCheckpoint.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("max_to_keep", [1, 0, -1])
def test_multihost_refuses_max_to_keep_below_two(tmp_path, max_to_keep):
  for lib in _LIBS.values():
    with pytest.raises(ValueError):
      lib.MultihostCheckpoint(str(tmp_path / "c"), host_id=0,
                              max_to_keep=max_to_keep)
  assert list(tmp_path.iterdir()) == []


def test_multihost_directories(tmp_path):
  base = str(tmp_path / "checkpoints")
  for given in (base, base + "/", base + "//"):
    ck = checkpoint.MultihostCheckpoint(given, host_id=3)
    assert ck.base_directory == f"{base}-3"
    assert ck.multihost_base_directory == base
  default = checkpoint.MultihostCheckpoint(base)
  assert default.base_directory == f"{base}-{jax.process_index()}"
  assert default.save({"a": 1}) == f"{base}-{jax.process_index()}/ckpt-1"
  assert [p.name for p in tmp_path.iterdir()] == [
      f"checkpoints-{jax.process_index()}"]


def _multihost_scenario(lib, base: str, template: TrainState) -> list[Any]:
  """Three hosts; a preempted host and a slow host; then all restart."""
  log: list[Any] = []
  saves = {0: 3, 1: 4, 2: 2}  # host 1 ran ahead, host 2 fell behind
  for host, count in saves.items():
    it = dataset_iterator()
    ck = lib.MultihostCheckpoint(base, dict(ds_iter=it), host_id=host,
                                 max_to_keep=3)
    log.append((host, "first", ck.get_latest_checkpoint_to_restore_from()))
    ck.restore_or_initialize(make_state(0))
    for step in range(1, count):
      for _ in range(host + 1):
        next(it)
      log.append((host, "save", ck.save(make_state(step))))
  for restart in range(2):
    for host in saves:
      it = dataset_iterator()
      ck = lib.MultihostCheckpoint(base, dict(ds_iter=it), host_id=host,
                                   max_to_keep=3)
      log.append((host, restart, ck.get_latest_checkpoint_to_restore_from(),
                  ck.latest_checkpoint))
      state = ck.restore_or_initialize(template)
      log.append((host, restart, int(state.step), batch(it),
                  ck.current_checkpoint, ck.restored_from))
      log.append((host, restart, ck.save(make_state(int(state.step) + 1))))
  for host in saves:
    log.append((host, "files", sorted(os.listdir(f"{base}-{host}")),
                tf_state_paths(f"{base}-{host}")))
  return log


def test_multihost_same_behaviour_as_clu(tmp_path):
  base = str(tmp_path / "run" / "checkpoints")
  logs = {}
  for name, lib in _LIBS.items():
    logs[name] = _multihost_scenario(lib, base, make_state(0))
    (tmp_path / "run").rename(tmp_path / f"run_{name}")
  assert logs["ours"] == logs["clu"]
  restarts = [e for e in logs["ours"] if e[1] == 0 and len(e) == 4]
  assert [e[2] for e in restarts] == [f"{base}-{h}/ckpt-2" for h in range(3)]


@pytest.mark.parametrize("hosts", [2, 3])
def test_multihost_highest_common_number(tmp_path, hosts):
  base = str(tmp_path / "checkpoints")
  # Host h holds checkpoints 1 .. 5 - h (max_to_keep=3 prunes the oldest).
  for host in range(hosts):
    ck = checkpoint.MultihostCheckpoint(base, host_id=host, max_to_keep=3)
    for step in range(1, 6 - host):
      ck.save({"step": step, "host": host})
  common = 5 - (hosts - 1)
  for host in range(hosts):
    ck = checkpoint.MultihostCheckpoint(base, host_id=host, max_to_keep=3)
    want = f"{base}-{host}/ckpt-{common}"
    assert ck.get_latest_checkpoint_to_restore_from() == want
    assert ck.restore_dict() == {"step": common, "host": host}
    assert ck.current_checkpoint == want
    theirs = clu_checkpoint.MultihostCheckpoint(base, host_id=host,
                                                max_to_keep=3)
    assert theirs.get_latest_checkpoint_to_restore_from() == want


def test_multihost_ignores_non_host_directories(tmp_path):
  base = str(tmp_path / "checkpoints")
  for host in range(2):
    ck = checkpoint.MultihostCheckpoint(base, host_id=host)
    for step in range(1, 3 + host):
      ck.save({"step": step})
  # A backup copy (non-integer suffix) and a stray file must not count.
  shutil.copytree(f"{base}-0", f"{base}-backup")
  (tmp_path / "checkpoints-backup" / "ckpt-2.flax").unlink()
  os.mkdir(f"{base}-old")
  (tmp_path / "checkpoints-7").write_text("not a directory")
  for host in range(2):
    ck = checkpoint.MultihostCheckpoint(base, host_id=host)
    assert (ck.get_latest_checkpoint_to_restore_from() ==
            f"{base}-{host}/ckpt-2")
    assert ck.restore_dict() == {"step": 2}


@pytest.mark.parametrize("given", ["./run/checkpoints", "run//checkpoints/",
                                   "{tmp}/run//checkpoints"])
def test_multihost_unnormalized_base(tmp_path, monkeypatch, given):
  # clu 0.0.12 itself finds no host directories here (it compares normalized
  # paths with unnormalized glob results); clu_ckpt must.
  monkeypatch.chdir(tmp_path)
  given = given.format(tmp=tmp_path)
  for host in range(2):
    ck = checkpoint.MultihostCheckpoint(given, host_id=host)
    for step in range(1, 3 + host):
      ck.save({"step": step})
  ck = checkpoint.MultihostCheckpoint(given, host_id=1)
  normalized = checkpoint.safe_normpath(given)
  assert ck.base_directory == f"{normalized}-1"
  assert (ck.get_latest_checkpoint_to_restore_from() ==
          f"{normalized}-1/ckpt-2")
  assert ck.restore_dict() == {"step": 2}


def test_multihost_host_without_directory_initializes(tmp_path):
  base = str(tmp_path / "checkpoints")
  checkpoint.MultihostCheckpoint(base, host_id=0).save({"step": 1})
  late = checkpoint.MultihostCheckpoint(base, host_id=1)
  assert late.get_latest_checkpoint_to_restore_from() is None
  assert late.restore_or_initialize({"step": 0}) == {"step": 0}
  assert late.latest_checkpoint == f"{base}-1/ckpt-1"
  ck0 = checkpoint.MultihostCheckpoint(base, host_id=0)
  assert ck0.get_latest_checkpoint_to_restore_from() == f"{base}-0/ckpt-1"


def _clu_multihost(base: str, saves: dict[int, int], max_to_keep: int = 3):
  """Host h saves steps 1 .. saves[h] with clu's own MultihostCheckpoint."""
  for host, count in saves.items():
    ck = clu_checkpoint.MultihostCheckpoint(base, host_id=host,
                                            max_to_keep=max_to_keep)
    for step in range(1, count + 1):
      ck.save({"step": step, "host": host, "w": np.full((2, 3), host * 10 +
                                                          step, np.int32)})


@pytest.mark.parametrize("saves, common", [
    ({0: 5, 1: 4}, 4),           # host 1 behind: its newest is common
    ({0: 4, 1: 5, 2: 3}, 3),     # the slowest host decides
    ({0: 3, 1: 3}, 3),
])
def test_load_state_dict_of_a_multihost_base(tmp_path, caplog, saves, common):
  base = str(tmp_path / "checkpoints")
  _clu_multihost(base, saves)
  assert not os.path.exists(base)
  with caplog.at_level(logging.INFO, logger="absl"):
    got = checkpoint.load_state_dict(base)
  want = f"{base}-0/ckpt-{common}"
  theirs = clu_checkpoint.MultihostCheckpoint(base, host_id=0, max_to_keep=3)
  assert theirs.get_latest_checkpoint_to_restore_from() == want
  assert_trees_equal(got, theirs.restore_dict(), same_array_types=False)
  assert got["step"] == common and got["host"] == 0
  np.testing.assert_array_equal(
      checkpoint.load_state_dict(base, subtree="w"),
      np.full((2, 3), common, np.int32))
  chose = [r.getMessage() for r in caplog.records
           if "MultihostCheckpoint base" in r.getMessage()]
  assert len(chose) == 1, [r.getMessage() for r in caplog.records]
  assert base in chose[0] and want in chose[0] and f"{base}-0" in chose[0]


def test_load_state_dict_multihost_without_common_number(tmp_path):
  base = str(tmp_path / "checkpoints")
  _clu_multihost(base, {0: 4, 1: 1}, max_to_keep=2)  # {3, 4} and {1}
  with pytest.raises(FileNotFoundError, match="in common") as raised:
    checkpoint.load_state_dict(base)
  assert isinstance(raised.value, errors.CheckpointNotFoundError)
  assert base in str(raised.value)


def test_load_state_dict_multihost_explicit_checkpoint(tmp_path):
  base = str(tmp_path / "checkpoints")
  _clu_multihost(base, {0: 4, 1: 3})
  got = checkpoint.load_state_dict(base, checkpoint=f"{base}-1/ckpt-2")
  assert (got["step"], got["host"]) == (2, 1)
  assert checkpoint.load_state_dict(
      base, checkpoint=f"{base}-0/ckpt-4")["step"] == 4  # not common: as given
  with pytest.raises(FileNotFoundError, match="ckpt-9"):
    checkpoint.load_state_dict(base, checkpoint=f"{base}-0/ckpt-9")


def test_load_state_dict_prefers_checkpoints_at_the_base_itself(tmp_path):
  base = str(tmp_path / "checkpoints")
  _clu_multihost(base, {0: 2, 1: 2})
  checkpoint.Checkpoint(base).save({"step": 7})
  assert checkpoint.load_state_dict(base) == {"step": 7}


def test_load_state_dict_multihost_without_host_zero(tmp_path):
  base = str(tmp_path / "checkpoints")
  _clu_multihost(base, {1: 3, 2: 2})
  got = checkpoint.load_state_dict(base)
  assert (got["step"], got["host"]) == (2, 1)  # the lowest host's copy


# ---------------------------------------------------------------------------
# Crash safety.
# ---------------------------------------------------------------------------


class SaveSpy(tf.train.experimental.PythonState):
  """A real TF trackable whose `serialize` runs inside TensorFlow's save."""

  def __init__(self, on_save: Callable[[], None]):
    super().__init__()
    self.on_save = on_save

  def serialize(self) -> str:
    self.on_save()
    return "spy"

  def deserialize(self, string_value) -> None:
    del string_value


def test_flax_file_is_complete_before_tf_commits(tmp_path):
  base = tmp_path / "ckpts"
  seen = []
  state = {"step": 0}

  def on_save():
    number = len(seen) + 1
    flax_file = base / f"ckpt-{number}.flax"
    committed = tf.train.get_checkpoint_state(str(base))
    seen.append((
        flax_file.read_bytes() == serialization.to_bytes(state),
        None if committed is None else committed.model_checkpoint_path,
        no_temp_files(base)))

  ck = checkpoint.Checkpoint(str(base), dict(spy=SaveSpy(on_save)))
  for step in range(1, 4):
    state = make_state(step)
    ck.save(state)
  assert seen == [(True, None, True), (True, f"{base}/ckpt-1", True),
                  (True, f"{base}/ckpt-2", True)]
  assert no_temp_files(base)


def test_failed_tensorflow_save_is_undone(tmp_path):
  base = tmp_path / "ckpts"
  failing = [False]

  def on_save():
    if failing[0]:
      raise RuntimeError("simulated failure inside TensorFlow's save")

  ck = checkpoint.Checkpoint(str(base), dict(spy=SaveSpy(on_save)))
  ck.save(make_state(1))
  failing[0] = True
  with pytest.raises(RuntimeError, match="simulated failure"):
    ck.save(make_state(2))  # not an I/O error: raised as it is
  assert files(base) == ["checkpoint", "ckpt-1.data-00000-of-00001",
                         "ckpt-1.flax", "ckpt-1.index"]
  failing[0] = False
  assert ck.save(make_state(2)) == f"{base}/ckpt-2"  # the same number
  assert clu_checkpoint.load_state_dict(str(base))["step"] == 2


def test_flax_without_tf_commit_is_ignored_and_overwritten(tmp_path):
  base = tmp_path / "ckpts"
  ck = checkpoint.Checkpoint(str(base))
  ck.save(make_state(1))
  # What a kill between the .flax rename and TensorFlow's commit leaves.
  (base / "ckpt-2.flax").write_bytes(serialization.to_bytes(make_state(99)))
  for lib in _LIBS.values():
    assert lib.Checkpoint(str(base)).latest_checkpoint == f"{base}/ckpt-1"
  assert checkpoint.load_state_dict(str(base))["step"] == 1
  restarted = checkpoint.Checkpoint(str(base))
  assert restarted.restore_or_initialize(make_state(0)).step == 1
  assert restarted.save(make_state(3)) == f"{base}/ckpt-2"
  assert (base / "ckpt-2.flax").read_bytes() == serialization.to_bytes(
      make_state(3))
  assert clu_checkpoint.load_state_dict(str(base))["step"] == 3
  assert no_temp_files(base)


def _failing_spy(error: list):
  def on_save():
    if error[0] is not None:
      raise error[0]
  return SaveSpy(on_save)


def test_failed_tensorflow_io_is_an_oserror_and_the_number_is_reused(
    tmp_path):
  base = tmp_path / "ckpts"
  error = [None]
  ck = checkpoint.Checkpoint(str(base), dict(spy=_failing_spy(error)))
  ck.save({"step": 1})
  error[0] = tf.errors.ResourceExhaustedError(
      None, None, "ckpt-2_temp/part: No space left on device")
  with pytest.raises(OSError) as raised:
    ck.save({"step": 2})
  assert raised.value.errno == errno.ENOSPC
  assert raised.value.filename == f"{base}/ckpt-2"
  assert "Could not write checkpoint" in str(raised.value)
  assert ck.latest_checkpoint == f"{base}/ckpt-1"
  # A TensorFlow error that is not about files passes through unchanged.
  error[0] = tf.errors.FailedPreconditionError(None, None, "not savable")
  with pytest.raises(tf.errors.FailedPreconditionError):
    ck.save({"step": 2})
  error[0] = None
  assert ck.save({"step": 2}) == f"{base}/ckpt-2"
  assert files(base) == ["checkpoint"] + [
      f"ckpt-{n}{ext}" for n in (1, 2)
      for ext in (".data-00000-of-00001", ".flax", ".index")]


def test_failure_after_the_commit_keeps_the_checkpoint(tmp_path, monkeypatch):
  base = tmp_path / "ckpts"
  ck = checkpoint.Checkpoint(str(base), max_to_keep=1)
  ck.save({"step": 1})
  manager = ck.tf_checkpoint_manager

  def failing_sweep():
    raise tf.errors.UnavailableError(None, None, "glob: too many open files")

  monkeypatch.setattr(manager, "_sweep", failing_sweep)
  with pytest.raises(OSError, match="ckpt-2 was committed"):
    ck.save({"step": 2})
  assert checkpoint.load_state_dict(str(base)) == {"step": 2}
  # Committed, and the state file cannot be read back: nothing is deleted.
  manager = ck.tf_checkpoint_manager
  monkeypatch.setattr(manager, "_sweep", failing_sweep)

  def unreadable(directory):
    raise OSError(errno.EMFILE, "Too many open files", directory)

  monkeypatch.setattr(checkpoint.layout, "read_checkpoint_state", unreadable)
  with pytest.raises(OSError, match="nor read"):
    ck.save({"step": 3})
  monkeypatch.undo()
  assert checkpoint.load_state_dict(str(base)) == {"step": 3}
  assert listed_without_files(str(base)) == []
  assert ck.save({"step": 4}) == f"{base}/ckpt-4"


def test_failed_cleanup_of_a_failed_save_raises_the_save_error(
    tmp_path, monkeypatch):
  base = tmp_path / "ckpts"
  error = [None]
  ck = checkpoint.Checkpoint(str(base), dict(spy=_failing_spy(error)))
  ck.save({"step": 1})
  error[0] = OSError(errno.EIO, "Input/output error")

  def failing_remove(path):
    raise OSError(errno.EROFS, "Read-only file system", path)

  monkeypatch.setattr(checkpoint.storage, "remove", failing_remove)
  with pytest.raises(OSError) as raised:
    ck.save({"step": 2})
  monkeypatch.undo()
  assert raised.value.errno == errno.EIO
  assert ck.latest_checkpoint == f"{base}/ckpt-1"  # re-read from disk
  error[0] = None
  assert ck.save({"step": 2}) == f"{base}/ckpt-2"


def test_listed_checkpoint_without_files_is_unlisted(tmp_path):
  base = tmp_path / "ckpts"
  ck = checkpoint.Checkpoint(str(base), max_to_keep=5)
  for step in range(1, 4):
    ck.save({"step": step})
  for path in base.glob("ckpt-3.*"):
    path.unlink()
  error = [OSError(errno.ENOSPC, "No space left on device")]
  fresh = checkpoint.Checkpoint(str(base), dict(spy=_failing_spy(error)))
  assert fresh.restore_or_initialize({"step": 0}) == {"step": 2}
  with pytest.raises(OSError, match="Could not write checkpoint"):
    fresh.save({"step": 3})
  assert listed_without_files(str(base)) == []
  assert fresh.latest_checkpoint == f"{base}/ckpt-2"
  error[0] = None
  assert fresh.save({"step": 3}) == f"{base}/ckpt-3"


def test_newer_checkpoints_are_unlisted_before_their_files_go(
    tmp_path, monkeypatch):
  base = tmp_path / "ckpts"
  ck = checkpoint.Checkpoint(str(base), max_to_keep=5)
  for step in range(1, 5):
    ck.save({"step": step})
  ck.restore_dict(f"{base}/ckpt-2")
  removed = []
  remove = checkpoint.storage.remove

  def checked_remove(path):
    # Whenever a file goes, TF's `checkpoint` file lists only whole ones.
    assert listed_without_files(str(base)) == [], path
    removed.append(os.path.basename(path))
    remove(path)

  monkeypatch.setattr(checkpoint.storage, "remove", checked_remove)
  assert ck.save({"step": 30}) == f"{base}/ckpt-3"
  assert {"ckpt-3.flax", "ckpt-4.flax", "ckpt-4.index"} <= set(removed)
  assert tf_state_paths(str(base)) == (
      f"{base}/ckpt-3", [f"{base}/ckpt-{n}" for n in (1, 2, 3)])
  assert files(base) == ["checkpoint"] + [
      f"ckpt-{n}{ext}" for n in (1, 2, 3)
      for ext in (".data-00000-of-00001", ".flax", ".index")]


def test_save_without_restore_starts_over_without_listing_deleted(tmp_path):
  base = tmp_path / "ckpts"
  ck = checkpoint.Checkpoint(str(base), max_to_keep=5)
  for step in range(1, 4):
    ck.save({"step": step})
  fresh = checkpoint.Checkpoint(str(base), max_to_keep=5)
  assert fresh.save({"step": 10}) == f"{base}/ckpt-1"
  assert tf_state_paths(str(base)) == (f"{base}/ckpt-1", [f"{base}/ckpt-1"])
  assert files(base) == ["checkpoint", "ckpt-1.data-00000-of-00001",
                         "ckpt-1.flax", "ckpt-1.index"]


def _unmanaged_checkpoints(tmp_path: pathlib.Path) -> pathlib.Path:
  """ckpt-1..3 whose timestamps are older than last_preserved_timestamp."""
  base = tmp_path / "ckpts"
  ck = checkpoint.Checkpoint(str(base), max_to_keep=5)
  for step in range(1, 4):
    ck.save({"step": step})
  state_file = base / "checkpoint"
  lines = state_file.read_text().splitlines()
  lines = [l for l in lines if not l.startswith("last_preserved_timestamp")]
  lines.append(f"last_preserved_timestamp: {time.time() - 0.001!r}")
  state_file.write_text("\n".join(lines) + "\n")
  return base


def test_restore_older_when_nothing_is_managed(tmp_path):
  # A state file whose checkpoints are all older than its
  # last_preserved_timestamp (written under a clock ahead of this one):
  # TensorFlow lists them but manages none.
  base = _unmanaged_checkpoints(tmp_path)
  ck = checkpoint.Checkpoint(str(base), max_to_keep=5)
  assert ck.tf_checkpoint_manager.checkpoints == []
  ck.restore_dict(f"{base}/ckpt-1")
  assert ck.save({"step": 20}) == f"{base}/ckpt-2"
  manager = tf.train.CheckpointManager(tf.train.Checkpoint(), str(base), 5)
  assert manager.latest_checkpoint == f"{base}/ckpt-2"
  assert manager.checkpoints == [f"{base}/ckpt-2"]
  assert listed_without_files(str(base)) == []
  assert not (base / "ckpt-3.flax").exists()
  # Later saves (another process) never sweep the unmanaged checkpoints.
  later = checkpoint.Checkpoint(str(base), max_to_keep=5)
  later.restore_dict()
  assert later.save({"step": 30}) == f"{base}/ckpt-3"
  assert checkpoint.load_state_dict(
      str(base), checkpoint=f"{base}/ckpt-1") == {"step": 1}


def test_unmanaged_checkpoints_are_never_swept(tmp_path):
  base = _unmanaged_checkpoints(tmp_path)
  ck = checkpoint.Checkpoint(str(base), max_to_keep=5)
  ck.restore_dict()
  assert ck.save({"step": 4}) == f"{base}/ckpt-4"
  for n in (1, 2, 3):
    assert checkpoint.load_state_dict(
        str(base), checkpoint=f"{base}/ckpt-{n}") == {"step": n}


def test_leftovers_of_killed_saves_are_swept(tmp_path):
  base = tmp_path / "ckpts"
  ck = checkpoint.Checkpoint(str(base), max_to_keep=2)
  for step in range(1, 4):
    ck.save({"step": step})
  # A kill after TF pruned ckpt-1 (before its .flax went), a kill inside
  # TF's state-file write, and a kill inside TF's own write of ckpt-1.
  (base / "ckpt-1.flax").write_bytes(b"orphan")
  (base / "ckpt-1.flax.tmp-1-abc").write_bytes(b"orphan")
  (base / "checkpoint.tmp0123abcd").write_text("partial")
  (base / "ckpt-1_temp").mkdir()
  (base / "ckpt-1_temp" / "part-00000-of-00001.index").write_bytes(b"x")
  assert ck.save({"step": 4}) == f"{base}/ckpt-4"
  assert files(base) == ["checkpoint"] + [
      f"ckpt-{n}{ext}" for n in (3, 4)
      for ext in (".data-00000-of-00001", ".flax", ".index")]


@pytest.mark.parametrize("form", ["plain", "file_url"])
def test_sweep_leaves_other_names_alone(tmp_path, form):
  base = tmp_path / "ckpts"
  directory = f"file://{base}" if form == "file_url" else str(base)
  ck = checkpoint.Checkpoint(directory, max_to_keep=2)
  for step in range(1, 4):
    ck.save({"step": step})
  foreign = ["ckpt-backup-1.flax", "ckpt-1.flax.bak", "model-1.flax",
             "ckpt-1_temporary", "notes.txt"]
  for name in foreign:
    (base / name).write_bytes(b"keep")
  (base / "ckpt-1.flax").write_bytes(b"orphan")
  (base / "ckpt-1_temp").mkdir()
  assert ck.save({"step": 4}) == f"{directory}/ckpt-4"
  assert files(base) == sorted(["checkpoint"] + foreign + [
      f"ckpt-{n}{ext}" for n in (3, 4)
      for ext in (".data-00000-of-00001", ".flax", ".index")])


def test_remote_paths_through_gfile():
  base = f"ram://clu_ckpt_test_{os.getpid()}/ckpts"
  try:
    ck = checkpoint.Checkpoint(base, max_to_keep=2)
    for step in range(1, 4):
      ck.save({"step": step})
    tf.io.gfile.makedirs(f"{base}/ckpt-1_temp")
    with tf.io.gfile.GFile(f"{base}/ckpt-1_temp/part", "wb") as f:
      f.write(b"x")
    with tf.io.gfile.GFile(f"{base}/ckpt-1.flax", "wb") as f:
      f.write(b"orphan")
    assert ck.save({"step": 4}) == f"{base}/ckpt-4"
    assert sorted(tf.io.gfile.listdir(base)) == ["checkpoint"] + [
        f"ckpt-{n}{ext}" for n in (3, 4)
        for ext in (".data-00000-of-00001", ".flax", ".index")]
    tf.io.gfile.remove(f"{base}/ckpt-4.data-00000-of-00001")
    fresh = checkpoint.Checkpoint(base, max_to_keep=2)
    assert fresh.get_latest_checkpoint_to_restore_from() == f"{base}/ckpt-3"
    assert fresh.restore_dict() == {"step": 3}
  finally:
    if tf.io.gfile.exists(base):
      tf.io.gfile.rmtree(base)


def _remove_data_file(directory, number):
  (pathlib.Path(directory) / f"ckpt-{number}.data-00000-of-00001").unlink()


def test_latest_with_missing_files_falls_back(tmp_path):
  # What clu leaves when killed while deleting newer checkpoints: the latest
  # listed checkpoint lost its .data file.
  base = tmp_path / "ckpts"
  ck = checkpoint.Checkpoint(str(base), max_to_keep=5)
  for step in range(1, 4):
    ck.save({"step": step})
  _remove_data_file(base, 3)
  fresh = checkpoint.Checkpoint(str(base))
  assert fresh.latest_checkpoint == f"{base}/ckpt-3"
  assert fresh.get_latest_checkpoint_to_restore_from() == f"{base}/ckpt-2"
  assert fresh.restore_or_initialize({"step": 0}) == {"step": 2}
  assert fresh.save({"step": 3}) == f"{base}/ckpt-3"
  assert listed_without_files(str(base)) == []


def test_multihost_number_counts_only_with_every_hosts_files(tmp_path):
  base = str(tmp_path / "checkpoints")
  for host in range(2):
    ck = checkpoint.MultihostCheckpoint(base, host_id=host, max_to_keep=3)
    for step in range(1, 4):
      ck.save({"step": step, "host": host})
  _remove_data_file(f"{base}-1", 3)
  for host in range(2):
    ck = checkpoint.MultihostCheckpoint(base, host_id=host, max_to_keep=3)
    assert ck.get_latest_checkpoint_to_restore_from() == f"{base}-{host}/ckpt-2"
    assert ck.restore_dict() == {"step": 2, "host": host}
  for name in ("flax", "index"):
    (pathlib.Path(f"{base}-0") / f"ckpt-2.{name}").rename(
        tmp_path / f"moved.{name}")
    ck = checkpoint.MultihostCheckpoint(base, host_id=1, max_to_keep=3)
    assert ck.get_latest_checkpoint_to_restore_from() == f"{base}-1/ckpt-1"
    (tmp_path / f"moved.{name}").rename(
        pathlib.Path(f"{base}-0") / f"ckpt-2.{name}")
  # No common number is complete: the newest is returned and its restore
  # fails, naming the file; no host starts over (that would delete them all).
  for n in (1, 2):
    _remove_data_file(f"{base}-1", n)
  before = {h: files(pathlib.Path(f"{base}-{h}")) for h in range(2)}
  for host in range(2):
    ck = checkpoint.MultihostCheckpoint(base, host_id=host, max_to_keep=3)
    assert (ck.get_latest_checkpoint_to_restore_from() ==
            f"{base}-{host}/ckpt-3")
  (pathlib.Path(f"{base}-1") / "ckpt-3.flax").unlink()
  before[1].remove("ckpt-3.flax")
  ck = checkpoint.MultihostCheckpoint(base, host_id=1, max_to_keep=3)
  with pytest.raises(FileNotFoundError, match="ckpt-3"):
    ck.restore_or_initialize({"step": 0, "host": 1})
  assert {h: files(pathlib.Path(f"{base}-{h}")) for h in range(2)} == before


def test_multihost_file_url(tmp_path):
  base = f"file://{tmp_path}/checkpoints"
  for host in range(2):
    ck = checkpoint.MultihostCheckpoint(base, host_id=host, max_to_keep=3)
    for step in range(1, 3 + host):
      ck.save({"step": step, "host": host})
  assert checkpoint.host_directories(base) == {
      h: f"{base}-{h}" for h in range(2)}
  ck = checkpoint.MultihostCheckpoint(base, host_id=1, max_to_keep=3)
  assert ck.get_latest_checkpoint_to_restore_from() == f"{base}-1/ckpt-2"


# ---------------------------------------------------------------------------
# Without TensorFlow.
# ---------------------------------------------------------------------------

_NO_TF_SCRIPT = textwrap.dedent("""
    import importlib.abc, json, os, sys

    class BlockTensorFlow(importlib.abc.MetaPathFinder):
      def find_spec(self, name, path=None, target=None):
        if name == "tensorflow" or name.startswith("tensorflow."):
          raise ImportError(f"No module named {name!r} (blocked by the test)")
        return None

    sys.meta_path.insert(0, BlockTensorFlow())
    import numpy as np

    def leaves(tree, path=""):
      if isinstance(tree, dict) and tree:
        out = {}
        for key, value in tree.items():
          out.update(leaves(value, f"{path}/{key}"))
        return out
      if tree is None:
        return {path: {"python": "None"}}
      arr = np.asarray(tree)
      total = None if arr.dtype.kind == "U" else float(
          arr.astype(np.float64).sum())
      return {path: {"dtype": str(arr.dtype), "shape": list(arr.shape),
                     "sum": total, "is_str": isinstance(tree, str)}}

    def error(fn):
      try:
        fn()
      except ImportError as e:
        return str(e)
      return None

    single, multihost = sys.argv[1], sys.argv[2]
    out = {}
    try:
      import tensorflow
      out["tf_importable"] = True
    except ImportError:
      out["tf_importable"] = False
    from clu_ckpt import checkpoint
    out["load_state_dict"] = leaves(checkpoint.load_state_dict(single))
    out["modules_after_load_state_dict"] = sorted(
        m for m in ("tensorflow", "jax", "flax") if m in sys.modules)
    from clu_ckpt import load_state_dict
    out["subtree_step"] = int(load_state_dict(single, subtree="step"))
    ck = checkpoint.Checkpoint(single)
    out["latest"] = ck.latest_checkpoint
    out["load_state"] = leaves(ck.load_state(None))
    out["load_state_ckpt3"] = ck.load_state(None, f"{single}/ckpt-3")["step"]
    restore = checkpoint.Checkpoint(single)
    out["restore_dict"] = leaves(restore.restore_dict())
    out["current"] = restore.current_checkpoint
    out["restored_from"] = restore.restored_from
    host = checkpoint.MultihostCheckpoint(f"{multihost}/checkpoints",
                                          host_id=1)
    out["multihost_step"] = host.restore_dict()["step"]
    before = sorted(os.listdir(single))
    out["tf_state_error"] = error(
        lambda: checkpoint.Checkpoint(single, dict(x=object())))
    out["save_error"] = error(lambda: restore.save({"step": 7}))
    out["files_unchanged"] = sorted(os.listdir(single)) == before
    out["tf_imported"] = "tensorflow" in sys.modules
    print(json.dumps(out))
""")


def _manifest_view(tree: dict[str, Any]) -> dict[str, Any]:
  """The manifest in the subprocess's leaf format (see `_NO_TF_SCRIPT`)."""
  out = {}
  for path, want in tree.items():
    if "python" in want:
      out[path] = want
    else:
      out[path] = dict(want, is_str=want["sum"] is None)
  return out


def _assert_same_leaves(got: dict[str, Any], want: dict[str, Any]) -> None:
  assert sorted(got) == sorted(want)
  for path, leaf in want.items():
    if leaf.get("sum") is not None:
      assert got[path]["sum"] == pytest.approx(leaf["sum"], rel=1e-6,
                                               abs=1e-12), path
      assert dict(got[path], sum=None) == dict(leaf, sum=None), path
    else:
      assert got[path] == leaf, path


def test_without_tensorflow(golden_copy, golden_manifest):
  single = golden_copy("single_host")
  multihost = golden_copy("multihost")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  proc = subprocess.run(
      [sys.executable, "-c", _NO_TF_SCRIPT, str(single), str(multihost)],
      capture_output=True, text=True, env=env, cwd=str(REPO), timeout=300,
      check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  manifest = golden_manifest("single_host")["checkpoints"]
  want = _manifest_view(manifest["ckpt-5"]["tree"])
  assert out["tf_importable"] is False
  _assert_same_leaves(out["load_state_dict"], want)
  assert out["modules_after_load_state_dict"] == []
  assert out["subtree_step"] == manifest["ckpt-5"]["step"]
  assert out["latest"] == f"{single}/ckpt-5"
  _assert_same_leaves(out["load_state"], want)
  assert out["load_state_ckpt3"] == manifest["ckpt-3"]["step"]
  _assert_same_leaves(out["restore_dict"], want)
  assert out["current"] == out["restored_from"] == f"{single}/ckpt-5"
  assert out["multihost_step"] == golden_manifest("multihost")["restored_step"]
  for key in ("tf_state_error", "save_error"):
    assert out[key] is not None, key
    assert "pip install" in out[key], key
    assert "tensorflow" in out[key].lower(), key
  assert out["files_unchanged"] is True
  assert out["tf_imported"] is False
