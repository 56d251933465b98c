"""The destination of a migration: the `Target` seam and its Orbax side.

`migrate` and `verify_step` talk to a `Target` only: list its steps, write a
step atomically (reporting bytes), remove what an interrupted write left,
read a step's metadata, restore a step's items. `OrbaxTarget` is the one
implementation: an Orbax `CheckpointManager` root, written through Orbax's
own handlers, with a bounded numpy handler (a byte budget, a read-ahead of
memory-mapped arrays and a heap trimmer) so memory stays small whatever the
checkpoint size.

This is the one module that uses a private Orbax API,
`NumpyHandler._background_serialize` (checked at use time against the
versions in `CHECKED_ORBAX_VERSIONS`; `PrivateApiError` if it is missing).
Orbax itself is imported only when a target is used: `list_steps` lists
a root's steps exactly as Orbax's default `CheckpointManager` does, without
importing Orbax (for `clu_ckpt.inspection`, too).

Synopsis::

  from clu_ckpt.migration import orbax_target

  steps, partial = orbax_target.list_steps("/runs/a/orbax")
  target = orbax_target.OrbaxTarget("/runs/a/orbax")
  target.write_step(7, {"state": tree, "metadata": meta}, on_bytes=print)
  state, meta = target.restore(7)
"""

from __future__ import annotations

import abc
import asyncio
import inspect
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from clu_ckpt import errors
from clu_ckpt import orbax_root
from clu_ckpt import storage

STATE_ITEM = "state"
DATASET_ITEM = "dataset"
METADATA_ITEM = "metadata"
# Array bytes handed to TensorStore at once; bounds the memory of a migration
# (TensorStore copies what it is given before compressing and writing it).
DEFAULT_INFLIGHT_BYTES = 128 * 2**20

# The private Orbax API the bounded handler overrides, and the
# orbax-checkpoint versions it was checked against.
PRIVATE_API = ("orbax.checkpoint.type_handlers.NumpyHandler."
               "_background_serialize")
PRIVATE_API_PARAMETERS = ("self", "values", "infos", "args")
CHECKED_ORBAX_VERSIONS = ("0.12.8",)

# What Orbax puts in the names of steps being written (local file systems).
ORBAX_TMP_MARKER = orbax_root.ORBAX_TMP_MARKER
# The one listing of an Orbax root's steps (Orbax's own rules, no Orbax).
list_steps = orbax_root.list_steps
# What marks a finished step on object stores (where nothing is renamed).


# --------------------------------------------------------------------------
# Listing steps, without Orbax.
# --------------------------------------------------------------------------


# --------------------------------------------------------------------------
# The seam.
# --------------------------------------------------------------------------


class Target(abc.ABC):
  """Where migrated steps go: the one interface `migrate` writes through."""

  root: str

  @abc.abstractmethod
  def steps(self) -> list[int]:
    """The finished steps, sorted."""

  @abc.abstractmethod
  def write_step(self, step: int, items: Mapping[str, Any],
                 on_bytes: Callable[[int], None]) -> None:
    """Writes one step atomically; on failure, nothing of it is left.

    Args:
      step: The step.
      items: {STATE_ITEM: tree, METADATA_ITEM: json, [DATASET_ITEM: tree]}.
      on_bytes: Called with the byte count of each array once written.
    """

  @abc.abstractmethod
  def remove_partial(self, step: int) -> None:
    """Removes what an interrupted write of `step` left behind."""

  @abc.abstractmethod
  def read_metadata(self, step: int) -> dict[str, Any]:
    """The step's metadata item ({} when it has none)."""

  @abc.abstractmethod
  def restore(self, step: int) -> tuple[Any, dict[str, Any]]:
    """(stored state tree, metadata) of a step."""

  @abc.abstractmethod
  def state_layout(self, step: int) -> Any:
    """The stored state's tree of per-leaf metadata (shape, dtype)."""

  @abc.abstractmethod
  def restore_leaves(self, step: int, layout: Any) -> Any:
    """Restores the part of the state `layout` (a subtree of
    `state_layout(step)`) covers."""

  @abc.abstractmethod
  def restore_dataset(self, step: int) -> Optional[dict[str, Any]]:
    """The step's dataset item, or None when it has none."""


