r"""Which runs a fleet holds: every path a glob matches, a run or skipped.

Synopsis::

  from clu_ckpt.migration import fleet_discovery

  plan = fleet_discovery.plan_fleet(
      sources=["/runs/x/checkpoints"], globs=["/runs/*/checkpoints"])
  for run in plan.runs:        # Run(source, kind, hosts, nbytes, ...)
    print(run.source, run.kind, run.hosts)
  for s in plan.skipped:       # Skipped(path, reason, glob)
    print("skipped", s.path, s.reason)

Every path a glob matches is a run or is skipped with its reason (an empty
directory, not a checkpoint directory, a host directory of a run listed as
its base). A `MultihostCheckpoint` keeps its hosts in `<base>-<int>`
directories: a glob or path naming `<base>` covers them, and a glob
matching them covers their `<base>` (when `<base>-0` is a checkpoint
directory). One function, `classify`, says what a directory is from its
listing. A glob that matches nothing is an error naming it. In a bucket,
each glob costs one listing.

Paths are compared normalized (`normalize_path`): local paths by
`os.path.normpath` (relative paths stay relative, as the operator typed
them), URLs with their scheme lower-cased and their key normalized.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import os
import posixpath
import re
from typing import Callable, Mapping, Optional, Sequence

from clu_ckpt.errors import UsageError

_HOST_DIR_RE = re.compile(r"^(?P<base>.+)-(?P<host>\d+)$")
_URL_RE = re.compile(r"^[a-z][a-z0-9.+-]*://", re.I)
# Flax's own `flax.training.checkpoints` layout: `checkpoint_<step>` files.
_FLAX_TRAINING_RE = re.compile(r"^checkpoint_\d+$")


# --------------------------------------------------------------------------
# Paths.
# --------------------------------------------------------------------------


def split_url(path: str) -> tuple[str, str]:
  """("gs://", "bucket/key") of a URL; ("", path) of a local path."""
  m = _URL_RE.match(path)
  return (m.group(0), path[m.end():]) if m else ("", path)


def normalize_path(path: str) -> str:
  """A local path normalized; a URL with its key normalized (`//`, `..`)."""
  scheme, rest = split_url(path)
  if not scheme:
    return os.path.normpath(path)
  return scheme.lower() + posixpath.normpath(rest).lstrip("/")


def absolute_path(path: str) -> str:
  return path if split_url(path)[0] else os.path.abspath(path)


def join_path(root: str, relative: str) -> str:
  if split_url(root)[0]:
    return f"{root.rstrip('/')}/{relative}"
  return os.path.join(root, relative)


def relative_path(path: str, root: str) -> Optional[str]:
  """`path` relative to `root` (both absolute), or None if not inside it."""
  (s1, p1), (s2, p2) = split_url(path), split_url(root)
  if s1 != s2:
    return None
  module = posixpath if s1 else os.path
  relative = module.relpath(p1, p2)
  if relative == "." or relative == ".." or relative.startswith(".." + "/"):
    return None
  return relative


def parent_path(path: str) -> str:
  scheme, rest = split_url(path)
  return scheme + (posixpath if scheme else os.path).dirname(rest)


def _has_wildcard(component: str) -> bool:
  return any(c in component for c in "*?[")


def glob_prefix(pattern: str) -> str:
  """The directory above the first wildcard of `pattern` (its parent if none).

  `/runs/*/checkpoints` -> `/runs`; `gs://b/x/run-*` -> `gs://b/x`.
  """
  scheme, rest = split_url(normalize_path(pattern))
  parts = rest.split("/")
  for i, part in enumerate(parts):
    if _has_wildcard(part):
      return scheme + ("/".join(parts[:i]) or ("/" if not scheme else ""))
  return scheme + ("/".join(parts[:-1]) or
                   ("." if not scheme and not rest.startswith("/") else "/"))


def _matches(path: str, pattern: str) -> bool:
  """Whether `path` matches the glob `pattern` component by component."""
  a, b = normalize_path(path).split("/"), normalize_path(pattern).split("/")
  return len(a) == len(b) and all(
      fnmatch.fnmatchcase(x, y) for x, y in zip(a, b))


# --------------------------------------------------------------------------
# What a directory is: one function.
# --------------------------------------------------------------------------

# Kinds `classify` returns.
CLU = "clu"
FLAX_TRAINING = "flax_training"
EMPTY = "empty"
OTHER = "other"
NOT_DIRECTORY = "not_directory"

_REASONS = {
    EMPTY: "empty directory",
    OTHER: "not a checkpoint directory (no `checkpoint` file, no "
           "<name>-<N>.flax)",
    NOT_DIRECTORY: "not a directory",
}


def classify(entries: Optional[Mapping[str, int]]) -> str:
  """What a directory is, from its listing alone.

  The one place that decides; a layout the library learns to migrate is
  added here (and to `_MIGRATED_KINDS`).

  Args:
    entries: Name -> size of each entry (-1 for a subdirectory), or None
      when the path is not a directory.

  Returns:
    CLU (a `checkpoint` file or a `<name>-<N>.flax`), FLAX_TRAINING (Flax's
    `checkpoint_<step>` files), EMPTY, OTHER or NOT_DIRECTORY.
  """
  from clu_ckpt import layout  # pylint: disable=g-import-not-at-top
  if entries is None:
    return NOT_DIRECTORY
  if layout.STATE_FILENAME in entries or any(
      layout.FLAX_NAME_RE.match(n) for n in entries):
    return CLU
  if any(_FLAX_TRAINING_RE.match(n) and size >= 0
         for n, size in entries.items()):
    return FLAX_TRAINING
  return EMPTY if not entries else OTHER


# The kinds this version migrates (`clu_ckpt.migration.migrate` reads both).
_MIGRATED_KINDS = (CLU, FLAX_TRAINING)


# --------------------------------------------------------------------------
# Listing: every candidate path of a glob with its entries.
# --------------------------------------------------------------------------

Entries = Optional[dict[str, int]]


def _list_local_directory(path: str) -> Entries:
  try:
    with os.scandir(path) as it:
      found = {}
      for entry in it:
        try:
          found[entry.name] = (-1 if entry.is_dir() else
                               entry.stat().st_size)
        except OSError:
          found[entry.name] = 0
      return found
  except (NotADirectoryError, FileNotFoundError):
    return None


def list_candidates(pattern: str) -> dict[str, Entries]:
  """Paths matching `pattern` or `pattern-<int>`, each with its entries.

  Locally: two globs and one directory listing per path. In a bucket: one
  recursive listing under the pattern's fixed prefix, two levels deeper
  than the pattern, matched here.

  Args:
    pattern: A glob (a literal path is a glob matching itself).

  Returns:
    Normalized path -> entries (see `classify`).
  """
  pattern = normalize_path(pattern)
  if split_url(pattern)[0]:
    return _list_bucket(pattern)
  paths = set(glob.glob(pattern))
  paths.update(p for p in glob.glob(pattern + "-[0-9]*")
               if _HOST_DIR_RE.match(p))
  for base in {m.group("base") for m in map(_HOST_DIR_RE.match, list(paths))
               if m}:  # the other hosts of a host directory matched
    paths.update(p for p in glob.glob(glob.escape(base) + "-[0-9]*")
                 if _HOST_DIR_RE.match(p))
  return {normalize_path(p): _list_local_directory(p) for p in sorted(paths)}


def _list_bucket(pattern: str) -> dict[str, Entries]:
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  scheme, key_pattern = split_url(pattern)
  backend = storage.filesystem(pattern)
  fs = getattr(backend, "fs", None)
  if fs is None or not hasattr(fs, "find"):
    return _list_bucket_slowly(pattern)
  prefix = split_url(glob_prefix(pattern))[1].rstrip("/")
  depth = key_pattern.count("/") - prefix.count("/") + 1
  found = fs.find(prefix, maxdepth=depth, withdirs=True, detail=True)
  host_pattern = key_pattern + "-[0-9]*"
  candidates: dict[str, Entries] = {}
  found = {key.rstrip("/"): info for key, info in found.items()}
  for key, info in found.items():
    if _matches(key, key_pattern) or (_matches(key, host_pattern) and
                                      _HOST_DIR_RE.match(key)):
      candidates[key] = ({} if info.get("type") == "directory" else None)
  bases = {m.group("base") for m in map(_HOST_DIR_RE.match, list(candidates))
           if m}  # the other hosts of a host directory matched
  for key, info in found.items():
    m = _HOST_DIR_RE.match(key)
    if m and m.group("base") in bases and key not in candidates:
      candidates[key] = ({} if info.get("type") == "directory" else None)
  for key, info in found.items():
    parent, name = posixpath.split(key)
    if candidates.get(parent) is not None:
      is_dir = info.get("type") == "directory"
      candidates[parent][name] = -1 if is_dir else int(info.get("size") or 0)
  return {scheme + k: v for k, v in sorted(candidates.items())}


def _list_bucket_slowly(pattern: str) -> dict[str, Entries]:
  """Through `clu_ckpt.storage` only: one listing per candidate."""
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  paths = set(storage.glob(pattern))
  paths.update(p for p in storage.glob(pattern + "-[0-9]*")
               if _HOST_DIR_RE.match(p))
  result = {}
  for p in sorted(paths):
    result[normalize_path(p)] = ({n: 0 for n in storage.listdir(p)}
                             if storage.isdir(p) else None)
  return result


# --------------------------------------------------------------------------
# The plan: runs and skipped paths.
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
  """One source to migrate.

  Attributes:
    source: The CLU `Checkpoint` directory or `MultihostCheckpoint` base,
      as listed (normalized).
    kind: "Checkpoint", "MultihostCheckpoint" or FLAX_TRAINING.
    hosts: The host directories of a multihost base.
    nbytes: The size of its files when listed.
    destination: Its Orbax root (set by `assign_destinations`).
    error: Why it cannot be migrated (an explicitly named source that is
      not a checkpoint directory); it is then reported, not migrated.
  """
  source: str
  kind: str
  hosts: list[str] = dataclasses.field(default_factory=list)
  nbytes: int = 0
  destination: str = ""
  error: Optional[str] = None


@dataclasses.dataclass
class Skipped:
  """A path a glob matched that is not migrated, and why."""
  path: str
  reason: str
  glob: str


@dataclasses.dataclass
class Plan:
  runs: list[Run]
  skipped: list[Skipped]


def _size(entries: Entries) -> int:
  return sum(s for s in (entries or {}).values() if s > 0)


def plan_pattern(pattern: str, candidates: Mapping[str, Entries],
                 explicit: Optional[str] = None) -> Plan:
  """The runs and skipped paths of one glob (or one named path).

  Args:
    pattern: The glob (for a named path, the path with its glob characters
      escaped).
    candidates: `list_candidates(pattern)`.
    explicit: The path, when `pattern` is a source named on the command
      line: if it is not a run, it is a run with an error (it was asked
      for), not skipped.

  Returns:
    The plan of this pattern.
  """
  pattern = normalize_path(pattern)
  runs, skipped, covered = [], [], set()
  # Multihost bases: <base>-0 a checkpoint directory, <base> itself not one.
  groups: dict[str, dict[int, str]] = {}
  for path in candidates:
    m = _HOST_DIR_RE.match(path)
    if m and classify(candidates[path]) != NOT_DIRECTORY:
      groups.setdefault(m.group("base"), {})[int(m.group("host"))] = path
  for base, hosts in sorted(groups.items()):
    named = _matches(base, pattern) or any(
        _matches(h, pattern) for h in hosts.values())
    if (0 not in hosts or classify(candidates[hosts[0]]) != CLU or
        not named or classify(candidates.get(base)) == CLU):
      continue
    ordered = [hosts[h] for h in sorted(hosts)]
    runs.append(Run(base, "MultihostCheckpoint", ordered,
                    sum(_size(candidates[h]) for h in ordered)))
    covered.add(base)
    for h in ordered:
      covered.add(h)
      if _matches(h, pattern):
        skipped.append(Skipped(h, f"host directory of {base}", pattern))
  for path, entries in candidates.items():
    if path in covered or not _matches(path, pattern):
      continue
    kind = classify(entries)
    if kind in _MIGRATED_KINDS:
      runs.append(Run(path, "Checkpoint" if kind == CLU else kind,
                      nbytes=_size(entries)))
    elif explicit:
      runs.append(Run(path, kind, error=_REASONS[kind]))
    else:
      skipped.append(Skipped(path, _REASONS[kind], pattern))
  if explicit and not runs:
    runs.append(Run(explicit, "Checkpoint", error=(
        "no such directory, and no "
        f"{posixpath.basename(explicit)}-<host_id> directories beside it")))
  return Plan(runs, skipped)


def plan_fleet(sources: Sequence[str], globs: Sequence[str],
               lister: Callable[[str], Mapping[str, Entries]] = list_candidates
               ) -> Plan:
  """Every run named or matched, and every matched path skipped.

  Args:
    sources: Paths named directly (`--sources`, `--sources-file`).
    globs: `--source-glob` patterns.
    lister: `list_candidates` (a test may count its calls).

  Returns:
    The plan, runs and skipped paths sorted and de-duplicated (a path that
    is a run is not also skipped).

  Raises:
    UsageError: A glob matched nothing.
  """
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  plans = []
  for pattern in globs:
    plan = plan_pattern(pattern, lister(pattern))
    if not plan.runs and not plan.skipped:
      raise UsageError(f"--source-glob {pattern!r} matched nothing")
    plans.append(plan)
  for source in sources:
    escaped = storage.glob_escape(normalize_path(source))
    plans.append(plan_pattern(escaped, lister(escaped),
                              explicit=normalize_path(source)))
  runs: dict[str, Run] = {}
  for plan in plans:
    for run in plan.runs:
      if run.source not in runs or runs[run.source].error:
        runs[run.source] = run
  skipped: dict[str, Skipped] = {}
  for plan in plans:
    for s in plan.skipped:
      if s.path not in runs:
        skipped.setdefault(s.path, s)
  return Plan([runs[s] for s in sorted(runs)],
              [skipped[s] for s in sorted(skipped)])


def read_sources_file(path: str) -> list[str]:
  """The paths listed in `path`, one a line ("#" starts a comment)."""
  try:
    with open(path) as f:
      lines = [l.split("#", 1)[0].strip() for l in f]
  except OSError as e:
    raise UsageError(f"--sources-file {path}: {e.strerror or e}") from None
  return [l for l in lines if l]


