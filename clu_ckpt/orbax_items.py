"""Orbax items for TensorFlow state, e.g. the position of a tf.data iterator.

Orbax has no built-in way to checkpoint a `tf.data` iterator. These
`CheckpointArgs` keep it in an Orbax step, next to the model state, for every
host of a multi-host job::

  import orbax.checkpoint as ocp
  import clu_ckpt

  ds_iter = iter(dataset)
  mngr = ocp.CheckpointManager(workdir)
  mngr.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      dataset=clu_ckpt.TfStateSave(dict(ds_iter=ds_iter))))
  ...
  restored = mngr.restore(mngr.latest_step(), args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state),
      dataset=clu_ckpt.TfStateRestore(dict(ds_iter=ds_iter))))
  # ds_iter now yields what it would have yielded after the save.

Stored form. The item is an ordinary Orbax PyTree of uint8 arrays, written by
Orbax's own `PyTreeCheckpointHandler` and recorded under that handler's type
name, so stock Orbax reads it without clu_ckpt::

  {"process_0": {"index": uint8[...], "data-00000-of-00001": uint8[...]},
   "process_1": {...}, ...}

Each `process_<i>` entry holds the files of the TensorFlow checkpoint of
`tf.train.Checkpoint(**tf_state)` on process `i`, keyed by the file name
suffix after the checkpoint prefix. `clu_ckpt.migration` writes CLU's own
`ckpt-N.index` / `ckpt-N.data-*` files in this form.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import struct
import tempfile
from typing import Any, Mapping, Optional

import numpy as np
import orbax.checkpoint as ocp

from clu_ckpt import errors
from clu_ckpt import tf_bundle

PROCESS_KEY_PREFIX = "process_"
# File suffixes TensorFlow gives a checkpoint's files after `<prefix>.`.
_SUFFIX_RE = re.compile(r"^(index|data-\d{5}-of-\d{5})$")
# Variables every `tf.train.Checkpoint` has; they are not "tf_state".
_BOOKKEEPING_VARIABLES = ("_CHECKPOINTABLE_OBJECT_GRAPH",)
_SAVE_COUNTER = "save_counter"

TfFiles = dict[str, np.ndarray]


def process_key(process_index: int) -> str:
  """The key of a process's entry in the stored tree (`"process_<i>"`)."""
  return f"{PROCESS_KEY_PREFIX}{int(process_index)}"


def process_indices(tree: Mapping[str, Any]) -> list[int]:
  """The process indices present in a stored tree, sorted."""
  found = []
  for key in tree:
    suffix = key[len(PROCESS_KEY_PREFIX):]
    if key.startswith(PROCESS_KEY_PREFIX) and suffix.isdigit():
      found.append(int(suffix))
  return sorted(found)


# --------------------------------------------------------------------------
# TensorFlow checkpoint files <-> uint8 arrays.
# --------------------------------------------------------------------------


def read_tf_files(prefix: str) -> TfFiles:
  """Reads the files of the TensorFlow checkpoint `prefix` as uint8 arrays.

  The arrays are views of `storage.map_file` maps: memory maps of local
  files, and of bucket objects spooled by ranged reads into unlinked
  temporary files, so a large data file is never held in process memory.

  Args:
    prefix: A checkpoint prefix, e.g. `/ckpts/ckpt-3` for `/ckpts/ckpt-3.index`
      and `/ckpts/ckpt-3.data-00000-of-00001` (a path or a `gs://`/`s3://`
      URL).

  Returns:
    File name suffix ("index", "data-00000-of-00001", ...) -> file content
    (read-only).

  Raises:
    FileNotFoundError: The `.index` file or a data shard is missing.
  """
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  files = {}
  for path in storage.glob(storage.glob_escape(prefix) + ".*"):
    suffix = path[len(prefix) + 1:]
    if _SUFFIX_RE.match(suffix):
      files[suffix] = np.frombuffer(storage.map_file(path), np.uint8)
  _check_complete(files, prefix)
  return files


def _check_complete(files: Mapping[str, Any], where: str) -> None:
  if "index" not in files:
    raise errors.CheckpointNotFoundError(f"{where}.index: TensorFlow checkpoint index not "
                            "found")
  shards = [s for s in files if s.startswith("data-")]
  if not shards:
    raise errors.CheckpointNotFoundError(f"{where}.data-*: TensorFlow checkpoint data not "
                            "found")
  count = int(shards[0].rsplit("-of-", 1)[1])
  for i in range(count):
    shard = f"data-{i:05d}-of-{count:05d}"
    if shard not in files:
      raise errors.CheckpointNotFoundError(f"{where}.{shard}: TensorFlow checkpoint data "
                              "shard not found")


