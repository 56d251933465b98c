"""Migrates CLU checkpoint directories into Orbax CheckpointManager layouts.

Every kept CLU checkpoint (`ckpt-N.flax` plus TensorFlow's `ckpt-N.index` and
`ckpt-N.data-*`) becomes one Orbax step directory that stock
`orbax.checkpoint.CheckpointManager` reads, with three items:

- `state`: the Flax state dict, arrays in TensorStore (OCDBT, zstd by
  default), written by Orbax's `PyTreeCheckpointHandler`.
- `dataset`: every host's TensorFlow checkpoint bytes (the tf.data iterator);
  see `clu_ckpt.orbax_items`. Absent when the checkpoint has no `tf_state`.
- `metadata`: JSON: source, CLU checkpoint number, hosts, clu_ckpt version,
  step mapping and a summary of every leaf.

Synopsis::

  from clu_ckpt import migration

  summary = migration.migrate("/runs/a/checkpoints", "/runs/a/orbax")
  for step in summary.steps:
    print(step.number, "->", step.step, step.status)

  import orbax.checkpoint as ocp
  mngr = ocp.CheckpointManager("/runs/a/orbax")
  restored = mngr.restore(mngr.latest_step())        # stock Orbax, no args
  state = migration.restore_state("/runs/a/orbax")   # exact Flax state dict

Arrays are fed to Orbax as views of the memory-mapped `.flax` file and
written a bounded number of bytes at a time, so memory stays small whatever
the checkpoint size. Each step is written under a temporary name and renamed
when complete (Orbax's own atomic save), so an interrupted migration leaves
no partial step, and re-running it skips the steps already there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import os
import re
import time
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

from absl import logging
import numpy as np

from clu_ckpt import __version__
from clu_ckpt import checkpoint as clu_checkpoint
from clu_ckpt import errors
from clu_ckpt import flax_format
from clu_ckpt import layout
from clu_ckpt import storage

FORMAT = "clu_ckpt.migration/1"
STATE_ITEM = "state"
DATASET_ITEM = "dataset"
METADATA_ITEM = "metadata"
STEP_NAMINGS = ("auto", "state", "number")
COMPRESSIONS = ("zstd", "none")
# Array bytes handed to TensorStore at once; bounds the memory of a migration
# (TensorStore copies what it is given before compressing and writing it).
DEFAULT_INFLIGHT_BYTES = 128 * 2**20
# Bytes of leaves restored at once by `verify`.
_VERIFY_BATCH_BYTES = 256 * 2**20
_COMPARE_BLOCK = 64 * 2**20


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


# --------------------------------------------------------------------------
# The source.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SourceCheckpoint:
  """One CLU checkpoint number, as found on every host.

  Attributes:
    number: The checkpoint number.
    prefixes: Host id -> checkpoint prefix (`<dir>/ckpt-<number>`).
  """
  number: int
  prefixes: Mapping[int, str]

  @property
  def name(self) -> str:
    return os.path.basename(next(iter(self.prefixes.values())))

  def flax_path(self, host: int) -> str:
    return f"{self.prefixes[host]}.flax"


@dataclasses.dataclass(frozen=True)
class Source:
  """A CLU checkpoint base directory, as `discover` found it.

  Attributes:
    path: The base directory (normalized).
    kind: "Checkpoint" or "MultihostCheckpoint".
    host_directories: Host id -> directory.
    checkpoints: Checkpoints kept on every host, oldest first.
    not_on_all_hosts: Numbers kept on some hosts only.
  """
  path: str
  kind: str
  host_directories: Mapping[int, str]
  checkpoints: list[SourceCheckpoint]
  not_on_all_hosts: list[int]


def discover(source: str) -> Source:
  """Finds the checkpoints of a CLU `Checkpoint` or `MultihostCheckpoint`.

  Args:
    source: A `Checkpoint` base directory (holding TF's `checkpoint` file), or
      a `MultihostCheckpoint` base (`<source>-<host_id>` directories).

  Returns:
    The source and its checkpoints.

  Raises:
    MigrationError: No CLU checkpoint is found there.
  """
  path = _normalize(source)
  if storage.exists(storage.join(path, storage.STATE_FILENAME)):
    kind, directories = "Checkpoint", {0: path}
  else:
    kind, directories = "MultihostCheckpoint", (
        clu_checkpoint.host_directories(path))
    if not directories:
      raise MigrationError(
          f"{path}: no CLU checkpoint here (no `checkpoint` file, and no "
          f"`{os.path.basename(path)}-<host_id>` directories beside it)")
  kept = {host: _kept_checkpoints(d) for host, d in directories.items()}
  common = set.intersection(*(set(k) for k in kept.values()))
  every = set().union(*(set(k) for k in kept.values()))
  checkpoints = [
      SourceCheckpoint(n, {host: kept[host][n] for host in sorted(kept)})
      for n in sorted(common)]
  return Source(path, kind, dict(sorted(directories.items())), checkpoints,
                sorted(every - common))


def _normalize(path: str) -> str:
  """Normalized, and absolute when local (the metadata records sources)."""
  path = clu_checkpoint.safe_normpath(path)
  return os.path.abspath(path) if storage.is_local(path) else path


def _kept_checkpoints(directory: str) -> dict[int, str]:
  """Checkpoint number -> prefix, for what TF's `checkpoint` file keeps.

  Raises:
    MigrationError: The `checkpoint` file cannot be read or parsed, lists a
      checkpoint outside `directory`, or a file of a kept checkpoint leads
      outside `directory` (a symlink) or is not a regular file.
  """
  try:
    state = storage.read_checkpoint_state(directory, strict=True)
  except (OSError, ValueError) as e:
    raise MigrationError(str(e)) from None
  if state is None:
    return {}
  paths = list(state.managed_checkpoints())
  if state.model_checkpoint_path not in paths:
    paths.append(state.model_checkpoint_path)
  names = storage.listdir(directory)
  kept = {}
  for path in paths:
    try:
      layout.check_inside(directory, path)
    except layout.OutsideDirectoryError as e:
      raise MigrationError(
          f"{storage.join(directory, storage.STATE_FILENAME)}: {e}") from None
    try:
      info = clu_checkpoint.CheckpointInfo.from_path(path)
    except ValueError:
      continue
    stem = os.path.basename(path)
    for name in names:
      if name.startswith(f"{stem}.") and (
          name in (f"{stem}.flax", f"{stem}.index") or
          name.startswith(f"{stem}.data-")):
        try:
          layout.check_inside(directory, storage.join(directory, name))
          storage.check_regular_file(storage.join(directory, name))
        except (OSError, ValueError) as e:
          raise MigrationError(str(e)) from None
    kept[info.number] = clu_checkpoint.safe_normpath(path)
  return kept


# --------------------------------------------------------------------------
# Planning: which checkpoints, under which steps.
# --------------------------------------------------------------------------


Selection = Union[str, int, Sequence[int]]


def select(source: Source, checkpoints: Selection = "all"
           ) -> list[SourceCheckpoint]:
  """Picks checkpoints: "all" kept, "latest", or given checkpoint numbers.

  Args:
    source: What `discover` found.
    checkpoints: "all", "latest", a number or a sequence of numbers.

  Returns:
    The chosen checkpoints, oldest first.

  Raises:
    MigrationError: A requested number is not available on every host, or
      the selection is malformed.
  """
  available = {c.number: c for c in source.checkpoints}
  if checkpoints == "all":
    return list(source.checkpoints)
  if checkpoints == "latest":
    return source.checkpoints[-1:]
  if isinstance(checkpoints, str):
    raise MigrationError(f"unknown checkpoint selection {checkpoints!r}: use "
                         "'all', 'latest' or checkpoint numbers")
  numbers = [checkpoints] if isinstance(checkpoints, int) else checkpoints
  missing = sorted(set(int(n) for n in numbers) - set(available))
  if missing:
    raise MigrationError(
        f"{source.path}: checkpoint number(s) {missing} not available on every "
        f"host; available: {sorted(available)}")
  return [available[n] for n in sorted(set(int(n) for n in numbers))]


def state_step(path: str) -> Optional[int]:
  """The integer top-level `step` of a `.flax` file, or None.

  Args:
    path: A `.flax` file.

  Returns:
    The value of `state["step"]` when it is a (numpy or python) integer.

  Raises:
    FlaxFormatError: The file is corrupt.
  """
  leaves = {leaf.path: leaf for leaf in flax_format.inspect_file(path)}
  leaf = leaves.get("/step")
  if leaf is None or leaf.kind not in ("int", "ndarray", "npscalar"):
    return None
  if leaf.kind != "int" and (leaf.shape != () or
                             np.dtype(leaf.dtype).kind not in "iu"):
    return None
  value = flax_format.load_file(path, subtree="step")
  return int(value)


def name_steps(checkpoints: Sequence[SourceCheckpoint],
               steps: Mapping[int, Optional[int]],
               step_naming: str = "auto") -> tuple[str, dict[int, int]]:
  """Chooses the Orbax step of every checkpoint.

  The state's own `step` is used when every checkpoint has a non-negative
  integer one and they increase with the checkpoint number; otherwise the
  CLU checkpoint number.

  Args:
    checkpoints: The checkpoints to migrate, oldest first.
    steps: Checkpoint number -> the state's `step` (None when it has none).
    step_naming: "auto", "state" (require the state's step) or "number".

  Returns:
    ("state" or "number", checkpoint number -> step).

  Raises:
    MigrationError: "state" was asked for but cannot be used.
  """
  if step_naming not in STEP_NAMINGS:
    raise MigrationError(f"unknown step naming {step_naming!r}; use one of "
                         f"{', '.join(STEP_NAMINGS)}")
  numbers = [c.number for c in checkpoints]
  if step_naming == "number":
    return "number", {n: n for n in numbers}
  problem = _state_steps_problem(numbers, steps)
  if problem is None:
    return "state", {n: int(steps[n]) for n in numbers}
  if step_naming == "state":
    raise MigrationError(f"cannot name steps by the state's `step`: {problem}")
  return "number", {n: n for n in numbers}


def _state_steps_problem(numbers: Sequence[int],
                         steps: Mapping[int, Optional[int]]) -> Optional[str]:
  previous = None
  for n in numbers:
    value = steps.get(n)
    if value is None:
      return f"checkpoint {n} has no integer top-level `step`"
    if value < 0:
      return f"checkpoint {n} has a negative step {value}"
    if previous is not None and value <= previous[1]:
      return (f"steps do not increase with checkpoint numbers (checkpoint "
              f"{previous[0]}: step {previous[1]}, checkpoint {n}: step "
              f"{value})")
    previous = (n, value)
  return None


# --------------------------------------------------------------------------
# Leaves Orbax cannot hold as they are.
# --------------------------------------------------------------------------


def encode_state(state: Any) -> tuple[Any, dict[str, dict[str, Any]]]:
  """Turns a Flax state dict into a tree Orbax stores and restores exactly.

  Orbax keeps dicts, lists, None, bool, int, float, str and arrays of the
  dtypes TensorStore knows. Other leaves are stored as stand-ins, recorded
  in the returned encodings (kept in the `metadata` item) and undone by
  `decode_state`:

  - complex -> 0-d complex128 array; numpy scalar -> 0-d array;
  - bytes -> uint8 array;
  - array of a dtype TensorStore lacks (unicode, uint4, ...) -> its raw bytes
    as a uint8 array;
  - zero-size array (Orbax refuses them) -> None; dtype and shape are
    recorded.

  Args:
    state: A Flax state dict (as `flax_format.load_file` returns it).

  Returns:
    (tree to store, {leaf path: encoding}).

  Raises:
    MigrationError: A key is not a string, a leaf has an unsupported type, or
      two leaves would share one name in Orbax (which joins keys with ".").
  """
  encodings = {}
  stored = _encode(state, "", encodings)
  _check_param_names(stored)
  return stored, encodings


def _encode(value: Any, path: str, encodings: dict) -> Any:
  if isinstance(value, dict):
    out = {}
    for key, item in value.items():
      if not isinstance(key, str):
        raise MigrationError(f"{path or '/'}: key {key!r} is a "
                             f"{type(key).__name__}; Orbax needs str keys")
      out[key] = _encode(item, f"{path}/{key}", encodings)
    return out
  if isinstance(value, (list, tuple)):
    return [_encode(v, f"{path}/{i}", encodings) for i, v in enumerate(value)]
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, complex):
    encodings[path] = {"kind": "complex"}
    return np.asarray(value, np.complex128)
  if isinstance(value, bytes):
    return _encode_array(np.frombuffer(value, np.uint8), path, encodings,
                         "bytes")
  if isinstance(value, np.generic):
    return _encode_array(np.asarray(value), path, encodings, "npscalar")
  if isinstance(value, np.ndarray):
    return _encode_array(value, path, encodings, "ndarray")
  raise MigrationError(f"{path}: leaf of type {type(value).__name__} cannot "
                       "be stored in Orbax")


def _encode_array(arr: np.ndarray, path: str, encodings: dict,
                  kind: str) -> Any:
  record = {"kind": kind, "dtype": _dtype_name(arr.dtype),
            "shape": list(arr.shape)}
  stored: Any = arr
  if arr.size == 0:
    record["stored_as"], stored = "none", None
  elif not _tensorstore_dtype(arr.dtype):
    record["stored_as"] = "raw_bytes"
    stored = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
  if kind != "ndarray" or "stored_as" in record:
    encodings[path] = record
  return stored


def _dtype_name(dtype: np.dtype) -> str:
  """A name `_dtype_from_name` turns back into `dtype`."""
  if dtype.type.__module__.startswith("ml_dtypes"):
    return dtype.name  # Their `.str` is an anonymous "<V1".
  return dtype.str


def _dtype_from_name(name: str) -> np.dtype:
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  custom = getattr(ml_dtypes, name, None)
  return np.dtype(custom) if isinstance(custom, type) else np.dtype(name)


_TS_DTYPES: dict[str, bool] = {}


def _tensorstore_dtype(dtype: np.dtype) -> bool:
  # ml_dtypes types (bfloat16, float8_*, int4, ...) have kind "V" too.
  if dtype.kind not in "biufcV" or dtype.fields is not None:
    return False
  if dtype.name not in _TS_DTYPES:
    import tensorstore as ts  # pylint: disable=g-import-not-at-top
    try:
      ts.dtype(dtype.name)
      _TS_DTYPES[dtype.name] = True
    except (ValueError, TypeError):
      _TS_DTYPES[dtype.name] = False
  return _TS_DTYPES[dtype.name]


def _check_param_names(tree: Any) -> None:
  """Refuses trees in which two leaves get the same Orbax parameter name."""
  seen = {}
  for keys in _terminal_paths(tree, ()):
    name = ".".join(str(k) for k in keys)
    path = "/" + "/".join(str(k) for k in keys)
    if name in seen:
      raise MigrationError(
          f"leaves {seen[name]} and {path} would both be stored under the "
          f"Orbax name {name!r} (Orbax joins keys with '.'); rename one of "
          "them before migrating")
    seen[name] = path


def _terminal_paths(tree: Any, keys: tuple) -> Iterator[tuple]:
  if isinstance(tree, dict) and tree:
    for key, item in tree.items():
      yield from _terminal_paths(item, keys + (key,))
  elif isinstance(tree, list) and tree:
    for i, item in enumerate(tree):
      yield from _terminal_paths(item, keys + (i,))
  else:
    yield keys


def decode_state(stored: Any, encodings: Mapping[str, Mapping[str, Any]],
                 leaf_paths: Sequence[str] = ()) -> Any:
  """Undoes `encode_state`: returns the Flax state dict that was migrated.

  Args:
    stored: The `state` item as Orbax restores it.
    encodings: `metadata["encoded"]` of the same step.
    leaf_paths: The source's leaf paths in file order (`metadata["leaves"]`);
      dict keys are put back in that order (Orbax returns them sorted).

  Returns:
    The state dict, equal leaf for leaf (type, dtype, shape, bytes) to what
    `flax_format.load_file` returns for the source.
  """
  order: dict = {}
  for path in leaf_paths:
    node = order
    for key in path.split("/")[1:]:
      node = node.setdefault(key, {})
  return _reorder(_decode(stored, "", encodings), order)


def _reorder(tree: Any, order: Mapping[str, Any]) -> Any:
  if not isinstance(tree, dict):
    return tree
  keys = [k for k in order if k in tree] + [k for k in tree if k not in order]
  return {k: _reorder(tree[k], order.get(k, {})) for k in keys}


def _decode(value: Any, path: str, encodings: Mapping) -> Any:
  record = encodings.get(path)
  if record is not None:
    return _decode_leaf(value, record)
  if isinstance(value, dict):
    return {k: _decode(v, f"{path}/{k}", encodings) for k, v in value.items()}
  if isinstance(value, list):
    return [_decode(v, f"{path}/{i}", encodings) for i, v in enumerate(value)]
  return value


def _decode_leaf(value: Any, record: Mapping[str, Any]) -> Any:
  kind = record["kind"]
  if kind == "complex":
    return complex(np.asarray(value).item())
  dtype, shape = _dtype_from_name(record["dtype"]), tuple(record["shape"])
  stored_as = record.get("stored_as")
  if stored_as == "none":
    arr = np.zeros(shape, dtype)
  elif stored_as == "raw_bytes":
    arr = np.frombuffer(np.asarray(value).tobytes(), dtype).reshape(shape)
  else:
    arr = np.asarray(value)
  if kind == "bytes":
    return arr.tobytes()
  if kind == "npscalar":
    return arr.reshape(()).astype(dtype)[()]
  return arr


# --------------------------------------------------------------------------
# Writing.
# --------------------------------------------------------------------------


def migrate(source: str,
            destination: str,
            *,
            checkpoints: Selection = "all",
            step_naming: str = "auto",
            state_host: Optional[int] = None,
            compression: str = "zstd",
            dry_run: bool = False,
            verify: bool = False,
            inflight_bytes: int = DEFAULT_INFLIGHT_BYTES,
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
  src = discover(source)
  if state_host is not None and state_host not in src.host_directories:
    raise MigrationError(f"--state-host {state_host}: no such host in "
                         f"{src.path} (hosts: {sorted(src.host_directories)})")
  chosen = select(src, checkpoints)
  destination = _normalize(destination)
  notify = progress or (lambda _: None)

  results: dict[int, StepResult] = {}
  steps: dict[int, Optional[int]] = {}
  usable = []
  for ckpt in chosen:
    try:
      host = _state_host(src, state_host)
      steps[ckpt.number] = state_step(ckpt.flax_path(host))
      usable.append(ckpt)
    except (OSError, flax_format.FlaxFormatError) as e:
      results[ckpt.number] = StepResult(ckpt.number, None, "failed",
                                        error=describe_error(e))
  naming, mapping = name_steps(usable, steps, step_naming)
  for number, result in results.items():
    notify(Progress("failed", number, result.step, message=result.error))

  writer = _Writer(src, destination, naming, mapping, state_host,
                   compression == "zstd", inflight_bytes, notify)
  existing = writer.existing_steps()
  for ckpt in usable:
    results[ckpt.number] = writer.run(ckpt, existing, dry_run, verify)
  ordered = [results[c.number] for c in chosen]
  return MigrationSummary(src.path, destination, src.kind,
                          sorted(src.host_directories), naming, ordered,
                          src.not_on_all_hosts, dry_run)


def _state_host(src: Source, state_host: Optional[int]) -> int:
  return min(src.host_directories) if state_host is None else state_host


class _Writer:
  """Writes (or checks, or plans) the step of one checkpoint at a time."""

  def __init__(self, src: Source, destination: str, naming: str,
               mapping: dict[int, int], state_host: Optional[int],
               use_compression: bool, inflight_bytes: int,
               notify: ProgressFn):
    self.src = src
    self.destination = destination
    self.naming = naming
    self.mapping = mapping
    self.state_host = state_host
    self.use_compression = use_compression
    self.inflight_bytes = inflight_bytes
    self.notify = notify

  def existing_steps(self) -> set[int]:
    if not storage.exists(self.destination):
      return set()
    return set(_orbax_steps(self.destination))

  def run(self, ckpt: SourceCheckpoint, existing: set[int], dry_run: bool,
          verify: bool) -> StepResult:
    step = self.mapping[ckpt.number]
    result = StepResult(ckpt.number, step, "planned")
    start = time.time()
    try:
      host = _state_host(self.src, self.state_host)
      leaves = flax_format.inspect_file(ckpt.flax_path(host))
      result.nbytes = sum(leaf.nbytes for leaf in leaves)
      if step in existing:
        self._check_existing(ckpt, step)
        result.status = "skipped"
        self.notify(Progress("skipped", ckpt.number, step, result.nbytes))
      elif not dry_run:
        self.notify(Progress("start", ckpt.number, step, result.nbytes))
        try:
          self._write(ckpt, step, host, leaves)
        except BaseException:
          _remove_temporary_steps(self.destination, step)
          raise
        result.status = "migrated"
        self.notify(Progress("done", ckpt.number, step, result.nbytes))
      if verify and not dry_run:
        verify_step(self.destination, step, ckpt, host)
        result.verified = True
        self.notify(Progress("verified", ckpt.number, step))
    except Exception as e:  # pylint: disable=broad-except
      # Whatever goes wrong with one checkpoint, the others still migrate.
      logging.debug("checkpoint %d failed", ckpt.number, exc_info=True)
      result.status, result.error = "failed", describe_error(e)
      self.notify(Progress("failed", ckpt.number, step, message=result.error))
    result.seconds = time.time() - start
    return result

  def _check_existing(self, ckpt: SourceCheckpoint, step: int) -> None:
    meta = read_metadata(self.destination, step)
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

  def _write(self, ckpt: SourceCheckpoint, step: int, host: int,
             leaves: list[flax_format.LeafInfo]) -> None:
    compared = self.state_host is None and len(ckpt.prefixes) > 1
    if compared:
      for other in ckpt.prefixes:
        if other != host:
          _compare_hosts(ckpt, host, other)
    dataset, tf_state = _dataset_tree(ckpt)
    state, encodings = encode_state(flax_format.load_file(ckpt.flax_path(host)))
    meta = self._metadata(ckpt, step, host, compared, leaves, encodings,
                          tf_state, dataset)
    items = {STATE_ITEM: state, METADATA_ITEM: meta}
    if dataset is not None:
      items[DATASET_ITEM] = dataset
    on_bytes = lambda n: self.notify(Progress("bytes", ckpt.number, step, n))
    _save_step(self.destination, step, items, self.use_compression,
               self.inflight_bytes, on_bytes)

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
        "compression": "zstd" if self.use_compression else "none",
        "migrated_at": datetime.datetime.now(
            datetime.timezone.utc).isoformat(timespec="seconds"),
        "leaves": [_leaf_summary(leaf) for leaf in leaves],
        "encoded": encodings,
    }


def _process_indices(dataset: Mapping[str, Any]) -> list[int]:
  from clu_ckpt import orbax_items  # pylint: disable=g-import-not-at-top
  return orbax_items.process_indices(dataset)


def _leaf_summary(leaf: flax_format.LeafInfo) -> dict[str, Any]:
  return {"path": leaf.path, "kind": leaf.kind, "dtype": leaf.dtype,
          "shape": None if leaf.shape is None else list(leaf.shape)}


def _dataset_tree(ckpt: SourceCheckpoint
                  ) -> tuple[Optional[dict[str, Any]], list[str]]:
  """The `dataset` item of a checkpoint (None without tf_state)."""
  from clu_ckpt import orbax_items  # pylint: disable=g-import-not-at-top
  tree, names = {}, set()
  for host, prefix in ckpt.prefixes.items():
    if not storage.exists(f"{prefix}.index"):
      continue
    files = orbax_items.read_tf_files(prefix)
    names.update(orbax_items.tf_state_names(prefix, check=True))
    tree[orbax_items.process_key(host)] = files
  if not names:
    return None, []
  return tree, sorted(names)


def _compare_hosts(ckpt: SourceCheckpoint, host: int, other: int) -> None:
  """Raises unless two hosts' `.flax` files hold the same state."""
  a, b = ckpt.flax_path(host), ckpt.flax_path(other)
  if _same_bytes(a, b):
    return
  difference = _first_difference(flax_format.load_file(a),
                                 flax_format.load_file(b), "")
  if difference is not None:
    raise MigrationError(
        f"{ckpt.name}: hosts {host} and {other} hold different states "
        f"(first difference at {difference or '/'}: {a} vs {b}); pass "
        "--state-host to take the state from one host")


def _same_bytes(a: str, b: str) -> bool:
  if storage.stat(a)[0] != storage.stat(b)[0]:
    return False
  x = np.frombuffer(storage.map_file(a), np.uint8)
  y = np.frombuffer(storage.map_file(b), np.uint8)
  for i in range(0, x.size, _COMPARE_BLOCK):
    if not np.array_equal(x[i:i + _COMPARE_BLOCK], y[i:i + _COMPARE_BLOCK]):
      return False
  return True


def _first_difference(x: Any, y: Any, path: str) -> Optional[str]:
  """Path of the first leaf where two state dicts differ, or None."""
  if isinstance(x, dict) or isinstance(y, dict):
    if not (isinstance(x, dict) and isinstance(y, dict)) or set(x) != set(y):
      return path
    for key in x:
      found = _first_difference(x[key], y[key], f"{path}/{key}")
      if found is not None:
        return found
    return None
  return None if same_leaf(x, y) else path


def same_leaf(x: Any, y: Any) -> bool:
  """Bit-exact equality of two leaves: type, dtype, shape and bytes."""
  if type(x) is not type(y):
    return False
  if isinstance(x, (np.ndarray, np.generic)):
    x, y = np.asarray(x), np.asarray(y)
    return (x.dtype == y.dtype and x.shape == y.shape and
            np.array_equal(_bytes_view(x), _bytes_view(y)))
  if isinstance(x, float):
    return np.float64(x).tobytes() == np.float64(y).tobytes()
  if isinstance(x, complex):
    return np.complex128(x).tobytes() == np.complex128(y).tobytes()
  if isinstance(x, (list, tuple)):
    return len(x) == len(y) and all(same_leaf(a, b) for a, b in zip(x, y))
  if isinstance(x, dict):
    return list(x) == list(y) and all(same_leaf(x[k], y[k]) for k in x)
  return x == y


def _bytes_view(arr: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)


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


# --------------------------------------------------------------------------
# Orbax.
# --------------------------------------------------------------------------


def _save_step(destination: str, step: int, items: Mapping[str, Any],
               use_compression: bool, inflight_bytes: int,
               on_bytes: Callable[[int], None]) -> None:
  """Writes one step directory atomically (temporary name, then rename)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top
  storage.makedirs(destination)
  state_handler = ocp.handlers.PyTreeCheckpointHandler(
      use_compression=use_compression,
      type_handler_registry=_type_handlers(inflight_bytes, on_bytes))
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
    checkpointer.save(epath.Path(destination) / str(step),
                      args=ocp.args.Composite(**args))
  finally:
    checkpointer.close()


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


def _remove_temporary_steps(destination: str, step: int) -> None:
  """Removes what an interrupted Orbax save of `step` left behind."""
  from etils import epath  # pylint: disable=g-import-not-at-top
  root = epath.Path(destination)
  if root.exists():
    for path in root.glob(f"{step}.orbax-checkpoint-tmp*"):
      path.rmtree()


def _orbax_steps(destination: str) -> list[int]:
  """The steps a default `CheckpointManager(destination)` lists."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  name_format = ocp.path.step.standard_name_format()
  return sorted(m.step for m in name_format.find_all(destination))


def read_metadata(destination: str, step: int) -> dict[str, Any]:
  """The `metadata` item of a migrated step, read through Orbax.

  Args:
    destination: The Orbax root directory.
    step: The step.

  Returns:
    The metadata (an empty dict when the step has none).
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top
  path = epath.Path(destination) / str(step) / METADATA_ITEM
  if not path.exists():
    return {}
  return ocp.handlers.JsonCheckpointHandler().restore(
      path, args=ocp.args.JsonRestore())


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
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top
  steps = _orbax_steps(destination) if storage.exists(destination) else []
  if step is None and steps:
    step = steps[-1]
  if step not in steps:
    raise errors.CheckpointNotFoundError(
        f"{destination}: no step {step} (steps: {steps})")
  checkpointer = ocp.Checkpointer(ocp.handlers.CompositeCheckpointHandler())
  with checkpointer:
    restored = checkpointer.restore(
        epath.Path(destination) / str(step), args=ocp.args.Composite(
            **{STATE_ITEM: ocp.args.PyTreeRestore(),
               METADATA_ITEM: ocp.args.JsonRestore()}))
  meta = restored[METADATA_ITEM]
  return decode_state(restored[STATE_ITEM], meta.get("encoded", {}),
                      [leaf["path"] for leaf in meta.get("leaves", [])])


# --------------------------------------------------------------------------
# Verification.
# --------------------------------------------------------------------------


def verify_step(destination: str, step: int, ckpt: SourceCheckpoint,
                host: int) -> None:
  """Compares a migrated step with its source, leaf by leaf, bit-exactly.

  The state is restored through stock Orbax in batches of leaves (bounded
  memory) and compared with the memory-mapped source; every host's
  TensorFlow files with the `dataset` item.

  Args:
    destination: The Orbax root directory.
    step: The step.
    ckpt: Its source checkpoint.
    host: The host whose `.flax` the state came from.

  Raises:
    MigrationError: Something differs or is missing.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top
  if step not in _orbax_steps(destination):
    raise MigrationError(f"verify: Orbax does not list step {step} in "
                         f"{destination}")
  encodings = read_metadata(destination, step).get("encoded", {})
  source = flax_format.load_file(ckpt.flax_path(host))
  item = epath.Path(destination) / str(step) / STATE_ITEM
  handler = ocp.handlers.PyTreeCheckpointHandler()
  tree = handler.metadata(item).tree
  expected = list(_verify_units(encode_state(source)[0], ()))
  present = set(_verify_units(tree, ()))
  missing = [k for k in expected if k not in present]
  if missing or len(present) != len(expected):
    where = _path(missing[0]) if missing else "(extra leaves)"
    raise MigrationError(f"verify: step {step} does not hold the same leaves "
                         f"as {ckpt.flax_path(host)}: {where}")
  for batch in _batches(expected, tree, _VERIFY_BATCH_BYTES):
    restored = handler.restore(item, args=ocp.args.PyTreeRestore(
        item=_subtree(tree, batch), partial_restore=True))
    for keys in batch:
      got = _decode(_get(restored, keys), _path(keys), encodings)
      if not same_leaf(got, _get(source, keys)):
        raise MigrationError(f"verify: step {step} leaf {_path(keys)} differs "
                             f"from {ckpt.flax_path(host)}")
  _verify_dataset(destination, step, ckpt)


def _verify_dataset(destination: str, step: int,
                    ckpt: SourceCheckpoint) -> None:
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top
  expected, _ = _dataset_tree(ckpt)
  item = epath.Path(destination) / str(step) / DATASET_ITEM
  if expected is None:
    if item.exists():
      raise MigrationError(f"verify: step {step} has an unexpected dataset")
    return
  stored = ocp.handlers.PyTreeCheckpointHandler().restore(
      item, args=ocp.args.PyTreeRestore())
  for key, files in expected.items():
    got = stored.get(key, {})
    if set(got) != set(files) or not all(
        np.array_equal(np.asarray(got[s]), files[s]) for s in files):
      raise MigrationError(f"verify: step {step} dataset/{key} differs from "
                           f"the TensorFlow files of {ckpt.prefixes}")


def _verify_units(tree: Any, keys: tuple) -> Iterator[tuple]:
  """Leaf paths, but a list counts as one unit (compared whole)."""
  if isinstance(tree, dict) and tree:
    for key, item in tree.items():
      yield from _verify_units(item, keys + (key,))
  else:
    yield keys


def _batches(units: Sequence[tuple], tree: Any,
             budget: int) -> Iterator[list[tuple]]:
  batch, used = [], 0
  for keys in units:
    size = _stored_nbytes(_get(tree, keys))
    if batch and used + size > budget:
      yield batch
      batch, used = [], 0
    batch.append(keys)
    used += size
  if batch:
    yield batch


def _stored_nbytes(meta: Any) -> int:
  shape, dtype = getattr(meta, "shape", None), getattr(meta, "dtype", None)
  if shape is None or dtype is None:
    return 0
  return int(np.prod(shape)) * np.dtype(dtype).itemsize


def _subtree(tree: Any, paths: Sequence[tuple]) -> Any:
  out: dict = {}
  for keys in paths:
    if not keys:
      return tree
    node = out
    for key in keys[:-1]:
      node = node.setdefault(key, {})
    node[keys[-1]] = _get(tree, keys)
  return out


def _path(keys: Sequence[Any]) -> str:
  return "/" + "/".join(str(k) for k in keys)


def _get(tree: Any, keys: Sequence[Any]) -> Any:
  for key in keys:
    tree = tree[key]
  return tree
