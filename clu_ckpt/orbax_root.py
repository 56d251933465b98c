"""What an Orbax CheckpointManager root holds, from its files alone.

`clu-ckpt inspect` and `verify` describe Orbax roots (migrated ones and native
ones) without importing Orbax, TensorStore or JAX: step directories are listed
by name, and each step's JSON metadata (`_CHECKPOINT_METADATA`, the migration's
`metadata` item, a PyTree item's `_METADATA`) is read as JSON. The one
exception: the tree of a native Orbax step (`inspect`'s leaves) is read
through Orbax when it is installed. This is the
one module that knows those file names and the one listing of an Orbax root's
steps (`list_steps`, with Orbax's step naming options `step_prefix` and
`step_format_fixed_length`: `step_name`); the migration package uses it too.

Synopsis::

  from clu_ckpt import orbax_root

  orbax_root.is_orbax_root("/runs/a/orbax")                    # True
  steps, partial = orbax_root.list_steps("/runs/a/orbax")      # [100, 200], []
  # Steps named `step_0100` (a run's own `step_prefix`/padding): found.
  naming, steps, partial = orbax_root.read_steps("/runs/b/orbax")
  naming.path("/runs/b/orbax", steps[-1])            # ".../step_0200"
  report = orbax_root.inspect_orbax_root("/runs/a/orbax")
  result = orbax_root.verify_orbax_root("/runs/a/orbax", source="/runs/a/ckpts")
"""

from __future__ import annotations

import collections
import datetime
import os
import re
from typing import NamedTuple, Optional

from clu_ckpt import errors
from clu_ckpt import flax_format
from clu_ckpt import flax_training
from clu_ckpt import layout
from clu_ckpt import storage

_read_json = storage.read_json_object


def _iso(t: float) -> str:
  return datetime.datetime.fromtimestamp(
      t, datetime.timezone.utc).isoformat(timespec="seconds")


# Orbax's step metadata file (save time, items).
STEP_METADATA = "_CHECKPOINT_METADATA"
# `metadata["writer"]` of a step `Checkpoint(layout="orbax")` saved: its
# steps are CLU checkpoint numbers (a migration's steps name no writer).
CHECKPOINT_WRITER = "clu_ckpt.checkpoint"
ORBAX_TMP_MARKER = ".orbax-checkpoint-tmp"
# The `source_kind` a migration records for Flax's `checkpoint_<step>` files
# (`migration.plan.FLAX_TRAINING_KIND`).
_FLAX_TRAINING_KIND = "flax.training.checkpoints"
# On GCS Orbax writes a step under its final name and commits it by writing
# this file in it (and in each item) last: a step without it is not finished.
COMMIT_SUCCESS_FILE = "commit_success.txt"
_COMMIT_SUCCESS = COMMIT_SUCCESS_FILE
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


def commits_by_file(root: str) -> bool:
  """Whether Orbax commits steps under `root` by `commit_success.txt`
  instead of a rename (`gs://` roots, as Orbax's `is_gcs_path` decides)."""
  return root.startswith("gs://")


def is_orbax_root(path: str) -> bool:
  """True when `path` holds Orbax step directories (`<int>/` or tmp ones,
  or steps of one prefix or padding: `find_step_naming`)."""
  if not storage.isdir(path):
    return False
  names = storage.listdir(path)
  for name in names:
    step = name.split(".", 1)[0]
    if step.isdigit() and (name == step or ORBAX_TMP_MARKER in name) and (
        storage.isdir(storage.join(path, name))):
      return True
  return find_step_naming(path, [n.rstrip("/") for n in names]) != (
      PLAIN_STEPS)


_NAMED_STEP = re.compile(r"^(?:.+_\d+|0\d+)$")
# A step directory's name under some naming: `[<prefix>_]<digits>`.
_NAME_PARTS = re.compile(r"^(?:(.*)_)?([0-9]+)$")


