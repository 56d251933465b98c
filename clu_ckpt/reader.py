"""One reader for every checkpoint layout of the Flax world, and which it is.

`load_state_dict(path)` gives the Flax state dict of the newest checkpoint
at `path`, whatever layout holds it, without TensorFlow (and without JAX or
Orbax): the same dict before and after `clu-ckpt migrate`. `detect_layout`
says which layout a directory holds (`detect_layouts`: every layout found
there); `load_state_dict` and `clu-ckpt inspect` and `verify`
(`clu_ckpt.inspection`) ask `detect_layouts`. `migrate` (`migration.plan`)
and a fleet's discovery (`migration.fleet_discovery`) recognise their
sources with checks of their own.

The layouts, in the order they are looked for (`LAYOUTS`):

- `"orbax_migrated"`: an Orbax CheckpointManager root written by
  `clu-ckpt migrate` (read by `clu_ckpt.orbax_read`, TensorStore only),
  its steps plain numbers or named with a prefix or padding
  (`orbax_root.find_step_naming`);
- `"orbax"`: another Orbax root (not read here: use `orbax.checkpoint`);
- `"clu"`: a CLU `Checkpoint` directory (`ckpt-N.flax` + TensorFlow's files);
- `"clu_multihost"`: a `MultihostCheckpoint` base (`<base>-<host>/`);
- `"flax_training"`: `flax.training.checkpoints` msgpack files `<prefix><step>`
  (`clu_ckpt.flax_training`): what Flax writes with
  `flax_use_orbax_checkpointing` off, and every Flax before 2023 (newer Flax
  writes Orbax directories by default: read them with `orbax.checkpoint`).

A single `.flax` (or Flax `checkpoint_<step>`) file is read as it is.

Synopsis::

  from clu_ckpt import reader

  reader.detect_layout("/runs/a/orbax")               # "orbax_migrated"
  state = reader.load_state_dict("/runs/a/orbax")     # the newest step
  state = reader.load_state_dict("/runs/a/checkpoints")   # the same dict
  params = reader.load_state_dict("/runs/a/orbax", subtree="params",
                                  step=500)
  state = reader.load_state_dict("/runs/flax_run")    # msgpack checkpoint_<step>
  state = reader.load_state_dict("/runs/b", prefix="model_")
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence, Union

from absl import logging

from clu_ckpt import errors
from clu_ckpt import flax_format
from clu_ckpt import flax_training
from clu_ckpt import layout
from clu_ckpt import orbax_read
from clu_ckpt import orbax_root
from clu_ckpt import storage

ORBAX_MIGRATED = "orbax_migrated"
ORBAX = "orbax"
CLU = "clu"
CLU_MULTIHOST = "clu_multihost"
FLAX_TRAINING = "flax_training"
LAYOUTS = (ORBAX_MIGRATED, ORBAX, CLU, CLU_MULTIHOST, FLAX_TRAINING)
# What a message says was looked for.
DESCRIPTIONS = {
    ORBAX_MIGRATED: "an Orbax root migrated by clu-ckpt",
    ORBAX: "an Orbax CheckpointManager root",
    CLU: "a CLU Checkpoint directory (ckpt-N.flax, `checkpoint`)",
    CLU_MULTIHOST: "a CLU MultihostCheckpoint base (<path>-<host>/)",
    FLAX_TRAINING: "flax.training.checkpoints files (<prefix><step>)",
}

Subtree = Union[None, str, Sequence[str]]


def looked_for(prefix: Optional[str] = None) -> str:
  """The layouts looked for, as a message says them."""
  names = [DESCRIPTIONS[n] for n in LAYOUTS]
  if prefix is not None:
    names[-1] = f"flax.training.checkpoints files {prefix}<step>"
  return "; ".join(names)


def detect_layouts(path: str, prefix: Optional[str] = None) -> list[str]:
  """Every layout `path` holds, in the order of `LAYOUTS`.

  Args:
    path: A directory (local path, `file://` or another URL).
    prefix: The Flax files' prefix; None: "checkpoint_", or the one prefix
      the directory's Flax files share (`flax_training.find_prefix`).

  Returns:
    Layout names; empty when none is there.
  """
  found = []
  is_dir = storage.isdir(path)
  if is_dir and orbax_root.is_orbax_root(path):
    found.append(ORBAX_MIGRATED if _migrated(path) else ORBAX)
  if is_dir and layout.is_checkpoint_directory(path):
    found.append(CLU)
  if any(layout.is_checkpoint_directory(d)
         for d in layout.host_directories(path).values()):
    found.append(CLU_MULTIHOST)
  if is_dir and flax_prefix(path, prefix) is not None:
    found.append(FLAX_TRAINING)
  return found


def detect_layout(path: str, prefix: Optional[str] = None) -> Optional[str]:
  """Which checkpoint layout a directory holds (the first of `LAYOUTS`).

  Example::

    detect_layout("/runs/a/checkpoints")   # "clu_multihost"
    detect_layout("/runs/a/orbax")         # "orbax_migrated"
    detect_layout("/runs/empty")           # None

  Args:
    path: A directory (or a `MultihostCheckpoint` base, which need not
      exist itself).
    prefix: See `detect_layouts`.

  Returns:
    "orbax_migrated", "orbax", "clu", "clu_multihost", "flax_training", or
    None when it holds no checkpoint of a known layout.
  """
  found = detect_layouts(path, prefix)
  return found[0] if found else None


def flax_prefix(path: str, prefix: Optional[str] = None) -> Optional[str]:
  """The prefix of `path`'s Flax checkpoint files, or None if it has none."""
  if prefix is not None:
    return prefix if flax_training.list_steps(path, prefix) else None
  return flax_training.find_prefix(path)


