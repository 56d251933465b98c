"""What a checkpoint directory holds, and whether it is sound: `inspect`, `verify`.

Works from file names, TensorFlow's `checkpoint` state file and the `.flax`
headers only: no TensorFlow, no JAX, and no array bytes are read by `inspect`
(a native Orbax root's tree is read through Orbax, imported then).

Synopsis::

  from clu_ckpt import inspection

  report = inspection.inspect_path("/work/ckpts")      # a dict, JSON-ready
  print(inspection.format_inspect(report))
  problems = inspection.verify_path("/work/ckpts")["problems"]   # [] if sound

Nothing outside the directory is read on its behalf: checkpoints that
TensorFlow's `checkpoint` file lists elsewhere (absolute paths, `..`), and
files that are symlinks leading out of the directory, are reported as
problems and not read; so are files that are not regular files.

Paths understood (the layouts `clu_ckpt.reader.detect_layouts` finds): a
`Checkpoint` base directory, a `MultihostCheckpoint` base (`<base>-0`,
`<base>-1`, ... beside it), a directory of `flax.training.checkpoints`
files (`checkpoint_<step>`, see `clu_ckpt.flax_training`), a single `.flax`
file, and an Orbax CheckpointManager root: one written by `clu-ckpt migrate`
(read from its JSON metadata files; Orbax is not imported) or a native one
(its items from Orbax's step metadata, its tree through Orbax's public
metadata API when Orbax is installed, else its leaf paths with dtype, shape
and size "unknown"; see `clu_ckpt.orbax_root`). A path holding none of them
is an error naming the layouts looked for. A file's tree is summarised
(`clu_ckpt.flax_summary`): every leaf counted, the first `LEAVES_SHOWN`
listed, so that a file of millions of leaves costs no more than loading it.

`inspect` of a directory checks every `.flax` file's headers: a damaged one
is listed as "damaged" and named in `problems` with what is wrong.
"""

from __future__ import annotations

import collections
import datetime
import math
import os
import re
from typing import Any, Callable, Optional

from clu_ckpt import flax_format
from clu_ckpt import flax_summary
from clu_ckpt import flax_training
from clu_ckpt import errors
from clu_ckpt import layout
from clu_ckpt import orbax_root
from clu_ckpt import reader
from clu_ckpt import storage

# How many leaves `inspect` lists (all are counted, per top-level key).
LEAVES_SHOWN = 1000



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
    The `layout.CheckpointState` with only the entries inside `directory`
    (`model_checkpoint_path` is None when the latest is elsewhere), or None.
  """
  try:
    state = layout.read_checkpoint_state(directory, strict=True)
  except (OSError, ValueError) as e:
    problems.append(str(e))
    return None
  if state is None:
    return None
  state_file = storage.join(directory, layout.STATE_FILENAME)
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
    `tf_bytes`, `mtime` (ISO 8601, UTC), `saved` (the save time TensorFlow
    recorded in its `checkpoint` file, ISO 8601, or None), `tf_files` and
    `readable`.
  """
  problems = [] if problems is None else problems
  recorded = _recorded_times(directory)
  state = read_state(directory, problems)
  committed = set(state.all_model_checkpoint_paths) if state else set()
  if state and state.model_checkpoint_path:
    committed.add(state.model_checkpoint_path)
  latest = state.model_checkpoint_path if state else None
  files = storage.listdir(directory)
  out = []
  for name in files:
    m = layout.FLAX_NAME_RE.match(name)
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
    saved = recorded.get(layout.normpath(prefix))
    out.append(dict(readable=readable,
        name=m.group("name"), number=int(m.group("number")), prefix=prefix,
        committed=prefix in committed and f"{stem}.index" in tf_files,
        latest=prefix == latest, flax_bytes=size, tf_bytes=tf_bytes,
        mtime=_iso(mtime), saved=None if saved is None else _iso(saved),
        tf_files=tf_files))
  return sorted(out, key=lambda c: (c["name"], c["number"]))


def _recorded_times(directory: str) -> dict[str, float]:
  """Checkpoint path -> the save time TensorFlow's `checkpoint` file records
  for it (`all_model_checkpoint_timestamps`, paired with the paths by
  position; the time a migration gives its step, too)."""
  try:
    state = layout.read_checkpoint_state(directory, strict=True)
  except (OSError, ValueError):
    return {}
  if state is None:
    return {}
  return {layout.normpath(p): float(t) for p, t in zip(
      state.all_model_checkpoint_paths, state.all_model_checkpoint_timestamps)
          if math.isfinite(t) and t >= 0}


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


