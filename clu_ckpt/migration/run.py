"""Running a migration: `migrate`, its results, and `restore_state`.

`migrate` plans (`plan`), then writes, checks or skips one checkpoint at a
time through a `Target` (an `orbax_target.OrbaxTarget` unless the caller
passes its own: `migrate(..., target=...)`), verifying with `verify`. Each
checkpoint's `.flax` is opened once, as a `flax_format.FlaxFile`, and parsed
once: its step, its leaves, the state written and the state verified all
come from that one parse.

Synopsis::

  from clu_ckpt.migration import run

  summary = run.migrate("/runs/a/checkpoints", "/runs/a/orbax", verify=True)
  state = run.restore_state("/runs/a/orbax")
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import os
import re
import threading
import time
from typing import Any, Callable, Mapping, Optional

from absl import logging

from clu_ckpt import __version__
from clu_ckpt import errors
from clu_ckpt import flax_format
from clu_ckpt import layout
from clu_ckpt import orbax_root
from clu_ckpt import storage
from clu_ckpt.migration import codec
from clu_ckpt.migration import destination as destination_lib
from clu_ckpt.migration import interrupt
from clu_ckpt.migration import orbax_target
from clu_ckpt.migration import plan
from clu_ckpt.migration import results
from clu_ckpt.migration import template as template_lib
from clu_ckpt.migration import verify as verify_lib

FORMAT = "clu_ckpt.migration/1"
COMPRESSIONS = ("zstd", "none")
# Local `.flax` files parsed while planning stay open (mapped, their tree
# parsed) for writing and verifying, up to this many; the others, and files
# in buckets (each spooled to a temporary file while open: keeping them all
# would need the run's size in $TMPDIR), are opened again when their turn
# comes.
_KEPT_HANDLES = 64

MigrationError = errors.MigrationError


# The result types live in `results`; re-exported here (public names).
StepResult = results.StepResult
MigrationSummary = results.MigrationSummary
Progress = results.Progress
ProgressFn = results.ProgressFn
MigrationInterrupted = results.MigrationInterrupted


@storage.caching_source_objects("source", "destination")  # read once
def migrate(source: str,
            destination: str,
            *,
            checkpoints: plan.Selection = "all",
            step_naming: str = "auto",
            state_host: Optional[int] = None,
            compression: str = "zstd",
            dry_run: bool = False,
            verify: bool = False,
            inflight_bytes: Optional[int] = None,
            progress: Optional[ProgressFn] = None,
            target: Optional[orbax_target.Target] = None,
            step_prefix: Optional[str] = None,
            step_format_fixed_length: Optional[int] = None,
            allow_other_sources: bool = False,
            template: Any = None,
            staging_dir: Optional[str] = None) -> MigrationSummary:
  """Migrates a CLU checkpoint directory into an Orbax CheckpointManager root.

  Re-running the same call finishes an interrupted migration: steps already
  in `destination` (from this source and checkpoint) are skipped, and so are
  checkpoints the destination's manifest records as migrated, even when
  Orbax has pruned their steps since. The destination is locked for the
  whole run (see `destination`): a second migration into it raises
  `DestinationLockedError` naming the holder. A destination holding steps of
  another source (another migration's, or an Orbax run's own) is refused
  before anything is written, unless `allow_other_sources`.

  Example::

    summary = migrate("/runs/a/checkpoints", "/runs/a/orbax", verify=True)
    assert summary.ok, summary.failed

    # Another destination: any `Target` (here an OrbaxTarget that also
    # reports what it writes); its root is the destination.
    from clu_ckpt.migration import OrbaxTarget

    class Recording(OrbaxTarget):
      def write_step(self, step, items, on_bytes, **kwargs):
        print("writing step", step)
        super().write_step(step, items, on_bytes, **kwargs)

    target = Recording("/runs/a/orbax", use_compression=False)
    summary = migrate("/runs/a/checkpoints", "/runs/a/orbax", target=target)

    # The state in the new loop's structure, for
    # `StandardRestore(abstract_state)` (see `template`).
    abstract_state = jax.eval_shape(create_train_state, jax.random.key(0))
    summary = migrate("/runs/a/checkpoints", "/runs/a/orbax",
                      template=abstract_state)

  Buckets: `source` may be a `gs://` or `s3://` URL and `destination` a
  `gs://` one (with `STORAGE_EMULATOR_HOST`, `AWS_ENDPOINT_URL`... as the
  clients know them). The source's files are read by ranged reads;
  TensorStore writes the arrays to the bucket itself, where Orbax commits a
  step by writing `commit_success.txt` last (there is no rename): a step
  without it is unfinished, is not listed, and is removed and written again
  by the next run. TensorFlow is not needed, nor imported: the iterator's files are
  copied byte for byte, their index read and their values checked (bounds,
  crc32c, the framing of the iterator state) as TensorFlow's reader checks
  them (see `orbax_items.tf_state_names`).

  Args:
    source: A CLU `Checkpoint` base directory or `MultihostCheckpoint` base
      (a path, relative or absolute, a `file://` URL, or a `gs://`/`s3://`
      URL).
    destination: The Orbax root directory (created if needed; a path, a
      `file://` URL or a `gs://` URL; `s3://` is refused: stock Orbax 0.12
      cannot restore from it).
    checkpoints: "all" kept checkpoints, "latest", or checkpoint number(s).
    step_naming: "auto", "state" (the state's top-level `step`) or "number"
      (the CLU checkpoint number); see `name_steps`.
    state_host: Take the `state` from this host without comparing hosts.
      Default: host 0's, after checking every host holds the same state.
    compression: "zstd" (Orbax's default) or "none": faster, larger.
    dry_run: Only plan and check; write nothing.
    verify: Re-read every migrated leaf through Orbax and compare it
      bit-exactly with the source.
    inflight_bytes: Array bytes handed to TensorStore at once (memory bound);
      None: `orbax_target.DEFAULT_INFLIGHT_BYTES` (128 MiB) locally,
      `orbax_target.REMOTE_INFLIGHT_BYTES` (16 MiB) for a bucket.
    progress: Called with a `Progress` as work advances (from any thread).
    target: Where the steps are written (a `Target`, see `orbax_target`).
      Default: an `OrbaxTarget` on `destination` with `compression` and
      `inflight_bytes`. A given target's `root` must be `destination`, and
      `compression` and `inflight_bytes` must keep their defaults (they
      configure only the default target: set them on the target itself).
    step_prefix: Name steps `<step_prefix>_<step>`, as Orbax's
      `CheckpointManagerOptions(step_prefix=...)` does (default target only).
    step_format_fixed_length: Zero-pad step numbers to this many digits, as
      `CheckpointManagerOptions(step_format_fixed_length=...)` does.
    allow_other_sources: Write into a destination that holds steps of
      another source (its clashing step numbers still fail one by one).
    template: The train state the new training loop builds, concrete or
      abstract (`jax.ShapeDtypeStruct` leaves, e.g. from `jax.eval_shape`):
      the `state` item is written in its tree structure, as
      `ocp.args.StandardSave(train_state)` would, with the `.flax` file's
      values and dtypes (see `template`). None: the Flax state dict.
      A checkpoint whose leaves differ from the template's (paths, shapes)
      or need stand-ins fails with a message naming the leaf.
    staging_dir: For a `gs://` destination, the local directory each step
      is written to before it is uploaded by many streams at once (see
      `staging`; default target only). None: `$CLU_CKPT_STAGING_DIR`, else
      the system's temporary directory.

  Returns:
    The summary. Checkpoints that could not be migrated (corrupt files,
    hosts that disagree, ...) have status "failed" and an error; no step
    directory exists for them.

  Raises:
    MigrationError: orbax-checkpoint is missing or older than
      `orbax_target.MIN_ORBAX_VERSION` (the default target; checked before
      anything is read or written), the source or the options are unusable (including a
      `target` with a root other than `destination`, or with `compression`
      or `inflight_bytes` given too, and an `s3://` destination, refused
      before anything is read or written), or the destination holds another
      source's steps.
    DestinationLockedError: Another migration is writing to `destination`.
    MigrationInterrupted: Ctrl-C (a KeyboardInterrupt in the calling
      thread): the step under way is abandoned (nothing of it is left) and
      the destination unlocked; its `summary` says what was done. While the
      abandoned step's writes stop, further SIGINTs are ignored.
  """
  if compression not in COMPRESSIONS:
    raise MigrationError(f"unknown compression {compression!r}; use one of "
                         f"{', '.join(COMPRESSIONS)}")
  if target is None or isinstance(target, orbax_target.OrbaxTarget):
    # Once, before anything is read or written: not a TypeError per step.
    orbax_target.require_orbax()
  destination = layout.absolute(destination)
  if target is None:
    try:
      orbax_target.check_destination(destination)
    except errors.UsageError as e:
      raise MigrationError(str(e)) from None
  if orbax_target.is_bucket(destination) or orbax_target.is_bucket(
      layout.absolute(source)):
    # Before Orbax (epath, TensorStore) is imported.
    from clu_ckpt import fsspec_fs  # pylint: disable=g-import-not-at-top
    fsspec_fs.configure_environment()
  if target is not None:
    _check_target(target, destination, compression, inflight_bytes,
                  step_prefix, step_format_fixed_length, staging_dir)
  src = plan.discover(source)
  if state_host is not None and state_host not in src.host_directories:
    raise MigrationError(f"--state-host {state_host}: no such host in "
                         f"{src.path} (hosts: {sorted(src.host_directories)})")
  chosen = plan.select(src, checkpoints)
  notify = progress or (lambda _: None)

  results: dict[int, StepResult] = {}
  steps: dict[int, Optional[int]] = {}
  # Each checkpoint's `.flax`, opened and parsed once, used by every stage.
  handles: dict[int, flax_format.FlaxFile] = {}
  usable = []
  sizes: dict[int, int] = {}
  for ckpt in chosen:
    try:
      host = _state_host(src, state_host)
      # Only the headers and `step` now; array data is read ahead as it is
      # written.
      path = ckpt.flax_path(host)
      if not storage.is_local(path):
        # A bucket's file is downloaded when it is parsed: here only its
        # first bytes, for the `step`; it is read whole once, to be written.
        steps[ckpt.number], sizes[ckpt.number] = plan.peek_step(path)
        usable.append(ckpt)
        continue
      handle = flax_format.FlaxFile(path, read_data=False)
      steps[ckpt.number] = plan.state_step(handle)
      sizes[ckpt.number] = handle.nbytes
      if len(handles) < _KEPT_HANDLES:
        handles[ckpt.number] = handle
      else:
        handle.close()
      usable.append(ckpt)
    except (OSError, flax_format.FlaxFormatError) as e:
      results[ckpt.number] = StepResult(ckpt.number, None, "failed",
                                        error=describe_error(e))
  ahead = None
  try:
    with _destination_answers(destination):
      numbered = orbax_root.saved_by_checkpoint(
          destination, step_prefix=step_prefix,
          step_format_fixed_length=step_format_fixed_length)
    naming, mapping = plan.name_steps(
        usable, steps, step_naming,
        numbered_root=destination if numbered else None)
    notify = _with_plan(notify, len(chosen), sizes)
    for number, result in results.items():
      notify(Progress("failed", number, result.step, message=result.error))

    if target is None:
      target = orbax_target.OrbaxTarget(
          destination, use_compression=compression == "zstd",
          inflight_bytes=inflight_bytes, step_prefix=step_prefix,
          step_format_fixed_length=step_format_fixed_length,
          staging_dir=staging_dir)
    writer = _Writer(src, target, naming, mapping, state_host, notify,
                     template)
    # The first bucket checkpoint's headers (and iterator files) are read
    # while the destination is locked and listed: both are round trips.
    ahead = _Prefetch.start(src, usable, handles, state_host)
    with _locked(destination, dry_run):
      with _destination_answers(destination):
        manifest = destination_lib.read_manifest(destination)
        existing = writer.existing_steps()
        manifest.check_source(
            src.path, allow_other_sources=allow_other_sources,
            foreign_steps=writer.foreign_steps(existing, manifest))
      for ckpt in usable:
        try:
          handle = handles.pop(ckpt.number, None)
          if handle is None and ahead is not None:
            handle = ahead.take(ckpt.number)
          results[ckpt.number] = writer.run(
              ckpt, handle, existing, manifest, dry_run, verify)
        except KeyboardInterrupt as e:
          results[ckpt.number] = StepResult(
              ckpt.number, mapping.get(ckpt.number), "interrupted",
              sizes.get(ckpt.number, 0))
          raise _interrupted(src, destination, naming, chosen, results,
                             dry_run) from e
  finally:
    for handle in handles.values():
      handle.close()
    if ahead is not None:
      ahead.close()
  return _summary(src, destination, naming, chosen, results, dry_run)


class _Prefetch:
  """Opens a bucket checkpoint's `.flax` (its headers: one ranged read per
  large array, each depending on the last) and reads its iterator files,
  in a thread, while the caller does other round trips; `take` hands the
  handle over (None if opening failed: the caller opens it again and
  reports why)."""

  def __init__(self, src: plan.Source, ckpt: plan.SourceCheckpoint,
               host: int):
    import contextvars  # pylint: disable=g-import-not-at-top
    self.number = ckpt.number
    self._handle: Optional[flax_format.FlaxFile] = None
    self._path = ckpt.flax_path(host)
    self._ckpt = ckpt
    self._taken = False
    # In the caller's context: the run's source objects and metadata kept
    # (`storage.caching_source_objects`) are shared with it.
    context = contextvars.copy_context()
    self._thread = threading.Thread(target=context.run, args=(self._run,),
                                    daemon=True, name="clu_ckpt-prefetch")
    self._thread.start()

  @classmethod
  def start(cls, src: plan.Source, usable: list[plan.SourceCheckpoint],
            handles: Mapping[int, Any], state_host: Optional[int]
            ) -> Optional["_Prefetch"]:
    """The prefetch of the first of `usable` not open yet, if in a bucket."""
    if not usable or usable[0].number in handles:
      return None
    host = _state_host(src, state_host)
    if storage.is_local(usable[0].flax_path(host)):
      return None
    return cls(src, usable[0], host)

  def _run(self) -> None:
    try:
      self._handle = flax_format.FlaxFile(self._path, read_data=False)
      self._read_iterator_files()
    except Exception:  # pylint: disable=broad-except
      pass  # said again, with its context, when the writer opens it

  def _read_iterator_files(self) -> None:
    """Reads the checkpoint's small TensorFlow files, which the run keeps
    (`bucket_cache.SMALL_OBJECT_BYTES`; larger ones are left to the
    writer, which reads them once)."""
    from clu_ckpt import bucket_cache  # pylint: disable=g-import-not-at-top
    for prefix in self._ckpt.prefixes.values():
      directory, _, base = prefix.rpartition("/")
      for name in storage.listdir(directory):  # the run's kept listing
        if name.startswith(base + ".") and (
            name.endswith(".index") or ".data-" in name):
          path = storage.join(directory, name)
          if storage.stat(path)[0] <= bucket_cache.SMALL_OBJECT_BYTES:
            storage.read_bytes(path)

  def take(self, number: int) -> Optional[flax_format.FlaxFile]:
    """The handle of checkpoint `number` (once), or None."""
    if number != self.number or self._taken:
      return None
    self._thread.join()
    self._taken = True
    handle, self._handle = self._handle, None
    return handle

  def close(self) -> None:
    """Closes the handle if it was never taken."""
    self._thread.join()
    if self._handle is not None:
      self._handle.close()
      self._handle = None


def _with_plan(notify: ProgressFn, count: int,
               sizes: Mapping[int, int]) -> ProgressFn:
  """`notify`, each event given the run's checkpoint count and bytes.

  `sizes` are the planned bytes per checkpoint number: the array bytes of a
  local file, the file size of a bucket's (whose arrays are counted only
  when it is read, to be written). A step's own events carry its array
  bytes; they replace the estimate, so the total ends equal to what was
  done.
  """
  planned = dict(sizes)
  total = [sum(planned.values())]

  def wrapped(event: Progress) -> None:
    if (event.event in ("start", "skipped", "done") and event.nbytes and
        planned.get(event.number, event.nbytes) != event.nbytes):
      total[0] += event.nbytes - planned[event.number]
      planned[event.number] = event.nbytes
    notify(dataclasses.replace(event, count=count, total_nbytes=total[0]))

  return wrapped


def _summary(src: plan.Source, destination: str, naming: str,
             chosen: list[plan.SourceCheckpoint],
             done: dict[int, StepResult], dry_run: bool) -> MigrationSummary:
  """The summary of the checkpoints in `done`, in `chosen`'s order."""
  ordered = [done[c.number] for c in chosen if c.number in done]
  return MigrationSummary(src.path, destination, src.kind,
                          sorted(src.host_directories), naming, ordered,
                          src.not_on_all_hosts, dry_run)