class StepNaming(NamedTuple):
  """How an Orbax root names its step directories: the fields of
  `CheckpointManagerOptions` of the same names (`step_name`).

  Example::

    naming = find_step_naming("/runs/a/orbax")   # StepNaming("step", 4)
    naming.name(7)                               # "step_0007"
    list_steps("/runs/a/orbax", **naming._asdict())
  """
  step_prefix: Optional[str] = None
  step_format_fixed_length: Optional[int] = None

  def name(self, step: int) -> str:
    """The directory name of `step`."""
    return step_name(step, self.step_prefix, self.step_format_fixed_length)

  def path(self, root: str, step: int) -> str:
    """The directory of `step` under `root`."""
    return storage.join(root, self.name(step))

  def describe(self) -> str:
    """The options as a CLI gives them; "" for plain step numbers."""
    parts = []
    if self.step_prefix is not None:
      parts.append(f"--step-prefix={self.step_prefix}")
    if self.step_format_fixed_length:
      parts.append(
          f"--step-format-fixed-length={self.step_format_fixed_length}")
    return " ".join(parts)


PLAIN_STEPS = StepNaming()


def _names(root: str) -> list[str]:
  return [n.rstrip("/") for n in storage.listdir(root)]


def find_step_naming(root: str, names: Optional[list[str]] = None
                     ) -> StepNaming:
  """The naming of `root`'s steps, read from the names of its directories.

  Plain step numbers (`7`) when any entry is so named (what Orbax writes by
  default, and what a root of mixed names is read as). Otherwise the one
  naming that every entry named like a step shares: `step_0007` is prefix
  "step" padded to 4 digits, `ckpt_7` prefix "ckpt", `0007` padding alone;
  its newest such directory must hold Orbax's step metadata
  (`_CHECKPOINT_METADATA`), so that other directories named `<word>_<n>`
  (`run_1`, `run_2`) are not taken for steps. Entries of two namings, or
  padded to two lengths, are ambiguous: plain step numbers then, and
  `step_naming_hint` says why nothing is found. One listing of `root`
  (unless `names` are given) and one existence check.

  Example::

    find_step_naming("/runs/a/orbax")    # StepNaming("step", 4)
    find_step_naming("/runs/b/orbax")    # PLAIN_STEPS

  Args:
    root: An Orbax root (a path or URL).
    names: Its entries, when already listed.

  Returns:
    The naming; `PLAIN_STEPS` when there is none other to find.
  """
  try:
    if names is None:
      names = _names(layout.absolute(root))
  except (OSError, ValueError):
    return PLAIN_STEPS
  plain = _step_pattern(None, None)
  groups: dict[Optional[str], list[tuple[str, str]]] = {}
  for name in names:
    if ORBAX_TMP_MARKER in name:
      continue
    if plain.match(name):
      return PLAIN_STEPS
    parts = _NAME_PARTS.match(name)
    if parts:
      groups.setdefault(parts.group(1), []).append((name, parts.group(2)))
  if len(groups) != 1:
    return PLAIN_STEPS
  (prefix, entries), = groups.items()
  padded = {len(d) for _, d in entries if len(d) > 1 and d.startswith("0")}
  if len(padded) > 1:
    return PLAIN_STEPS
  try:
    naming = StepNaming(prefix, padded.pop() if padded else None)
    check_step_naming(*naming)
  except errors.UsageError:
    return PLAIN_STEPS  # a prefix Orbax itself could not list
  pattern = _step_pattern(*naming)
  numbered = [(int(d), n) for n, d in entries if pattern.match(n)]
  if not numbered:
    return PLAIN_STEPS
  newest = max(numbered)[1]
  try:
    if not storage.exists(storage.join(root, newest, STEP_METADATA)):
      return PLAIN_STEPS
  except (OSError, ValueError):
    return PLAIN_STEPS
  return naming


