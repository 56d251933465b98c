"""Running a migration: `migrate`, its results, and `restore_state`.

`migrate` plans (`plan`), then writes, checks or skips one checkpoint at a
time through a `Target` (`orbax_target.OrbaxTarget`), verifying with
`verify`. Each checkpoint's `.flax` is opened once, as a
`flax_format.FlaxFile`, and parsed once: its step, its leaves, the state
written and the state verified all come from that one parse.

Synopsis::

  from clu_ckpt.migration import run

  summary = run.migrate("/runs/a/checkpoints", "/runs/a/orbax", verify=True)
  state = run.restore_state("/runs/a/orbax")
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import time
from typing import Any, Callable, Mapping, Optional

from absl import logging

from clu_ckpt import __version__
from clu_ckpt import errors
from clu_ckpt import flax_format
from clu_ckpt import storage
from clu_ckpt.migration import codec
from clu_ckpt.migration import orbax_target
from clu_ckpt.migration import plan
from clu_ckpt.migration import verify as verify_lib

FORMAT = "clu_ckpt.migration/1"
COMPRESSIONS = ("zstd", "none")
# Local `.flax` files parsed while planning stay open (mapped, their tree
# parsed) for writing and verifying, up to this many; the others, and remote
# files (read whole into memory), are parsed again when their turn comes.
_KEPT_HANDLES = 64

MigrationError = errors.MigrationError


# --------------------------------------------------------------------------
# Results.
# --------------------------------------------------------------------------


@dataclasses.dataclass
class StepResult:
  """What happened to one CLU checkpoint.

  Attributes:
    number: The CLU checkpoint number (`ckpt-<number>`).
    step: The Orbax step it maps to (None when its state could not be read
      to name it).
    status: "migrated", "skipped" (already in the destination), "planned"
      (dry run) or "failed".
    nbytes: Bytes of array data in the state.
    seconds: Wall time spent on it.
    verified: True when `verify` compared it with the source.
    error: Why it failed.
  """
  number: int
  step: Optional[int]
  status: str
  nbytes: int = 0
  seconds: float = 0.0
  verified: bool = False
  error: Optional[str] = None


@dataclasses.dataclass
class MigrationSummary:
  """The outcome of `migrate`.

  Attributes:
    source: The source base directory.
    destination: The Orbax root directory.
    kind: "Checkpoint" or "MultihostCheckpoint".
    hosts: Host ids found (`[0]` for a single-host source).
    step_naming: "state" or "number": how steps were named.
    steps: One result per selected checkpoint, oldest first.
    not_on_all_hosts: Checkpoint numbers some host lacks (not migrated).
    dry_run: Nothing was written.
  """
  source: str
  destination: str
  kind: str
  hosts: list[int]
  step_naming: str
  steps: list[StepResult]
  not_on_all_hosts: list[int] = dataclasses.field(default_factory=list)
  dry_run: bool = False

  @property
  def ok(self) -> bool:
    """True when no checkpoint failed."""
    return not self.failed

  @property
  def failed(self) -> list[StepResult]:
    return [s for s in self.steps if s.status == "failed"]

  @property
  def step_mapping(self) -> dict[int, int]:
    """CLU checkpoint number -> Orbax step."""
    return {s.number: s.step for s in self.steps if s.step is not None}

  def to_json(self) -> dict[str, Any]:
    """The summary as JSON-serializable data."""
    data = dataclasses.asdict(self)
    data["ok"] = self.ok
    return data


@dataclasses.dataclass(frozen=True)
class Progress:
  """A progress report passed to `migrate(progress=...)`.

  Attributes:
    event: "start" (a step begins), "bytes" (array data written), "done",
      "skipped", "failed" or "verified".
    number: CLU checkpoint number.
    step: Orbax step.
    nbytes: For "start", the step's total array bytes; for "bytes", the
      bytes just written.
    message: For "failed", the error.
  """
  event: str
  number: int
  step: Optional[int]
  nbytes: int = 0
  message: str = ""


ProgressFn = Callable[[Progress], None]


def migrate(source: str,
            destination: str,
            *,
            checkpoints: plan.Selection = "all",
            step_naming: str = "auto",
            state_host: Optional[int] = None,
            compression: str = "zstd",
            dry_run: bool = False,
            verify: bool = False,
            inflight_bytes: int = orbax_target.DEFAULT_INFLIGHT_BYTES,
            progress: Optional[ProgressFn] = None) -> MigrationSummary:
  """Migrates a CLU checkpoint directory into an Orbax CheckpointManager root.

  Re-running the same call finishes an interrupted migration: steps already
  in `destination` (from this source and checkpoint) are skipped.

  Example::

    summary = migrate("/runs/a/checkpoints", "/runs/a/orbax", verify=True)
    assert summary.ok, summary.failed

  Args:
    source: A CLU `Checkpoint` base directory or `MultihostCheckpoint` base.
    destination: The Orbax root directory (created if needed).
    checkpoints: "all" kept checkpoints, "latest", or checkpoint number(s).
    step_naming: "auto", "state" (the state's top-level `step`) or "number"
      (the CLU checkpoint number); see `name_steps`.
    state_host: Take the `state` from this host without comparing hosts.
      Default: host 0's, after checking every host holds the same state.
    compression: "zstd" (Orbax's default) or "none": faster, larger.
    dry_run: Only plan and check; write nothing.
    verify: Re-read every migrated leaf through Orbax and compare it
      bit-exactly with the source.
    inflight_bytes: Array bytes handed to TensorStore at once (memory bound).
    progress: Called with a `Progress` as work advances (from any thread).

  Returns:
    The summary. Checkpoints that could not be migrated (corrupt files,
    hosts that disagree, ...) have status "failed" and an error; no step
    directory exists for them.

  Raises:
    MigrationError: The source or the options are unusable.
  """
  if compression not in COMPRESSIONS:
    raise MigrationError(f"unknown compression {compression!r}; use one of "
                         f"{', '.join(COMPRESSIONS)}")
  src = plan.discover(source)
  if state_host is not None and state_host not in src.host_directories:
    raise MigrationError(f"--state-host {state_host}: no such host in "
                         f"{src.path} (hosts: {sorted(src.host_directories)})")
  chosen = plan.select(src, checkpoints)
  destination = plan.normalize(destination)
  notify = progress or (lambda _: None)

  results: dict[int, StepResult] = {}
  steps: dict[int, Optional[int]] = {}
  # Each checkpoint's `.flax`, opened and parsed once, used by every stage.
  handles: dict[int, flax_format.FlaxFile] = {}
  usable = []
  for ckpt in chosen:
    try:
      host = _state_host(src, state_host)
      handle = flax_format.FlaxFile(ckpt.flax_path(host))
      steps[ckpt.number] = plan.state_step(handle)
      if len(handles) < _KEPT_HANDLES and storage.is_local(handle.path):
        handles[ckpt.number] = handle
      else:
        # Remote files are read whole: they are not all held at once.
        handle.close()
      usable.append(ckpt)
    except (OSError, flax_format.FlaxFormatError) as e:
      results[ckpt.number] = StepResult(ckpt.number, None, "failed",
                                        error=describe_error(e))
  try:
    naming, mapping = plan.name_steps(usable, steps, step_naming)
    for number, result in results.items():
      notify(Progress("failed", number, result.step, message=result.error))

    target = orbax_target.OrbaxTarget(destination,
                                      use_compression=compression == "zstd",
                                      inflight_bytes=inflight_bytes)
    writer = _Writer(src, target, naming, mapping, state_host, notify)
    existing = writer.existing_steps()
    for ckpt in usable:
      results[ckpt.number] = writer.run(ckpt, handles.pop(ckpt.number, None),
                                        existing, dry_run, verify)
  finally:
    for handle in handles.values():
      handle.close()
  ordered = [results[c.number] for c in chosen]
  return MigrationSummary(src.path, destination, src.kind,
                          sorted(src.host_directories), naming, ordered,
                          src.not_on_all_hosts, dry_run)


def _state_host(src: plan.Source, state_host: Optional[int]) -> int:
  return min(src.host_directories) if state_host is None else state_host


class _Writer:
  """Writes (or checks, or plans) the step of one checkpoint at a time.

  It talks to the destination through the `Target` interface only.
  """

  def __init__(self, src: plan.Source, target: orbax_target.Target,
               naming: str, mapping: dict[int, int],
               state_host: Optional[int], notify: ProgressFn):
    self.src = src
    self.target = target
    self.destination = target.root
    self.naming = naming
    self.mapping = mapping
    self.state_host = state_host
    self.notify = notify

  def existing_steps(self) -> set[int]:
    return set(self.target.steps())

  def run(self, ckpt: plan.SourceCheckpoint,
          handle: Optional[flax_format.FlaxFile], existing: set[int],
          dry_run: bool, verify: bool) -> StepResult:
    """Migrates one checkpoint; `handle` is its open `.flax` (or None)."""
    step = self.mapping[ckpt.number]
    result = StepResult(ckpt.number, step, "planned")
    start = time.time()
    try:
      host = _state_host(self.src, self.state_host)
      if handle is None:
        handle = flax_format.FlaxFile(ckpt.flax_path(host))
      result.nbytes = handle.nbytes
      if step in existing:
        self._check_existing(ckpt, step)
        result.status = "skipped"
        self.notify(Progress("skipped", ckpt.number, step, result.nbytes))
      elif not dry_run:
        self.notify(Progress("start", ckpt.number, step, result.nbytes))
        self._write(ckpt, step, host, handle)
        result.status = "migrated"
        self.notify(Progress("done", ckpt.number, step, result.nbytes))
      if verify and not dry_run:
        verify_lib.verify_step(self.target, step, ckpt, host, handle)
        result.verified = True
        self.notify(Progress("verified", ckpt.number, step))
    except Exception as e:  # pylint: disable=broad-except
      # Whatever goes wrong with one checkpoint, the others still migrate.
      logging.debug("checkpoint %d failed", ckpt.number, exc_info=True)
      result.status, result.error = "failed", describe_error(e)
      self.notify(Progress("failed", ckpt.number, step, message=result.error))
    finally:
      if handle is not None:
        handle.close()
    result.seconds = time.time() - start
    return result

  def _check_existing(self, ckpt: plan.SourceCheckpoint, step: int) -> None:
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

  def _write(self, ckpt: plan.SourceCheckpoint, step: int, host: int,
             handle: flax_format.FlaxFile) -> None:
    compared = self.state_host is None and len(ckpt.prefixes) > 1
    if compared:
      for other in ckpt.prefixes:
        if other != host:
          verify_lib.compare_hosts(ckpt, host, other, handle)
    dataset, tf_state = plan.dataset_tree(ckpt)
    state, encodings = codec.encode_state(handle.tree)
    meta = self._metadata(ckpt, step, host, compared, handle.leaves,
                          encodings, tf_state, dataset)
    items = {orbax_target.STATE_ITEM: state,
             orbax_target.METADATA_ITEM: meta}
    if dataset is not None:
      items[orbax_target.DATASET_ITEM] = dataset
    on_bytes = lambda n: self.notify(Progress("bytes", ckpt.number, step, n))
    self.target.write_step(step, items, on_bytes)

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
    return f"{e.filename}: file not found"
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


def restore_state(destination: str, step: Optional[int] = None) -> Any:
  """Restores a migrated step's state exactly as the source `.flax` held it.

  Stock Orbax returns stand-ins for the few leaves it cannot hold (see
  `encode_state`); this undoes them.

  Args:
    destination: The Orbax root directory.
    step: The step; default the latest.

  Returns:
    The Flax state dict.

  Raises:
    FileNotFoundError: There is no such step.
  """
  target = orbax_target.OrbaxTarget(destination)
  steps = target.steps()
  if step is None and steps:
    step = steps[-1]
  if step not in steps:
    raise errors.CheckpointNotFoundError(
        f"{destination}: no step {step} (steps: {steps})")
  stored, meta = target.restore(step)
  return codec.decode_state(stored, meta.get("encoded", {}),
                            [leaf["path"] for leaf in meta.get("leaves", [])])