def _interrupted(src: plan.Source, destination: str, naming: str,
                 chosen: list[plan.SourceCheckpoint],
                 done: dict[int, StepResult],
                 dry_run: bool) -> MigrationInterrupted:
  """The `MigrationInterrupted` for a run stopped after `done`."""
  remaining = [c.number for c in chosen if c.number not in done]
  return MigrationInterrupted(
      _summary(src, destination, naming, chosen, done, dry_run), remaining)


@contextlib.contextmanager
def _destination_answers(destination: str):
  """A block in which a bucket destination is listed once (its manifest,
  its steps and its lock answered from that listing: one round trip, not
  one or three per question); nothing is kept after it. For reads only: a
  write through `storage` in the block forgets what was kept."""
  with storage.metadata_cache():
    if not storage.is_local(destination):
      with contextlib.suppress(OSError):
        storage.listdir(destination)
    yield


def _locked(destination: str, dry_run: bool):
  """The destination's lock (none for a dry run, which writes nothing)."""
  if dry_run:
    return contextlib.nullcontext()
  return destination_lib.lock(destination)


def _check_target(target: orbax_target.Target, destination: str,
                  compression: str, inflight_bytes: Optional[int],
                  step_prefix: Optional[str],
                  step_format_fixed_length: Optional[int],
                  staging_dir: Optional[str] = None) -> None:
  """Refuses a `target` that `migrate`'s other arguments contradict."""
  if not isinstance(target, orbax_target.Target):
    raise MigrationError(f"target {target!r} is not an "
                         "orbax_target.Target")
  root = getattr(target, "root", None)
  if not isinstance(root, str) or layout.absolute(root) != destination:
    raise MigrationError(f"target writes to {root!r}, not to the destination "
                         f"{destination!r}; pass its root as destination")
  given = [f"{name}={value!r}" for name, value, default in (
      ("compression", compression, "zstd"),
      ("inflight_bytes", inflight_bytes, None),
      ("step_prefix", step_prefix, None),
      ("step_format_fixed_length", step_format_fixed_length, None),
      ("staging_dir", staging_dir, None))
           if value != default]
  if given:
    raise MigrationError(f"{', '.join(given)} configure the default "
                         "OrbaxTarget only; with target=..., set them on the "
                         "target")