def step_naming_hint(path: str) -> str:
  """Why `path` may look like no Orbax root to the tools: directories
  named like steps of a prefix or a padding (`step_0004`, `0004`) that
  `find_step_naming` could not read as one root's steps (two namings, or
  no Orbax step metadata in the newest).

  Args:
    path: A directory.

  Returns:
    "" when no such name is there; else a sentence starting with "; ".
  """
  try:
    root = layout.absolute(path)
    named = [n for n in sorted(_names(root)) if _NAMED_STEP.match(n)]
    # Step directories only: Flax's own `checkpoint_<step>` files are not.
    if not named or not storage.isdir(storage.join(root, named[0])):
      return ""
  except (OSError, ValueError):
    return ""
  first = _prefix_of(named[0])
  other = next((n for n in named if _prefix_of(n) != first), None)
  which = (f"{named[0]!r} and {other!r} (two namings)" if other is not None
           else f"{named[0]!r} (a step prefix or a fixed length)")
  return (f"; its entries are named like {which}, which inspect, verify and "
          "load_state_dict do not read as one Orbax root's steps (they need "
          f"one naming, and Orbax's {STEP_METADATA} in the newest step): "
          "`clu-ckpt migrate --verify` with the same --step-prefix / "
          "--step-format-fixed-length checks such a root")


def _prefix_of(name: str) -> Optional[str]:
  parts = _NAME_PARTS.match(name)
  return parts.group(1) if parts else name


def read_steps(root: str) -> tuple[StepNaming, list[int], list[str]]:
  """`root`'s step naming (`find_step_naming`) and its steps under it.

  Example::

    naming, steps, partial = read_steps("/runs/a/orbax")
    newest = naming.path("/runs/a/orbax", steps[-1])

  Args:
    root: An Orbax root (a path or URL; a missing one has no steps).

  Returns:
    (naming, sorted finished steps, names of unfinished entries), as
    `list_steps` with that naming; one listing of `root`.
  """
  root = layout.absolute(root)
  if not storage.exists(root) or not storage.isdir(root):
    return PLAIN_STEPS, [], []
  names = _names(root)
  naming = find_step_naming(root, names)
  steps, partial = _steps_among(root, names, naming)
  return naming, steps, partial


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
  return _steps_among(root, _names(root),
                      StepNaming(step_prefix, step_format_fixed_length))


def _steps_among(root: str, names: list[str], naming: StepNaming
                 ) -> tuple[list[int], list[str]]:
  """`list_steps` of `root`, whose entries are `names`."""
  pattern = _step_pattern(*naming)
  remote = commits_by_file(root)
  steps, partial = [], []
  for name in names:
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


def _directory_bytes(path: str) -> int:
  if storage.is_local(path):
    return sum(os.path.getsize(os.path.join(d, f))
               for d, _, files in os.walk(path) for f in files)
  total = 0
  for entry in storage.glob(f"{storage.glob_escape(path)}/**"):
    try:
      total += storage.stat(entry)[0]
    except errors.NotRegularFileError:
      pass  # a subdirectory (a prefix in a bucket), or not a file
  return total


def _item_handlers(meta: dict) -> dict[str, str]:
  """Item name -> handler type name, as the step metadata records them."""
  handlers = meta.get("item_handlers")
  if isinstance(handlers, str):  # default-item mode of older Orbax versions
    return {"default": handlers}
  return {str(k): str(v) for k, v in (handlers or {}).items()}


def _step_items(directory: str, meta: dict) -> dict[str, str]:
  """The items a step holds: recorded in its metadata and present on disk.

  Without step metadata: its subdirectories, with unknown handlers ("").
  """
  recorded = _item_handlers(meta)
  if not meta:
    recorded = {name.rstrip("/"): "" for name in storage.listdir(directory)}
  return {name: handler for name, handler in sorted(recorded.items())
          if _item_inside(directory, name)
          and storage.isdir(storage.join(directory, name))}


def _item_inside(directory: str, name: str) -> bool:
  """Whether item `name` (read from disk) is a directory entry of the step
  that stays in it, symlinks followed: `../x` or a link elsewhere is not."""
  try:
    layout.check_inside(directory, storage.join(directory, name))
  except (errors.OutsideDirectoryError, OSError):
    return False
  return True