def _step_from(cache: dict, flax_path: str) -> Optional[int]:
  """The state's integer top-level `step`, from the file's summary."""
  summary = cache.get(flax_path)
  if summary is None:
    return _step_of(flax_path)
  step = summary.step
  return step if isinstance(step, int) and not isinstance(step, bool) else None


_TEXT_PROBE = 48


def _summary(flax_path: str, cache: Optional[dict]) -> Any:
  """`flax_summary.summarize_file`, once per file and inspect call."""
  if cache is None:
    return flax_summary.summarize_file(flax_path, sample=LEAVES_SHOWN)
  if flax_path not in cache:
    cache[flax_path] = flax_summary.summarize_file(flax_path,
                                                   sample=LEAVES_SHOWN)
  return cache[flax_path]


def _damage(flax_path: str, cache: Optional[dict] = None) -> Optional[str]:
  """What is wrong with a `.flax` file's headers, in one sentence, or None.

  The sentence names the file and, where the format says so, the byte
  offset: "truncated at byte N", "not msgpack at byte N", and for a text file
  "not a Flax checkpoint: starts with text '...'" (msgpack would read its
  first character as a small integer and complain about what follows).
  """
  try:
    _summary(flax_path, cache)
    return None
  except flax_format.FlaxFormatError as e:
    error = e
  except OSError as e:
    return f"{flax_path}: cannot be read: {e}"
  text = _text_start(flax_path)
  if text is not None:
    return (f"{flax_path}: not a Flax checkpoint: starts with text "
            f"{text!r} (a text file, not msgpack)")
  detail = str(error).split(": ", 1)[-1]
  offset = getattr(error, "offset", None)
  at = "" if offset is None else f" at byte {offset}"
  if "truncated" in detail or "empty file" in detail:
    return f"{flax_path}: damaged: truncated{at} ({detail})"
  if "msgpack" in detail:
    return f"{flax_path}: damaged: not msgpack{at} ({detail})"
  return f"{flax_path}: damaged{at}: {detail}"


def _text_start(path: str) -> Optional[str]:
  """The file's first characters when it starts as printable text."""
  try:
    # One byte past the probe: whether the text goes on ("...").
    head = bytes(storage.map_file(path, populate=False)[:_TEXT_PROBE + 1])
  except (OSError, ValueError):
    return None
  more, head = len(head) > _TEXT_PROBE, head[:_TEXT_PROBE]
  for cut in range(4):  # a UTF-8 character cut at the probe's end
    try:
      text = head[:len(head) - cut].decode("utf-8")
      break
    except UnicodeDecodeError:
      continue
  else:
    return None
  if not text or not all(ch.isprintable() or ch in "\t\r\n" for ch in text):
    return None
  return text + "..." if more else text


# --------------------------------------------------------------------------
# inspect
# --------------------------------------------------------------------------


def tree_summary(flax_path: str, limit: int = LEAVES_SHOWN,
                 _cache: Optional[dict] = None) -> dict[str, Any]:
  """The leaves of a `.flax` file (headers only) with per-subtree totals.

  Every leaf is counted, but only the first `limit` are listed: a file of
  millions of leaves is summarised in the time and memory `load_file` would
  take (`flax_summary`), not listed leaf by leaf.

  Args:
    flax_path: The file.
    limit: How many leaves to list.

  Returns:
    `leaves` (the first `limit`: path, kind, dtype, shape, bytes),
    `leaf_count` (all of them), `subtrees` (top-level key -> leaves, bytes;
    the first `flax_summary.MAX_SUBTREES` keys, the others in
    `more_subtrees`) and `total_bytes`.

  Raises:
    flax_format.FlaxFormatError: The headers are corrupt.
  """
  summary = (_summary(flax_path, _cache) if limit == LEAVES_SHOWN else
             flax_summary.summarize_file(flax_path, sample=limit))
  subtrees: dict[str, dict[str, int]] = collections.OrderedDict(
      (top, {"leaves": leaves, "bytes": nbytes})
      for top, (leaves, nbytes) in summary.subtrees.items())
  more = summary.more_subtrees
  return dict(
      file=flax_path,
      leaves=[dict(path=l.path, kind=l.kind, dtype=l.dtype,
                   shape=list(l.shape) if l.shape is not None else None,
                   bytes=l.nbytes) for l in summary.sample],
      leaf_count=summary.leaves,
      subtrees=subtrees,
      more_subtrees=({"leaves": more[0], "bytes": more[1]} if more[0]
                     else None),
      total_bytes=summary.nbytes)