def _migrated(root: str) -> bool:
  naming, steps, _ = orbax_root.read_steps(root)
  return bool(steps) and orbax_read.migration_metadata(
      naming.path(root, steps[-1])) is not None


def load_state_dict(path: str, *, subtree: Subtree = None,
                    checkpoint: Union[None, str, int] = None,
                    step: Optional[int] = None,
                    prefix: Optional[str] = None,
                    layout_name: Optional[str] = None) -> Any:
  """The state dict of the newest (or a given) checkpoint at `path`.

  Whatever the layout (see the module docstring), the result is what
  `clu.checkpoint.load_state_dict` gave for the CLU run it came from, or
  `flax.training.checkpoints.restore_checkpoint(path, None)` for Flax's
  files: dicts in the saved key order, lists as dicts keyed "0", "1", ...,
  numpy arrays, Python scalars and strings. The layout read is logged, and
  a warning says which was chosen when `path` holds several.

  Args:
    path: A directory of any layout, a `MultihostCheckpoint` base, or a
      single `.flax` / Flax checkpoint file.
    subtree: Only this subtree ("params/Dense_0" or a sequence of keys);
      only its arrays are read.
    checkpoint: A CLU checkpoint prefix (`<dir>/ckpt-N`, read as given, as
      clu does: a relative one against the current directory), a file, an
      Orbax step directory; for a migrated root also the CLU name it was
      migrated from ("ckpt-5") or a step; for Flax's layout
      `<prefix><step>`.
    step: A step of an Orbax root or of Flax's layout.
    prefix: The prefix of Flax's files (default "checkpoint_", or the one
      the directory's files share).
    layout_name: Read this layout when `path` holds several.

  Returns:
    The state dict, or the subtree.

  Raises:
    CheckpointNotFoundError: Nothing to read (the message names the
      layouts looked for, or the absolute path tried).
    FlaxFormatError: A file is damaged; `SubtreeNotFoundError` (one) when
      there is no such subtree (the message lists the keys there are).
    UsageError: `step` for a CLU directory, or a `layout_name` not found.
  """
  if not path:
    raise errors.UsageError("load_state_dict: an empty path")
  if storage.exists(path) and not storage.isdir(path):
    logging.info("load_state_dict: reading the file %s", path)
    return flax_format.load_file(path, subtree=subtree)
  if (isinstance(checkpoint, str) and step is None and layout_name is None
      and storage.exists(f"{checkpoint}.flax")):
    return _read_clu(path, subtree, checkpoint)  # a CLU checkpoint, as given
  found = detect_layouts(path, prefix)
  if layout_name is not None:
    if layout_name not in found:
      raise errors.UsageError(
          f"{path}: no {layout_name} layout here (found: "
          f"{', '.join(found) or 'none'})")
    chosen = layout_name
  else:
    chosen = found[0] if found else None
    if checkpoint is None and step is None:
      chosen = _newest_of_migrated_and_clu(path, found, chosen)
  if chosen is not None and len(found) > 1 and layout_name is None:
    logging.warning(
        "%s holds several checkpoint layouts (%s): reading the %s; pass "
        "layout_name= to read another", path, ", ".join(found), chosen)
  elif chosen is not None:
    logging.info("load_state_dict: reading %s as layout %r", path, chosen)
  if checkpoint is not None and step is not None:
    raise errors.UsageError("load_state_dict: give checkpoint= or step=, "
                            "not both")
  if chosen in (ORBAX_MIGRATED, ORBAX):
    return _read_orbax(path, chosen, subtree, checkpoint, step)
  if chosen == FLAX_TRAINING:
    return _read_flax_training(path, flax_prefix(path, prefix), subtree,
                               checkpoint, step)
  if step is not None:
    raise errors.UsageError(
        f"{path}: step={step}: the checkpoints of a CLU directory are chosen "
        "by checkpoint='<directory>/ckpt-<number>'")
  if checkpoint is None and chosen is None:
    raise errors.CheckpointNotFoundError(
        f"No checkpoint found at {path} (looked for {looked_for(prefix)})"
        f"{orbax_root.step_naming_hint(path)}")
  return _read_clu(path, subtree, checkpoint)