def inspect_orbax_root(root: str, step: Optional[int] = None) -> dict:
  """Describes an Orbax CheckpointManager root, migrated or native.

  Steps and items are read from Orbax's JSON metadata files. The tree of a
  migrated step comes from the migration's `metadata` item (no Orbax needed);
  the tree of a native step from Orbax's public metadata API (the recorded
  item handler's `metadata()`, see `item_leaves`), imported only
  then. Without Orbax installed, a native step's leaf paths are listed from
  its `_METADATA` file with dtype, shape and size unknown.

  Args:
    root: The root directory.
    step: The step whose tree to show (default: the latest).

  Returns:
    A JSON-ready dict: `kind` "orbax_root", `steps` (step, items, bytes,
    time, the CLU checkpoint it was migrated from), `partial` (unfinished
    temporary step directories), `tree` for the chosen step (`source`:
    "metadata item" or "orbax"; `leaves`, `subtrees`, `total_bytes`, None
    when unknown; `items`: item -> handler, leaf count and `unknown`, the
    reason its leaves are not described) and `problems` (metadata Orbax
    could not read).
  """
  naming, numbers, partial = read_steps(root)
  rows = []
  for number in numbers:
    directory = naming.path(root, number)
    meta = _read_json(storage.join(directory, STEP_METADATA)) or {}
    clu = _read_json(storage.join(directory, "metadata", "metadata")) or {}
    stamp = meta.get("commit_timestamp_nsecs")
    rows.append(dict(
        step=number, items=list(_step_items(directory, meta)),
        bytes=_directory_bytes(directory),
        time=_iso(stamp / 1e9) if stamp else None,
        clu_checkpoint=clu.get("clu_checkpoint"), source=clu.get("source"),
        hosts=clu.get("hosts")))
  if step is not None and step not in numbers:
    raise errors.CheckpointNotFoundError(
        f"No step {step} in {root} (steps: {numbers})"
        f"{_mapping_hint(root, numbers, step, naming)}")
  chosen = step if step is not None else (numbers[-1] if numbers else None)
  problems: list[str] = []
  tree = None
  if chosen is not None:
    tree = _step_tree(naming.path(root, chosen), problems)
    tree["number"] = chosen
  elif not numbers:
    hint = step_naming_hint(root)  # one listing, and only without steps
    if hint:
      problems.append(f"{root}: no finished step{hint}")
  return dict(kind="orbax_root", path=root, steps=rows, partial=partial,
              tree=tree, problems=problems,
              step_naming=naming.describe() or None)


def _mapping_hint(root: str, numbers: list[int], number: int,
                  naming: StepNaming = PLAIN_STEPS) -> str:
  """"; CLU checkpoint 7 (ckpt-7) became step 700" when the root's
  migration metadata maps checkpoint `number` to a step, else ""."""
  for step in reversed(numbers):
    clu = _read_json(storage.join(naming.path(root, step), "metadata",
                                  "metadata")) or {}
    mapping = clu.get("step_mapping")
    if isinstance(mapping, dict) and str(number) in mapping:
      name = str(clu.get("clu_checkpoint", "")).rsplit("-", 1)[0]
      return (f"; CLU checkpoint {number} ({name}-{number}) was migrated to "
              f"step {mapping[str(number)]}: ask for that step")
  return ""


def _step_tree(step_dir: str, problems: list) -> dict:
  """The tree of one step: migrated (its summary) or native (Orbax's)."""
  clu = _read_json(storage.join(step_dir, "metadata", "metadata")) or {}
  if clu.get("leaves"):
    leaves = [dict(path=l.get("path"), kind=l.get("kind"),
                   dtype=l.get("dtype"), shape=l.get("shape"),
                   bytes=_leaf_bytes(l)) for l in clu["leaves"]]
    return dict(file=step_dir, source="metadata item", leaves=leaves,
                subtrees=_subtrees(leaves, False),
                total_bytes=sum(l["bytes"] for l in leaves), items={})
  meta = _read_json(storage.join(step_dir, STEP_METADATA)) or {}
  leaves, items = [], {}
  for item, handler in _step_items(step_dir, meta).items():
    item_dir = storage.join(step_dir, item)
    found, unknown = item_leaves(item_dir, handler)
    if unknown and unknown.startswith("Orbax could not read"):
      problems.append(f"{item_dir}: {unknown}")
    items[item] = dict(handler=handler.rsplit(".", 1)[-1] or None,
                       leaves=None if found is None else len(found),
                       unknown=unknown)
    for leaf in found or []:
      leaves.append(dict(leaf, item=item))
  sizes = [l["bytes"] for l in leaves]
  return dict(file=step_dir, source="orbax", leaves=leaves,
              subtrees=_subtrees(leaves, True), items=items,
              total_bytes=None if None in sizes else sum(sizes))


