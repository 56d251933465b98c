"""What a checkpoint directory holds, and whether it is sound: `inspect`, `verify`.

Works from file names, TensorFlow's `checkpoint` state file and the `.flax`
headers only: no TensorFlow, no JAX, and no array bytes are read by `inspect`.

Synopsis::

  from clu_ckpt import inspection

  report = inspection.inspect_path("/work/ckpts")      # a dict, JSON-ready
  print(inspection.format_inspect(report))
  problems = inspection.verify_path("/work/ckpts")["problems"]   # [] if sound

Nothing outside the directory is read on its behalf: checkpoints that
TensorFlow's `checkpoint` file lists elsewhere (absolute paths, `..`), and
files that are symlinks leading out of the directory, are reported as
problems and not read; so are files that are not regular files.

Paths understood: a `Checkpoint` base directory, a `MultihostCheckpoint` base
(`<base>-0`, `<base>-1`, ... beside it), a single `.flax` file, and an Orbax
CheckpointManager root written by `clu-ckpt migrate` (read from Orbax's JSON
metadata files; Orbax itself is not imported).
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import re
from typing import Any, Optional

from clu_ckpt import flax_format
from clu_ckpt import errors
from clu_ckpt import layout
from clu_ckpt.checkpoint import host_directories
from clu_ckpt import storage

_FLAX_RE = re.compile(r"^(?P<name>.+)-(?P<number>\d+)\.flax$")


# --------------------------------------------------------------------------
# Finding checkpoints.
# --------------------------------------------------------------------------


def read_state(directory: str, problems: list) -> Optional[Any]:
  """TensorFlow's state of `directory`, its listed paths contained.

  Args:
    directory: A `Checkpoint` base directory.
    problems: Gets a sentence for an unreadable or unparsable `checkpoint`
      file and for each listed checkpoint outside `directory`.

  Returns:
    The `storage.CheckpointState` with only the entries inside `directory`
    (`model_checkpoint_path` is None when the latest is elsewhere), or None.
  """
  try:
    state = storage.read_checkpoint_state(directory, strict=True)
  except (OSError, ValueError) as e:
    problems.append(str(e))
    return None
  if state is None:
    return None
  state_file = storage.join(directory, storage.STATE_FILENAME)
  inside = []
  for path in dict.fromkeys(state.all_model_checkpoint_paths +
                            [state.model_checkpoint_path]):
    if layout.is_contained(directory, path):
      inside.append(path)
    else:
      problems.append(f"{state_file}: lists {path}, which is outside "
                      f"{directory}; refused")
  state.all_model_checkpoint_paths = [
      p for p in state.all_model_checkpoint_paths if p in inside]
  if state.model_checkpoint_path not in inside:
    state.model_checkpoint_path = None
  return state


def _readable(directory: str, name: str, problems: list) -> bool:
  """Whether `directory/name` may be read: inside, and a regular file."""
  path = storage.join(directory, name)
  try:
    layout.check_inside(directory, path)
    storage.check_regular_file(path)
  except (OSError, ValueError) as e:
    problems.append(str(e))
    return False
  return True


def list_checkpoints(directory: str,
                     problems: Optional[list] = None) -> list[dict[str, Any]]:
  """Every numbered `.flax` in a CLU directory, committed or not.

  Args:
    directory: A `Checkpoint` base directory.
    problems: Gets a sentence for each file that cannot be read: a symlink
      leading outside `directory`, not a regular file, unreadable; such a
      checkpoint is listed with `readable` False. Also see `read_state`.

  Returns:
    One dict per `<name>-<number>.flax`, sorted by name and number: `name`,
    `number`, `prefix` (path without extension), `committed` (listed in TF's
    `checkpoint` file with its `.index` present), `latest`, `flax_bytes`,
    `tf_bytes`, `mtime` (ISO 8601, UTC), `tf_files` and `readable`.
  """
  problems = [] if problems is None else problems
  state = read_state(directory, problems)
  committed = set(state.all_model_checkpoint_paths) if state else set()
  if state and state.model_checkpoint_path:
    committed.add(state.model_checkpoint_path)
  latest = state.model_checkpoint_path if state else None
  files = storage.listdir(directory)
  out = []
  for name in files:
    m = _FLAX_RE.match(name)
    if m is None:
      continue
    prefix = storage.join(directory, name[:-len(".flax")])
    stem = name[:-len(".flax")]
    tf_files = sorted(f for f in files
                      if f == f"{stem}.index" or f.startswith(f"{stem}.data-"))
    readable = all([_readable(directory, f, problems)
                    for f in [name] + tf_files])
    size = tf_bytes = 0
    mtime = 0.0
    if readable:
      size, mtime = storage.stat(storage.join(directory, name))
      tf_bytes = sum(storage.stat(storage.join(directory, f))[0]
                     for f in tf_files)
    out.append(dict(readable=readable,
        name=m.group("name"), number=int(m.group("number")), prefix=prefix,
        committed=prefix in committed and f"{stem}.index" in tf_files,
        latest=prefix == latest, flax_bytes=size, tf_bytes=tf_bytes,
        mtime=_iso(mtime), tf_files=tf_files))
  return sorted(out, key=lambda c: (c["name"], c["number"]))


def _iso(t: float) -> str:
  return datetime.datetime.fromtimestamp(
      t, datetime.timezone.utc).isoformat(timespec="seconds")


def _step_of(flax_path: str) -> Optional[int]:
  """The state's integer top-level `step`, read from headers, or None."""
  try:
    step = flax_format.load_file(flax_path, subtree="step")
  except (flax_format.FlaxFormatError, OSError):
    return None
  if hasattr(step, "ndim") and getattr(step, "ndim", 1) == 0:
    step = step.item() if hasattr(step, "item") else step
  return step if isinstance(step, int) and not isinstance(step, bool) else None