def _iso(t: Optional[float]) -> str:
  """A time as the messages show it (UTC), or "an unknown time"."""
  if t is None:
    return "an unknown time"
  return datetime.datetime.fromtimestamp(
      float(t), datetime.timezone.utc).isoformat(timespec="seconds")


def _state_host(src: plan.Source, state_host: Optional[int]) -> int:
  return min(src.host_directories) if state_host is None else state_host


class _Writer:
  """Writes (or checks, or plans) the step of one checkpoint at a time.

  It talks to the destination through the `Target` interface only.
  """

  def __init__(self, src: plan.Source, target: orbax_target.Target,
               naming: str, mapping: dict[int, int],
               state_host: Optional[int], notify: ProgressFn,
               template: Any = None):
    self.src = src
    self.template = template
    self.target = target
    self.destination = target.root
    self.naming = naming
    self.mapping = mapping
    self.state_host = state_host
    self.notify = notify

  def existing_steps(self) -> set[int]:
    return set(self.target.steps())

  def foreign_steps(self, existing: set[int],
                    manifest: destination_lib.Manifest) -> dict[int, str]:
    """The existing steps that are not this source's, with what they hold.

    Steps without clu_ckpt metadata are an Orbax run's own: foreign in a
    root this source was never migrated into, the training that went on
    from the migrated steps in one it was.
    """
    ours = {r["step"] for r in manifest.recorded(self.src.path).values()}
    continued = self.src.path in manifest.sources
    foreign = {}
    for step in sorted(existing - ours):
      meta = self.target.read_metadata(step)
      if not meta:
        if not continued:
          foreign[step] = "no clu_ckpt metadata (an Orbax run's own step?)"
      elif meta.get("source") != self.src.path:
        foreign[step] = f"checkpoint of {meta.get('source')!r}"
    return foreign

  def run(self, ckpt: plan.SourceCheckpoint,
          handle: Optional[flax_format.FlaxFile], existing: set[int],
          manifest: destination_lib.Manifest, dry_run: bool,
          verify: bool) -> StepResult:
    """Migrates one checkpoint; `handle` is its open `.flax` (or None).

    Raises:
      MigrationError: This run lost the destination's lease (a bucket) to
        another migration: nothing more is written, the run stops.
    """
    if not dry_run:
      try:
        destination_lib.ensure_held(self.destination)
      except BaseException:
        if handle is not None:
          handle.close()
        raise
    step = self.mapping[ckpt.number]
    result = StepResult(ckpt.number, step, "planned")
    start = time.time()
    written = False
    try:
      host = _state_host(self.src, self.state_host)
      if handle is None:
        handle = flax_format.FlaxFile(ckpt.flax_path(host), read_data=False)
      result.nbytes = handle.nbytes
      record = manifest.recorded(self.src.path).get(ckpt.number)
      if record is not None and not destination_lib.same_checkpoint(
          record, ckpt.saved_at):
        # Never skipped as done, never verified against (a verification
        # would take away the step of the checkpoint recorded: its only
        # copy when that source is gone).
        raise MigrationError(
            f"{ckpt.name} of {self.src.path} was saved at "
            f"{_iso(ckpt.saved_at)}, but the {ckpt.name} migrated into step "
            f"{record['step']} of {self.destination} was saved at "
            f"{_iso(record.get('saved_at'))}: another checkpoint under the "
            "same number (the run re-launched at this path, or restored to "
            "an older checkpoint and trained on); migrate it into another "
            "destination")
      if record is not None and record["step"] in existing:
        # Recorded under another step (the naming chosen now differs: a
        # checkpoint's state changed since): never written again.
        step = result.step = record["step"]
      if record is not None and record["step"] not in existing:
        result.step, result.status = record["step"], "skipped"
        self.notify(Progress("skipped", ckpt.number, record["step"],
                             result.nbytes, message="recorded as migrated; "
                             "its step has been removed since"))
        return result
      if step in existing:
        meta = self._check_existing(ckpt, step)
        recorded_host = meta.get("state_host")
        if (verify and isinstance(recorded_host, int) and
            recorded_host != host and recorded_host in ckpt.prefixes):
          # Verified against the host it was migrated from (--state-host
          # then), not against one whose state may differ.
          handle.close()
          host = recorded_host
          handle = flax_format.FlaxFile(ckpt.flax_path(host),
                                        read_data=False)
        result.status = "skipped"
        self.notify(Progress("skipped", ckpt.number, step, result.nbytes))
      elif not dry_run:
        self.notify(Progress("start", ckpt.number, step, result.nbytes))
        self._write(ckpt, step, host, handle)
        written = True
        result.status = "migrated"
        self.notify(Progress("done", ckpt.number, step, result.nbytes))
      if verify and not dry_run:
        self._verify(ckpt, step, host, handle, manifest)
        result.verified = True
        self.notify(Progress("verified", ckpt.number, step))
      if not dry_run and (written or record is None or
                          (verify and not record.get("verified"))):
        manifest.record(self.src.path, ckpt.number, ckpt.name, step,
                        kind=self.src.kind, verified=result.verified,
                        saved_at=ckpt.saved_at)
    except Exception as e:  # pylint: disable=broad-except
      if interrupt.caused_by_interrupt(e):
        # Ctrl-C, turned into another error on its way (e.g. an OSError
        # from a clean-up it cut short): the run stops, it does not go on.
        raise KeyboardInterrupt() from e
      # Whatever goes wrong with one checkpoint, the others still migrate.
      logging.debug("checkpoint %d failed", ckpt.number, exc_info=True)
      result.status, result.error = "failed", describe_error(e)
      self.notify(Progress("failed", ckpt.number, step, message=result.error))
    finally:
      if handle is not None:
        handle.close()
      result.seconds = time.time() - start
    return result

  def _verify(self, ckpt: plan.SourceCheckpoint, step: int, host: int,
              handle: flax_format.FlaxFile,
              manifest: destination_lib.Manifest) -> None:
    """Verifies a step; one that differs from its source is taken away.

    It leaves Orbax's listing (moved aside, then removed) and the manifest,
    so that the next run writes it again. A source that cannot be read is
    only reported: the step is kept.
    """
    try:
      verify_lib.verify_step(self.target, step, ckpt, host, handle)
    except errors.VerificationError as e:
      logging.warning("step %d of %s failed verification (%s); removing it "
                      "so that the next run writes it again", step,
                      self.destination, describe_error(e))
      try:
        self.target.discard(step)
        manifest.forget(self.src.path, ckpt.number)
      except Exception as cleanup:  # pylint: disable=broad-except
        raise MigrationError(
            f"{describe_error(e)}; and step {step} could not be removed "
            f"({describe_error(cleanup)}): remove it by hand") from e
      raise

  def _check_existing(self, ckpt: plan.SourceCheckpoint, step: int
                      ) -> dict[str, Any]:
    """The step's migration metadata, when it is of `ckpt`; else raises."""
    meta = self.target.read_metadata(step)
    same = (meta.get("format") == FORMAT and
            meta.get("source") == self.src.path and
            meta.get("clu_checkpoint_number") == ckpt.number)
    if not same:
      raise MigrationError(
          f"{self.destination}/{step} already exists and is not checkpoint "
          f"{ckpt.number} of {self.src.path} (it holds "
          f"{meta.get('source')!r} checkpoint "
          f"{meta.get('clu_checkpoint_number')!r}); choose another destination "
          "or --step-naming")
    return meta


  def _write(self, ckpt: plan.SourceCheckpoint, step: int, host: int,
             handle: flax_format.FlaxFile) -> None:
    compared = self.state_host is None and len(ckpt.prefixes) > 1
    if compared:
      for other in ckpt.prefixes:
        if other != host:
          verify_lib.compare_hosts(ckpt, host, other, handle)
    dataset, tf_state = plan.dataset_tree(ckpt)
    # A bucket's arrays are fetched as the writer reaches them (the next
    # ones' download overlapping the current upload) by Orbax's own target,
    # whose writer advises each array before writing it. Exactly that class:
    # a subclass (as the docstring shows) may read the items itself first,
    # and would then read a bucket's arrays before they are fetched.
    streamed = type(self.target) is orbax_target.OrbaxTarget
    state, encodings = codec.encode_state(
        handle.streaming_tree() if streamed else handle.tree)
    meta = self._metadata(ckpt, step, host, compared, handle.leaves,
                          encodings, tf_state, dataset)
    extra = {}
    if self.template is not None:
      state = template_lib.from_template(self.template, state, encodings)
      meta["structure"] = template_lib.STRUCTURE
      meta["template_type"] = template_lib.type_name(self.template)
      extra["standard_state"] = True
    items = {orbax_target.STATE_ITEM: state,
             orbax_target.METADATA_ITEM: meta}
    if dataset is not None:
      items[orbax_target.DATASET_ITEM] = dataset
    stop = threading.Event()

    def on_bytes(n: int) -> None:
      if stop.is_set():
        interrupt.cancel_running_tasks()
      else:
        self.notify(Progress("bytes", ckpt.number, step, n))

    before = set(threading.enumerate())
    try:
      self.target.write_step(step, items, on_bytes, saved_at=ckpt.saved_at,
                             custom_metadata=self._custom_metadata(ckpt),
                             **extra)
    except BaseException as e:
      if not interrupt.caused_by_interrupt(e):
        raise
      stop.set()
      interrupt.abandon(self.target, step, before)
      raise KeyboardInterrupt() from e

  def _custom_metadata(self, ckpt: plan.SourceCheckpoint) -> dict[str, Any]:
    """The step's Orbax custom metadata: where it came from."""
    return {"clu_ckpt": {
        "source": self.src.path, "clu_checkpoint": ckpt.name,
        "clu_checkpoint_number": ckpt.number,
        "hosts": sorted(self.src.host_directories),
        "clu_ckpt_version": __version__}}

  def _metadata(self, ckpt, step, host, compared, leaves, encodings, tf_state,
                dataset) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "clu_ckpt_version": __version__,
        "source": self.src.path,
        "source_kind": self.src.kind,
        "hosts": len(self.src.host_directories),
        "host_ids": sorted(self.src.host_directories),
        "clu_checkpoint": ckpt.name,
        "clu_checkpoint_number": ckpt.number,
        "step": step,
        "step_naming": self.naming,
        "step_mapping": {str(n): s for n, s in self.mapping.items()},
        "state_host": host,
        "hosts_compared": compared,
        "dataset": None if dataset is None else {
            "tf_state": tf_state,
            "processes": _process_indices(dataset),
        },
        "compression": _compression(self.target),
        "migrated_at": datetime.datetime.now(
            datetime.timezone.utc).isoformat(timespec="seconds"),
        "leaves": [_leaf_summary(leaf) for leaf in leaves],
        "encoded": encodings,
    }


