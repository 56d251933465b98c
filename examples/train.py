"""A small real training loop: a Flax model on a tf.data pipeline, checkpointed.

With `--workdir` alone it checkpoints with `clu_ckpt.checkpoint` (exactly as a
`clu.checkpoint` script would, one import changed); with `--orbax DIR` it
resumes from an Orbax CheckpointManager root written by `clu-ckpt migrate`,
restoring the tf.data iterator with `clu_ckpt.TfStateRestore`, and keeps
checkpointing there with `clu_ckpt.TfStateSave`.

Every batch carries the index of its first element, so a resumed run can
prove it continues exactly where the checkpoint left off: after restoring step
S the next batch must start at element S * batch_size. The script prints one
JSON line per event (`resumed`, `saved`, `done`) for `demo.py` to check.

  python examples/train.py --workdir /tmp/run --steps 40 --kill_at 25
  python examples/train.py --workdir /tmp/run --steps 40
  python examples/train.py --workdir /tmp/run --orbax /tmp/run/orbax --steps 60
"""

import argparse
import json
import os
import signal
import sys
from typing import Any

import flax
from flax import linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tensorflow as tf

BATCH = 8
FEATURES = 4


@flax.struct.dataclass
class TrainState:
  step: int
  params: Any
  opt_state: Any


class Model(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(16)(x))
    return nn.Dense(1)(x)[..., 0]


def make_dataset() -> tf.data.Dataset:
  """Endless synthetic regression data; each element knows its index."""
  true_w = tf.constant([1.0, -2.0, 0.5, 3.0])

  def element(i):
    x = tf.sin(tf.cast(i, tf.float32) * tf.range(1.0, FEATURES + 1.0))
    return dict(index=i, x=x, y=tf.reduce_sum(x * true_w))

  return tf.data.Dataset.range(10**9).map(element).batch(BATCH)


def init_state(tx) -> TrainState:
  params = Model().init(jax.random.PRNGKey(0), jnp.zeros((BATCH, FEATURES)))
  return TrainState(step=0, params=params, opt_state=tx.init(params))


def make_train_step(tx):

  @jax.jit
  def train_step(state: TrainState, x, y):

    def loss_fn(params):
      return jnp.mean((Model().apply(params, x) - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    return TrainState(step=state.step + 1,
                      params=optax.apply_updates(state.params, updates),
                      opt_state=opt_state), loss

  return train_step


def emit(event: str, **fields) -> None:
  print(json.dumps(dict(event=event, **fields)), flush=True)


def check_position(state: TrainState, batch) -> int:
  first = int(batch["index"][0])
  expected = int(state.step) * BATCH
  if first != expected:
    raise SystemExit(f"iterator out of step: step {int(state.step)} expects "
                     f"element {expected}, the iterator yields {first}")
  return first


class CluCheckpointer:
  """Checkpoints with the drop-in clu_ckpt.checkpoint."""

  def __init__(self, workdir: str, ds_iter):
    from clu_ckpt import checkpoint  # was: from clu import checkpoint
    self.ckpt = checkpoint.Checkpoint(
        os.path.join(workdir, "checkpoints"), dict(ds_iter=ds_iter),
        max_to_keep=3)

  def restore_or_initialize(self, state: TrainState) -> TrainState:
    return self.ckpt.restore_or_initialize(state)

  def save(self, state: TrainState) -> str:
    return self.ckpt.save(state)


class OrbaxCheckpointer:
  """Checkpoints with stock Orbax plus clu_ckpt's tf.data item."""

  def __init__(self, root: str, ds_iter):
    import orbax.checkpoint as ocp
    import clu_ckpt
    self.ocp, self.clu_ckpt = ocp, clu_ckpt
    self.ds_iter = ds_iter
    self.mngr = ocp.CheckpointManager(
        root, options=ocp.CheckpointManagerOptions(max_to_keep=3))

  def restore_or_initialize(self, state: TrainState) -> TrainState:
    step = self.mngr.latest_step()
    if step is None:
      self.save(state)
      return state
    ocp = self.ocp
    restored = self.mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(),
        dataset=self.clu_ckpt.TfStateRestore(dict(ds_iter=self.ds_iter))))
    return flax.serialization.from_state_dict(state, restored["state"])

  def save(self, state: TrainState) -> str:
    ocp = self.ocp
    step = int(state.step)
    self.mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(flax.serialization.to_state_dict(state)),
        dataset=self.clu_ckpt.TfStateSave(dict(ds_iter=self.ds_iter))))
    self.mngr.wait_until_finished()
    return f"{self.mngr.directory}/{step}"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--orbax", help="resume from / save to this Orbax root")
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--save_every", type=int, default=10)
  parser.add_argument("--kill_at", type=int, default=None,
                      help="SIGKILL this process at this step (a preemption)")
  args = parser.parse_args(argv)

  tf.config.set_visible_devices([], "GPU")
  tx = optax.adam(1e-2)
  ds_iter = iter(make_dataset())
  checkpointer = (OrbaxCheckpointer(args.orbax, ds_iter) if args.orbax else
                  CluCheckpointer(args.workdir, ds_iter))
  state = checkpointer.restore_or_initialize(init_state(tx))
  train_step = make_train_step(tx)
  resumed_at = int(state.step)
  loss = None
  for step in range(resumed_at + 1, args.steps + 1):
    batch = next(ds_iter)
    first = check_position(state, batch)
    if step == resumed_at + 1:
      emit("resumed", step=resumed_at, next_element=first,
           backend="orbax" if args.orbax else "clu_ckpt")
    state, loss = train_step(state, jnp.asarray(batch["x"]),
                             jnp.asarray(batch["y"]))
    if step % args.save_every == 0:
      emit("saved", step=step, checkpoint=checkpointer.save(state))
    if args.kill_at is not None and step == args.kill_at:
      emit("killed", step=step)
      os.kill(os.getpid(), signal.SIGKILL)
  emit("done", step=int(state.step),
       loss=None if loss is None else float(loss))
  return 0


if __name__ == "__main__":
  sys.exit(main())