# --------------------------------------------------------------------------
# inspect
# --------------------------------------------------------------------------


def tree_summary(flax_path: str) -> dict[str, Any]:
  """The leaves of a `.flax` file (headers only) with per-subtree totals.

  Args:
    flax_path: The file.

  Returns:
    `leaves` (path, kind, dtype, shape, bytes), `subtrees` (top-level key ->
    leaves, bytes) and `total_bytes`.

  Raises:
    flax_format.FlaxFormatError: The headers are corrupt.
  """
  leaves = flax_format.inspect_file(flax_path)
  subtrees: dict[str, dict[str, int]] = collections.OrderedDict()
  for leaf in leaves:
    top = leaf.path.split("/")[1] if leaf.path.count("/") >= 1 else ""
    entry = subtrees.setdefault(top, {"leaves": 0, "bytes": 0})
    entry["leaves"] += 1
    entry["bytes"] += leaf.nbytes
  return dict(
      file=flax_path,
      leaves=[dict(path=l.path, kind=l.kind, dtype=l.dtype,
                   shape=list(l.shape) if l.shape is not None else None,
                   bytes=l.nbytes) for l in leaves],
      subtrees=subtrees,
      total_bytes=sum(l.nbytes for l in leaves))


def inspect_path(path: str, checkpoint: Optional[int] = None) -> dict[str, Any]:
  """Describes a CLU directory, multihost base or `.flax` file.

  Args:
    path: What to describe.
    checkpoint: For directories, the checkpoint number whose tree to show
      (default: the latest committed one).

  Returns:
    A JSON-ready dict: `kind` ("flax_file", "checkpoint_dir",
    "multihost"), `checkpoints` (number, step, bytes, time, hosts, committed)
    and `tree` (see `tree_summary`) for the chosen checkpoint, and
    `problems`: sentences naming what was refused or could not be read
    (entries outside the directory, files that are not regular files).

  Raises:
    FileNotFoundError: Nothing checkpoint-like at `path`.
    OSError: `path` is not a regular file or directory, or cannot be read.
    flax_format.FlaxFormatError: The chosen `.flax` is corrupt.
  """
  if storage.exists(path) and not storage.isdir(path):
    storage.check_regular_file(path)
    return dict(kind="flax_file", path=path, tree=tree_summary(path),
                problems=[])
  if is_orbax_root(path):
    return inspect_orbax_root(path, checkpoint)
  hosts = host_directories(path)
  if storage.isdir(path) and (_has_checkpoints(path) or not hosts):
    hosts = {None: path}
  elif not hosts:
    raise errors.CheckpointNotFoundError(f"No CLU checkpoint directory, multihost base or "
                            f".flax file at {path}")
  rows: dict[tuple, dict[str, Any]] = {}
  problems: list[str] = []
  for host, directory in hosts.items():
    for c in list_checkpoints(directory, problems):
      row = rows.setdefault((c["name"], c["number"]), dict(
          name=c["name"], number=c["number"], step=None, bytes=0,
          time=c["mtime"], hosts=[], committed_hosts=[], torn_hosts=[]))
      row["bytes"] += c["flax_bytes"] + c["tf_bytes"]
      row["time"] = max(row["time"], c["mtime"])
      row["hosts"].append(host)
      (row["committed_hosts"] if c["committed"] and c["readable"] else
       row["torn_hosts"]).append(host)
      if row["step"] is None and c["committed"] and c["readable"]:
        row["step"] = _step_of(c["prefix"] + ".flax")
  checkpoints = [rows[k] for k in sorted(rows)]
  for row in checkpoints:
    row["committed"] = (not row["torn_hosts"] and
                        len(row["committed_hosts"]) == len(hosts))
  chosen = _choose(checkpoints, checkpoint)
  tree = None
  if chosen is not None:
    first_host = chosen["committed_hosts"][0] if chosen[
        "committed_hosts"] else chosen["hosts"][0]
    flax_path = storage.join(
        hosts[first_host], f"{chosen['name']}-{chosen['number']}.flax")
    layout.check_inside(hosts[first_host], flax_path)
    storage.check_regular_file(flax_path)
    tree = tree_summary(flax_path)
    tree["number"] = chosen["number"]
  return dict(kind="multihost" if None not in hosts else "checkpoint_dir",
              path=path, hosts=[h for h in hosts if h is not None],
              checkpoints=checkpoints, tree=tree, problems=problems)