def _process_indices(dataset: Mapping[str, Any]) -> list[int]:
  from clu_ckpt import orbax_items  # pylint: disable=g-import-not-at-top
  return orbax_items.process_indices(dataset)


def _compression(target: orbax_target.Target) -> str:
  return "zstd" if getattr(target, "use_compression", True) else "none"


def _leaf_summary(leaf: flax_format.LeafInfo) -> dict[str, Any]:
  return {"path": leaf.path, "kind": leaf.kind, "dtype": leaf.dtype,
          "shape": None if leaf.shape is None else list(leaf.shape)}


def describe_error(e: BaseException) -> str:
  """A one-line message for an error, naming the file when there is one.

  TensorStore's I/O errors (several lines, the OS error buried in them) are
  reduced to the file and the OS error: `<file>: [Errno 28] No space left on
  device`.
  """
  if isinstance(e, FileNotFoundError) and e.filename:
    # A store says what is missing (a bucket) where it knows more than ENOENT.
    problem = e.strerror if e.strerror and e.strerror != os.strerror(
        errno.ENOENT) else "file not found"
    return f"{e.filename}: {problem}"
  text = str(e).strip()
  code = re.search(r"os_error_code='(\d+)'", text)
  if code:
    files = re.findall(r'"(/[^"]+|[a-z0-9]+://[^"]+)"', text)
    errno_ = int(code.group(1))
    where = f"{files[-1]}: " if files else ""
    return f"{where}[Errno {errno_}] {os.strerror(errno_)}"
  line = text.splitlines()[0] if text else ""
  if isinstance(e, (MigrationError, ValueError, OSError)):
    return line or type(e).__name__
  return f"{type(e).__name__}: {line}"