def write_tf_files(files: Mapping[str, Any], prefix: str) -> None:
  """Writes `files` (see `read_tf_files`) as `<prefix>.<suffix>` files."""
  for suffix, content in files.items():
    if not _SUFFIX_RE.match(suffix):
      raise errors.InvalidCheckpointError(f"not a TensorFlow checkpoint file suffix: {suffix!r}")
    with open(f"{prefix}.{suffix}", "wb") as f:
      f.write(np.asarray(content, np.uint8).tobytes())


def tf_state_names(prefix: str, *, check: bool = False) -> list[str]:
  """The `tf_state` keys a TensorFlow checkpoint holds (e.g. `["ds_iter"]`).

  CLU writes a TensorFlow checkpoint even without `tf_state`; it then holds
  only the save counter and this returns an empty list.

  The names come from the `.index` table, read with ranged reads and
  without TensorFlow (`index_entries`). `check` then verifies, still without
  TensorFlow, that every value lies inside its data shard and matches the
  crc32c TensorFlow recorded, the iterator state (a variant) included, as
  TensorFlow's reader checks it (`tf_bundle.check_data`). Only where that
  cannot be done without TensorFlow (no `google_crc32c`, a value over
  `tf_bundle`'s read limits) does TensorFlow check the values, when it is
  installed: only for checkpoints that hold `tf_state`, on a local copy of
  the files when they are in a bucket (TensorFlow's own file systems know
  neither s3:// nor an emulator's gs://); without it that check is skipped
  (the bytes are copied as they are, and TensorFlow checks them when the
  iterator is restored). An index with compressed blocks is read by
  TensorFlow only.

  Args:
    prefix: A checkpoint prefix (path or `gs://`/`s3://` URL).
    check: Also verify the stored values as described.

  Returns:
    Sorted top-level object names other than `save_counter`.

  Raises:
    ValueError: The checkpoint cannot be read (corrupt or truncated).
    ImportError: A compressed index, and no TensorFlow.
  """
  try:
    shards, entries = tf_bundle.index_entries(prefix)
  except tf_bundle.NeedsTensorFlow:
    return _state_names(_tf_variable_names(prefix, check))
  names = _state_names(entries)
  if check:
    complete = tf_bundle.check_data(prefix, shards, entries)
    if names and not complete:
      try:
        _tf_variable_names(prefix, check=True)
      except ImportError:
        pass  # TensorFlow checks the values when it restores them.
  return names


def _tf_variable_names(prefix: str, check: bool) -> list[str]:
  """The variable names TensorFlow reads (from a local copy of a bucket's)."""
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  tf = _tensorflow()
  with storage.local_prefix(prefix) as local:
    try:
      reader = tf.train.load_checkpoint(local)
      variables = sorted(reader.get_variable_to_shape_map())
    except (tf.errors.OpError, ValueError) as e:
      raise errors.InvalidCheckpointError(
          f"{prefix}.index: unreadable TensorFlow checkpoint: "
          f"{_first_line(e).replace(local, prefix)}") from None
    if check:
      for name in variables:
        _read_variable(tf, reader, name, prefix)
  return variables


def _state_names(variables: Any) -> list[str]:
  names = {v.split("/", 1)[0] for v in variables
           if v and v not in _BOOKKEEPING_VARIABLES}
  names.discard(_SAVE_COUNTER)
  return sorted(names)


def _read_variable(tf: Any, reader: Any, name: str, prefix: str) -> None:
  try:
    reader.get_tensor(name)
  except tf.errors.InternalError as e:
    # Variants (iterator states) are read and checksummed, then cannot be
    # turned into numpy arrays; that last step is all that failed.
    if "not convertible to numpy" not in str(e):
      raise errors.InvalidCheckpointError(f"{prefix}.data-*: corrupt TensorFlow checkpoint "
                       f"data ({name}): {_first_line(e)}") from None
  except tf.errors.OpError as e:
    raise errors.InvalidCheckpointError(f"{prefix}.data-*: corrupt TensorFlow checkpoint data "
                     f"({name}): {_first_line(e)}") from None


