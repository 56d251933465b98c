"""The destination of a migration: the `Target` seam and its Orbax side.

`migrate` and `verify_step` talk to a `Target` only: list its steps, write a
step atomically (reporting bytes), remove what an interrupted write left,
read a step's metadata, restore a step's items. `OrbaxTarget` is the one
implementation: an Orbax `CheckpointManager` root, written through Orbax's
own handlers, with a bounded numpy handler (a byte budget, a read-ahead of
memory-mapped arrays, for uncompressed writes aligned copies of unaligned
ones in reused buffers, and a heap trimmer; see `memory`) so memory stays
small whatever the checkpoint size.

Writing needs orbax-checkpoint >= `MIN_ORBAX_VERSION`: `require_orbax`
(called by `migrate` before it reads or writes anything, and by
`OrbaxTarget.write_step`) raises a one-line `MigrationError` naming the
installed and the required version and the command that makes a migration
environment; reading a migrated root works with older Orbax too.

This is the one module that relies on Orbax behaviour outside its public
API, checked against the versions in `CHECKED_ORBAX_VERSIONS`:
`NumpyHandler._background_serialize` (`PRIVATE_API`, checked at use time;
`PrivateApiError` if it is missing), and, to give a step its source's save
time, that a save's commit time is written through the `MetadataStore`
given to `Checkpointer` as `update(..., commit_timestamp_nsecs=...)` before
the step is renamed into place (`COMMIT_TIME_API`, checked after each save;
`PrivateApiError` if it did not happen).
Orbax itself is imported only when a target is used: `list_steps` lists
a root's steps exactly as a `CheckpointManager` with the same `step_prefix`
and `step_format_fixed_length` options does, without importing Orbax (for
`clu_ckpt.inspection`, too).

Synopsis::

  from clu_ckpt.migration import orbax_target

  steps, partial = orbax_target.list_steps("/runs/a/orbax")
  target = orbax_target.OrbaxTarget("/runs/a/orbax", step_prefix="step",
                                    step_format_fixed_length=8)
  target.write_step(7, {"state": tree, "metadata": meta}, on_bytes=print,
                    saved_at=1700000000.5, custom_metadata={"source": src})
  state, meta = target.restore(7)
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import functools
import inspect
import math
import os
import threading
from typing import Any, Callable, Mapping, Optional

import numpy as np

from clu_ckpt import errors
from clu_ckpt import layout
from clu_ckpt import orbax_root
from clu_ckpt import storage
from clu_ckpt.migration import memory

STATE_ITEM = "state"
DATASET_ITEM = "dataset"
METADATA_ITEM = "metadata"
# Array bytes handed to TensorStore at once; bounds the memory of a migration
# (TensorStore copies what it is given before compressing and writing it).
DEFAULT_INFLIGHT_BYTES = 128 * 2**20
# The same for a bucket destination (`gs://`): TensorStore's GCS writes hold
# the bytes they are given until the upload is acknowledged, on top of the
# copies compression makes, so the window is smaller there. Chosen by
# measurement (benchmarks/bench_buckets.py, migrate@W): gs:// -> gs://, 480
# MiB, fake-gcs-server's memory store behind the 30 ms / 60 MB/s-per-
# connection proxy, 2 runs, medians, a loaded 2-core machine: 16 MiB 26.8 s
# (extra peak RssAnon 0.44x the checkpoint), 32 MiB 28.0 s (0.44x), 64 MiB
# 27.9 s (0.42x), 128 MiB 24.5 s (0.60x): no gain up to 64 MiB, and 9% at
# 128 MiB for +0.16x memory. About 140 MiB of the memory is a fixed cost
# (TensorStore, Orbax; the same locally), so the extra memory is below a
# quarter of the checkpoint's size from checkpoints of about 1 GB up.
REMOTE_INFLIGHT_BYTES = 16 * 2**20
# The size of the OCDBT data files TensorStore writes to a bucket
# (`ocdbt_target_data_file_size`, public in Orbax's PyTreeSave; Orbax's
# default on GCS is 400 MiB). TensorStore uploads a data file as soon as it
# reaches this size, in parallel with the next ones; with 400 MiB files every
# array went up as one upload, one at a time. Arrays larger than this are
# chunked at this size (stock Orbax restores either). None: Orbax's default.
# Measured (benchmarks/bench_buckets.py, migrate@16xF, 480 MiB gs:// -> gs://
# through the 30 ms / 60 MB/s proxy, two runs of 2 at load 14-17): 400 MiB
# (Orbax's) 26.6 / 28.2 s with 1 upload at a time, 8 MiB 24.2 / 27.0 s with
# up to 4 at once; 4 MiB 25.4 s (one run; 8 at once, more requests, and
# twice the chunks for every later restore to read): within the noise of 8.
REMOTE_DATA_FILE_BYTES: Optional[int] = 8 * 2**20
# An array larger than half the in-flight window is handed to TensorStore in
# slices of whole chunks of at most half the window, this many at once (see
# `write_in_slices`): TensorStore holds an array's copy, compressed chunks
# and uploads at once, so without slices the memory followed the largest
# array, not the window. (Only chunked arrays can be sliced: on a bucket,
# where `REMOTE_DATA_FILE_BYTES` makes Orbax chunk them; a local
# destination's arrays are one chunk each and go whole, as before.)
# Measured (benchmarks/bench_buckets.py, migrate@sKbM, 480 MiB gs:// -> gs://
# through the 30 ms / 60 MB/s proxy, 64 MiB arrays, one run at load 13):
# whole arrays 24.4 s and 0.37x the checkpoint in extra RssAnon; 8 MiB x 2
# 25.2 s and 0.18x; 8 x 4 24.4 s, 0.25x; 16 x 2 23.1 s, 0.26x; 16 x 4
# 22.8 s, 0.38x; 32 x 2 24.1 s, 0.35x. Again, 2 runs at load 8-9: whole
# 20.7 s (0.35x), 8 x 2 23.8 s (0.18x), 8 x 4 21.6 s (0.25x). With two in
# flight TensorStore commits one slice at a time, so one data file uploads
# at a time; with four, two or more go up at once (the default). Straight
# to the emulator: 10.7 s either way, 0.23x against 0.36x (8 x 2).
SLICES_IN_FLIGHT = 4
# The most bytes of one slice; None: half the in-flight window. 0: arrays
# are handed over whole (Orbax's own way).
SLICE_BYTES: Optional[int] = None

# A step for a `gs://` root is written by Orbax to a local staging directory
# first, then uploaded by many streams at once and committed last as Orbax
# commits it there (`staging`): on a link with real latency a direct write
# spends most of its time in sequential round trips (TensorStore's commits
# of one or two data files at a time, each followed by dependent small
# requests). Not staged: several JAX processes (each writes its own part
# of the step), or a staging directory without room for the step. False:
# always the direct write. Measured: see the README's bucket section.
STAGE_BUCKET_STEPS = True
# The anonymous memory a staged step's uploads hold, per stream (gcsfs'
# copy of a data file and the send buffer: ~240 MiB at 8 streams, measured
# at 480 MiB and 1344 MiB). Unless a staging directory is named (the
# argument or `$CLU_CKPT_STAGING_DIR`), a step is staged only when that is
# at most a quarter of its bytes (about 1 GiB at 8 streams): issue 25's
# bound on extra memory, 0.25x the checkpoint. Below, the direct write
# keeps it (0.25x at 480 MiB, against 0.50x staged).
STAGED_BYTES_PER_STREAM = 30 * 2**20
# A staged step's source arrays are read ahead from the start, one after the
# other, in a thread (`_ReadAhead`), not one array ahead of the writer: the
# local writes do not wait for a link, so the download is the pace.
STAGED_READ_AHEAD = True
# Ranged reads in flight for it (`bucket_spool.READ_AHEAD_CHUNK` each; the
# writer's own read-ahead sends `bucket_spool.READ_AHEAD_STREAMS`, 4).
# Measured (bench_buckets.py, migrate@o1 against migrate@o1a8, 480 MiB, 3
# runs): 4 in flight 12.23 s, 8 in flight 10.11 s (2.24x / 2.71x naive).
STAGED_READ_AHEAD_STREAMS = 8
# A staged step's local files are written without fsync (TensorStore's
# `file_io_sync` off for its OCDBT data and manifest files): they are
# temporary, read back from the page cache by the upload, and the step is
# committed by its upload, whose commit file goes up last; a crash loses the
# staging directory, never a committed step. The bytes written are the same.
# Measured (480 MiB written locally with the staged step's settings, 2 runs
# each, load 6-7): 4.48 / 4.70 s with fsync, 2.79 / 3.11 s without, for
# the same CPU time (~2 s): the write waited for the disk.
STAGED_FILE_SYNC = False

# The oldest orbax-checkpoint the migration writes with: its `NumpyHandler`
# takes `deepcopy_host_arrays` from 0.12.5 on (before, it deep-copies every
# array: memory grows to the checkpoint's size). Checked once, before a
# migration reads or writes anything (`require_orbax`).
MIN_ORBAX_VERSION = "0.12.5"
# Where the command that makes a migration environment installs it.
MIGRATION_ENV = "~/clu-ckpt-migrate"

# The private Orbax API the bounded handler overrides, and the
# orbax-checkpoint versions it was checked against.
PRIVATE_API = ("orbax.checkpoint.type_handlers.NumpyHandler."
               "_background_serialize")
PRIVATE_API_PARAMETERS = ("self", "values", "infos", "args")
CHECKED_ORBAX_VERSIONS = ("0.12.5", "0.12.8")  # the matrix (noxfile.py)
# The Orbax behaviour a step's commit time is set through (see the module
# docstring), checked against the same versions.
COMMIT_TIME_API = ("orbax.checkpoint.metadata.MetadataStore.update("
                   "commit_timestamp_nsecs=...), called by Checkpointer.save")
COMMIT_TIME_FIELD = "commit_timestamp_nsecs"

# What Orbax puts in the names of steps being written (local file systems).
ORBAX_TMP_MARKER = orbax_root.ORBAX_TMP_MARKER
# What a step that failed verification is renamed to before it is removed.
DISCARDED_MARKER = ".clu_ckpt-discarded"
# The file whose presence commits a step (and an item) on GCS, where Orbax
# writes under the final name and does not rename.
COMMIT_SUCCESS_FILE = orbax_root.COMMIT_SUCCESS_FILE
# The one listing of an Orbax root's steps (Orbax's own rules, no Orbax).
list_steps = orbax_root.list_steps


def default_inflight_bytes(root: str) -> int:
  """The in-flight window for a destination: smaller for buckets.

  Example::

    default_inflight_bytes("/runs/a/orbax")     # DEFAULT_INFLIGHT_BYTES
    default_inflight_bytes("gs://b/orbax")      # REMOTE_INFLIGHT_BYTES
  """
  return DEFAULT_INFLIGHT_BYTES if storage.is_local(root) else (
      REMOTE_INFLIGHT_BYTES)


def check_destination(root: str) -> None:
  """Refuses a destination stock Orbax cannot restore from.

  Orbax 0.12 reads arrays through TensorStore specs that know `gs://` and
  local paths only: a step written to `s3://` could never be restored by a
  stock `CheckpointManager`.

  Example::

    check_destination("gs://b/orbax")   # fine
    check_destination("s3://b/orbax")   # UsageError

  Raises:
    UsageError: `root` is an `s3://` URL.
  """
  if root.lower().startswith("s3://"):
    raise errors.UsageError(
        f"{root}: Orbax destinations on s3:// are not supported: the "
        f"installed orbax-checkpoint {orbax_version()} cannot restore arrays "
        "from s3:// (its TensorStore specs know gs:// and local paths "
        "only); migrate to gs:// or a local/mounted directory (s3:// "
        "sources are fine)")


def is_bucket(root: str) -> bool:
  """Whether `root` is in an object store (`gs://`, `s3://`)."""
  return root.lower().startswith(("gs://", "s3://"))


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
                 on_bytes: Callable[[int], None], *,
                 saved_at: Optional[float] = None,
                 custom_metadata: Optional[Mapping[str, Any]] = None,
                 standard_state: bool = False) -> None:
    """Writes one step atomically; on failure, nothing of it is left.

    Args:
      step: The step.
      items: {STATE_ITEM: tree, METADATA_ITEM: json, [DATASET_ITEM: tree]}.
      on_bytes: Called with the byte count of each array once written.
      saved_at: The step's save time (Unix seconds), recorded as the time
        the target's retention policies use; None: the time of writing.
      custom_metadata: JSON-ready custom metadata of the step.
      standard_state: The state has a template's structure: write it as a
        StandardSave item (`migrate` passes it only with a template).
    """

  @abc.abstractmethod
  def remove_partial(self, step: int) -> None:
    """Removes what an interrupted write of `step` left behind."""

  @abc.abstractmethod
  def discard(self, step: int) -> None:
    """Takes a finished step away (it failed verification): it leaves the
    listing first, at once, and its files after that."""

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

  Steps are named as a `CheckpointManager` with
  `CheckpointManagerOptions(step_prefix=..., step_format_fixed_length=...)`
  names them (`orbax_root.step_name`: step 7 is "7", or "step_0007"), and
  listed as it lists them.

  Args:
    root: The root directory (created on the first write): a path (made
      absolute against the current directory), a `file://` URL (becomes a
      local path) or another URL (`gs://`; TensorStore writes the arrays
      there itself, so the environment Orbax needs for a bucket is set up
      here: `fsspec_fs.configure_environment`). `self.root` is the absolute
      form.
    use_compression: zstd (Orbax's default) or none, for the state's arrays.
    inflight_bytes: Array bytes handed to TensorStore at once; None: see
      `default_inflight_bytes`.
    step_prefix: As in `CheckpointManagerOptions` (None: no prefix).
    step_format_fixed_length: As in `CheckpointManagerOptions` (None or 0:
      no zero padding).
    before_commit: Called with the step's temporary directory once all of
      it is written, just before Orbax renames it into place (through the
      same `MetadataStore` hook as the commit time, `COMMIT_TIME_API`);
      `clu_ckpt.orbax_layout` fsyncs the step there. None: nothing.
    staging_dir: For a `gs://` root, the local directory each step is
      written to before it is uploaded (`staging`, `STAGE_BUCKET_STEPS`);
      None: `$CLU_CKPT_STAGING_DIR`, else the system's temporary directory.

  Raises:
    UsageError: An empty root, an `s3://` root (`check_destination`), or
      naming options Orbax cannot use (see `orbax_root.check_step_naming`).
  """

  def __init__(self, root: str, *, use_compression: bool = True,
               inflight_bytes: Optional[int] = None,
               step_prefix: Optional[str] = None,
               step_format_fixed_length: Optional[int] = None,
               before_commit: Optional[Callable[[str], None]] = None,
               staging_dir: Optional[str] = None):
    orbax_root.check_step_naming(step_prefix, step_format_fixed_length)
    self.root = layout.absolute(root)
    check_destination(self.root)
    if is_bucket(self.root):
      from clu_ckpt import fsspec_fs  # pylint: disable=g-import-not-at-top
      fsspec_fs.configure_environment()
    self.use_compression = use_compression
    self.inflight_bytes = (default_inflight_bytes(self.root)
                           if inflight_bytes is None else inflight_bytes)
    self.step_prefix = step_prefix
    self.step_format_fixed_length = step_format_fixed_length
    self.before_commit = before_commit
    self.staging_dir = staging_dir
    # Staging areas of steps under way (removed again by remove_partial,
    # once an interrupted write's threads have stopped).
    self._areas: set[Any] = set()
    # Whether the last write_step was staged (for tests and benchmarks).
    self.last_write_staged = False

  def step_name(self, step: int) -> str:
    """The name of `step`'s directory under the root."""
    return orbax_root.step_name(step, self.step_prefix,
                                self.step_format_fixed_length)

  def _path(self, step: int, item: Optional[str] = None):
    from etils import epath  # pylint: disable=g-import-not-at-top
    path = epath.Path(self.root) / self.step_name(step)
    return path / item if item else path

  def steps(self) -> list[int]:
    return list_steps(
        self.root, step_prefix=self.step_prefix,
        step_format_fixed_length=self.step_format_fixed_length)[0]

  def write_step(self, step: int, items: Mapping[str, Any],
                 on_bytes: Callable[[int], None], *,
                 saved_at: Optional[float] = None,
                 custom_metadata: Optional[Mapping[str, Any]] = None,
                 standard_state: bool = False) -> None:
    """Writes one step atomically; on failure, nothing of it is left.

    The step's `_CHECKPOINT_METADATA` gets `saved_at` as its commit time
    (`commit_timestamp_nsecs`: what a `CheckpointManager` reports as the
    step's time and its retention policies use) and `custom_metadata` (a
    `CheckpointManager`'s `metadata(step).custom_metadata`), both before
    Orbax renames the step into place.

    Args:
      step: The step.
      items: {STATE_ITEM: tree, METADATA_ITEM: json, [DATASET_ITEM: tree]}.
      on_bytes: Called with the byte count of each array once written.
      saved_at: The source's save time (Unix seconds); None: now.
      custom_metadata: JSON-ready custom metadata of the step.
      standard_state: The state has a template's structure: Orbax records
        it as a StandardSave item (`template.standard_state_handler`).

    What an interrupted write of the same step left (a killed run) is
    removed first: Orbax refuses to save over an existing directory, and on
    GCS the uncommitted step has the final name.

    Raises:
      MigrationError: orbax-checkpoint is older than `MIN_ORBAX_VERSION`
        (or missing): nothing is written.
      UsageError: `saved_at` is not a finite non-negative time.
      PrivateApiError: This Orbax did not record the commit time as
        `COMMIT_TIME_API` says (the step is removed again).
    """
    require_orbax()
    commit_nsecs = _commit_nsecs(saved_at)
    custom = None if custom_metadata is None else dict(custom_metadata)
    self.last_write_staged = self._stages(items)
    cleared = None
    if self.last_write_staged:
      # What a killed run left of the step in the bucket is removed while
      # the step is written locally (its round trips off the path): the
      # uploader sends nothing of the step before that has ended.
      self._remove_local_partial()
      cleared = _started(self._remove_remote_partial, step)
    else:
      self.remove_partial(step)
    try:
      if self.last_write_staged:
        self._save_staged(step, items, on_bytes, commit_nsecs, custom,
                          standard_state, cleared)
      else:
        self._save(step, items, on_bytes, commit_nsecs, custom,
                   standard_state)
    except BaseException:
      if cleared is not None:
        concurrent.futures.wait([cleared])
      self.remove_partial(step)
      raise

  def _stages(self, items: Mapping[str, Any]) -> bool:
    """Whether a step goes through a local staging directory: a `gs://`
    root, one JAX process, and room for the step's bytes there."""
    if not STAGE_BUCKET_STEPS or not orbax_root.commits_by_file(self.root):
      return False
    import jax  # pylint: disable=g-import-not-at-top
    if jax.process_count() > 1:
      return False
    from clu_ckpt.migration import staging  # pylint: disable=g-import-not-at-top
    nbytes = _tree_nbytes(items)
    named = self.staging_dir or os.environ.get(staging.STAGING_DIR_ENV)
    if not named and 4 * staging.upload_streams() * (
        STAGED_BYTES_PER_STREAM) > nbytes:
      return False
    return staging.has_room(self.staging_dir, nbytes)

  def _save_staged(self, step: int, items: Mapping[str, Any],
                   on_bytes: Callable[[int], None],
                   commit_nsecs: Optional[int],
                   custom_metadata: Optional[dict[str, Any]],
                   standard_state: bool = False,
                   cleared: Optional[concurrent.futures.Future] = None
                   ) -> None:
    """Orbax's save into a local staging area, its data files uploaded as
    they are written (`staging.StepUploader`, `staging.upload_streams()` at
    a time), the rest after it, the step's `commit_success.txt` last, as
    Orbax commits a step on GCS. `cleared`: the removal of what a killed
    run left of the step in the bucket, which every upload waits for."""
    from clu_ckpt.migration import staging  # pylint: disable=g-import-not-at-top
    area = staging.StagingArea(self.staging_dir)
    self._areas.add(area)
    name = self.step_name(step)
    with area:
      uploader = staging.StepUploader(area.path, name,
                                      storage.join(self.root, name),
                                      ready=cleared)
      if staging.OVERLAP:
        uploader.start()
      try:
        self._save(step, items, on_bytes, commit_nsecs, custom_metadata,
                   standard_state, root=area.path)
        uploader.finish()
      except BaseException:
        uploader.abort()
        raise
    self._areas.discard(area)

  def _save(self, step: int, items: Mapping[str, Any],
            on_bytes: Callable[[int], None], commit_nsecs: Optional[int],
            custom_metadata: Optional[dict[str, Any]],
            standard_state: bool = False, root: Optional[str] = None) -> None:
    """Orbax's own atomic save: a temporary name, then a rename.

    On GCS Orbax writes under the final name and commits by writing
    `commit_success.txt` (after the commit time): `list_steps` lists only
    steps that have it. `root`: where to write it (a staging area); None:
    the target's root.
    """
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    from clu_ckpt.migration import template  # pylint: disable=g-import-not-at-top
    root = self.root if root is None else root
    storage.makedirs(root)
    state_handler = (template.standard_state_handler if standard_state else
                     ocp.handlers.PyTreeCheckpointHandler)(
                         use_compression=self.use_compression,
                         type_handler_registry=_type_handlers(
                             self.inflight_bytes, on_bytes,
                             stage=not self.use_compression,
                             read_ahead_all=(root != self.root and
                                             STAGED_READ_AHEAD),
                             file_sync=(root == self.root or
                                        STAGED_FILE_SYNC)))
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add(STATE_ITEM, ocp.args.PyTreeSave, state_handler)
    registry.add(DATASET_ITEM, ocp.args.PyTreeSave,
                 ocp.handlers.PyTreeCheckpointHandler())
    registry.add(METADATA_ITEM, ocp.args.JsonSave,
                 ocp.handlers.JsonCheckpointHandler())
    files = {}
    if is_bucket(self.root) and REMOTE_DATA_FILE_BYTES:
      files["ocdbt_target_data_file_size"] = REMOTE_DATA_FILE_BYTES
    args = {STATE_ITEM: ocp.args.PyTreeSave(items[STATE_ITEM], **files),
            METADATA_ITEM: ocp.args.JsonSave(items[METADATA_ITEM])}
    if DATASET_ITEM in items:
      args[DATASET_ITEM] = ocp.args.PyTreeSave(items[DATASET_ITEM])
    store = None
    if commit_nsecs is not None or self.before_commit is not None:
      store = _CommitTimeStore(
          ocp.metadata.metadata_store(enable_write=True, blocking_write=True),
          commit_nsecs, self.before_commit)
    checkpointer = ocp.Checkpointer(
        ocp.handlers.CompositeCheckpointHandler(handler_registry=registry),
        checkpoint_metadata_store=store)
    try:
      from etils import epath  # pylint: disable=g-import-not-at-top
      checkpointer.save(epath.Path(root) / self.step_name(step),
                        args=ocp.args.Composite(**args),
                        custom_metadata=custom_metadata)
    finally:
      checkpointer.close()
    if store is not None and not store.committed and _primary_process():
      # Listed with the time of writing (or not fsynced): not what was
      # asked; undo it. (Only the primary process commits.)
      storage.remove_tree(storage.join(root, self.step_name(step)))
      raise errors.PrivateApiError(
          f"clu_ckpt sets a migrated step's save time through Orbax's "
          f"{COMMIT_TIME_API}, checked against orbax-checkpoint "
          f"{', '.join(CHECKED_ORBAX_VERSIONS)}; the installed "
          f"orbax-checkpoint {orbax_version()} did not call it. Install "
          f"orbax-checkpoint=={CHECKED_ORBAX_VERSIONS[-1]}.")

  def remove_partial(self, step: int) -> None:
    """Removes Orbax's temporary directories of `step`, and on GCS (where
    the step is written under its final name) the step's directory when it
    has no `commit_success.txt`."""
    self._remove_local_partial()
    self._remove_remote_partial(step)

  def _remove_local_partial(self) -> None:
    for area in list(self._areas):  # a staged write's local files
      area.remove()

  def _remove_remote_partial(self, step: int) -> None:
    # Through the storage seam: an entry that is a symlink is unlinked, its
    # target never touched.
    if not storage.isdir(self.root):
      return
    path = storage.join(self.root, self.step_name(step))
    for tmp in storage.glob(f"{storage.glob_escape(path)}{ORBAX_TMP_MARKER}*"):
      storage.remove_tree(tmp)
    if orbax_root.commits_by_file(self.root) and storage.isdir(path) and (
        not storage.exists(storage.join(path, COMMIT_SUCCESS_FILE))):
      storage.remove_tree(path)

  def discard(self, step: int) -> None:
    # Renamed to a name Orbax neither lists nor treats as its own temporary
    # one, then removed: a kill in between leaves an unlisted directory. On
    # stores without rename the commit file goes first, which unlists the
    # step at once, then the rest.
    path = storage.join(self.root, self.step_name(step))
    if not storage.exists(path):
      return
    aside = f"{path}{DISCARDED_MARKER}"
    try:
      storage.remove_tree(aside)
      storage.rename(path, aside)
    except NotImplementedError:  # stores without rename
      storage.remove(storage.join(path, COMMIT_SUCCESS_FILE))
      aside = path
    storage.remove_tree(aside)

  def read_metadata(self, step: int) -> dict[str, Any]:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    path = self._path(step, METADATA_ITEM)
    if not path.exists():
      return {}
    return ocp.handlers.JsonCheckpointHandler().restore(
        path, args=ocp.args.JsonRestore())

  def restore(self, step: int) -> tuple[Any, dict[str, Any]]:
    # Through the handler, not a `Checkpointer`: its restore ends at a
    # barrier of every JAX process, so a process restoring alone in a
    # multi-process job (CLU's `if jax.process_index() == 0: restore`)
    # waited there until the job's collectives timed out.
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    restored = ocp.handlers.CompositeCheckpointHandler().restore(
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


def item_handlers(*, standard_state: bool = False) -> dict[str, Any]:
  """The item handlers that make a stock `CheckpointManager` quiet.

  A `CheckpointManager` made without them restores a migrated step with a
  plain `restore(step)` all the same (it finds each item's handler in the
  step's `_CHECKPOINT_METADATA`, where the migration records them exactly
  as Orbax records its own items), but orbax-checkpoint 0.12 logs two
  "Item ... could not be restored. Please provide a
  `CheckpointHandlerRegistry`" warnings per item first, on its own roots
  too. Given these, `restore(step)` is silent and returns every item.

  Example::

    import orbax.checkpoint as ocp
    from clu_ckpt import migration

    mngr = ocp.CheckpointManager(
        "/runs/a/orbax", item_handlers=migration.item_handlers())
    restored = mngr.restore(mngr.latest_step())   # state, metadata, dataset

  Args:
    standard_state: The steps were migrated with a template (`--template`):
      their `state` item is a StandardSave's.

  Returns:
    {item name: a new Orbax handler} for `state`, `dataset`, `metadata`.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  state = (ocp.handlers.StandardCheckpointHandler() if standard_state else
           ocp.handlers.PyTreeCheckpointHandler())
  return {STATE_ITEM: state,
          DATASET_ITEM: ocp.handlers.PyTreeCheckpointHandler(),
          METADATA_ITEM: ocp.handlers.JsonCheckpointHandler()}


def read_metadata(destination: str, step: int, *,
                  step_prefix: Optional[str] = None,
                  step_format_fixed_length: Optional[int] = None
                  ) -> dict[str, Any]:
  """The `metadata` item of a migrated step, read through Orbax.

  Args:
    destination: The Orbax root directory (path or URL).
    step: The step.
    step_prefix: As in `CheckpointManagerOptions`.
    step_format_fixed_length: As in `CheckpointManagerOptions`.

  Returns:
    The metadata (an empty dict when the step has none).

  Raises:
    UsageError: See `OrbaxTarget`.
  """
  return OrbaxTarget(
      destination, step_prefix=step_prefix,
      step_format_fixed_length=step_format_fixed_length).read_metadata(step)


# --------------------------------------------------------------------------
# The step's save time.
# --------------------------------------------------------------------------


def _tree_nbytes(tree: Any) -> int:
  """The bytes of the arrays in a tree of dicts, lists and arrays."""
  if isinstance(tree, Mapping):
    return sum(_tree_nbytes(v) for v in tree.values())
  if isinstance(tree, (list, tuple)):
    return sum(_tree_nbytes(v) for v in tree)
  nbytes = getattr(tree, "nbytes", 0)
  return nbytes if isinstance(nbytes, int) else 0


def _primary_process() -> bool:
  """Whether this is the process that commits Orbax's steps (process 0)."""
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_index() == 0


def _commit_nsecs(saved_at: Optional[float]) -> Optional[int]:
  """`saved_at` (Unix seconds) as Orbax's integer nanoseconds, or None."""
  if saved_at is None:
    return None
  if isinstance(saved_at, bool) or not isinstance(
      saved_at, (int, float, np.integer, np.floating)) or not (
          math.isfinite(saved_at) and saved_at >= 0):
    raise errors.UsageError(
        f"saved_at {saved_at!r}: must be a finite, non-negative Unix time "
        "in seconds")
  return int(round(float(saved_at) * 1e9))


class _CommitTimeStore:
  """Orbax's step metadata store, recording a given commit time.

  Implements `orbax.checkpoint.metadata.MetadataStore` by delegating to
  Orbax's own store; only an update of `COMMIT_TIME_FIELD` (made once per
  save, inside the temporary directory, before it is renamed into place)
  is given `commit_nsecs` instead of the current time.
  """

  def __init__(self, store: Any, commit_nsecs: Optional[int],
               before_commit: Optional[Callable[[str], None]] = None):
    self._store = store
    self._commit_nsecs = commit_nsecs  # None: Orbax's own time.
    self._before_commit = before_commit
    self.committed = False  # Whether the commit time went through here.

  def is_blocking_writer(self) -> bool:
    return self._store.is_blocking_writer()

  def write(self, file_path: Any, metadata: Any) -> None:
    self._store.write(file_path, metadata)

  def read(self, file_path: Any) -> Any:
    return self._store.read(file_path)

  def update(self, file_path: Any, **kwargs: Any) -> None:
    committing = COMMIT_TIME_FIELD in kwargs
    if committing:
      if self._commit_nsecs is not None:
        kwargs[COMMIT_TIME_FIELD] = self._commit_nsecs
      self.committed = True
    self._store.update(file_path, **kwargs)
    if committing and self._before_commit is not None:
      self._store.wait_until_finished()
      self._before_commit(str(file_path).rsplit("/", 1)[0])

  def wait_until_finished(self) -> None:
    self._store.wait_until_finished()

  def close(self) -> None:
    self._store.close()


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


@functools.lru_cache(maxsize=1)
def installed_orbax_version() -> Optional[str]:
  """The installed orbax-checkpoint version, or None when it is not
  installed (read from the package metadata once per process: Orbax is not
  imported)."""
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  try:
    return metadata.version("orbax-checkpoint")
  except metadata.PackageNotFoundError:
    return None


def _release(version: str) -> tuple[int, ...]:
  """The numeric release of a version string: "0.12.5rc1" -> (0, 12, 5)."""
  parts = []
  for part in version.strip().split("."):
    digits = ""
    for char in part:
      if not char.isdigit():
        break
      digits += char
    if not digits:
      break
    parts.append(int(digits))
    if digits != part:
      break
  return tuple(parts)


def migration_env_command() -> str:
  """The shell command that makes an environment the migration runs in.

  It installs this checkout of clu_ckpt with its `[orbax]` extra (the
  package installs from a checkout), into a virtual environment of its own
  so that the training environment's jax and Orbax stay as they are.
  """
  package = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  checkout = package if os.path.exists(
      os.path.join(package, "setup.py")) else "<clu_ckpt checkout>"
  return (f"python -m venv {MIGRATION_ENV} && {MIGRATION_ENV}/bin/pip "
          f"install -e '{checkout}[orbax]'")


def check_orbax_version(version: Optional[str]) -> None:
  """Refuses an orbax-checkpoint the migration cannot write with.

  Example::

    check_orbax_version("0.12.8")    # fine
    check_orbax_version("0.11.24")   # MigrationError
    check_orbax_version(None)        # MigrationError: not installed

  Args:
    version: The installed orbax-checkpoint version; None: not installed.

  Raises:
    MigrationError: `version` is None, unreadable or older than
      `MIN_ORBAX_VERSION`; one line naming the installed and the required
      version and the command that makes a migration environment.
  """
  release = _release(version) if version else ()
  if release and release >= _release(MIN_ORBAX_VERSION):
    return
  installed = ("orbax-checkpoint is not installed" if version is None else
               f"the installed orbax-checkpoint is {version}")
  raise errors.MigrationError(
      f"migrating needs orbax-checkpoint >= {MIN_ORBAX_VERSION} and "
      f"{installed}; nothing was written. Make a migration environment of "
      f"its own and run clu-ckpt from it: {migration_env_command()}")


def require_orbax() -> None:
  """`check_orbax_version` of the installed orbax-checkpoint.

  Raises:
    MigrationError: See `check_orbax_version`.
  """
  check_orbax_version(installed_orbax_version())


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
  init = inspect.signature(handler_cls.__init__).parameters
  if "deepcopy_host_arrays" not in init and not any(
      p.kind is inspect.Parameter.VAR_KEYWORD for p in init.values()):
    raise errors.PrivateApiError(
        f"clu_ckpt's migration writes arrays without Orbax's defensive copy "
        f"(NumpyHandler(deepcopy_host_arrays=False), orbax-checkpoint >= "
        f"{MIN_ORBAX_VERSION}); the installed orbax-checkpoint "
        f"{orbax_version()} does not take it. Install "
        f"orbax-checkpoint=={CHECKED_ORBAX_VERSIONS[-1]}.")
  return method


def _type_handlers(inflight_bytes: int, on_bytes: Callable[[int], None],
                   stage: bool = True, read_ahead_all: bool = False,
                   file_sync: bool = True):
  """Orbax's standard type handlers, numpy arrays written in bounded slices
  (unaligned ones staged first when `stage`; every array read ahead in a
  thread when `read_ahead_all`; local files not fsynced unless `file_sync`:
  see `_bounded_numpy_handler`)."""
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  th = ocp.type_handlers
  return th.create_type_handler_registry(
      (int, th.ScalarHandler()),
      (float, th.ScalarHandler()),
      (np.number, th.ScalarHandler()),
      (np.ndarray, _bounded_numpy_handler(inflight_bytes, on_bytes, stage,
                                          read_ahead_all, file_sync)),
      (jax.Array, th.get_type_handler(jax.Array)),
      (str, th.StringHandler()),
  )


def staging_bytes(inflight_bytes: int) -> int:
  """The most bytes of aligned buffers `memory.AlignedStaging` keeps for a
  window of `inflight_bytes`: what is in flight, and half as much again for
  buffers TensorStore has not let go of yet when the next array comes."""
  return inflight_bytes + inflight_bytes // 2


def slice_rows(shape: tuple[int, ...], itemsize: int,
               chunk_shape: Optional[tuple[int, ...]],
               slice_bytes: int) -> list[tuple[int, int]]:
  """Row ranges [start, end) of axis 0 that split an array into slices.

  Each slice is a whole number of write chunks along axis 0 (so that no
  chunk is written twice, read back or merged) and at most `slice_bytes`,
  or one chunk row when that is larger. An array of at most `slice_bytes`,
  a scalar, or one whose chunks span all of axis 0 is one slice.

  Example::

    slice_rows((64, 256), 4, (8, 256), 16384)   # [(0, 16), (16, 32), ...]
  """
  if not shape or not chunk_shape or len(chunk_shape) != len(shape):
    return [(0, shape[0])] if shape else []
  rows = shape[0]
  row_bytes = itemsize * math.prod(shape[1:])
  if rows * row_bytes <= slice_bytes or chunk_shape[0] >= rows:
    return [(0, rows)]
  chunk_rows = max(1, chunk_shape[0])
  step = chunk_rows * max(1, slice_bytes // max(1, chunk_rows * row_bytes))
  return [(s, min(s + step, rows)) for s in range(0, rows, step)]


async def write_in_slices(t: Any, value: np.ndarray, slice_bytes: int,
                          in_flight: int) -> None:
  """Writes `value` to TensorStore array `t`, at most `in_flight` slices of
  about `slice_bytes` at once (`slice_rows`), each committed before another
  starts in its place; a small array is one write, as Orbax makes it."""
  try:
    chunk_shape = tuple(t.chunk_layout.write_chunk.shape)
  except (AttributeError, TypeError, ValueError):
    chunk_shape = None
  pieces = slice_rows(value.shape, value.dtype.itemsize, chunk_shape,
                      slice_bytes)
  if len(pieces) <= 1:
    await t.write(value, can_reference_source_data_indefinitely=True)
    return
  running = set()
  try:
    for start, end in pieces:
      if len(running) >= in_flight:
        done, running = await asyncio.wait(
            running, return_when=asyncio.FIRST_COMPLETED)
        for future in done:
          future.result()
      running.add(asyncio.ensure_future(_write_slice(t, value, start, end)))
    for future in asyncio.as_completed(running):
      await future
  finally:
    for future in running:
      future.cancel()


async def _write_slice(t: Any, value: np.ndarray, start: int,
                       end: int) -> None:
  await t[start:end].write(value[start:end],
                           can_reference_source_data_indefinitely=True)


def _bounded_numpy_handler(inflight_bytes: int,
                           on_bytes: Callable[[int], None],
                           stage: bool = True, read_ahead_all: bool = False,
                           file_sync: bool = True):
  """A `NumpyHandler` that hands TensorStore a bounded number of bytes.

  Orbax's handler deep-copies every array, then gives all of them to
  TensorStore at once, which copies each into its chunk buffers before
  compressing it: memory grows to the checkpoint's size. This one writes the
  (memory-mapped) arrays themselves, starting another only while less than
  `inflight_bytes` are being written; an unaligned one (which TensorStore
  would copy into a fresh allocation) is copied into a reused aligned buffer
  first (`memory.AlignedStaging`, at most `staging_bytes(inflight_bytes)`),
  when `stage`: the migration stages for uncompressed writes only. With zstd
  TensorStore compresses from the array as it is, and the staging copy only
  added work: a 2 GiB migration's whole process took 12.09 s staged against
  11.09 s unstaged (0.75 against 0.82 of the copy limit), while without
  compression staging took 10.59 s against 11.60 s (0.93 against 0.85), in
  one quiet run of `bench_migration.py --size_gib 2 --runs 3`. The files are
  the same (the type name is the same), so stock Orbax restores them.

  Args:
    inflight_bytes: Bytes of arrays being written at once (an array larger
      than this is written alone).
    on_bytes: Called with an array's byte count once it is written.
    stage: Whether unaligned arrays are copied into aligned buffers first.
    read_ahead_all: Whether a thread also advises every array, in order,
      from the start (a bucket source's arrays are then downloaded one
      after the other at the link's pace, not one array ahead of the
      writer): for a step staged locally (`staging`), whose writes do not
      wait for a link. The bytes go to the source's spool (a file), not to
      process memory.
    file_sync: Whether TensorStore fsyncs the local files it writes (its
      `file_io_sync`); False for a staged step's temporary files
      (`STAGED_FILE_SYNC`, `without_file_sync`). The files are the same.

  Returns:
    The handler.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  check_private_api(ocp.type_handlers.NumpyHandler)

  class BoundedNumpyHandler(ocp.type_handlers.NumpyHandler):

    def __init__(self):
      super().__init__(deepcopy_host_arrays=False)

    async def _open_and_write(self, value, tspec, ts_context):
      # Orbax's own opens the array and writes it whole: TensorStore then
      # holds the whole array at once (a copy of an unaligned view, its
      # compressed chunks, the uploads), whatever the window. Here an array
      # larger than half the window goes in slices of whole chunks.
      import tensorstore as ts  # pylint: disable=g-import-not-at-top
      if not file_sync:
        tspec = without_file_sync(tspec)
      t = await ts.open(ts.Spec(tspec), create=True, open=True,
                        context=ts_context)
      slice_bytes = (inflight_bytes // 2 if SLICE_BYTES is None else
                     SLICE_BYTES)
      if not slice_bytes:
        await t.write(value, can_reference_source_data_indefinitely=True)
        return
      await write_in_slices(t, value, slice_bytes, SLICES_IN_FLIGHT)

    async def _background_serialize(self, values, infos, args=None):
      write_all = super()._background_serialize
      budget = memory.ByteBudget(inflight_bytes)
      trim = memory.MemoryTrimmer(inflight_bytes)
      staging = (memory.AlignedStaging(staging_bytes(inflight_bytes))
                 if stage else None)

      async def write(value, info, arg):
        try:
          # An unaligned view of the map would be copied by TensorStore
          # into a fresh allocation; into a reused one here.
          staged = value if staging is None else await staging.stage(value)
          await write_all([staged], [info], [arg])
          del staged
        finally:
          await budget.release(value.nbytes)
        trim.written(value.nbytes)
        on_bytes(value.nbytes)

      tasks = []
      prefetch = memory.Prefetcher(values, 2 * inflight_bytes)
      ahead = _ReadAhead(values) if read_ahead_all else None
      # The read-ahead runs in a thread: on a bucket it downloads (a spool's
      # madvise fetches), and on the event loop it would stall the writes
      # already admitted, so the next arrays' download would not overlap
      # the current ones' upload. `up_to(i - 1)` has read array i (and
      # more, up to the window), so array i waits only for that. (The
      # thread runs in this context: a bucket_cache block holding the
      # source's small objects applies there too.)
      reading = None
      try:
        for i, (value, info, arg) in enumerate(
            zip(values, infos, args or [None] * len(values))):
          if reading is not None:
            await reading
          reading = asyncio.ensure_future(
              asyncio.to_thread(prefetch.up_to, i))
          if i == 0:
            await reading
          await budget.acquire(value.nbytes)
          tasks.append(asyncio.ensure_future(write(value, info, arg)))
        if reading is not None:
          await reading
        await asyncio.gather(*tasks)
      finally:
        if reading is not None and not reading.done():
          reading.cancel()
        if ahead is not None:
          ahead.stop()

  return BoundedNumpyHandler()


def _started(function: Callable[..., Any], *args: Any
             ) -> concurrent.futures.Future:
  """`function(*args)` running in a thread of its own: its future."""
  future: concurrent.futures.Future = concurrent.futures.Future()

  def run() -> None:
    if not future.set_running_or_notify_cancel():
      return
    try:
      future.set_result(function(*args))
    except BaseException as e:  # pylint: disable=broad-except
      future.set_exception(e)

  threading.Thread(target=run, daemon=True,
                   name="clu_ckpt-remove-partial").start()
  return future


def without_file_sync(tspec: Mapping[str, Any]) -> dict[str, Any]:
  """`tspec` with TensorStore's `file_io_sync` off for its local files.

  The `file` key-value stores of the array's spec (OCDBT's `base` and
  `manifest`, or the array's own) get `"file_io_sync": false`: TensorStore
  then writes the same bytes without fsyncing them. Other drivers (a
  bucket) are left as they are.

  Example::

    without_file_sync({"kvstore": {"driver": "file", "path": "/s/"}})
    # {"kvstore": {"driver": "file", "path": "/s/", "file_io_sync": False}}
  """

  def walk(spec: Any) -> Any:
    if not isinstance(spec, Mapping):
      return spec
    out = {k: walk(v) if k in ("kvstore", "base", "manifest") else v
           for k, v in spec.items()}
    if out.get("driver") == "file":
      out["file_io_sync"] = False
    return out

  return walk(tspec)


def _fetch_ahead(value: Any) -> None:
  """Fetches the bytes of `value`, a view of a bucket spool's map, with
  `STAGED_READ_AHEAD_STREAMS` ranged reads in flight (`SparseSpool.ensure`);
  any other array is advised (`memory.will_need`)."""
  import mmap  # pylint: disable=g-import-not-at-top
  base = value
  while base is not None and not isinstance(base, mmap.mmap):
    base = base.obj if isinstance(base, memoryview) else getattr(
        base, "base", None)
  spool = getattr(base, "spool", None)
  if spool is None or not getattr(value, "nbytes", 0):
    memory.will_need(value)
    return
  from clu_ckpt import bucket_spool  # pylint: disable=g-import-not-at-top
  start = (value.__array_interface__["data"][0] -
           np.frombuffer(base, np.uint8).__array_interface__["data"][0])
  spool.ensure([(start, start + value.nbytes)],
               width=STAGED_READ_AHEAD_STREAMS,
               chunk=bucket_spool.READ_AHEAD_CHUNK)


class _ReadAhead:
  """Advises every array of a list, in order, in a thread of its own
  (`memory.will_need`: a bucket spool's map downloads each), until done or
  stopped; in the caller's context (a `bucket_cache` block applies)."""

  def __init__(self, values: Any):
    import contextvars  # pylint: disable=g-import-not-at-top
    import threading  # pylint: disable=g-import-not-at-top
    self._values = values
    self._stopped = threading.Event()
    context = contextvars.copy_context()
    self._thread = threading.Thread(
        target=context.run, args=(self._run,), daemon=True,
        name="clu_ckpt-read-ahead")
    self._thread.start()

  def _run(self) -> None:
    for value in self._values:
      if self._stopped.is_set():
        return
      try:
        _fetch_ahead(value)
      except Exception:  # pylint: disable=broad-except
        return  # the writer's own advice reports the failure

  def stop(self) -> None:
    """No further arrays are advised (the one under way finishes)."""
    self._stopped.set()