# --------------------------------------------------------------------------
# Orbax.
# --------------------------------------------------------------------------


class OrbaxTarget(Target):
  """An Orbax `CheckpointManager` root, written with bounded memory.

  Args:
    root: The root directory (created on the first write).
    use_compression: zstd (Orbax's default) or none, for the state's arrays.
    inflight_bytes: Array bytes handed to TensorStore at once.
  """

  def __init__(self, root: str, *, use_compression: bool = True,
               inflight_bytes: int = DEFAULT_INFLIGHT_BYTES):
    self.root = root
    self.use_compression = use_compression
    self.inflight_bytes = inflight_bytes

  def _path(self, step: int, item: Optional[str] = None):
    from etils import epath  # pylint: disable=g-import-not-at-top
    path = epath.Path(self.root) / str(step)
    return path / item if item else path

  def steps(self) -> list[int]:
    return list_steps(self.root)[0]

  def write_step(self, step: int, items: Mapping[str, Any],
                 on_bytes: Callable[[int], None]) -> None:
    try:
      self._save(step, items, on_bytes)
    except BaseException:
      self.remove_partial(step)
      raise

  def _save(self, step: int, items: Mapping[str, Any],
            on_bytes: Callable[[int], None]) -> None:
    """Orbax's own atomic save: a temporary name, then a rename."""
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    storage.makedirs(self.root)
    state_handler = ocp.handlers.PyTreeCheckpointHandler(
        use_compression=self.use_compression,
        type_handler_registry=_type_handlers(self.inflight_bytes, on_bytes))
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add(STATE_ITEM, ocp.args.PyTreeSave, state_handler)
    registry.add(DATASET_ITEM, ocp.args.PyTreeSave,
                 ocp.handlers.PyTreeCheckpointHandler())
    registry.add(METADATA_ITEM, ocp.args.JsonSave,
                 ocp.handlers.JsonCheckpointHandler())
    args = {STATE_ITEM: ocp.args.PyTreeSave(items[STATE_ITEM]),
            METADATA_ITEM: ocp.args.JsonSave(items[METADATA_ITEM])}
    if DATASET_ITEM in items:
      args[DATASET_ITEM] = ocp.args.PyTreeSave(items[DATASET_ITEM])
    checkpointer = ocp.Checkpointer(
        ocp.handlers.CompositeCheckpointHandler(handler_registry=registry))
    try:
      checkpointer.save(self._path(step), args=ocp.args.Composite(**args))
    finally:
      checkpointer.close()

  def remove_partial(self, step: int) -> None:
    # Through the storage seam: an entry that is a symlink is unlinked, its
    # target never touched.
    if storage.isdir(self.root):
      prefix = storage.glob_escape(storage.join(self.root, str(step)))
      for path in storage.glob(f"{prefix}{ORBAX_TMP_MARKER}*"):
        storage.remove_tree(path)

  def read_metadata(self, step: int) -> dict[str, Any]:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    path = self._path(step, METADATA_ITEM)
    if not path.exists():
      return {}
    return ocp.handlers.JsonCheckpointHandler().restore(
        path, args=ocp.args.JsonRestore())

  def restore(self, step: int) -> tuple[Any, dict[str, Any]]:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    checkpointer = ocp.Checkpointer(ocp.handlers.CompositeCheckpointHandler())
    with checkpointer:
      restored = checkpointer.restore(
          self._path(step), args=ocp.args.Composite(
              **{STATE_ITEM: ocp.args.PyTreeRestore(),
                 METADATA_ITEM: ocp.args.JsonRestore()}))
    return restored[STATE_ITEM], restored[METADATA_ITEM]

  def state_layout(self, step: int) -> Any:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    handler = ocp.handlers.PyTreeCheckpointHandler()
    return handler.metadata(self._path(step, STATE_ITEM)).tree

  def restore_leaves(self, step: int, layout: Any) -> Any:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    handler = ocp.handlers.PyTreeCheckpointHandler()
    return handler.restore(self._path(step, STATE_ITEM),
                           args=ocp.args.PyTreeRestore(
                               item=layout, partial_restore=True))

  def restore_dataset(self, step: int) -> Optional[dict[str, Any]]:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    item = self._path(step, DATASET_ITEM)
    if not item.exists():
      return None
    return ocp.handlers.PyTreeCheckpointHandler().restore(
        item, args=ocp.args.PyTreeRestore())