# The public Orbax handlers whose `metadata()` describes an item's tree, by
# the class name `_CHECKPOINT_METADATA` records for the item.
_TREE_HANDLERS = ("StandardCheckpointHandler", "PyTreeCheckpointHandler")
ORBAX_MISSING = "Orbax is not installed: dtype, shape and size unknown"


def item_leaves(item_dir: str, handler: str
                ) -> tuple[Optional[list], Optional[str]]:
  """The leaves of one item of a native Orbax step, as Orbax records them.

  Read with Orbax's public API: a new `ocp.StandardCheckpointHandler` or
  `ocp.PyTreeCheckpointHandler` (whichever the step metadata names) and its
  `metadata(directory)`, which reads the item's metadata files (no array
  data). Orbax is imported here, not with this module. Without Orbax, the
  leaf paths are read from the item's `_METADATA` JSON with dtype, shape and
  size None.

  Args:
    item_dir: The item directory (`<root>/<step>/<item>`).
    handler: The handler type name recorded for it ("" if unknown).

  Returns:
    (leaves or None, None or why they are unknown). Each leaf: `path`,
    `kind` ("array", "scalar", "string", ...), `dtype` (a numpy name),
    `shape` (list), `bytes` (None when unknown).
  """
  name = handler.rsplit(".", 1)[-1]
  if name not in _TREE_HANDLERS:
    return None, (f"not a tree item (handler {name})" if name else
                  "no handler recorded")
  try:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    from etils import epath  # pylint: disable=g-import-not-at-top
  except ImportError:
    return _json_leaves(item_dir), ORBAX_MISSING
  reader = getattr(ocp, name)()
  try:
    metadata = reader.metadata(epath.Path(layout.absolute(item_dir)))
  except Exception as e:  # pylint: disable=broad-except
    return None, f"Orbax could not read its metadata: {type(e).__name__}: {e}"
  finally:
    reader.close()
  leaves: list[dict] = []
  _walk(getattr(metadata, "tree", metadata), [], leaves)
  return leaves, None


def _walk(node, keys: list, leaves: list) -> None:
  """Flattens Orbax's metadata tree (dicts, lists, tuples) into `leaves`."""
  if isinstance(node, dict):
    for key, value in node.items():
      _walk(value, keys + [str(key)], leaves)
  elif isinstance(node, (list, tuple)):
    for index, value in enumerate(node):
      _walk(value, keys + [str(index)], leaves)
  else:
    import numpy as np  # pylint: disable=g-import-not-at-top
    shape = getattr(node, "shape", None)
    dtype = getattr(node, "dtype", None)
    dtype = None if dtype is None else np.dtype(dtype)
    size = None
    if shape is not None and dtype is not None:
      size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    kind = type(node).__name__
    leaves.append(dict(
        path="/" + "/".join(keys),
        kind=kind[:-len("Metadata")].lower() if kind.endswith("Metadata")
        else kind,
        dtype=None if dtype is None else dtype.name,
        shape=None if shape is None else [int(d) for d in shape],
        bytes=size))


def _json_leaves(item_dir: str) -> Optional[list]:
  """Leaf paths from an item's `_METADATA` JSON; dtype, shape, size None."""
  tree = (_read_json(storage.join(item_dir, "_METADATA")) or {}).get(
      "tree_metadata")
  if not isinstance(tree, dict):
    return None
  leaves = []
  for entry in tree.values():
    keys = [str(k.get("key")) for k in entry.get("key_metadata") or []]
    leaves.append(dict(path="/" + "/".join(keys), kind=None, dtype=None,
                       shape=None, bytes=None))
  return leaves


