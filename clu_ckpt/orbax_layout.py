"""The Orbax layout of `Checkpoint`: CLU-API checkpoints saved as Orbax steps.

`Checkpoint(base, tf_state, layout="orbax")` (or `CLU_CKPT_LAYOUT=orbax` in
the environment; the argument wins) keeps the CLU API and saves checkpoint
number N as step N of an Orbax `CheckpointManager` root, laid out exactly as
`clu-ckpt migrate --step-naming number` lays out a migrated checkpoint: a
`state` item, a `dataset` item holding every process's `tf_state` (the
`orbax_items` form) and a `metadata` item (the migration's, with
`writer: "clu_ckpt.checkpoint"`). The writer is the migration's
(`migration.orbax_target.OrbaxTarget`, `migration.codec`,
`migration.template`): stock Orbax restores the steps, `clu-ckpt
inspect/verify` read them. This module owns that side of `Checkpoint`;
`checkpoint.Checkpoint` decides which layout a checkpoint is in.

Where the steps go: the root is the `Checkpoint`'s own base directory (the
CLU files beside it are ignored by Orbax, which lists only step names), and
for a `MultihostCheckpoint` the multihost base itself (`<base>`, beside the
hosts' `<base>-<host>` directories): one root for all hosts, the state
written once (by process 0, as Orbax's multi-process save does), each
host's iterator kept under `process_<host>` in the `dataset` item.

Steps are numbered by checkpoint number, not by the state's `step`:
`latest_checkpoint`, `current_checkpoint`, `restore(state, checkpoint)` and
`MultihostCheckpoint`'s "newest number every host has" all speak of
checkpoint numbers, and a save after restoring an older checkpoint writes
the next number and removes the newer ones; the number is defined for every
state (the state's `step` may be missing, or repeat: `restore_or_initialize`
saves the initial state, a loop may save twice at one step), and numbering by
it keeps a run's CLU checkpoints and its Orbax steps one sequence. The
state's `step`, when it has one, is recorded in the metadata (`state_step`).

Synopsis::

  from clu_ckpt import orbax_layout

  orbax_layout.resolve(None)                 # "clu", or $CLU_CKPT_LAYOUT
  steps = orbax_layout.OrbaxSteps("/ckpts")
  steps.save(3, state, dict(ds_iter=ds_iter), checkpoint_name="ckpt")
  state_dict = steps.load_state_dict(3)      # the Flax state dict
  steps.restore_tf_state(3, dict(ds_iter=ds_iter))
"""

from __future__ import annotations

import os
import re
import sys
import time
from typing import Any, Mapping, Optional

import numpy as np
from absl import logging

from clu_ckpt import __version__
from clu_ckpt import errors
from clu_ckpt import layout
from clu_ckpt import orbax_root
from clu_ckpt import storage

LAYOUT_ENV = "CLU_CKPT_LAYOUT"
CLU = "clu"
ORBAX = "orbax"
LAYOUTS = (CLU, ORBAX)
# `metadata["writer"]` of a step `Checkpoint.save` wrote (a migration's
# steps have none).
WRITER = orbax_root.CHECKPOINT_WRITER
# The state's arrays are stored uncompressed, as the `.flax` file holds them:
# the save must be as fast as the CLU layout's (benchmarks/bench_checkpoint.py
# `save_orbax`); `clu-ckpt migrate --compression none` writes the same.
COMPRESSION = "none"
# Array bytes handed to TensorStore at once. Unbounded: unlike a migration's
# memory-mapped source, the state is in memory already, and uncompressed
# writes reference the arrays without copying them (measured: extra RssAnon
# 0.00x the state, `save_orbax`); the migration's 128 MiB window would only
# serialize the writes (2x slower).
INFLIGHT_BYTES = 2**62


def resolve(value: Optional[str]) -> str:
  """The layout a `Checkpoint` saves in: `value`, else `$CLU_CKPT_LAYOUT`.

  Example::

    resolve("orbax")   # "orbax"
    resolve(None)      # "clu" unless CLU_CKPT_LAYOUT=orbax

  Args:
    value: "clu", "orbax" or None.

  Returns:
    "clu" or "orbax".

  Raises:
    UsageError: Another value (names where it came from).
  """
  where = "layout argument"
  if value is None:
    value, where = os.environ.get(LAYOUT_ENV) or CLU, f"${LAYOUT_ENV}"
  if not isinstance(value, str) or value.strip().lower() not in LAYOUTS:
    raise errors.UsageError(f"{where} {value!r}: use one of "
                            f"{', '.join(LAYOUTS)}")
  return value.strip().lower()


# --------------------------------------------------------------------------
# Processes.
# --------------------------------------------------------------------------


def process_index_and_count() -> tuple[int, int]:
  """(jax.process_index(), jax.process_count())."""
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_index(), jax.process_count()