def _has_checkpoints(directory: str) -> bool:
  files = storage.listdir(directory)
  return storage.STATE_FILENAME in files or any(_FLAX_RE.match(f)
                                                for f in files)


def _choose(checkpoints: list, number: Optional[int]) -> Optional[dict]:
  if number is not None:
    for row in checkpoints:
      if row["number"] == number:
        return row
    raise errors.CheckpointNotFoundError(f"No checkpoint number {number}")
  committed = [r for r in checkpoints if r["committed"]]
  return committed[-1] if committed else None


def format_inspect(report: dict[str, Any]) -> str:
  """A human-readable rendering of `inspect_path`'s report."""
  lines = []
  if report["kind"] == "orbax_root":
    return _format_orbax(report)
  if report["kind"] != "flax_file":
    hosts = report.get("hosts") or []
    lines.append(f"{report['path']}: " + (
        f"multihost base, {len(hosts)} hosts" if hosts else
        "checkpoint directory"))
    table = [("number", "step", "size", "written (UTC)", "hosts", "state")]
    for row in report["checkpoints"]:
      state = "committed" if row["committed"] else (
          "torn" if row["torn_hosts"] else "partial")
      table.append((f"{row['name']}-{row['number']}",
                    "" if row["step"] is None else str(row["step"]),
                    _human(row["bytes"]), row["time"].replace("+00:00", ""),
                    ",".join("-" if h is None else str(h)
                             for h in row["hosts"]), state))
    lines += _table(table)
    lines.append("")
  tree = report.get("tree")
  if tree:
    lines.append(f"tree of {tree['file']}:")
    table = [("path", "dtype", "shape", "bytes")]
    for leaf in tree["leaves"]:
      table.append((leaf["path"], leaf["dtype"] or leaf["kind"],
                    "" if leaf["shape"] is None else
                    str(tuple(leaf["shape"])),
                    _human(leaf["bytes"])))
    lines += _table(table)
    lines.append("")
    table = [("subtree", "leaves", "bytes")]
    for key, entry in tree["subtrees"].items():
      table.append(("/" + key, str(entry["leaves"]), _human(entry["bytes"])))
    table.append(("total", str(len(tree["leaves"])),
                  _human(tree["total_bytes"])))
    lines += _table(table)
  for problem in report.get("problems") or []:
    lines.append(f"PROBLEM: {problem}")
  return "\n".join(lines)


