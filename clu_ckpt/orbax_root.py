"""What an Orbax CheckpointManager root holds, from its files alone.

`clu-ckpt inspect` and `verify` describe Orbax roots (migrated ones and native
ones) without importing Orbax, TensorStore or JAX: step directories are listed
by name, and each step's JSON metadata (`_CHECKPOINT_METADATA`, the migration's
`metadata` item, a PyTree item's `_METADATA`) is read as JSON. This is the
one module that knows those file names and the one listing of an Orbax root's
steps (`list_steps`, with Orbax's step naming options `step_prefix` and
`step_format_fixed_length`: `step_name`); the migration package uses it too.

Synopsis::

  from clu_ckpt import orbax_root

  orbax_root.is_orbax_root("/runs/a/orbax")                    # True
  steps, partial = orbax_root.list_steps("/runs/a/orbax")      # [100, 200], []
  report = orbax_root.inspect_orbax_root("/runs/a/orbax")
  result = orbax_root.verify_orbax_root("/runs/a/orbax", source="/runs/a/ckpts")
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import re
from typing import Optional

from clu_ckpt import errors
from clu_ckpt import flax_format
from clu_ckpt import layout
from clu_ckpt import storage


def _iso(t: float) -> str:
  return datetime.datetime.fromtimestamp(
      t, datetime.timezone.utc).isoformat(timespec="seconds")


_ORBAX_STEP_METADATA = "_CHECKPOINT_METADATA"
ORBAX_TMP_MARKER = ".orbax-checkpoint-tmp"
_COMMIT_SUCCESS = "commit_success.txt"
# Characters a step prefix may not hold: "/" (Orbax would write the step into
# a subdirectory, which it never lists), NUL, and those Orbax's own listing
# reads as regular expression syntax (it matches `^<prefix>_<digits>$`
# without escaping the prefix, so it would not find the steps it wrote).
_PREFIX_FORBIDDEN = frozenset("/\0\\^$*+?{}[]()|")


def check_step_naming(step_prefix: Optional[str] = None,
                      step_format_fixed_length: Optional[int] = None) -> None:
  """Raises unless Orbax names and finds steps with these options.

  They mean what `orbax.checkpoint.CheckpointManagerOptions`'s fields of the
  same names mean: step 7 is `<step_prefix>_7`, zero-padded to
  `step_format_fixed_length` digits (`step_0007`). Orbax accepts every
  string and integer, but with a prefix holding "/" or regular expression
  syntax ("a+", "x(1)") a `CheckpointManager` lists none of the steps it
  wrote, and a negative length fails its first save; those are refused here.
  An empty prefix ("_7") and length 0 (no padding) work in Orbax and are
  accepted.

  Args:
    step_prefix: None (step 7 is "7"), or the prefix.
    step_format_fixed_length: None or 0 (no padding), or the digit count.

  Raises:
    UsageError: A prefix or length Orbax cannot use (the message says why).
  """
  if step_prefix is not None:
    if not isinstance(step_prefix, str):
      raise errors.UsageError(
          f"step prefix {step_prefix!r}: must be a string")
    bad = sorted(set(step_prefix) & _PREFIX_FORBIDDEN)
    if bad:
      raise errors.UsageError(
          f"step prefix {step_prefix!r}: may not contain {''.join(bad)!r} "
          "(Orbax puts the prefix in a directory name and matches it as a "
          "regular expression: its CheckpointManager would not list these "
          "steps)")
  if step_format_fixed_length is not None and (
      isinstance(step_format_fixed_length, bool) or
      not isinstance(step_format_fixed_length, int) or
      step_format_fixed_length < 0):
    raise errors.UsageError(
        f"step format fixed length {step_format_fixed_length!r}: must be a "
        "non-negative integer (the number of digits steps are zero-padded "
        "to; 0 or None: no padding)")


def step_name(step: int, step_prefix: Optional[str] = None,
              step_format_fixed_length: Optional[int] = None) -> str:
  """The directory name Orbax gives `step` under these naming options.

  Example::

    step_name(7)                                # "7"
    step_name(7, "step", 4)                     # "step_0007"

  Args:
    step: A non-negative step.
    step_prefix: As in `CheckpointManagerOptions` (None: no prefix).
    step_format_fixed_length: As in `CheckpointManagerOptions`.

  Returns:
    The name.

  Raises:
    UsageError: See `check_step_naming`.
  """
  check_step_naming(step_prefix, step_format_fixed_length)
  digits = str(step).zfill(step_format_fixed_length or 0)
  return digits if step_prefix is None else f"{step_prefix}_{digits}"


def _step_pattern(step_prefix: Optional[str],
                  step_format_fixed_length: Optional[int]) -> re.Pattern:
  """The names Orbax's standard name format reads as steps.

  Unpadded: a number without leading zeros. Padded to n digits: exactly n
  digits starting with 0, or n or more starting with 1-9. `\\d` and `$` as
  Orbax has them (any Unicode digit; `$` also before a final newline).
  """
  n = step_format_fixed_length or 0
  digits = (rf"0\d{{{n - 1}}}|[1-9]\d{{{n - 1},}}" if n > 0
            else r"0|[1-9]\d*")
  prefix = "" if step_prefix is None else re.escape(step_prefix) + "_"
  return re.compile(rf"^{prefix}({digits})$")


def is_orbax_root(path: str) -> bool:
  """True when `path` holds Orbax step directories (`<int>/` or tmp ones)."""
  if not storage.isdir(path):
    return False
  for name in storage.listdir(path):
    step = name.split(".", 1)[0]
    if step.isdigit() and (name == step or ORBAX_TMP_MARKER in name) and (
        storage.isdir(storage.join(path, name))):
      return True
  return False


def list_steps(root: str, *, step_prefix: Optional[str] = None,
               step_format_fixed_length: Optional[int] = None
               ) -> tuple[list[int], list[str]]:
  """(finished steps, names of unfinished step directories) under `root`.

  The steps are those `orbax.checkpoint.CheckpointManager(root, options)`
  lists (`all_steps()`, from `standard_name_format(...).find_all`), for
  options with this `step_prefix` and `step_format_fixed_length`:
  directories named `[<prefix>_]<step>` (see `step_name`; unpadded: no
  leading zeros; padded to n: n digits, or more without leading zeros), not
  being written (no `.orbax-checkpoint-tmp` in their name; on `gs://` roots,
  holding `commit_success.txt`). Other names are ignored, as Orbax ignores
  them. Unfinished entries are every name holding `.orbax-checkpoint-tmp`
  (whatever its prefix: Orbax's `cleanup_tmp_directories` removes them
  all) and, on `gs://`, step directories without `commit_success.txt`.
  Orbax is not imported.

  Args:
    root: An Orbax root directory: a path (relative ones are made absolute),
      a `file://` URL or another URL (a missing root has no steps).
    step_prefix: As in `CheckpointManagerOptions` (None: no prefix).
    step_format_fixed_length: As in `CheckpointManagerOptions`.

  Returns:
    (sorted step numbers, sorted names of temporary or uncommitted entries).

  Raises:
    UsageError: An empty root, or naming options Orbax cannot use (see
      `check_step_naming`).
  """
  check_step_naming(step_prefix, step_format_fixed_length)
  root = layout.absolute(root)
  if not storage.exists(root) or not storage.isdir(root):
    return [], []
  pattern = _step_pattern(step_prefix, step_format_fixed_length)
  remote = root.startswith("gs://")
  steps, partial = [], []
  for name in storage.listdir(root):
    name = name.rstrip("/")
    match = pattern.match(name)
    if ORBAX_TMP_MARKER in name:
      partial.append(name)
    elif match and storage.isdir(storage.join(root, name)):
      if remote and not storage.exists(storage.join(root, name,
                                                    _COMMIT_SUCCESS)):
        partial.append(name)
      else:
        steps.append(int(match.group(1)))
  return sorted(steps), sorted(partial)


def _read_json(path: str) -> Optional[dict]:
  try:
    value = json.loads(storage.read_bytes(path))
  except (OSError, ValueError):
    return None
  return value if isinstance(value, dict) else None


def _directory_bytes(path: str) -> int:
  if storage.is_local(path):
    return sum(os.path.getsize(os.path.join(d, f))
               for d, _, files in os.walk(path) for f in files)
  return sum(storage.stat(p)[0] for p in storage.glob(f"{path}/**"))


def inspect_orbax_root(root: str, step: Optional[int] = None) -> dict:
  """Describes an Orbax CheckpointManager root from its JSON metadata only.

  Args:
    root: The root directory.
    step: The step whose tree to show (default: the latest).

  Returns:
    A JSON-ready dict: `kind` "orbax_root", `steps` (step, items, bytes,
    time, the CLU checkpoint it was migrated from), `partial` (unfinished
    temporary step directories) and `tree` (from the `metadata` item's leaf
    summary) for the chosen step.
  """
  numbers, partial = list_steps(root)
  rows = []
  for number in numbers:
    directory = storage.join(root, str(number))
    meta = _read_json(storage.join(directory, _ORBAX_STEP_METADATA)) or {}
    clu = _read_json(storage.join(directory, "metadata", "metadata")) or {}
    stamp = meta.get("commit_timestamp_nsecs")
    rows.append(dict(
        step=number, items=sorted(meta.get("item_handlers") or {}),
        bytes=_directory_bytes(directory),
        time=_iso(stamp / 1e9) if stamp else None,
        clu_checkpoint=clu.get("clu_checkpoint"), source=clu.get("source"),
        hosts=clu.get("hosts")))
  if step is not None and step not in numbers:
    raise errors.CheckpointNotFoundError(f"No step {step} in {root}")
  chosen = step if step is not None else (numbers[-1] if numbers else None)
  tree = None
  if chosen is not None:
    leaves = _orbax_leaves(storage.join(root, str(chosen)))
    subtrees: dict[str, dict[str, int]] = collections.OrderedDict()
    for leaf in leaves:
      entry = subtrees.setdefault((leaf["path"] or "/").split("/")[1],
                                  {"leaves": 0, "bytes": 0})
      entry["leaves"] += 1
      entry["bytes"] += leaf["bytes"]
    tree = dict(file=storage.join(root, str(chosen)), number=chosen,
                leaves=leaves, subtrees=subtrees,
                total_bytes=sum(l["bytes"] for l in leaves))
  return dict(kind="orbax_root", path=root, steps=rows, partial=partial,
              tree=tree)


def _orbax_leaves(step_dir: str) -> list[dict]:
  """Leaves of a step: the migration's summary, else Orbax's `state` tree."""
  clu = _read_json(storage.join(step_dir, "metadata", "metadata")) or {}
  if clu.get("leaves"):
    return [dict(path=l.get("path"), kind=l.get("kind"), dtype=l.get("dtype"),
                 shape=l.get("shape"), bytes=_leaf_bytes(l))
            for l in clu["leaves"]]
  tree = (_read_json(storage.join(step_dir, "state", "_METADATA")) or
          {}).get("tree_metadata") or {}
  leaves = []
  for entry in tree.values():
    keys = [str(k.get("key")) for k in entry.get("key_metadata") or []]
    value = entry.get("value_metadata") or {}
    leaves.append(dict(path="/" + "/".join(keys),
                       kind=value.get("value_type"), dtype=None,
                       shape=value.get("write_shape"), bytes=0))
  return leaves


def _leaf_bytes(leaf: dict) -> int:
  if leaf.get("shape") is None or leaf.get("dtype") is None:
    return 0
  try:
    dtype = flax_format.dtype_from_name(str(leaf["dtype"]))
  except (TypeError, ValueError):
    return 0
  count = 1
  for dim in leaf["shape"]:
    count *= int(dim)
  return count * dtype.itemsize


def verify_orbax_root(root: str, source: Optional[str] = None) -> dict:
  """Checks the structure of an Orbax root, optionally against its source.

  Every step must have Orbax's step metadata and, for each item it lists, an
  item directory with its own metadata; unfinished temporary step
  directories are reported (Orbax ignores them, a re-run of the migration
  replaces them). With `source`, each migrated step's leaf summary (paths,
  dtypes, shapes) must equal the headers of the CLU `.flax` it came from.
  Array values are compared by `clu-ckpt migrate --verify`, which reads
  them back through Orbax.

  Args:
    root: The Orbax root.
    source: The CLU directory (or multihost base) it was migrated from.

  Returns:
    `ok`, `checked` (steps) and `problems` (sentences naming the files).
  """
  problems: list[str] = []
  compared = 0
  numbers, partial = list_steps(root)
  for name in partial:
    problems.append(f"{storage.join(root, name)}: unfinished step directory "
                    "(an interrupted save or migration)")
  for number in numbers:
    directory = storage.join(root, str(number))
    meta = _read_json(storage.join(directory, _ORBAX_STEP_METADATA))
    if meta is None:
      problems.append(f"{storage.join(directory, _ORBAX_STEP_METADATA)}: "
                      "missing or not JSON")
      continue
    for item in meta.get("item_handlers") or {}:
      item_dir = storage.join(directory, item)
      if not storage.isdir(item_dir) or not storage.listdir(item_dir):
        problems.append(f"{item_dir}: item listed in the step metadata is "
                        "missing or empty")
    if source is not None and storage.exists(
        storage.join(directory, "metadata", "metadata")):
      compared += 1
      _compare_with_source(directory, source, problems)
  if source is not None and not compared:
    problems.append(f"{root}: no migrated step to compare with {source}")
  if not numbers:
    problems.append(f"{root}: no finished step")
  return dict(ok=not problems, checked=len(numbers), problems=problems)


def _compare_with_source(step_dir: str, source: str, problems: list) -> None:
  clu = _read_json(storage.join(step_dir, "metadata", "metadata"))
  if not clu or "clu_checkpoint" not in clu:
    problems.append(f"{step_dir}: no migration metadata to compare with "
                    f"{source}")
    return
  hosts = layout.source_directories(source)
  directory = source if None in hosts or not hosts else hosts[
      clu.get("state_host", min(hosts))]
  flax_path = storage.join(directory, f"{clu['clu_checkpoint']}.flax")
  try:
    expected = [(l.path, l.dtype, list(l.shape) if l.shape is not None else
                 None) for l in flax_format.inspect_file(flax_path)]
  except (OSError, flax_format.FlaxFormatError) as e:
    problems.append(f"{flax_path}: cannot be read to compare: {e}")
    return
  got = [(l.get("path"), l.get("dtype"), l.get("shape"))
         for l in clu.get("leaves") or []]
  if got != expected:
    problems.append(f"{step_dir}: leaves differ from {flax_path} (paths, "
                    "dtypes or shapes)")
