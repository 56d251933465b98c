"""The source side of a migration: which CLU checkpoints, under which steps.

`discover` finds a CLU `Checkpoint` or `MultihostCheckpoint` directory's kept
checkpoints on every host; `select` picks some; `state_step` reads a state's
own `step` and `name_steps` chooses every checkpoint's Orbax step;
`dataset_tree` reads every host's TensorFlow files as the `dataset` item.

Synopsis::

  from clu_ckpt.migration import plan

  src = plan.discover("/runs/a/checkpoints")
  chosen = plan.select(src, "latest")
  steps = {c.number: plan.state_step(c.flax_path(0)) for c in chosen}
  naming, mapping = plan.name_steps(chosen, steps)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from clu_ckpt import bucket_cache
from clu_ckpt import errors
from clu_ckpt import flax_format
from clu_ckpt import flax_training
from clu_ckpt import layout
from clu_ckpt import storage

STEP_NAMINGS = ("auto", "state", "number")

MigrationError = errors.MigrationError


# --------------------------------------------------------------------------
# The source.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SourceCheckpoint:
  """One CLU checkpoint number, as found on every host.

  Attributes:
    number: The checkpoint number.
    prefixes: Host id -> checkpoint prefix (`<dir>/ckpt-<number>`).
    saved_at: When it was saved (Unix seconds), as the default state host
      (the lowest host id) knows it: the timestamp TensorFlow's `checkpoint`
      file records for it (`all_model_checkpoint_timestamps`, parallel to
      `all_model_checkpoint_paths`) when there is one, else the modification
      time of its `.flax` file; None when neither can be read.
    files: Host id -> state file, when it is not `<prefix>.flax`: Flax's
      own layout (`flax.training.checkpoints`), whose file is
      `<directory>/<prefix><step>` and whose `number` is that step.
  """
  number: int
  prefixes: Mapping[int, str]
  saved_at: Optional[float] = None
  files: Optional[Mapping[int, str]] = None

  @property
  def name(self) -> str:
    return os.path.basename(next(iter(self.prefixes.values())))

  def flax_path(self, host: int) -> str:
    if self.files is not None:
      return self.files[host]
    return f"{self.prefixes[host]}.flax"


@dataclasses.dataclass(frozen=True)
class Source:
  """A CLU checkpoint base directory, as `discover` found it.

  Attributes:
    path: The base directory (normalized).
    kind: "Checkpoint", "MultihostCheckpoint" or "flax.training.checkpoints"
      (`FLAX_TRAINING_KIND`: Flax's `checkpoint_<step>` files).
    host_directories: Host id -> directory.
    checkpoints: Checkpoints kept on every host, oldest first.
    not_on_all_hosts: Numbers kept on some hosts only.
  """
  path: str
  kind: str
  host_directories: Mapping[int, str]
  checkpoints: list[SourceCheckpoint]
  not_on_all_hosts: list[int]


def discover(source: str, prefix: Optional[str] = None) -> Source:
  """Finds the checkpoints of a CLU `Checkpoint` or `MultihostCheckpoint`,
  or of Flax's `flax.training.checkpoints` files.

  Args:
    source: A `Checkpoint` base directory (holding TF's `checkpoint` file),
      a `MultihostCheckpoint` base (`<source>-<host_id>` directories), or a
      directory of Flax's `<prefix><step>` files (their steps are the
      checkpoint numbers).
    prefix: The prefix of Flax's files; None: "checkpoint_", or the one the
      directory's files share (`flax_training.find_prefix`).

  Returns:
    The source and its checkpoints.

  Raises:
    MigrationError: No checkpoint is found there.
  """
  path = layout.absolute(source)
  if storage.exists(storage.join(path, layout.STATE_FILENAME)):
    kind, directories = "Checkpoint", {0: path}
  else:
    kind, directories = "MultihostCheckpoint", (
        layout.host_directories(path))
    _refuse_hosts_not_directories(path, directories)
    if not directories:
      flax_prefix = (flax_training.find_prefix(path) if prefix is None
                     else prefix)
      if flax_prefix is not None and flax_training.list_steps(
          path, flax_prefix):
        return _discover_flax_training(path, flax_prefix)
      raise MigrationError(
          f"{path}: no CLU checkpoint here (no `checkpoint` file, and no "
          f"`{os.path.basename(path)}-<host_id>` directories beside it), "
          f"and no flax.training.checkpoints files "
          f"{prefix or flax_training.DEFAULT_PREFIX}<step>")
  kept, stamps = {}, {}
  for host, d in directories.items():
    kept[host], stamps[host] = _kept_checkpoints(d)
  common = set.intersection(*(set(k) for k in kept.values()))
  every = set().union(*(set(k) for k in kept.values()))
  state_host = min(kept)
  checkpoints = []
  for n in sorted(common):
    prefixes = {host: kept[host][n] for host in sorted(kept)}
    saved_at = stamps[state_host].get(n)
    if saved_at is None:
      saved_at = _modification_time(f"{prefixes[state_host]}.flax")
    checkpoints.append(SourceCheckpoint(n, prefixes, saved_at))
  return Source(path, kind, dict(sorted(directories.items())), checkpoints,
                sorted(every - common))


def _refuse_hosts_not_directories(base: str,
                                  directories: Mapping[int, str]) -> None:
  """Raises naming a `<base>-<host_id>` entry that is no directory one can
  read (a link to a disk not mounted): a migration without that host would
  leave its iterator behind, and verify would call the source migrated."""
  prefix = f"{layout.normpath(base.rstrip('/'))}-"
  for entry in storage.glob(f"{storage.glob_escape(prefix)}*"):
    suffix = entry[len(prefix):]
    if suffix.isdigit() and int(suffix) not in directories:
      raise MigrationError(
          f"{entry}: a host directory of the MultihostCheckpoint {base} that "
          "is not a directory one can read (a broken link, a disk not "
          "mounted?); mount it, or move it aside if it is not a host")


FLAX_TRAINING_KIND = "flax.training.checkpoints"


def _discover_flax_training(path: str, prefix: str) -> Source:
  """The `Source` of a directory of Flax's `<prefix><step>` files.

  Each file is one checkpoint, numbered by its step, saved at its file's
  modification time (Flax records no other). Its files must be regular
  files inside `path`.
  """
  checkpoints = []
  for step, file in flax_training.list_steps(path, prefix).items():
    try:
      layout.check_inside(path, file)
      storage.check_regular_file(file)
    except (OSError, ValueError) as e:
      raise MigrationError(str(e)) from None
    checkpoints.append(SourceCheckpoint(
        step, {0: file}, _modification_time(file), files={0: file}))
  return Source(path, FLAX_TRAINING_KIND, {0: path}, checkpoints, [])


def _modification_time(path: str) -> Optional[float]:
  try:
    return float(storage.stat(path)[1])
  except OSError:
    return None


def _kept_checkpoints(directory: str
                      ) -> tuple[dict[int, str], dict[int, float]]:
  """What TF's `checkpoint` file keeps, and the times it records.

  Returns:
    (checkpoint number -> prefix, checkpoint number -> recorded timestamp);
    the timestamps pair with the paths by position, as TensorFlow pairs
    them; non-finite or negative ones are left out.

  Raises:
    MigrationError: The `checkpoint` file cannot be read or parsed, lists a
      checkpoint outside `directory`, or a file of a kept checkpoint leads
      outside `directory` (a symlink) or is not a regular file.
  """
  try:
    state = layout.read_checkpoint_state(directory, strict=True)
  except (OSError, ValueError) as e:
    raise MigrationError(str(e)) from None
  if state is None:
    return {}, {}
  recorded = {}
  for path, stamp in zip(state.all_model_checkpoint_paths,
                         state.all_model_checkpoint_timestamps):
    if math.isfinite(stamp) and stamp >= 0:
      recorded[layout.normpath(path)] = float(stamp)
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
          f"{storage.join(directory, layout.STATE_FILENAME)}: {e}") from None
    parts = layout.split_checkpoint(path)
    if parts is None:
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
    kept[parts[1]] = layout.normpath(path)
  times = {n: recorded[p] for n, p in kept.items() if p in recorded}
  return kept, times


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


def state_step(source: Union[str, flax_format.FlaxFile]) -> Optional[int]:
  """The integer top-level `step` of a `.flax` file, or None.

  Args:
    source: A `.flax` file, or its open handle (which parses it once, for
      whatever else the handle is used for).

  Returns:
    The value of `state["step"]` when it is a (numpy or python) integer.

  Raises:
    FlaxFormatError: The file is corrupt.
  """
  if isinstance(source, str):
    with flax_format.FlaxFile(source, read_data=False) as handle:
      return state_step(handle)
  leaf = next((l for l in source.leaves if l.path == "/step"), None)
  if leaf is None or leaf.kind not in ("int", "ndarray", "npscalar"):
    return None
  if leaf.kind != "int" and (leaf.shape != () or
                             np.dtype(leaf.dtype).kind not in "iu"):
    return None
  return int(source.subtree("step"))


# `peek_step` reads this much of a remote `.flax` to find its `step`.
PEEK_BYTES = 1 << 20


def peek_step(path: str) -> tuple[Optional[int], int]:
  """(`state_step`, file size) of a `.flax` in a bucket, from its first bytes.

  A remote file is read whole when it is parsed (`storage.map_file` spools
  it); planning needs only its `step`, which a train state stores before its
  arrays. So the first `PEEK_BYTES` are fetched by one ranged read and the
  `step` found there; only when it lies beyond them (or they cannot be
  parsed) is the whole file parsed, as `state_step` does.

  Example::

    peek_step("gs://b/run/ckpt-7.flax")   # (7000, 512_000_123)

  Raises:
    FlaxFormatError: The file is corrupt (found by the full parse).
    OSError: It cannot be read.
  """
  size, _ = storage.stat(path)
  # Not kept whole (bucket_cache): the cache could drop it before its turn.
  with (bucket_cache.passing_through() if size > PEEK_BYTES else
        contextlib.nullcontext()):
    head = storage.filesystem(path).read_bytes(path, 0,
                                               min(size, PEEK_BYTES))
  try:
    value = flax_format.load(head, subtree="step")
  except (flax_format.FlaxFormatError, KeyError, TypeError, ValueError):
    return state_step(path), size  # beyond the first bytes, or damaged
  if isinstance(value, bool) or not isinstance(value, (int, np.integer,
                                                       np.ndarray)):
    return None, size
  if isinstance(value, np.ndarray) and (value.shape != () or
                                        value.dtype.kind not in "iu"):
    return None, size
  return int(value), size


def name_steps(checkpoints: Sequence[SourceCheckpoint],
               steps: Mapping[int, Optional[int]],
               step_naming: str = "auto", *,
               numbered_root: Optional[str] = None
               ) -> tuple[str, dict[int, int]]:
  """Chooses the Orbax step of every checkpoint.

  The state's own `step` is used when every checkpoint has a non-negative
  integer one and they increase with the checkpoint number; otherwise the
  CLU checkpoint number. Flax's `checkpoint_<step>` files ("auto") keep
  the step of their names (their number). Into a root whose steps
  `Checkpoint(layout="orbax")` saved (`numbered_root`), steps are checkpoint
  numbers: that run resumes from its highest step, which must be its newest
  checkpoint, so "auto" names by number and "state" is refused.

  Example::

    naming, mapping = name_steps(chosen, {1: 100, 2: 200})
    # ("state", {1: 100, 2: 200})

  Args:
    checkpoints: The checkpoints to migrate, oldest first.
    steps: Checkpoint number -> the state's `step` (None when it has none).
    step_naming: "auto", "state" (require the state's step) or "number".
    numbered_root: The destination, when it holds steps saved by
      `Checkpoint(layout="orbax")` (`orbax_root.saved_by_checkpoint`); None
      otherwise.

  Returns:
    ("state" or "number", checkpoint number -> step).

  Raises:
    MigrationError: "state" was asked for but cannot be used.
  """
  if step_naming not in STEP_NAMINGS:
    raise MigrationError(f"unknown step naming {step_naming!r}; use one of "
                         f"{', '.join(STEP_NAMINGS)}")
  numbers = [c.number for c in checkpoints]
  if numbered_root is not None:
    if step_naming == "state":
      raise MigrationError(
          f"{numbered_root} holds steps saved by Checkpoint(layout=\"orbax\"),"
          " numbered by checkpoint number, from which that run resumes: steps "
          "named by the state's `step` would be taken for newer checkpoints; "
          "use --step-naming number, or another destination")
    return "number", {n: n for n in numbers}
  if step_naming == "auto" and checkpoints and all(
      c.files is not None for c in checkpoints):
    # Flax's own files: their names carry the step, which is the number.
    return "number", {n: n for n in numbers}
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
# The TensorFlow side: the `dataset` item.
# --------------------------------------------------------------------------


def _has_other_index(prefix: str) -> bool:
  """Whether the directory of checkpoint `prefix` holds another's `.index`."""
  directory = os.path.dirname(prefix)
  try:
    return any(n.endswith(".index") for n in storage.listdir(directory))
  except OSError:
    return False


def dataset_tree(ckpt: SourceCheckpoint
                  ) -> tuple[Optional[dict[str, Any]], list[str]]:
  """The `dataset` item of a checkpoint (None without tf_state).

  Raises:
    MigrationError: A CLU checkpoint without TensorFlow's `.index` on a host
      whose other checkpoints have theirs (every CLU save writes one): its
      iterator state would be lost.
  """
  from clu_ckpt import orbax_items  # pylint: disable=g-import-not-at-top
  tree, names = {}, set()
  for host, prefix in ckpt.prefixes.items():
    if not storage.exists(f"{prefix}.index"):
      # Flax's own files have no TensorFlow side, nor does a run whose
      # checkpoints all lack it (not written through TensorFlow).
      if ckpt.files is None and _has_other_index(prefix):
        raise MigrationError(
            f"{prefix}.index: missing: checkpoint {ckpt.name} has its .flax "
            "but not TensorFlow's files, which hold its iterator state (CLU "
            "cannot restore it either); restore them, or migrate the other "
            "checkpoints with --number")
      continue
    files = orbax_items.read_tf_files(prefix)
    names.update(orbax_items.tf_state_names(prefix, check=True))
    tree[orbax_items.process_key(host)] = files
  if not names:
    return None, []
  return tree, sorted(names)
