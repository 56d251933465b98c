"""`migrate(..., template=train_state)`: the state in the train state's
structure, restored by stock Orbax with `StandardRestore(abstract)`.

The source is written by the real `clu.checkpoint.Checkpoint` from a real
`flax.training.train_state.TrainState` (a small `nn.Module`, `optax.adam`).
"""

import json
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from clu import checkpoint as clu_checkpoint
from flax import serialization
from flax.training import train_state

from clu_ckpt import flax_format
from clu_ckpt import migration
from migration_helpers import clu_save
from migration_helpers import same_tree


class _Mlp(nn.Module):
  features: int = 3

  @nn.compact
  def __call__(self, x):
    return nn.Dense(self.features)(nn.relu(nn.Dense(4)(x)))


def _create(seed=0, features=3):
  model = _Mlp(features)
  params = model.init(jax.random.PRNGKey(seed), jnp.ones((1, 2)))
  return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                       tx=optax.adam(1e-2))


def _trained(seed=1):
  """A TrainState after two real optimizer steps (non-zero moments)."""
  state = _create(seed)
  loss = lambda p: jnp.sum(state.apply_fn(p, jnp.ones((2, 2))) ** 2)
  for _ in range(2):
    state = state.apply_gradients(grads=jax.grad(loss)(state.params))
  return state


@pytest.fixture(scope="module", name="source")
def fixture_source(tmp_path_factory):
  """(CLU directory, the TrainState it saved, its `.flax` path)."""
  root = tmp_path_factory.mktemp("template_source")
  state = _trained()
  ckpt = clu_checkpoint.Checkpoint(str(root / "src"))
  ckpt.save(state)
  flax_path = ckpt.get_latest_checkpoint_to_restore_from() + ".flax"
  return str(root / "src"), state, flax_path


def _abstract(**kwargs):
  return jax.eval_shape(lambda: _create(**kwargs))


def _restore(destination, step, abstract):
  with ocp.CheckpointManager(destination) as mngr:
    return mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract)))["state"]


def _assert_same_leaves(restored, state):
  """Every leaf bit-exact; `step` (a Python int in the source) by value."""
  pairs = zip(jax.tree_util.tree_leaves_with_path(restored),
              jax.tree.leaves(state))
  for (path, got), want in pairs:
    name = jax.tree_util.keystr(path)
    got, want = np.asarray(got), np.asarray(want)
    if name == ".step":
      assert got.shape == () and int(got) == int(want)
      continue
    assert got.dtype == want.dtype and got.shape == want.shape, name
    assert got.tobytes() == want.tobytes(), name


def _migrate(source, destination, template, **kwargs):
  summary = migration.migrate(source, str(destination), template=template,
                              step_naming="state", **kwargs)
  assert summary.ok, summary.failed
  return summary.steps[0].step


def test_abstract_template_restores_with_standard_restore(source, tmp_path):
  src, state, _ = source
  abstract = _abstract()
  events = []
  step = _migrate(src, tmp_path / "dst", abstract, progress=events.append)
  assert step == int(state.step) == 2

  restored = _restore(str(tmp_path / "dst"), step, abstract)
  assert isinstance(restored, train_state.TrainState)
  assert isinstance(restored.opt_state[0], optax.ScaleByAdamState)
  _assert_same_leaves(restored, state)
  # Written through the bounded numpy handler: it reports every array byte.
  nbytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(state)
               if np.ndim(x))
  assert sum(e.nbytes for e in events if e.event == "bytes") >= nbytes > 0


def test_step_is_recorded_as_a_standard_save_item(source, tmp_path):
  src, _, _ = source
  step = _migrate(src, tmp_path / "dst", _abstract())
  recorded = json.loads(
      (tmp_path / "dst" / str(step) / "_CHECKPOINT_METADATA").read_text())
  assert recorded["item_handlers"]["state"] == (
      ocp.handlers.StandardCheckpointHandler.typestr())
  meta = migration.read_metadata(str(tmp_path / "dst"), step)
  assert meta["structure"] == "template"
  assert meta["template_type"].endswith("train_state.TrainState")
  # A stock manager picks its handler from that name when given no args.
  with ocp.CheckpointManager(str(tmp_path / "dst")) as mngr:
    restored = mngr.restore(step)
    assert set(restored["state"]) == {"step", "params", "opt_state"}
    assert mngr.item_metadata(step)["state"] is not None


def test_without_template_the_layout_is_unchanged(source, tmp_path):
  src, _, _ = source
  step = _migrate(src, tmp_path / "dst", None)
  recorded = json.loads(
      (tmp_path / "dst" / str(step) / "_CHECKPOINT_METADATA").read_text())
  assert recorded["item_handlers"]["state"] == (
      ocp.handlers.PyTreeCheckpointHandler.typestr())
  meta = migration.read_metadata(str(tmp_path / "dst"), step)
  assert "structure" not in meta and "template_type" not in meta


def test_concrete_template_takes_the_values_of_the_file(source, tmp_path):
  src, state, _ = source
  other = _create(seed=7)  # other values, same structure
  step = _migrate(src, tmp_path / "dst", other)
  restored = _restore(str(tmp_path / "dst"), step, _abstract())
  assert isinstance(restored, train_state.TrainState)
  _assert_same_leaves(restored, state)