def read_metadata(destination: str, step: int) -> dict[str, Any]:
  """The `metadata` item of a migrated step, read through Orbax.

  Args:
    destination: The Orbax root directory.
    step: The step.

  Returns:
    The metadata (an empty dict when the step has none).
  """
  return OrbaxTarget(destination).read_metadata(step)


# --------------------------------------------------------------------------
# The bounded numpy handler (the private API).
# --------------------------------------------------------------------------


def orbax_version() -> str:
  """The installed orbax-checkpoint version ("unknown" if it cannot say)."""
  try:
    from importlib import metadata  # pylint: disable=g-import-not-at-top
    return metadata.version("orbax-checkpoint")
  except Exception:  # pylint: disable=broad-except
    return "unknown"


def check_private_api(handler_cls: Any = None) -> Callable[..., Any]:
  """The private `NumpyHandler._background_serialize`, or PrivateApiError.

  Args:
    handler_cls: The class to look in; default Orbax's `NumpyHandler`.

  Returns:
    The method.

  Raises:
    PrivateApiError: It is missing, or takes other parameters.
  """
  if handler_cls is None:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    handler_cls = ocp.type_handlers.NumpyHandler
  method = getattr(handler_cls, "_background_serialize", None)
  checked = ", ".join(CHECKED_ORBAX_VERSIONS)
  if method is None or not callable(method):
    raise errors.PrivateApiError(
        f"clu_ckpt's migration writes arrays through the private Orbax API "
        f"{PRIVATE_API}, checked against orbax-checkpoint {checked}; the "
        f"installed orbax-checkpoint {orbax_version()} does not have it. "
        f"Install orbax-checkpoint=={CHECKED_ORBAX_VERSIONS[-1]}.")
  parameters = tuple(inspect.signature(method).parameters)
  if parameters != PRIVATE_API_PARAMETERS:
    raise errors.PrivateApiError(
        f"clu_ckpt's migration writes arrays through the private Orbax API "
        f"{PRIVATE_API}{PRIVATE_API_PARAMETERS}, checked against "
        f"orbax-checkpoint {checked}; in the installed orbax-checkpoint "
        f"{orbax_version()} it takes {parameters}. Install "
        f"orbax-checkpoint=={CHECKED_ORBAX_VERSIONS[-1]}.")
  return method


def _type_handlers(inflight_bytes: int, on_bytes: Callable[[int], None]):
  """Orbax's standard type handlers, numpy arrays written in bounded slices."""
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  th = ocp.type_handlers
  return th.create_type_handler_registry(
      (int, th.ScalarHandler()),
      (float, th.ScalarHandler()),
      (np.number, th.ScalarHandler()),
      (np.ndarray, _bounded_numpy_handler(inflight_bytes, on_bytes)),
      (jax.Array, th.get_type_handler(jax.Array)),
      (str, th.StringHandler()),
  )