def check_tensorflow(where: str) -> None:
  """Raises ImportError (naming `where`) unless TensorFlow can be imported.

  A `tf_state` is saved through TensorFlow in either layout.
  """
  try:
    import tensorflow  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError as e:
    raise ImportError(
        f"Checkpoint({where!r}): saving or restoring a tf_state needs "
        "TensorFlow, which cannot be imported. Install it with `pip install "
        "tensorflow-cpu`.") from e


def _jax_process_count() -> int:
  """jax.process_count(), or 1 when JAX was never imported (no job then)."""
  jax = sys.modules.get("jax")
  return 1 if jax is None else jax.process_count()


def _barrier(name: str) -> None:
  """Waits for every process (a no-op in a single process)."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices(f"clu_ckpt.orbax_layout:{name}")


def fsync_tree(directory: str) -> None:
  """fsyncs every file and directory under `directory` (local paths only).

  Called with a step's temporary directory just before Orbax renames it into
  place: the step is whole on disk before it is listed. Objects in a bucket
  are durable once uploaded: nothing to do there.
  """
  if not storage.is_local(directory):
    return
  for parent, _, files in os.walk(directory):
    for name in files:
      path = os.path.join(parent, name)
      if os.path.islink(path):
        continue
      fd = os.open(path, os.O_RDONLY)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)
    storage.fsync_directory(parent)


# --------------------------------------------------------------------------
# The state: a Flax state dict, its leaf summary, stand-ins.
# --------------------------------------------------------------------------


def state_dict_of(state: Any) -> tuple[dict, list[dict]]:
  """The Flax state dict `to_bytes` would write, numpy leaves, and its leaves.

  JAX arrays become numpy arrays (views of the device buffer on CPU: no
  copy); everything else is as `flax.serialization.to_state_dict` returns it.

  Args:
    state: A train state (flax struct dataclass, dict, ...).

  Returns:
    (state dict, leaf summaries in the `.flax` file's order: path, kind,
    dtype, shape, as the migration's `metadata["leaves"]` has them).
  """
  from flax import serialization  # pylint: disable=g-import-not-at-top
  leaves: list[dict] = []
  tree = _numpy_tree(serialization.to_state_dict(state), "", leaves)
  if not isinstance(tree, dict):
    tree = {"": tree}  # what Flax cannot name either; kept, not refused
  return tree, leaves


def _numpy_tree(value: Any, path: str, leaves: list) -> Any:
  if isinstance(value, dict):
    return {k: _numpy_tree(v, f"{path}/{k}", leaves) for k, v in value.items()}
  if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
    return {str(i): _numpy_tree(v, f"{path}/{i}", leaves)
            for i, v in enumerate(value)}
  if not isinstance(value, (np.ndarray, np.generic)) and hasattr(
      value, "__array__") and hasattr(value, "dtype") and hasattr(
          value, "shape"):
    value = np.asarray(value)  # a jax.Array
  leaves.append(_leaf_summary(path, value))
  return value


def _leaf_summary(path: str, value: Any) -> dict:
  dtype = shape = None
  if isinstance(value, np.ndarray):
    kind = "ndarray"
  elif isinstance(value, np.generic):
    kind = "npscalar"
  elif value is None:
    kind = "none"
  elif isinstance(value, bool):
    kind = "bool"
  else:
    kind = {int: "int", float: "float", str: "str", bytes: "bytes",
            complex: "complex"}.get(type(value), type(value).__name__)
  if kind in ("ndarray", "npscalar"):
    dtype = np.asarray(value).dtype.name  # as the `.flax` header names it
    shape = list(np.shape(value))
  return {"path": path, "kind": kind, "dtype": dtype, "shape": shape}


def _state_step(state_dict: Mapping[str, Any]) -> Optional[int]:
  value = state_dict.get("step")
  if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
    return int(value)
  if isinstance(value, np.ndarray) and value.shape == () and (
      value.dtype.kind in "iu"):
    return int(value)
  return None


# --------------------------------------------------------------------------
# The steps.
# --------------------------------------------------------------------------


class OrbaxSteps:
  """The Orbax root a `Checkpoint` saves in with `layout="orbax"`.

  On disk (`<root>` is the base directory, or a multihost base)::

    <root>/<N>/_CHECKPOINT_METADATA   Orbax's step metadata (items, time)
    <root>/<N>/state/                 the state (StandardSave form for a
                                      dataclass state, else the state dict)
    <root>/<N>/dataset/               {"process_<i>": TF checkpoint files}
    <root>/<N>/metadata/metadata      JSON: leaves, stand-ins, source, ...

  A step is written into Orbax's temporary directory, fsynced whole, then
  renamed into place (by Orbax; on `gs://` Orbax writes
  `commit_success.txt` last instead): a listed step is never half-written,
  and what a killed save left is removed by the next save. Steps are taken
  away by renaming them out of Orbax's listing first, then deleting them.

  Args:
    root: The Orbax root (a path or a `gs://` URL).
    kind: "Checkpoint" or "MultihostCheckpoint" (for the metadata).
    process_index: This process (its `tf_state` is `process_<index>`).
    process_count: How many processes save together (the `dataset` item
      holds all of theirs).

  Raises:
    UsageError: An `s3://` root (stock Orbax cannot restore from it).
  """

  def __init__(self, root: str, *, kind: str = "Checkpoint",
               process_index: int = 0, process_count: int = 1):
    from clu_ckpt.migration import orbax_target  # pylint: disable=g-import-not-at-top
    self.root = layout.absolute(root)
    self.kind = kind
    self.process_index = process_index
    self.process_count = process_count
    self._target = orbax_target.OrbaxTarget(
        self.root, use_compression=COMPRESSION == "zstd",
        inflight_bytes=INFLIGHT_BYTES, before_commit=fsync_tree)

  @property
  def primary(self) -> bool:
    """Whether this process commits and removes steps (process 0)."""
    return self.process_index == 0

  def steps(self) -> list[int]:
    """The finished steps, sorted (Orbax's own listing rules)."""
    return orbax_root.list_steps(self.root)[0]

  def step_path(self, number: int) -> str:
    """The directory of step `number`."""
    return storage.join(self.root, str(number))

  # -- saving -----------------------------------------------------------------

  def save(self, number: int, state: Any,
           tf_state: Optional[Mapping[str, Any]], *,
           checkpoint_name: str = "ckpt") -> int:
    """Writes `state` and `tf_state` as step `number` (collective).

    Every process calls it; the state is written by process 0, each
    process's `tf_state` is gathered into the `dataset` item.

    Args:
      number: The checkpoint number (the step).
      state: The train state.
      tf_state: TensorFlow trackables by name (e.g. the dataset iterator), or
        None/{} for none.
      checkpoint_name: The `Checkpoint`'s name (recorded: `ckpt-N`).

    Returns:
      The bytes of array data in the state.

    Raises:
      TypeError, MigrationError: A leaf Orbax cannot hold even as a stand-in.
      OSError: The step could not be written (nothing of it is left).
    """
    from clu_ckpt.migration import codec  # pylint: disable=g-import-not-at-top
    from clu_ckpt.migration import orbax_target  # pylint: disable=g-import-not-at-top
    self._check_processes()
    state_dict, leaves = state_dict_of(state)
    stored, encodings = codec.encode_state(state_dict)
    tree, native = self._native(state, stored, encodings)
    items = {orbax_target.STATE_ITEM: tree}
    names = sorted(tf_state or {})
    if names:
      items[orbax_target.DATASET_ITEM] = self._dataset(tf_state)
    items[orbax_target.METADATA_ITEM] = self._metadata(
        number, checkpoint_name, state, state_dict, leaves, encodings,
        native, names)
    if self.primary:
      self._target.remove_partial(number)
    _barrier(f"save-start-{number}")
    nbytes = [0]

    def on_bytes(n: int) -> None:
      nbytes[0] += n

    self._target.write_step(
        number, items, on_bytes, standard_state=native,
        custom_metadata={"clu_ckpt": {
            "writer": WRITER, "clu_checkpoint": f"{checkpoint_name}-{number}",
            "clu_checkpoint_number": number,
            "clu_ckpt_version": __version__}})
    if self.primary and storage.is_local(self.root):
      storage.fsync_directory(self.root)  # the rename
    return nbytes[0]

  def _check_processes(self) -> None:
    """Refuses a plain `Checkpoint`'s save inside a multi-process JAX job.

    Orbax's save is collective: it waits for every process at its barriers
    and only process 0 writes. A `Checkpoint` saved by one process (CLU's
    `if jax.process_index() == 0: ckpt.save(...)`) would wait forever, and
    one per host would leave the other hosts' directories unwritten.
    """
    if self.process_count > 1:
      return
    count = _jax_process_count()
    if count > 1:
      raise errors.UsageError(
          f"Checkpoint({self.root!r}, layout=\"orbax\") in a job of {count} "
          "JAX processes: Orbax's save is collective (every process, one "
          "root). Use MultihostCheckpoint(..., layout=\"orbax\") and call "
          "save() on every process, or keep the CLU layout for a checkpoint "
          "saved by one process.")

  def _native(self, state: Any, stored: Any,
              encodings: Mapping[str, Any]) -> tuple[Any, bool]:
    """The state item in the state's own structure where it has one.

    A dict state is stored as its state dict; any other (a flax struct
    dataclass...) in its own structure (what `StandardRestore` reads), unless
    it holds leaves only a stand-in can hold.
    """
    if isinstance(state, dict):
      return stored, False
    from clu_ckpt.migration import template  # pylint: disable=g-import-not-at-top
    try:
      return template.from_template(state, stored, encodings), True
    except errors.MigrationError as e:
      logging.info("Saving the state as a state dict: %s", e)
      return stored, False

  def _dataset(self, tf_state: Mapping[str, Any]) -> dict:
    """{"process_<i>": files} of every process (a collective)."""
    from clu_ckpt import orbax_items  # pylint: disable=g-import-not-at-top
    own = orbax_items.serialize_tf_state(tf_state)
    if self.process_count == 1:
      return {orbax_items.process_key(self.process_index): own}
    gathered = orbax_items._allgather_files(own)  # pylint: disable=protected-access
    return {orbax_items.process_key(i): files
            for i, files in enumerate(gathered)}

  def _metadata(self, number, checkpoint_name, state, state_dict, leaves,
                encodings, native, names) -> dict:
    from clu_ckpt.migration import run  # pylint: disable=g-import-not-at-top
    from clu_ckpt.migration import template  # pylint: disable=g-import-not-at-top
    hosts = list(range(self.process_count)) if self.process_count > 1 else [
        self.process_index]
    meta = {
        "format": run.FORMAT,
        "writer": WRITER,
        "clu_ckpt_version": __version__,
        "source": self.root,
        "source_kind": self.kind,
        "hosts": len(hosts),
        "host_ids": hosts,
        "clu_checkpoint": f"{checkpoint_name}-{number}",
        "clu_checkpoint_number": number,
        "step": number,
        "step_naming": "number",
        "state_step": _state_step(state_dict),
        "state_host": 0,
        "hosts_compared": False,
        "dataset": None if not names else {
            "tf_state": names, "processes": hosts},
        "compression": COMPRESSION,
        "saved_at": time.time(),
        "leaves": leaves,
        "encoded": encodings,
    }
    if native:
      meta["structure"] = template.STRUCTURE
      meta["template_type"] = template.type_name(state)
    return meta

  # -- restoring --------------------------------------------------------------

  def load_state_dict(self, number: int) -> dict:
    """The Flax state dict of step `number`, exactly as the state saved.

    Raises:
      CheckpointNotFoundError: There is no such step.
    """
    from clu_ckpt.migration import run  # pylint: disable=g-import-not-at-top
    return run.restore_state(self.root, number)

  def restore_tf_state(self, number: int, tf_state: Mapping[str, Any],
                       process_index: Optional[int] = None) -> None:
    """Restores `tf_state` in place from step `number`'s `dataset` item.

    Args:
      number: The step.
      tf_state: The trackables, by the names they were saved under.
      process_index: Whose entry to read; default this process's.

    Raises:
      InvalidCheckpointError: The step has no `dataset` item, no entry for
        the process, or not these objects (names the step).
    """
    from clu_ckpt import orbax_items  # pylint: disable=g-import-not-at-top
    index = self.process_index if process_index is None else process_index
    tree = self._target.restore_dataset(number)
    where = self.step_path(number)
    if tree is None:
      raise errors.InvalidCheckpointError(
          f"{where}: has no dataset item, but tf_state {sorted(tf_state)} "
          "was given to restore")
    key = orbax_items.process_key(index)
    if key not in tree:
      raise errors.InvalidCheckpointError(
          f"{where}/dataset: no tf_state saved for process {index} "
          f"(processes: {orbax_items.process_indices(tree)})")
    try:
      orbax_items.restore_tf_state(tf_state, tree[key])
    except (ValueError, AssertionError) as e:
      raise errors.InvalidCheckpointError(f"{where}/dataset: {e}") from e

  # -- removing ---------------------------------------------------------------

  def discard(self, number: int) -> None:
    """Takes step `number` away: out of the listing at once, then deleted."""
    if self.primary:
      logging.info("Removing step %s", self.step_path(number))
      self._target.discard(number)

  def sweep_partial(self) -> None:
    """Removes what killed saves left: Orbax's temporary step directories,
    and steps a killed removal had already taken out of the listing
    (`<N>.clu_ckpt-discarded`, see `OrbaxTarget.discard`)."""
    if not self.primary:
      return
    from clu_ckpt.migration import orbax_target  # pylint: disable=g-import-not-at-top
    marker = orbax_target.DISCARDED_MARKER
    try:
      aside = [name.rstrip("/") for name in storage.listdir(self.root)
               if re.fullmatch(r"\d+" + re.escape(marker), name.rstrip("/"))]
      for name in orbax_root.list_steps(self.root)[1] + aside:
        path = storage.join(self.root, name)
        logging.info("Removing leftover '%s'", path)
        storage.remove_tree(path)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("Could not remove leftovers in %s: %s", self.root, e)