@storage.metadata_cache()  # one operation: each listing asked once
def inspect_path(path: str, checkpoint: Optional[int] = None, *,
                 prefix: Optional[str] = None) -> dict[str, Any]:
  """Describes a checkpoint directory of any layout, or a `.flax` file.

  Args:
    path: What to describe: a CLU directory or multihost base, an Orbax
      root, a directory of `flax.training.checkpoints` files, or a file.
    checkpoint: For directories, the checkpoint number (the step, for Orbax
      roots and Flax's files) whose tree to show (default: the latest
      committed one).
    prefix: The prefix of Flax's files (default "checkpoint_", or the one
      the directory's files share).

  Returns:
    A JSON-ready dict: `kind` ("flax_file", "checkpoint_dir",
    "multihost", "orbax_root", "flax_training"), `checkpoints` (number,
    step, bytes, time, hosts, committed) and `tree` (see `tree_summary`)
    for the chosen checkpoint, `layouts` (every layout found at `path`;
    the first is described) and `problems`: sentences naming what was
    refused or could not be read (entries outside the directory, files that
    are not regular files, and each committed `.flax` whose headers are
    damaged: also in its row's `damage`). The default tree is that of the
    latest committed checkpoint that is not damaged; a damaged chosen one
    has no tree. A row's `time` is the save time TensorFlow recorded for
    it (`time_source` "recorded"), else its `.flax` file's modification
    time ("mtime").

  Raises:
    CheckpointNotFoundError: No checkpoint of any known layout at `path`
      (the message names the layouts looked for).
    OSError: `path` is not a regular file or directory, or cannot be read.
    flax_format.FlaxFormatError: The chosen `.flax` is corrupt.
  """
  if storage.exists(path) and not storage.isdir(path):
    storage.check_regular_file(path)
    return dict(kind="flax_file", path=path, tree=tree_summary(path),
                problems=[])
  found = reader.detect_layouts(path, prefix)
  if not found:
    raise errors.CheckpointNotFoundError(
        f"No checkpoint at {path}: looked for {reader.looked_for(prefix)}"
        f"{orbax_root.step_naming_hint(path)}")
  if found[0] in (reader.ORBAX_MIGRATED, reader.ORBAX):
    report = orbax_root.inspect_orbax_root(path, checkpoint)
  elif found[0] == reader.FLAX_TRAINING:
    report = _inspect_flax_training(path, reader.flax_prefix(path, prefix),
                                    checkpoint)
  else:
    report = _inspect_clu(path, checkpoint)
  report["layouts"] = found
  return report


def _inspect_clu(path: str, checkpoint: Optional[int]) -> dict[str, Any]:
  """`inspect_path` of a CLU directory or multihost base."""
  hosts = layout.source_directories(path)
  if not hosts:
    raise errors.CheckpointNotFoundError(
        f"No CLU checkpoint directory, multihost base or .flax file at {path}")
  rows: dict[tuple, dict[str, Any]] = {}
  problems: list[str] = []
  cache: dict[str, Any] = {}
  for host, directory in hosts.items():
    for c in list_checkpoints(directory, problems):
      row = rows.setdefault((c["name"], c["number"]), dict(
          name=c["name"], number=c["number"], step=None, bytes=0,
          time=c["saved"] or c["mtime"],
          time_source="recorded" if c["saved"] else "mtime", hosts=[],
          committed_hosts=[], torn_hosts=[], damage=[]))
      row["bytes"] += c["flax_bytes"] + c["tf_bytes"]
      if c["saved"] is None:
        row["time_source"] = "mtime"
      row["time"] = max(row["time"], c["saved"] or c["mtime"])
      row["hosts"].append(host)
      (row["committed_hosts"] if c["committed"] and c["readable"] else
       row["torn_hosts"]).append(host)
      # A torn save's partial file is expected; committed ones must be whole.
      flax_path = c["prefix"] + ".flax"
      damage = (_damage(flax_path, cache)
                if c["readable"] and c["committed"] else None)
      if damage:
        row["damage"].append(damage)
        problems.append(damage)
      elif row["step"] is None and c["committed"] and c["readable"]:
        row["step"] = _step_from(cache, flax_path)
      if flax_path in cache and not row["step"] is None and (
          host != min(hosts)):
        cache.pop(flax_path)  # other hosts' summaries: not needed again
  checkpoints = [rows[k] for k in sorted(rows)]
  for row in checkpoints:
    row["committed"] = (not row["torn_hosts"] and
                        len(row["committed_hosts"]) == len(hosts))
  chosen = _choose(checkpoints, checkpoint)
  tree = None
  if chosen is not None and not chosen["damage"]:
    first_host = chosen["committed_hosts"][0] if chosen[
        "committed_hosts"] else chosen["hosts"][0]
    flax_path = storage.join(
        hosts[first_host], f"{chosen['name']}-{chosen['number']}.flax")
    layout.check_inside(hosts[first_host], flax_path)
    storage.check_regular_file(flax_path)
    tree = tree_summary(flax_path, _cache=cache)
    tree["number"] = chosen["number"]
  return dict(kind="multihost" if None not in hosts else "checkpoint_dir",
              path=path, hosts=[h for h in hosts if h is not None],
              checkpoints=checkpoints, tree=tree, problems=problems)