def _subtrees(leaves: list, by_item: bool) -> dict:
  """Top-level key (`item/key` for native steps) -> leaves, bytes."""
  subtrees: dict[str, dict] = collections.OrderedDict()
  for leaf in leaves:
    top = (leaf["path"] or "/").split("/")[1]
    entry = subtrees.setdefault(f"{leaf['item']}/{top}" if by_item else top,
                                {"leaves": 0, "bytes": 0})
    entry["leaves"] += 1
    if entry["bytes"] is not None and leaf["bytes"] is not None:
      entry["bytes"] += leaf["bytes"]
    else:
      entry["bytes"] = None
  return subtrees


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
  dtypes, shapes) must equal the headers of the CLU `.flax` it came from,
  on every host, and each host must still hold that checkpoint's `.index`;
  a step whose checkpoint the source no longer holds on any host (CLU's
  `max_to_keep` pruned it as training went on) is noted, not a problem.
  Array values are compared by `clu-ckpt migrate --verify`, which reads
  them back through Orbax.

  Args:
    root: The Orbax root.
    source: The CLU directory or `MultihostCheckpoint` base it was
      migrated from (found by `plan.discover`; every host is compared).

  Returns:
    `ok`, `checked` (steps), `problems` (sentences naming the files) and
    `notes` (what was not compared, and why; not problems).
  """
  problems: list[str] = []
  notes: list[str] = []
  compared = 0
  naming, numbers, partial = read_steps(root)
  src = None if source is None else _discover(source, problems)
  for name in partial:
    problems.append(f"{storage.join(root, name)}: unfinished step directory "
                    "(an interrupted save or migration)")
  for number in numbers:
    directory = naming.path(root, number)
    meta = _read_json(storage.join(directory, STEP_METADATA))
    if meta is None:
      problems.append(f"{storage.join(directory, STEP_METADATA)}: "
                      "missing or not JSON")
      continue
    for item in _item_handlers(meta):
      item_dir = storage.join(directory, item)
      if not _item_inside(directory, item):
        problems.append(f"{item_dir}: item listed in the step metadata leads "
                        "out of the step; refused")
      elif not storage.isdir(item_dir) or not storage.listdir(item_dir):
        problems.append(f"{item_dir}: item listed in the step metadata is "
                        "missing or empty")
    if src is not None and storage.exists(
        storage.join(directory, "metadata", "metadata")):
      compared += 1
      _compare_with_source(directory, src, problems, notes)
  if src is not None and not compared:
    problems.append(f"{root}: no migrated step to compare with {source}")
  if not numbers:
    problems.append(f"{root}: no finished step{step_naming_hint(root)}")
  return dict(ok=not problems, checked=len(numbers), problems=problems,
              notes=notes)


class _Source:
  """A CLU source as `layout` sees it: its path and its host directories."""

  def __init__(self, path: str, host_directories: dict[int, str]):
    self.path = path
    self.host_directories = host_directories


def _discover(source: str, problems: list) -> Optional[_Source]:
  """The CLU source (a directory, or every host of a base), or None."""
  try:
    path = layout.absolute(source)
    directories = layout.source_directories(path)
  except (errors.CluCkptError, OSError, ValueError) as e:
    text = (str(e).splitlines() or [type(e).__name__])[0]
    problems.append(f"{source}: cannot be read as a CLU source: {text}")
    return None
  if not directories or (None in directories and not
                         layout.is_checkpoint_directory(path)):
    if storage.isdir(path) and flax_training.find_prefix(path):
      return _Source(path, {0: path})  # Flax's `checkpoint_<step>` files
    problems.append(f"{source}: cannot be read as a CLU source: no CLU "
                    "checkpoint here (no `checkpoint` file, and no "
                    f"`{os.path.basename(path)}-<host_id>` directories), "
                    "and no flax.training.checkpoints files")
    return None
  if None in directories:  # a single `Checkpoint` directory is host 0
    directories = {0: directories[None]}
  return _Source(path, dict(sorted(directories.items())))


def _pruned_from_source(clu: dict, suffix: str, src: _Source) -> bool:
  """Whether the checkpoint a step of `src` was migrated from is gone from
  every host of `src`: no `.flax`, no `.index` (CLU's `max_to_keep` removed
  it as training went on). A checkpoint some host still holds, or one of
  another source, is not: comparing it says what is wrong."""
  if clu.get("source") != src.path:
    return False
  name = clu["clu_checkpoint"]
  return not any(
      storage.exists(storage.join(directory, f"{name}{ext}"))
      for directory in src.host_directories.values()
      for ext in {suffix, ".index"})


def _compare_with_source(step_dir: str, src: _Source, problems: list,
                         notes: list) -> None:
  """Compares a migrated step's leaf summary with every source host's file.

  Every host directory of `src` must hold the `.flax` the
  step was migrated from, with the same leaves (paths, dtypes, shapes), and
  the step must have been migrated from the same hosts. A checkpoint the
  source no longer holds on any host (pruned since) is a note, not a
  problem: the step is its only copy, and deleting the source loses nothing
  of it.
  """
  clu = _read_json(storage.join(step_dir, "metadata", "metadata"))
  if not clu or "clu_checkpoint" not in clu:
    problems.append(f"{step_dir}: no migration metadata to compare with "
                    f"{src.path}")
    return
  host_ids = clu.get("host_ids")
  if host_ids is not None and list(host_ids) != list(src.host_directories):
    problems.append(
        f"{step_dir}: migrated from hosts {list(host_ids)}, but {src.path} "
        f"has hosts {list(src.host_directories)}")
  got = [(l.get("path"), l.get("dtype"), l.get("shape"))
         for l in clu.get("leaves") or []]
  # Flax's own files have no extension (`checkpoint_<step>`).
  suffix = "" if clu.get("source_kind") == _FLAX_TRAINING_KIND else ".flax"
  if _pruned_from_source(clu, suffix, src):
    notes.append(f"{step_dir}: {clu['clu_checkpoint']} is no longer in "
                 f"{src.path} (removed since the migration, as CLU's "
                 "max_to_keep does when training goes on): this step holds "
                 "its only copy; nothing to compare")
    return
  for directory in src.host_directories.values():
    flax_path = storage.join(directory, f"{clu['clu_checkpoint']}{suffix}")
    index_path = storage.join(directory, f"{clu['clu_checkpoint']}.index")
    if suffix and not storage.exists(index_path):
      problems.append(f"{index_path}: missing (TensorFlow files of the "
                      f"checkpoint {step_dir} was migrated from)")
    try:
      expected = [(l.path, l.dtype, list(l.shape) if l.shape is not None else
                   None) for l in flax_format.inspect_file(flax_path)]
    except (OSError, flax_format.FlaxFormatError) as e:
      problems.append(f"{flax_path}: cannot be read to compare: {e}")
      continue
    if got != expected:
      problems.append(f"{step_dir}: leaves differ from {flax_path} (paths, "
                      "dtypes or shapes)")


def saved_by_checkpoint(root: str, *, step_prefix: Optional[str] = None,
                        step_format_fixed_length: Optional[int] = None
                        ) -> bool:
  """Whether `root`'s newest step was saved by `Checkpoint(layout="orbax")`
  (its steps are CLU checkpoint numbers, from which that run resumes).

  Example::

    saved_by_checkpoint("/runs/a/checkpoints")   # True for such a run

  Args:
    root: An Orbax root (it need not exist).
    step_prefix: As in `CheckpointManagerOptions`.
    step_format_fixed_length: As in `CheckpointManagerOptions`.

  Returns:
    True when the newest step's `metadata` item names that writer.
  """
  if not storage.isdir(root):
    return False
  steps, _ = list_steps(root, step_prefix=step_prefix,
                        step_format_fixed_length=step_format_fixed_length)
  if not steps:
    return False
  meta = _read_json(storage.join(
      root, step_name(steps[-1], step_prefix, step_format_fixed_length),
      "metadata", "metadata")) or {}
  return meta.get("writer") == CHECKPOINT_WRITER