def _newest_of_migrated_and_clu(path: str, found: list[str],
                                chosen: Optional[str]) -> Optional[str]:
  """The layout holding the newest checkpoint, when `path` holds a migrated
  Orbax root and CLU checkpoints (a run saving with `layout="orbax"`, or one
  migrated in place that went on saving in CLU's layout).

  Newest is the later save time: a migrated step keeps its source's save
  time (Orbax's `commit_timestamp_nsecs`), and TensorFlow's `checkpoint`
  file records each CLU checkpoint's. Where a time is missing, or both are
  equal, the higher CLU checkpoint number wins (a migrated step records
  the number it came from, `clu_checkpoint_number`); on a tie the Orbax
  step is read, as `Checkpoint(layout="orbax")` restores it.
  """
  clu_kind = next((k for k in (CLU, CLU_MULTIHOST) if k in found), None)
  if chosen != ORBAX_MIGRATED or clu_kind is None:
    return chosen
  try:
    latest = _clu_latest(path)
  except errors.CheckpointNotFoundError:
    return chosen
  parts = None if latest is None else layout.split_checkpoint(latest)
  if parts is None:
    return chosen
  naming, steps, _ = orbax_root.read_steps(path)
  step_dir = naming.path(path, steps[-1])
  number = (orbax_read.migration_metadata(step_dir) or {}).get(
      "clu_checkpoint_number")
  orbax_time = _commit_time(step_dir)
  clu_time = _clu_save_time(latest, [layout.normpath(path), *layout.
                                     host_directories(path).values()])
  if orbax_time is not None and clu_time is not None and (
      abs(orbax_time - clu_time) > 1e-3):
    newer = clu_time > orbax_time
    why = (f"saved at {clu_time:.3f}, the Orbax root's newest step "
           f"{steps[-1]} at {orbax_time:.3f}")
  else:
    newer = isinstance(number, int) and parts[1] > number
    why = (f"number {parts[1]}, the Orbax root's newest step {steps[-1]} "
           f"holds number {number}")
  if not newer:
    return chosen
  logging.warning("%s: the CLU checkpoint %s is newer (%s): reading it", path,
                  latest, why)
  return clu_kind


def _commit_time(step_dir: str) -> Optional[float]:
  """When an Orbax step was saved (its source's save time, if migrated)."""
  meta = storage.read_json_object(
      storage.join(step_dir, orbax_root.STEP_METADATA)) or {}
  stamp = meta.get("commit_timestamp_nsecs")
  return stamp / 1e9 if isinstance(stamp, (int, float)) and stamp else None


def _clu_save_time(checkpoint: str,
                   directories: Sequence[str]) -> Optional[float]:
  """When a CLU checkpoint was saved, as its directory's `checkpoint` file
  records it; None when it does not, or when the checkpoint lies outside
  `directories` (a state file naming a checkpoint elsewhere does not make
  this read another directory's state file)."""
  directory = next((d for d in directories
                    if layout.is_contained(d, checkpoint)), None)
  if directory is None:
    return None
  name = checkpoint.rstrip("/").rsplit("/", 1)[-1]
  state = layout.read_checkpoint_state(directory)
  if state is None:
    return None
  names = [p.rstrip("/").rsplit("/", 1)[-1]
           for p in state.all_model_checkpoint_paths]
  stamps = state.all_model_checkpoint_timestamps
  if name in names and len(stamps) == len(names):
    return stamps[names.index(name)]
  return None


# --------------------------------------------------------------------------
# CLU.
# --------------------------------------------------------------------------


def _clu_latest(path: str) -> Optional[str]:
  """The CLU checkpoint a restore of `path` reads: every host's newest
  common one for a multihost base (`layout.multihost_latest`), else the
  directory's (`layout.latest_restorable`)."""
  latest = layout.multihost_latest(path, "ckpt")
  if latest is None:
    latest = layout.latest_restorable(layout.normpath(path))
  return latest


def _read_clu(path: str, subtree: Subtree, checkpoint: Any) -> Any:
  """As clu's `load_state_dict`: the latest (every host's newest common
  one for a multihost base, `layout.multihost_latest`; a directory's by
  `layout.latest_restorable`), or `checkpoint` read as given."""
  if checkpoint is not None:
    checkpoint = str(checkpoint)
    if not storage.exists(f"{checkpoint}.flax"):
      if storage.exists(checkpoint) and not storage.isdir(checkpoint):
        return flax_format.load_file(checkpoint, subtree=subtree)
      raise errors.CheckpointNotFoundError(
          _not_found(checkpoint, f"{checkpoint}.flax", path))
    return flax_format.load_file(f"{checkpoint}.flax", subtree=subtree)
  latest = _clu_latest(path)
  if latest is None:
    raise errors.CheckpointNotFoundError(
        f"No checkpoint found at {layout.normpath(path)}")
  flax_path = f"{latest}.flax"
  if not storage.exists(flax_path):
    raise errors.CheckpointNotFoundError(
        f"Checkpoint {latest} does not exist ({flax_path} not found)")
  return flax_format.load_file(flax_path, subtree=subtree)