def restore_state(destination: str, step: Optional[int] = None, *,
                  step_prefix: Optional[str] = None,
                  step_format_fixed_length: Optional[int] = None) -> Any:
  """Restores a migrated step's state exactly as the source `.flax` held it.

  Stock Orbax returns stand-ins for the few leaves it cannot hold (see
  `encode_state`); this undoes them. A step written with a template (its
  state in the train state's structure) is returned as the Flax state dict
  too: its sequences become dicts keyed "0", "1", ... again.

  Example::

    state = restore_state("/runs/a/orbax")            # the latest step
    params = restore_state("orbax", 7000)["params"]   # relative paths work

  Args:
    destination: The Orbax root directory (a path or a `file://` URL).
    step: The step; default the latest.
    step_prefix: As given to `migrate` (steps named `<prefix>_<step>`).
    step_format_fixed_length: As given to `migrate`.

  Returns:
    The Flax state dict.

  Raises:
    FileNotFoundError: There is no such step.
  """
  destination = layout.absolute(destination)
  target = orbax_target.OrbaxTarget(
      destination, step_prefix=step_prefix,
      step_format_fixed_length=step_format_fixed_length)
  steps = target.steps()
  if step is None and steps:
    step = steps[-1]
  if step not in steps:
    raise errors.CheckpointNotFoundError(
        f"{destination}: no step {step} (steps: {steps})")
  stored, meta = target.restore(step)
  encodings = meta.get("encoded", {})
  if template_lib.written_with_template(meta):
    stored = template_lib.state_dict_form(stored, encodings.get("order"))
  return codec.decode_state(stored, encodings,
                            [leaf["path"] for leaf in meta.get("leaves", [])])