@pytest.mark.parametrize("kind", ["single_device", "mesh"])
def test_restores_with_the_abstract_shardings(source, tmp_path, kind):
  src, state, _ = source
  device = jax.devices("cpu")[0]
  if kind == "mesh":
    mesh = jax.sharding.Mesh(np.array([device]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh,
                                          jax.sharding.PartitionSpec())
  else:
    sharding = jax.sharding.SingleDeviceSharding(device)
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
      _abstract())
  step = _migrate(src, tmp_path / "dst", abstract)
  restored = _restore(str(tmp_path / "dst"), step, abstract)
  for leaf in jax.tree.leaves(restored):
    assert isinstance(leaf, jax.Array) and leaf.sharding == sharding
  _assert_same_leaves(restored, state)


def test_file_dtype_is_written_and_standard_restore_casts(source, tmp_path):
  src, state, _ = source
  half = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float16)
      if x.dtype == jnp.float32 else x, _abstract())
  step = _migrate(src, tmp_path / "dst", half)
  # Stored as in the file (float32), bit-exact ...
  stored = migration.restore_state(str(tmp_path / "dst"), step)
  kernel = stored["params"]["params"]["Dense_0"]["kernel"]
  assert kernel.dtype == np.float32
  want = np.asarray(state.params["params"]["Dense_0"]["kernel"])
  assert kernel.tobytes() == want.tobytes()
  # ... and StandardRestore casts to the abstract leaf's dtype.
  restored = _restore(str(tmp_path / "dst"), step, half)
  got = restored.params["params"]["Dense_0"]["kernel"]
  assert got.dtype == np.float16
  np.testing.assert_array_equal(got, want.astype(np.float16))


def test_shape_mismatch_is_refused_naming_the_leaf(source, tmp_path):
  src, _, _ = source
  summary = migration.migrate(src, str(tmp_path / "dst"),
                              template=_abstract(features=5))
  assert not summary.ok
  error = summary.failed[0].error
  assert error == ("/params/params/Dense_0/bias: shape (3,) in the source, "
                   "(5,) in the template"), error
  assert migration.list_steps(str(tmp_path / "dst"))[0] == []


def test_missing_and_extra_leaves_are_refused(source, tmp_path):
  src, _, _ = source
  abstract = _abstract()
  fewer = abstract.replace(params={"params": {
      "Dense_0": abstract.params["params"]["Dense_0"]}})
  summary = migration.migrate(src, str(tmp_path / "dst"), template=fewer)
  assert not summary.ok
  assert "/params/params/Dense_1: in the source, not in the template" in (
      summary.failed[0].error)


def test_leaf_needing_a_stand_in_is_refused(tmp_path):
  clu_save(tmp_path / "src", [{"step": 3, "w": np.ones(2, np.float32),
                               "empty": np.zeros((0, 4), np.float32)}])
  template = {"step": 0, "w": np.zeros(2, np.float32),
              "empty": np.zeros((0, 4), np.float32)}
  summary = migration.migrate(str(tmp_path / "src"), str(tmp_path / "dst"),
                              template=template)
  assert not summary.ok
  assert "/empty: a zero-size array" in summary.failed[0].error


def test_restore_state_is_the_flax_state_dict(source, tmp_path):
  src, _, flax_path = source
  step = _migrate(src, tmp_path / "dst", _abstract())
  with open(flax_path, "rb") as f:
    expected = serialization.msgpack_restore(f.read())
  got = migration.restore_state(str(tmp_path / "dst"), step)
  assert same_tree(got, expected)
  assert list(got["opt_state"]) == ["0", "1"]  # tuples as Flax keys them


def test_verify_passes_and_catches_a_damaged_template_step(source, tmp_path):
  src, state, _ = source
  dst = tmp_path / "dst"
  summary = migration.migrate(src, str(dst), template=_abstract(),
                              step_naming="state", verify=True)
  assert summary.ok and summary.steps[0].verified, summary.failed
  step = summary.steps[0].step

  # The same structure and leaf types, one moment changed, written by stock
  # Orbax.
  numpy = jax.tree.map(
      lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, state)
  damaged = numpy.replace(opt_state=(numpy.opt_state[0]._replace(
      nu=jax.tree.map(lambda x: x + 1, numpy.opt_state[0].nu)),
                                     numpy.opt_state[1]))
  with ocp.CheckpointManager(str(tmp_path / "other")) as mngr:
    mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(damaged)))
  shutil.rmtree(dst / str(step) / "state")
  shutil.copytree(tmp_path / "other" / str(step) / "state",
                  dst / str(step) / "state")

  again = migration.migrate(src, str(dst), template=_abstract(),
                            step_naming="state", verify=True)
  assert not again.ok
  assert "/opt_state/0/nu/params/Dense_0/bias differs" in (
      again.failed[0].error), again.failed[0].error
  assert migration.list_steps(str(dst))[0] == []  # taken away


def test_from_template_keeps_arrays_as_views_of_the_file(source):
  from clu_ckpt.migration import codec  # pylint: disable=g-import-not-at-top
  from clu_ckpt.migration import template  # pylint: disable=g-import-not-at-top
  _, _, flax_path = source
  with flax_format.FlaxFile(flax_path) as handle:
    stored, encodings = codec.encode_state(handle.tree)
    tree = template.from_template(_abstract(), stored, encodings)
    kernel = tree.params["params"]["Dense_0"]["kernel"]
    assert kernel is stored["params"]["params"]["Dense_0"]["kernel"]
    assert not kernel.flags.owndata
    del tree, stored, kernel