def serialize_tf_state(tf_state: Mapping[str, Any]) -> TfFiles:
  """Checkpoints `tf.train.Checkpoint(**tf_state)` and returns its files.

  Args:
    tf_state: TensorFlow trackables by name, e.g. `dict(ds_iter=ds_iter)`.

  Returns:
    See `read_tf_files`.
  """
  tf = _tensorflow()
  with tempfile.TemporaryDirectory(prefix="clu_ckpt_tf_") as tmp:
    prefix = tf.train.Checkpoint(**tf_state).write(os.path.join(tmp, "tf"))
    return {k: v.copy() for k, v in read_tf_files(prefix).items()}


def restore_tf_state(tf_state: Mapping[str, Any],
                     files: Mapping[str, Any]) -> None:
  """Restores `tf_state` in place from checkpoint files (see `read_tf_files`).

  Args:
    tf_state: The TensorFlow trackables to restore, by the names they were
      saved under, e.g. `dict(ds_iter=ds_iter)`.
    files: The checkpoint's files.

  Raises:
    ValueError: An object of `tf_state` has no saved value under its name.
  """
  tf = _tensorflow()
  _check_complete(files, "<stored TensorFlow checkpoint>")
  with tempfile.TemporaryDirectory(prefix="clu_ckpt_tf_") as tmp:
    prefix = os.path.join(tmp, "tf")
    write_tf_files(files, prefix)
    saved = tf_state_names(prefix)
    missing = sorted(set(tf_state) - set(saved))
    if missing:
      raise errors.InvalidCheckpointError(f"tf_state keys {missing} have no saved value; the "
                       f"checkpoint holds {saved}")
    status = tf.train.Checkpoint(**tf_state).read(prefix)
    status.assert_existing_objects_matched()
    status.expect_partial()  # CLU's save_counter is not part of tf_state.


# --------------------------------------------------------------------------
# The Orbax handler and its arguments.
# --------------------------------------------------------------------------


class TfStateHandler(ocp.handlers.AsyncCheckpointHandler):
  """Saves and restores `tf_state` in the stock form described above.

  The work is done by an inner `PyTreeCheckpointHandler`; this class only
  turns TensorFlow objects into checkpoint file bytes and back. The step's
  metadata records the inner handler's type name, so a process without
  clu_ckpt restores the item as a plain PyTree of uint8 arrays.
  """

  def __init__(self):
    self._inner = ocp.handlers.PyTreeCheckpointHandler()
    # Orbax records `handler.typestr()` in the step metadata and resolves it
    # when restoring without arguments: name the handler that wrote the data.
    self.typestr = ocp.handlers.PyTreeCheckpointHandler.typestr

  async def async_save(self, directory: Any,
                       args: "TfStateSave") -> Optional[list[Any]]:
    """Writes every process's `tf_state` (collective across processes)."""
    own = serialize_tf_state(args.tf_state)
    tree = {process_key(i): files
            for i, files in enumerate(_allgather_files(own))}
    return await self._inner.async_save(
        directory, args=ocp.args.PyTreeSave(tree))

  def save(self, directory: Any, args: "TfStateSave") -> None:
    async def _save():
      for f in await self.async_save(directory, args) or []:
        f.result()
    asyncio.run(_save())

  def restore(self, directory: Any,
              args: Optional["TfStateRestore"] = None) -> Any:
    """Restores `args.tf_state` in place, or returns the stored tree.

    Args:
      directory: The item directory.
      args: What to restore; without `tf_state`, nothing is restored and the
        stored tree is returned (what stock Orbax returns).

    Returns:
      `args.tf_state`, now restored, or the stored tree.

    Raises:
      KeyError: The checkpoint has no entry for the process.
      ValueError: `tf_state` does not match what was saved.
    """
    if args is None or args.tf_state is None:
      return self._inner.restore(directory, args=ocp.args.PyTreeRestore())
    index = _process_index() if args.process_index is None else int(
        args.process_index)
    files = self._restore_process(directory, index)
    restore_tf_state(args.tf_state, files)
    return args.tf_state

  def _restore_process(self, directory: Any, index: int) -> TfFiles:
    tree = self._inner.metadata(directory).tree
    key = process_key(index)
    if key not in tree:
      raise KeyError(
          f"{directory}: no tf_state saved for process {index}; processes "
          f"present: {process_indices(tree)}")
    target = {key: tree[key]}
    restore_args = {key: {suffix: ocp.RestoreArgs(restore_type=np.ndarray)
                          for suffix in tree[key]}}
    restored = self._inner.restore(
        directory, args=ocp.args.PyTreeRestore(
            item=target, restore_args=restore_args, partial_restore=True))
    return restored[key]

  def metadata(self, directory: Any) -> Any:
    return self._inner.metadata(directory)

  def finalize(self, directory: Any) -> None:
    self._inner.finalize(directory)

  def close(self) -> None:
    self._inner.close()