def _inspect_flax_training(directory: str, prefix: str,
                           checkpoint: Optional[int]) -> dict[str, Any]:
  """`inspect_path` of a directory of `flax.training.checkpoints` files."""
  problems: list[str] = []
  rows = []
  cache: dict[str, Any] = {}
  for number, path in flax_training.list_steps(directory, prefix).items():
    name = path.rsplit("/", 1)[-1]
    readable = _readable(directory, name, problems)
    size, mtime = storage.stat(path) if readable else (0, 0.0)
    damage = _damage(path, cache) if readable else None
    if damage:
      problems.append(damage)
    rows.append(dict(
        name=name, number=number, bytes=size, time=_iso(mtime),
        time_source="mtime", hosts=[None],
        step=None if damage or not readable else _step_from(cache, path),
        committed=readable and not damage, committed_hosts=[],
        torn_hosts=[], damage=[damage] if damage else []))
  for extra in flax_training.orbax_step_directories(directory, prefix):
    problems.append(f"{extra}: an Orbax-format Flax checkpoint directory; "
                    "not described here (inspect it as an Orbax checkpoint)")
  chosen = _choose(rows, checkpoint)
  tree = None
  if chosen is not None and not chosen["damage"]:
    tree = tree_summary(storage.join(directory, chosen["name"]), _cache=cache)
    tree["number"] = chosen["number"]
  return dict(kind="flax_training", path=directory, prefix=prefix, hosts=[],
              checkpoints=rows, tree=tree, problems=problems)


def _choose(checkpoints: list, number: Optional[int]) -> Optional[dict]:
  if number is not None:
    for row in checkpoints:
      if row["number"] == number:
        return row
    raise errors.CheckpointNotFoundError(f"No checkpoint number {number}")
  sound = [r for r in checkpoints if r["committed"] and not r["damage"]]
  return sound[-1] if sound else None


def format_inspect(report: dict[str, Any]) -> str:
  """A human-readable rendering of `inspect_path`'s report."""
  lines = []
  if report["kind"] == "orbax_root":
    return _format_orbax(report)
  if report["kind"] == "flax_training":
    lines.append(f"{report['path']}: flax.training.checkpoints files "
                 f"{report['prefix']}<step>")
    table = [("file", "step", "size", "written (UTC, file time)", "state")]
    for row in report["checkpoints"]:
      table.append((row["name"],
                    "" if row["step"] is None else str(row["step"]),
                    _human(row["bytes"]), row["time"].replace("+00:00", ""),
                    "damaged" if row["damage"] else "complete"))
    lines += _table(table)
    lines.append("")
  elif report["kind"] != "flax_file":
    hosts = report.get("hosts") or []
    lines.append(f"{report['path']}: " + (
        f"multihost base, {len(hosts)} hosts" if hosts else
        "checkpoint directory"))
    table = [("number", "step", "size", "saved (UTC)", "hosts", "state")]
    for row in report["checkpoints"]:
      state = "damaged" if row.get("damage") else (
          "committed" if row["committed"] else (
              "torn" if row["torn_hosts"] else "partial"))
      table.append((f"{row['name']}-{row['number']}",
                    "" if row["step"] is None else str(row["step"]),
                    _human(row["bytes"]), _time_text(row),
                    ",".join("-" if h is None else str(h)
                             for h in row["hosts"]), state))
    lines += _table(table)
    if any(r.get("time_source") == "mtime" for r in report["checkpoints"]):
      lines.append("* no save time recorded by TensorFlow: the file's "
                   "modification time")
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
    count = tree.get("leaf_count", len(tree["leaves"]))
    if count > len(tree["leaves"]):
      lines.append(f"... and {count - len(tree['leaves'])} more leaves "
                   f"(the first {len(tree['leaves'])} of {count} are listed)")
    lines.append("")
    table = [("subtree", "leaves", "bytes")]
    for key, entry in tree["subtrees"].items():
      table.append(("/" + key, str(entry["leaves"]), _human(entry["bytes"])))
    more = tree.get("more_subtrees")
    if more:
      table.append(("(other top-level keys)", str(more["leaves"]),
                    _human(more["bytes"])))
    table.append(("total", str(count), _human(tree["total_bytes"])))
    lines += _table(table)
  for problem in report.get("problems") or []:
    lines.append(f"PROBLEM: {problem}")
  return "\n".join(lines)