def _table(rows: list[tuple]) -> list[str]:
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  out = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
         for r in rows]
  out.insert(1, "  ".join("-" * w for w in widths))
  return out


def _human(n: int) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if n < 1024 or unit == "TiB":
      return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return str(n)


# --------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------


def verify_path(path: str) -> dict[str, Any]:
  """Checks that every committed checkpoint at `path` is sound.

  Checked: every committed `.flax` decodes completely (every header, every
  length, every chunk); its TensorFlow `.index` and all `.data-K-of-N` shards
  are present; in a multihost base, the hosts have a checkpoint in common and
  hold the same tree (paths, dtypes, shapes) for each common number.

  Args:
    path: A CLU directory, multihost base or `.flax` file.

  Returns:
    `ok` (bool), `checked` (number of files decoded) and `problems` (list of
    sentences, each naming the file).
  """
  problems: list[str] = []
  checked = 0
  if storage.exists(path) and not storage.isdir(path):
    return _verify_flax(path, problems, 0)
  if is_orbax_root(path):
    return verify_orbax_root(path)
  hosts = host_directories(path)
  if storage.isdir(path) and (_has_checkpoints(path) or not hosts):
    hosts = {None: path}
  elif not hosts:
    return dict(ok=False, checked=0, problems=[
        f"{path}: no CLU checkpoint directory or multihost base here"])
  trees: dict[int, dict[Any, list]] = collections.defaultdict(dict)
  numbers: dict[Any, set] = {}
  for host, directory in hosts.items():
    found = [c for c in list_checkpoints(directory, problems)
             if c["committed"] and c["readable"]]
    state = read_state(directory, [])  # its problems are reported above
    listed = set(state.all_model_checkpoint_paths) if state else set()
    if state and state.model_checkpoint_path:
      listed.add(state.model_checkpoint_path)
    for prefix in sorted(listed):
      if not storage.exists(prefix + ".flax"):
        problems.append(f"{prefix}.flax: missing for a checkpoint listed in "
                        f"{storage.join(directory, storage.STATE_FILENAME)}")
      elif not storage.exists(prefix + ".index"):
        problems.append(f"{prefix}.index: missing (TensorFlow files of a "
                        "committed checkpoint)")
    numbers[host] = {c["number"] for c in found}
    for c in found:
      checked += 1
      leaves = _decode_fully(c["prefix"] + ".flax", problems)
      if leaves is not None:
        trees[c["number"]][host] = leaves
      _check_tf_shards(directory, c, problems)
  if None not in hosts:
    _check_hosts(path, hosts, numbers, trees, problems)
  if not checked:
    problems.append(f"{path}: no committed checkpoint found")
  return dict(ok=not problems, checked=checked, problems=problems)


def _verify_flax(path: str, problems: list, checked: int) -> dict[str, Any]:
  try:
    storage.check_regular_file(path)
  except OSError as e:
    problems.append(str(e))
    return dict(ok=False, checked=checked, problems=problems)
  _decode_fully(path, problems)
  return dict(ok=not problems, checked=checked + 1, problems=problems)


def _decode_fully(flax_path: str, problems: list) -> Optional[list]:
  try:
    flax_format.load_file(flax_path)
    return [(l.path, l.dtype, l.shape) for l in
            flax_format.inspect_file(flax_path)]
  except flax_format.FlaxFormatError as e:
    problems.append(str(e))
  except OSError as e:
    problems.append(f"{flax_path}: cannot be read: {e}")
  return None