def _bounded_numpy_handler(inflight_bytes: int,
                           on_bytes: Callable[[int], None]):
  """A `NumpyHandler` that hands TensorStore a bounded number of bytes.

  Orbax's handler deep-copies every array, then gives all of them to
  TensorStore at once, which copies each into its chunk buffers before
  compressing it: memory grows to the checkpoint's size. This one writes the
  (memory-mapped) arrays themselves, starting another only while less than
  `inflight_bytes` are being written. The files are the same (the type name
  is the same), so stock Orbax restores them.

  Args:
    inflight_bytes: Bytes of arrays being written at once (an array larger
      than this is written alone).
    on_bytes: Called with an array's byte count once it is written.

  Returns:
    The handler.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  check_private_api(ocp.type_handlers.NumpyHandler)

  class BoundedNumpyHandler(ocp.type_handlers.NumpyHandler):

    def __init__(self):
      super().__init__(deepcopy_host_arrays=False)

    async def _background_serialize(self, values, infos, args=None):
      write_all = super()._background_serialize
      budget = _ByteBudget(inflight_bytes)
      trim = _MemoryTrimmer(inflight_bytes)

      async def write(value, info, arg):
        try:
          await write_all([value], [info], [arg])
        finally:
          await budget.release(value.nbytes)
        trim.written(value.nbytes)
        on_bytes(value.nbytes)

      tasks = []
      prefetch = _Prefetcher(values, 2 * inflight_bytes)
      for i, (value, info, arg) in enumerate(
          zip(values, infos, args or [None] * len(values))):
        prefetch.up_to(i)
        await budget.acquire(value.nbytes)
        tasks.append(asyncio.ensure_future(write(value, info, arg)))
      await asyncio.gather(*tasks)

  return BoundedNumpyHandler()


class _Prefetcher:
  """Asks the kernel to read memory-mapped arrays ahead of their writing.

  With a cold page cache, TensorStore's threads would otherwise fault the
  file in page by page. Reading ahead is bounded (`window` bytes beyond the
  array being admitted) and goes to the page cache, not to process memory.
  """

  def __init__(self, values: Sequence[Any], window: int):
    self._values = values
    self._window = window
    self._next = 0  # First array not yet prefetched.
    self._ahead = 0  # Bytes prefetched beyond the current array.

  def up_to(self, current: int) -> None:
    if current < self._next:
      self._ahead -= self._values[current].nbytes
    else:
      self._next = current
      self._ahead = 0
    while self._next < len(self._values) and self._ahead < self._window:
      value = self._values[self._next]
      _will_need(value)
      if self._next > current:
        self._ahead += value.nbytes
      self._next += 1


def _will_need(arr: Any) -> None:
  """madvise(WILLNEED) for an array that is a view of an `mmap`."""
  import mmap  # pylint: disable=g-import-not-at-top
  base = arr
  while base is not None and not isinstance(base, mmap.mmap):
    base = base.obj if isinstance(base, memoryview) else getattr(
        base, "base", None)
  if base is None or not hasattr(base, "madvise") or not arr.nbytes:
    return
  try:
    start = (arr.__array_interface__["data"][0] -
             np.frombuffer(base, np.uint8).__array_interface__["data"][0])
    aligned = start - start % mmap.PAGESIZE
    base.madvise(mmap.MADV_WILLNEED, aligned, arr.nbytes + start - aligned)
  except (ValueError, OSError, AttributeError):
    pass  # Only a hint.


class _MemoryTrimmer:
  """Returns freed heap memory to the OS every `interval` bytes written.

  TensorStore's compression buffers are allocated and freed from many
  threads; glibc keeps the freed memory in per-thread arenas, so without
  `malloc_trim` the resident memory creeps up with the bytes written.
  """

  def __init__(self, interval: int):
    self._interval = interval
    self._pending = 0
    self._trim = _malloc_trim()

  def written(self, n: int) -> None:
    self._pending += n
    if self._trim is not None and self._pending >= self._interval:
      self._pending = 0
      self._trim(0)


def _malloc_trim() -> Optional[Callable[[int], int]]:
  try:
    import ctypes  # pylint: disable=g-import-not-at-top
    return ctypes.CDLL("libc.so.6").malloc_trim
  except (OSError, AttributeError):
    return None  # Not glibc.


class _ByteBudget:
  """Admits work while fewer than `limit` bytes are in flight."""

  def __init__(self, limit: int):
    self._limit = limit
    self._used = 0
    self._cond = asyncio.Condition()

  async def acquire(self, n: int) -> None:
    async with self._cond:
      await self._cond.wait_for(
          lambda: self._used == 0 or self._used + n <= self._limit)
      self._used += n

  async def release(self, n: int) -> None:
    async with self._cond:
      self._used -= n
      self._cond.notify_all()