def _not_found(requested: str, tried: str, base: str) -> str:
  """A message for a `checkpoint=` that is not there: the absolute path
  tried and, for a relative one, that it was read from the current
  directory (and where it is, if it is in `base`)."""
  scheme, _ = layout.split_scheme(tried)
  absolute = tried if scheme else os.path.abspath(tried)
  text = f"Checkpoint {requested} does not exist: tried {absolute}"
  if not scheme and not os.path.isabs(requested):
    text += (f" (a relative checkpoint= is read from the current directory, "
             f"{os.getcwd()})")
    candidate = storage.join(layout.absolute(base), requested)
    if storage.exists(f"{candidate}.flax") or storage.exists(candidate):
      text += f"; did you mean checkpoint={candidate!r}?"
  return text


# --------------------------------------------------------------------------
# Orbax roots.
# --------------------------------------------------------------------------


def _read_orbax(root: str, kind: str, subtree: Subtree, checkpoint: Any,
                step: Optional[int]) -> Any:
  naming, steps, _ = orbax_root.read_steps(root)
  if checkpoint is not None:
    step_dir = _orbax_step_of(root, steps, checkpoint, naming)
  else:
    if step is None:
      step = steps[-1] if steps else None
    if step not in steps:
      raise errors.CheckpointNotFoundError(
          f"{root}: no step {step} (steps: {steps})" if step is not None
          else f"No checkpoint found at {root}: an Orbax root with no "
          f"finished step{orbax_root.step_naming_hint(root)}")
    step_dir = naming.path(root, step)
  if kind == ORBAX:
    raise errors.CheckpointNotFoundError(
        f"{step_dir}: an Orbax step not written by clu-ckpt migrate; "
        "restore it with orbax.checkpoint.CheckpointManager")
  logging.info("load_state_dict: reading step %s of %s", step_dir, root)
  return orbax_read.read_state(step_dir, subtree)


def _orbax_step_of(root: str, steps: list[int], checkpoint: Any,
                   naming: orbax_root.StepNaming = orbax_root.PLAIN_STEPS
                   ) -> str:
  """The step directory `checkpoint=` names in a migrated root.

  A step (int or digits), a step directory, or the CLU checkpoint a step
  was migrated from (`ckpt-5`, or a path ending in it).
  """
  text = str(checkpoint)
  if isinstance(checkpoint, int) or text.isdecimal():
    if int(text) in steps:
      return naming.path(root, int(text))
  elif storage.isdir(text) and orbax_read.migration_metadata(text):
    return text
  else:
    name = text.rstrip("/").rsplit("/", 1)[-1]
    for s in reversed(steps):
      meta = orbax_read.migration_metadata(naming.path(root, s))
      if meta and meta.get("clu_checkpoint") == name:
        logging.info("load_state_dict: %s was migrated to step %d of %s",
                     name, s, root)
        return naming.path(root, s)
  raise errors.CheckpointNotFoundError(
      f"{root}: no step for checkpoint={checkpoint!r} (steps: {steps}; a "
      "step, a step directory or the CLU checkpoint name a step was "
      "migrated from, e.g. 'ckpt-5')")


# --------------------------------------------------------------------------
# flax.training.checkpoints.
# --------------------------------------------------------------------------


def _read_flax_training(directory: str, prefix: str, subtree: Subtree,
                        checkpoint: Any, step: Optional[int]) -> Any:
  steps = flax_training.list_steps(directory, prefix)
  if checkpoint is not None:
    text = str(checkpoint)
    number = flax_training.split_name(text, prefix)
    if isinstance(checkpoint, int) or text.isdecimal():
      step = int(text)
    elif storage.exists(text) and not storage.isdir(text):
      return flax_format.load_file(text, subtree=subtree)
    elif number is not None and number in steps:
      step = number
    else:
      raise errors.CheckpointNotFoundError(
          _not_found(text, text, directory) + f" (steps in {directory}: "
          f"{list(steps)})")
  if step is None:
    step = max(steps)
  if step not in steps:
    raise errors.CheckpointNotFoundError(
        f"{directory}: no {prefix}{step} (steps: {list(steps)})")
  logging.info("load_state_dict: reading %s (flax.training.checkpoints)",
               steps[step])
  return flax_format.load_file(steps[step], subtree=subtree)