def _check_tf_shards(directory: str, c: dict, problems: list) -> None:
  shards = [f for f in c["tf_files"] if ".data-" in f]
  if not shards:
    problems.append(f"{c['prefix']}.data-*: no TensorFlow data file")
    return
  m = re.search(r"\.data-\d+-of-(\d+)$", shards[0])
  expected = int(m.group(1)) if m else len(shards)
  for k in range(expected):
    name = f"{os.path.basename(c['prefix'])}.data-{k:05d}-of-{expected:05d}"
    if name not in c["tf_files"]:
      problems.append(f"{storage.join(directory, name)}: missing TensorFlow "
                      "data shard")


def _check_hosts(path: str, hosts: dict, numbers: dict, trees: dict,
                 problems: list) -> None:
  common = set.intersection(*numbers.values()) if numbers else set()
  if not common:
    problems.append(f"{path}: the {len(hosts)} host directories have no "
                    "committed checkpoint number in common")
    return
  for number in sorted(common):
    by_host = trees.get(number, {})
    reference = next(iter(by_host.items()), None)
    for host, leaves in by_host.items():
      if reference is not None and leaves != reference[1]:
        problems.append(
            f"{hosts[host]}: checkpoint {number} holds a different tree than "
            f"{hosts[reference[0]]} (paths, dtypes or shapes differ)")


# --------------------------------------------------------------------------
# Orbax CheckpointManager roots (as written by `clu-ckpt migrate`).
# --------------------------------------------------------------------------

_ORBAX_STEP_METADATA = "_CHECKPOINT_METADATA"
_ORBAX_TMP = ".orbax-checkpoint-tmp"


def is_orbax_root(path: str) -> bool:
  """True when `path` holds Orbax step directories (`<int>/` or tmp ones)."""
  if not storage.isdir(path):
    return False
  for name in storage.listdir(path):
    step = name.split(".", 1)[0]
    if step.isdigit() and (name == step or _ORBAX_TMP in name) and (
        storage.isdir(storage.join(path, name))):
      return True
  return False


def _orbax_steps(root: str) -> tuple[list[int], list[str]]:
  """(finished step numbers, names of unfinished temporary step dirs)."""
  steps, partial = [], []
  for name in storage.listdir(root):
    if name.isdigit() and storage.isdir(storage.join(root, name)):
      steps.append(int(name))
    elif _ORBAX_TMP in name:
      partial.append(name)
  return sorted(steps), partial


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
  numbers, partial = _orbax_steps(root)
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
  dtype = flax_format._dtype_from_name(  # pylint: disable=protected-access
      str(leaf["dtype"]).encode())
  count = 1
  for dim in leaf["shape"]:
    count *= int(dim)
  return 0 if dtype is None else count * dtype.itemsize


def _format_orbax(report: dict) -> str:
  lines = [f"{report['path']}: Orbax CheckpointManager root"]
  table = [("step", "items", "size", "committed (UTC)", "from")]
  for row in report["steps"]:
    table.append((str(row["step"]), ",".join(row["items"]),
                  _human(row["bytes"]),
                  (row["time"] or "").replace("+00:00", ""),
                  row["clu_checkpoint"] or ""))
  lines += _table(table)
  for name in report["partial"]:
    lines.append(f"unfinished (ignored by Orbax): {name}")
  tree = report.get("tree")
  if tree and tree["leaves"]:
    lines.append("")
    lines.append(f"tree of step {tree['number']} (from its metadata item):")
    rows = [("path", "dtype", "shape", "bytes")]
    for leaf in tree["leaves"]:
      rows.append((leaf["path"] or "", leaf["dtype"] or leaf["kind"] or "",
                   "" if leaf["shape"] is None else str(tuple(leaf["shape"])),
                   _human(leaf["bytes"])))
    lines += _table(rows)
  return "\n".join(lines)


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
  numbers, partial = _orbax_steps(root)
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
  hosts = host_directories(source)
  directory = source if not hosts or _has_checkpoints(source) else hosts[
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