@ocp.args.register_with_handler(TfStateHandler, for_save=True)
@dataclasses.dataclass
class TfStateSave(ocp.args.CheckpointArgs):
  """Saves TensorFlow state (e.g. a tf.data iterator) as an Orbax item.

  Every process saves its own `tf_state`; all are kept, one entry per process.
  The state is captured when `CheckpointManager.save` is called.

  Attributes:
    tf_state: TensorFlow trackables by name, e.g. `dict(ds_iter=ds_iter)`, as
      for `tf.train.Checkpoint(**tf_state)`.
  """
  tf_state: dict


@ocp.args.register_with_handler(TfStateHandler, for_restore=True)
@dataclasses.dataclass
class TfStateRestore(ocp.args.CheckpointArgs):
  """Restores TensorFlow state saved by `TfStateSave` or by a migration.

  Attributes:
    tf_state: The trackables to restore in place, by the names they were
      saved under (`dict(ds_iter=ds_iter)`). None returns the stored tree.
    process_index: Whose state to restore; default `jax.process_index()`.
  """
  tf_state: Optional[dict] = None
  process_index: Optional[int] = None


def handler_registry(
    item: str = "dataset",
    registry: Optional[Any] = None) -> Any:
  """A `CheckpointHandlerRegistry` that knows `item` holds `tf_state`.

  Orbax picks an item's handler from the first arguments it sees for it on a
  `CheckpointManager`. Restoring without arguments first, then with
  `TfStateRestore` on the same manager, therefore fails unless the manager
  is told up front::

    mngr = ocp.CheckpointManager(
        workdir, handler_registry=clu_ckpt.orbax_items.handler_registry())

  Args:
    item: The item name.
    registry: A registry to add to; default a new
      `DefaultCheckpointHandlerRegistry`.

  Returns:
    The registry.
  """
  if registry is None:
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  handler = TfStateHandler()
  registry.add(item, TfStateSave, handler)
  registry.add(item, TfStateRestore, handler)
  return registry


# --------------------------------------------------------------------------
# Helpers.
# --------------------------------------------------------------------------


def _process_index() -> int:
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_index()


def _allgather_files(own: TfFiles) -> list[TfFiles]:
  """Every process's files, in process order (a collective when multi-host).

  Orbax writes numpy leaves from the primary process only, so the primary
  needs every process's bytes.

  Args:
    own: This process's files.

  Returns:
    One entry per process.
  """
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_count() == 1:
    return [own]
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  blob = _pack(own)
  sizes = multihost_utils.process_allgather(np.asarray([blob.size], np.int64))
  padded = np.zeros(int(np.max(sizes)), np.uint8)
  padded[:blob.size] = blob
  rows = multihost_utils.process_allgather(padded)
  return [_unpack(row[:int(size)])
          for row, size in zip(rows, np.ravel(sizes))]


def _pack(files: TfFiles) -> np.ndarray:
  header = json.dumps({k: int(v.size) for k, v in files.items()}).encode()
  parts = [struct.pack("<Q", len(header)), header]
  parts += [v.tobytes() for v in files.values()]
  return np.frombuffer(b"".join(parts), np.uint8)


def _unpack(blob: np.ndarray) -> TfFiles:
  (n,) = struct.unpack("<Q", blob[:8].tobytes())
  sizes = json.loads(blob[8:8 + n].tobytes())
  files, pos = {}, 8 + n
  for key, size in sizes.items():
    files[key] = blob[pos:pos + size].copy()
    pos += size
  return files


def _tensorflow():
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  try:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(storage.TF_INSTALL_HINT) from e
  return tf


def _first_line(e: BaseException) -> str:
  text = str(e).strip()
  return text.splitlines()[0] if text else type(e).__name__