def _time_text(row: dict) -> str:
  text = row["time"].replace("+00:00", "")
  return text + " *" if row.get("time_source") == "mtime" else text


def _table(rows: list[tuple]) -> list[str]:
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  out = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
         for r in rows]
  out.insert(1, "  ".join("-" * w for w in widths))
  return out


def _human(n: Optional[int]) -> str:
  if n is None:
    return "unknown"
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if n < 1024 or unit == "TiB":
      return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return str(n)


# --------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------


@storage.metadata_cache()  # one operation: each listing asked once
def verify_path(path: str,
                progress: Optional[Callable[..., None]] = None, *,
                prefix: Optional[str] = None) -> dict[str, Any]:
  """Checks that every committed checkpoint at `path` is sound.

  Checked: every committed `.flax` decodes completely (every header, every
  length, every chunk); its TensorFlow `.index` and all `.data-K-of-N` shards
  are present; in a multihost base, the hosts have a checkpoint in common and
  hold the same tree (paths, dtypes, shapes) for each common number. In a
  directory of `flax.training.checkpoints` files, every `<prefix><step>`
  file decodes completely. Orbax roots: see `orbax_root.verify_orbax_root`.

  Example::

    report = verify_path("/ckpts")   # {"ok": True, "checked": 3, ...}

  Args:
    path: A CLU directory, multihost base, Orbax root, directory of Flax's
      `checkpoint_<step>` files, or a `.flax` file.
    progress: Called after each `.flax` file as `progress(done, count, name,
      nbytes, total_nbytes)` (see `clu_ckpt.progress.VerifyReport`): `name`
      is the file's name, with its host directory's in a multihost base
      (`checkpoints-1/ckpt-5.flax`); the bytes are those of the checkpoint's
      files (`.flax` and TensorFlow's), as `inspect` counts them.
    prefix: The prefix of Flax's files (default "checkpoint_", or the one
      the directory's files share).

  Returns:
    `ok` (bool), `checked` (number of files decoded) and `problems` (list of
    sentences, each naming the file).
  """
  problems: list[str] = []
  checked = 0
  if storage.exists(path) and not storage.isdir(path):
    return _verify_flax(path, problems, 0)
  found = reader.detect_layouts(path, prefix)
  if not found:
    return dict(ok=False, checked=0, problems=[
        f"{path}: no checkpoint here: looked for "
        f"{reader.looked_for(prefix)}{orbax_root.step_naming_hint(path)}"])
  if found[0] in (reader.ORBAX_MIGRATED, reader.ORBAX):
    return orbax_root.verify_orbax_root(path)
  if found[0] == reader.FLAX_TRAINING:
    return _verify_flax_training(path, reader.flax_prefix(path, prefix),
                                 progress)
  hosts = layout.source_directories(path)
  trees: dict[int, dict[Any, list]] = collections.defaultdict(dict)
  numbers: dict[Any, set] = {}
  work: list[tuple[Any, str, dict]] = []
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
                        f"{storage.join(directory, layout.STATE_FILENAME)}")
      elif not storage.exists(prefix + ".index"):
        problems.append(f"{prefix}.index: missing (TensorFlow files of a "
                        "committed checkpoint)")
    numbers[host] = {c["number"] for c in found}
    work.extend((host, directory, c) for c in found)
  sizes = [c["flax_bytes"] + c["tf_bytes"] for _, _, c in work]
  for (host, directory, c), nbytes in zip(work, sizes):
    checked += 1
    leaves = _decode_fully(c["prefix"] + ".flax", problems)
    if leaves is not None:
      trees[c["number"]][host] = leaves
    _check_tf_shards(directory, c, problems)
    if progress is not None:
      name = os.path.basename(c["prefix"]) + ".flax"
      if host is not None:
        name = f"{os.path.basename(directory.rstrip('/'))}/{name}"
      progress(checked, len(work), name, nbytes, sum(sizes))
  if None not in hosts:
    _check_hosts(path, hosts, numbers, trees, problems)
  if not checked:
    problems.append(f"{path}: no committed checkpoint found")
  return dict(ok=not problems, checked=checked, problems=problems)


