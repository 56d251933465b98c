"""Shared helpers of the migration tests (tests/test_migration*.py).

CLU sources written by the real `clu.checkpoint`, a small example state, an
exact comparison of state trees independent of the code under test, and a
stock Orbax restore.

Synopsis::

  from migration_helpers import clu_save, example_state, orbax_restore

  clu_save(tmp_path / "src", [example_state(10), example_state(20)])
  migration.migrate(str(tmp_path / "src"), str(tmp_path / "dst"))
  restored = orbax_restore(tmp_path / "dst", 20)  # {"state": ..., ...}
"""

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import tensorflow as tf
from clu import checkpoint as clu_checkpoint


def dataset_iterator():
  """A tf.data iterator over batches of 4 consecutive integers."""
  return iter(tf.data.Dataset.range(10_000).batch(4))


def clu_save(directory, states, tf_state=None, **kwargs):
  """Saves `states` in turn with a real `clu.checkpoint.Checkpoint`."""
  ckpt = clu_checkpoint.Checkpoint(str(directory), tf_state, **kwargs)
  for state in states:
    ckpt.save(state)


def example_state(step, scale=1.0):
  """A small Flax-like state: arrays, bfloat16, python scalars, None."""
  return {
      "step": np.int64(step),
      "params": {"w": np.arange(6, dtype=np.float32).reshape(2, 3) * scale,
                 "e": (np.ones(4) * scale).astype(ml_dtypes.bfloat16)},
      "opt": {"count": np.int32(step), "lr": 0.1, "name": "sgd",
              "flag": None},
  }


def same_tree(a, b):
  """Exact equality of leaves, independent of the code under test."""
  if isinstance(a, dict):
    return (isinstance(b, dict) and list(a) == list(b) and
            all(same_tree(a[k], b[k]) for k in a))
  if isinstance(a, list):
    return (isinstance(b, list) and len(a) == len(b) and
            all(same_tree(x, y) for x, y in zip(a, b)))
  if type(a) is not type(b):
    return False
  if isinstance(a, (np.ndarray, np.generic)):
    return (a.dtype == b.dtype and np.shape(a) == np.shape(b) and
            np.asarray(a).tobytes() == np.asarray(b).tobytes())
  if isinstance(a, float):
    return np.float64(a).tobytes() == np.float64(b).tobytes()
  return a == b


def orbax_restore(destination, step):
  """Every item of `step`, restored by a stock Orbax CheckpointManager."""
  with ocp.CheckpointManager(destination) as mngr:
    return mngr.restore(step)


def multihost_save(base, states_per_host):
  """Saves with a real `clu.checkpoint.MultihostCheckpoint` per host, each
  with a dataset iterator advanced once per save."""
  for host, states in enumerate(states_per_host):
    it = dataset_iterator()
    ckpt = clu_checkpoint.MultihostCheckpoint(str(base), dict(ds_iter=it),
                                              host_id=host)
    for state in states:
      next(it)
      ckpt.save(state)