def _verify_flax_training(directory: str, prefix: str,
                          progress: Optional[Callable[..., None]]
                          ) -> dict[str, Any]:
  """`verify_path` of a directory of `flax.training.checkpoints` files."""
  problems: list[str] = []
  files = list(flax_training.list_steps(directory, prefix).values())
  sizes = [_size_or_zero(f) for f in files]
  checked = 0
  for path, nbytes in zip(files, sizes):
    checked += 1
    if _readable(directory, path.rsplit("/", 1)[-1], problems):
      _decode_fully(path, problems)
    if progress is not None:
      progress(checked, len(files), path.rsplit("/", 1)[-1], nbytes,
               sum(sizes))
  if not checked:
    problems.append(f"{directory}: no {prefix}<step> file")
  return dict(ok=not problems, checked=checked, problems=problems)


def _size_or_zero(path: str) -> int:
  try:
    return storage.stat(path)[0]
  except OSError:
    return 0


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
    # One parse builds the tree (every check `load` makes) and the leaves.
    with flax_format.FlaxFile(flax_path, read_data=False) as handle:
      return [(l.path, l.dtype, l.shape) for l in handle.leaves]
  except flax_format.FlaxFormatError as e:
    text = _text_start(flax_path)
    problems.append(str(e) if text is None else
                    f"{flax_path}: not a Flax checkpoint: starts with text "
                    f"{text!r} (a text file, not msgpack)")
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


def _format_orbax(report: dict) -> str:
  """Renders `orbax_root.inspect_orbax_root`'s report."""
  naming = report.get("step_naming")
  lines = [f"{report['path']}: Orbax CheckpointManager root" + (
      f" (steps named with {naming})" if naming else "")]
  table = [("step", "items", "size", "saved (UTC)", "from")]
  for row in report["steps"]:
    table.append((str(row["step"]), ",".join(row["items"]),
                  _human(row["bytes"]),
                  (row["time"] or "").replace("+00:00", ""),
                  row["clu_checkpoint"] or ""))
  lines += _table(table)
  for name in report["partial"]:
    lines.append(f"unfinished (ignored by Orbax): {name}")
  tree = report.get("tree")
  native = bool(tree) and tree.get("source") == "orbax"
  if tree and (tree["leaves"] or native):
    lines.append("")
    lines.append(f"tree of step {tree['number']} " + (
        "(items as Orbax records them):" if native else "(from its metadata item):"))
  if tree and tree["leaves"]:
    head = ("item",) if native else ()
    rows = [head + ("path", "dtype", "shape", "bytes")]
    for leaf in tree["leaves"]:
      unknown = native and leaf["dtype"] is None and leaf["kind"] is None
      rows.append(((leaf["item"],) if native else ()) + (
          leaf["path"] or "",
          "unknown" if unknown else (leaf["dtype"] or leaf["kind"] or ""),
          "unknown" if unknown else (
              "" if leaf["shape"] is None else str(tuple(leaf["shape"]))),
          _human(leaf["bytes"])))
    lines += _table(rows)
  if native:
    for item, entry in tree["items"].items():
      if entry["unknown"]:
        lines.append(f"item {item}: {entry['unknown']}")
    if tree["leaves"]:
      lines.append(f"total: {len(tree['leaves'])} leaves, "
                   f"{_human(tree['total_bytes'])}")
  for problem in report.get("problems") or []:
    lines.append(f"PROBLEM: {problem}")
  return "\n".join(lines)


# Orbax roots are described by `clu_ckpt.orbax_root`; re-exported here, the
# module `clu-ckpt inspect` and `verify` talk to.
is_orbax_root = orbax_root.is_orbax_root
inspect_orbax_root = orbax_root.inspect_orbax_root
verify_orbax_root = orbax_root.verify_orbax_root
