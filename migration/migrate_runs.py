r"""Migrates many CLU runs to Orbax at once, on one or many machines.

Synopsis::

  python migration/migrate_runs.py \
      --source-glob='/runs/*/checkpoints' \
      --destination-root=/orbax_runs \
      --parallelism=4 --verify --report=/tmp/migration_report.json

  # What would be migrated, and what is skipped and why (writes nothing):
  python migration/migrate_runs.py --source-glob='/runs/*/checkpoints' \
      --destination-root=/orbax_runs --dry-run

  # Retrying one run of that fleet: same destination root, same layout.
  python migration/migrate_runs.py --sources=/runs/c/checkpoints \
      --destination-root=/orbax_runs

  # The same fleet split over 3 machines (the same command on each, with its
  # own --shard-index), then the shard reports merged into one:
  python migration/migrate_runs.py --source-glob='/runs/*/checkpoints' \
      --destination-root=/orbax_runs --num-shards=3 --shard-index=0 \
      --report=/reports/shard-0.json
  python migration/migrate_runs.py --merge-reports=/reports/all.json \
      /reports/shard-*.json

Every `clu-ckpt migrate` option (`--latest`, `--number`, `--step-naming`,
`--state-host`, `--compression`, `--verify`, `--max-inflight-mib`,
`--step-prefix`, `--step-format-fixed-length`, `--allow-other-sources`,
`--template`) is accepted and applied to every run: the options are taken
from `clu-ckpt migrate`'s own parser. Flags are spelled with hyphens; the
underscored spellings (`--destination_root`) are accepted too.

Finding the runs (`plan_fleet`): every path a `--source-glob` matches is a
run or is listed as skipped with its reason (an empty directory, not a
checkpoint directory, a host directory of a run listed as its base). A
`MultihostCheckpoint` keeps its hosts in `<base>-<int>` directories: a glob
or path naming `<base>` covers them, and a glob matching them covers their
`<base>` (when `<base>-0` is a checkpoint directory). One function,
`classify`, says what a directory is from its listing. A glob that matches
nothing is an error naming it. In a bucket, each glob costs one listing.

Destinations: `<destination-root>/<the run's path relative to the source
root>`. The source root is `--source-root`, or the one recorded in
`<destination-root>/clu_ckpt_fleet.json` by an earlier run, or (first run)
the directory above the first wildcard of the globs (`/runs` for
`/runs/*/checkpoints`). It is recorded by the first migration into the
destination root; a later command giving another `--source-root` is
refused. A retry naming one run (`--sources=/runs/c/checkpoints`) therefore
writes where the fleet run did. Two runs mapping to one destination, or a
destination inside a source, are refused before anything is written.

Workers: `--parallelism` long-lived worker processes each import the
migration once and migrate run after run in-process
(`clu_ckpt.migration.migrate`). A run that kills its worker (a crash, the
kernel's out-of-memory killer) is reported as an error; a new worker takes
the next run. Steps already migrated are skipped, so the command can simply
be re-run.

Report: written (atomically) before the first run and after every finished
run, so a killed fleet leaves the report of what finished. It lists every
run of the shard (source, destination, shard, status "ok", "failed" (some
checkpoint failed), "error" (the run could not be migrated, or its worker
died), "interrupted" or "pending", seconds, the migration's summary) and
every skipped path with its reason. `--merge-reports=OUT REPORT...` merges
shard reports, partial ones included.

Stopping: the first Ctrl-C or SIGTERM starts no new run; the runs under way
abandon their current step (nothing of it stays, as with `clu-ckpt
migrate`); the report is written; exit status 130 (SIGINT) or 143 (SIGTERM),
within seconds. A second Ctrl-C stops at once (the report then holds every
run finished before). Re-running resumes.

Sharding: `--num-shards=N --shard-index=I` (0 <= I < N) migrates the runs
whose stable hash (SHA-256 of the source path as listed, modulo N) is I.
Without `--shard-index`, the index is read from `JOB_COMPLETION_INDEX`
(Kubernetes indexed Jobs) when `--num-shards` is above 1.

Progress: one line per finished run, e.g. `[3/12] /runs/a/checkpoints ok
(4 steps, 1.2 GiB, 35 s); 3.4 GiB of 9.0 GiB, 0 failed, ETA 2 min`; on a
terminal, one line rewritten in place (runs not ok keep their line).

Exit status: 0 when every run (of the shard, or of the merged fleet, with no
shard missing) is ok, 1 otherwise, 2 for a usage error, 130/143 when
stopped. Errors are one line on stderr; `--verbose` adds tracebacks and the
workers' log messages.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fnmatch
import glob
import hashlib
import json
import os
import posixpath
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, TextIO

_PROG = "migrate_runs.py"
_INDEX_ENV = "JOB_COMPLETION_INDEX"
_HOST_DIR_RE = re.compile(r"^(?P<base>.+)-(?P<host>\d+)$")
_URL_RE = re.compile(r"^[a-z][a-z0-9.+-]*://", re.I)
# Flax's own `flax.training.checkpoints` layout: `checkpoint_<step>` files.
_FLAX_TRAINING_RE = re.compile(r"^checkpoint_\d+$")
# The source root recorded in a destination root.
FLEET_FILE = "clu_ckpt_fleet.json"
_FLEET_FORMAT = "clu_ckpt.fleet/1"
# `clu-ckpt migrate` options the fleet does not pass through: it has its own
# `--dry-run` (the fleet's plan) and report (instead of `--json`).
_NOT_PASSED = {"help", "json", "dry_run"}
# How long runs under way may take to abandon their step after a stop.
STOP_SECONDS = 30.0
# Workers dying in a row before taking a run: the pending runs then fail.
_MAX_FAILED_STARTS = 3
_MIB = 2**20
FINISHED = ("ok", "failed", "error")


class UsageError(Exception):
  """A bad command line or input file: reported in one line, exit status 2."""


# --------------------------------------------------------------------------
# Paths.
# --------------------------------------------------------------------------


def _split_url(path: str) -> tuple[str, str]:
  """("gs://", "bucket/key") of a URL; ("", path) of a local path."""
  m = _URL_RE.match(path)
  return (m.group(0), path[m.end():]) if m else ("", path)


def _normalize(path: str) -> str:
  """A local path normalized; a URL with its key normalized (`//`, `..`)."""
  scheme, rest = _split_url(path)
  if not scheme:
    return os.path.normpath(path)
  return scheme.lower() + posixpath.normpath(rest).lstrip("/")


def _absolute(path: str) -> str:
  return path if _split_url(path)[0] else os.path.abspath(path)


def _join(root: str, relative: str) -> str:
  if _split_url(root)[0]:
    return f"{root.rstrip('/')}/{relative}"
  return os.path.join(root, relative)


def _relative(path: str, root: str) -> Optional[str]:
  """`path` relative to `root` (both absolute), or None if not inside it."""
  (s1, p1), (s2, p2) = _split_url(path), _split_url(root)
  if s1 != s2:
    return None
  module = posixpath if s1 else os.path
  relative = module.relpath(p1, p2)
  if relative == "." or relative == ".." or relative.startswith(".." + "/"):
    return None
  return relative


def _parent(path: str) -> str:
  scheme, rest = _split_url(path)
  return scheme + (posixpath if scheme else os.path).dirname(rest)


def _has_wildcard(component: str) -> bool:
  return any(c in component for c in "*?[")


def glob_prefix(pattern: str) -> str:
  """The directory above the first wildcard of `pattern` (its parent if none).

  `/runs/*/checkpoints` -> `/runs`; `gs://b/x/run-*` -> `gs://b/x`.
  """
  scheme, rest = _split_url(_normalize(pattern))
  parts = rest.split("/")
  for i, part in enumerate(parts):
    if _has_wildcard(part):
      return scheme + ("/".join(parts[:i]) or ("/" if not scheme else ""))
  return scheme + ("/".join(parts[:-1]) or
                   ("." if not scheme and not rest.startswith("/") else "/"))


def _matches(path: str, pattern: str) -> bool:
  """Whether `path` matches the glob `pattern` component by component."""
  a, b = _normalize(path).split("/"), _normalize(pattern).split("/")
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
  pattern = _normalize(pattern)
  if _split_url(pattern)[0]:
    return _list_bucket(pattern)
  paths = set(glob.glob(pattern))
  paths.update(p for p in glob.glob(pattern + "-[0-9]*")
               if _HOST_DIR_RE.match(p))
  for base in {m.group("base") for m in map(_HOST_DIR_RE.match, list(paths))
               if m}:  # the other hosts of a host directory matched
    paths.update(p for p in glob.glob(glob.escape(base) + "-[0-9]*")
                 if _HOST_DIR_RE.match(p))
  return {_normalize(p): _list_local_directory(p) for p in sorted(paths)}


def _list_bucket(pattern: str) -> dict[str, Entries]:
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  scheme, key_pattern = _split_url(pattern)
  backend = storage.filesystem(pattern)
  fs = getattr(backend, "fs", None)
  if fs is None or not hasattr(fs, "find"):
    return _list_bucket_slowly(pattern)
  prefix = _split_url(glob_prefix(pattern))[1].rstrip("/")
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
    result[_normalize(p)] = ({n: 0 for n in storage.listdir(p)}
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
  pattern = _normalize(pattern)
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
    escaped = storage.glob_escape(_normalize(source))
    plans.append(plan_pattern(escaped, lister(escaped),
                              explicit=_normalize(source)))
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


# --------------------------------------------------------------------------
# Destinations.
# --------------------------------------------------------------------------


def read_recorded_root(destination_root: str) -> Optional[str]:
  """The source root recorded in `destination_root`, or None."""
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  path = _join(destination_root, FLEET_FILE)
  try:
    data = json.loads(storage.read_bytes(path))
  except (FileNotFoundError, NotADirectoryError):
    return None  # nothing recorded (making the root will say what is wrong)
  except (OSError, ValueError) as e:
    raise UsageError(f"{path}: unreadable: {e}") from None
  if not isinstance(data, dict) or not isinstance(data.get("source_root"),
                                                  str):
    raise UsageError(f"{path}: not a fleet record (no source_root)")
  return data["source_root"]


def record_root(destination_root: str, source_root: str) -> None:
  """Records `source_root` in `destination_root` unless one is recorded.

  Raises:
    UsageError: Another source root is recorded (a concurrent shard wrote
      first with another root).
  """
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  storage.makedirs(destination_root)
  data = json.dumps({"format": _FLEET_FORMAT, "source_root": source_root,
                     "created": _now()}, indent=1).encode("utf-8")
  try:
    storage.create_exclusive(_join(destination_root, FLEET_FILE), data)
  except FileExistsError:
    pass
  recorded = read_recorded_root(destination_root)
  if recorded != source_root:
    raise UsageError(_root_mismatch(destination_root, recorded, source_root))


def _root_mismatch(destination_root: str, recorded: str, given: str) -> str:
  return (f"{destination_root} mirrors source root {recorded} (recorded in "
          f"{FLEET_FILE}), not {given}: give --source-root={recorded}, or "
          "another --destination-root")


def choose_source_root(explicit: Optional[str], recorded: Optional[str],
                       globs: Sequence[str], sources: Sequence[str] = ()
                       ) -> str:
  """The source root: explicit, else recorded, else from the globs.

  Args:
    explicit: `--source-root`.
    recorded: What the destination root records (`read_recorded_root`).
    globs: `--source-glob` patterns: without the two above, the root is the
      common directory of the directories above their first wildcards (and
      of the parents of `sources`).
    sources: Paths named beside the globs.

  Returns:
    The absolute source root.

  Raises:
    UsageError: An explicit root other than the recorded one, or none at
      all (only `--sources`, nothing recorded).
  """
  if explicit is not None:
    root = _normalize(_absolute(explicit))
    if recorded is not None and _normalize(recorded) != root:
      raise UsageError(f"--source-root={explicit}: the destination root "
                       f"mirrors {recorded} (recorded in {FLEET_FILE})")
    return root
  if recorded is not None:
    return _normalize(recorded)
  if not globs:
    raise UsageError(
        "--sources without --source-glob needs --source-root (the directory "
        "whose layout the destination root mirrors), e.g. --source-root=/runs"
        " for --sources=/runs/a/checkpoints -> <destination-root>/a/"
        "checkpoints")
  prefixes = [_absolute(glob_prefix(g)) for g in globs] + [
      _parent(_absolute(_normalize(s))) for s in sources]
  schemes = {_split_url(p)[0] for p in prefixes}
  if len(schemes) > 1:
    raise UsageError("globs on different stores: give --source-root, or "
                     "migrate each store's runs with its own command")
  scheme = schemes.pop()
  if scheme:
    keys = [_split_url(p)[1] for p in prefixes]
    if len({k.split("/", 1)[0] for k in keys}) > 1:
      raise UsageError("globs in several buckets: migrate each bucket's runs "
                       "with its own command")
    return scheme + posixpath.commonpath(keys)
  return os.path.commonpath(prefixes)


def assign_destinations(runs: Sequence[Run], source_root: str,
                        destination_root: str) -> None:
  """Sets each run's destination: `<destination_root>/<source - root>`.

  Raises:
    UsageError: A run outside the source root (or the root itself), two
      runs with one destination, a destination inside another, or a
      destination inside a source.
  """
  owner: dict[str, str] = {}
  for run in runs:
    relative = _relative(_absolute(run.source), source_root)
    if relative is None:
      raise UsageError(f"{run.source} is not inside the source root "
                       f"{source_root}: give a --source-root above every run")
    run.destination = _normalize(_join(destination_root, relative))
    if run.destination in owner:
      raise UsageError(f"{owner[run.destination]} and {run.source} would both "
                       f"migrate into {run.destination}")
    owner[run.destination] = run.source
  absolute = sorted((_absolute(d), s) for d, s in owner.items())
  for (d1, s1), (d2, s2) in zip(absolute, absolute[1:]):
    if _relative(d2, d1) is not None:
      raise UsageError(f"the destination of {s2} ({d2}) is inside that of "
                       f"{s1} ({d1})")
  for run in runs:
    for directory in [run.source, *run.hosts]:
      if _relative(_absolute(destination_root), _absolute(directory)) or (
          _normalize(_absolute(destination_root)) ==
          _normalize(_absolute(directory))):
        raise UsageError(f"--destination-root={destination_root} is inside "
                         f"the source {directory}")


# --------------------------------------------------------------------------
# Shards.
# --------------------------------------------------------------------------


def shard_of(source: str, num_shards: int) -> int:
  """The shard of `source`: SHA-256 of its path, modulo `num_shards`.

  The same on every machine and Python process (unlike `hash`), and
  independent of the other sources.
  """
  digest = hashlib.sha256(source.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") % num_shards


def shard_sources(sources: Sequence[str], num_shards: int,
                  shard_index: int) -> list[str]:
  """The sources of shard `shard_index` of `num_shards`, sorted."""
  return sorted(s for s in sources if shard_of(s, num_shards) == shard_index)


def resolve_shard(num_shards: int, shard_index: Optional[int],
                  environ: Mapping[str, str]) -> int:
  """The shard index to run, validated.

  Args:
    num_shards: `--num-shards`.
    shard_index: `--shard-index`, or None when not given.
    environ: The environment (for `JOB_COMPLETION_INDEX`).

  Returns:
    The shard index.

  Raises:
    UsageError: A bad count or index.
  """
  if num_shards < 1:
    raise UsageError(f"--num-shards must be >= 1, not {num_shards}")
  if shard_index is None:
    if num_shards == 1:
      return 0
    if _INDEX_ENV not in environ:
      raise UsageError(f"--num-shards={num_shards} needs --shard-index (or "
                       f"${_INDEX_ENV})")
    try:
      shard_index = int(environ[_INDEX_ENV])
    except ValueError:
      raise UsageError(f"${_INDEX_ENV}={environ[_INDEX_ENV]!r} is not an "
                       "integer") from None
  if not 0 <= shard_index < num_shards:
    raise UsageError(f"--shard-index must be in [0, {num_shards}) with "
                     f"--num-shards={num_shards}, not {shard_index}")
  return shard_index


# --------------------------------------------------------------------------
# The command line: the fleet's flags and `clu-ckpt migrate`'s.
# --------------------------------------------------------------------------


def migrate_parser() -> argparse.ArgumentParser:
  """`clu-ckpt migrate`'s own argument parser (from `clu_ckpt.cli`)."""
  from clu_ckpt import cli  # pylint: disable=g-import-not-at-top
  parser = cli._parser()  # pylint: disable=protected-access
  for action in parser._actions:  # pylint: disable=protected-access
    if isinstance(action, argparse._SubParsersAction):  # pylint: disable=protected-access
      return action.choices["migrate"]
  raise RuntimeError("clu_ckpt.cli has no migrate command")


def _add_migrate_options(parser: argparse.ArgumentParser) -> list[str]:
  """Adds `clu-ckpt migrate`'s options (its own definitions) to `parser`.

  Returns:
    The destinations (`dest`) of the options added.
  """
  source = migrate_parser()
  group = parser.add_argument_group(
      "clu-ckpt migrate options (applied to every run; see `clu-ckpt "
      "migrate --help`)")
  # pylint: disable=protected-access
  exclusive = {}
  for g in source._mutually_exclusive_groups:
    copy = group.add_mutually_exclusive_group(required=g.required)
    for action in g._group_actions:
      exclusive[id(action)] = copy
  dests = []
  for action in source._actions:
    if not action.option_strings or action.dest in _NOT_PASSED:
      continue
    exclusive.get(id(action), group)._add_action(action)
    if action.dest not in dests:
      dests.append(action.dest)
  # pylint: enable=protected-access
  return dests


def _version() -> str:
  from clu_ckpt import __version__  # pylint: disable=g-import-not-at-top
  return __version__


class _Parser(argparse.ArgumentParser):
  """argparse, with a usage error in one line (status 2)."""

  def error(self, message: str) -> Any:
    self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> tuple[argparse.ArgumentParser, list[str]]:
  """The parser, and the destinations of the passed-through options."""
  parser = _Parser(
      prog=_PROG,
      description="Migrates many CLU runs (Checkpoint directories, "
      "MultihostCheckpoint bases) into Orbax roots, in long-lived worker "
      "processes, with a JSON report.",
      epilog="Exit status: 0 every run ok, 1 some run not ok, 2 bad usage, "
      "130/143 stopped by SIGINT/SIGTERM.")
  parser.add_argument("--version", action="version",
                      version=f"{_PROG} (clu-ckpt {_version()})")
  parser.add_argument("-v", "--verbose", action="store_true",
                      help="tracebacks, and the workers' log messages")
  fleet = parser.add_argument_group("the fleet")
  fleet.add_argument("--sources", action="append", default=[],
                     metavar="PATH[,PATH...]",
                     help="CLU checkpoint directories / MultihostCheckpoint "
                     "bases (comma-separated; repeatable)")
  fleet.add_argument("--source-glob", action="append", default=[],
                     metavar="GLOB", help="a glob matching sources "
                     "(repeatable); quote it")
  fleet.add_argument("--sources-file", metavar="FILE",
                     help="a file listing one source per line")
  fleet.add_argument("--destination-root", metavar="DIR",
                     help="where the Orbax roots are created (required "
                     "unless --merge-reports)")
  fleet.add_argument("--source-root", metavar="DIR",
                     help="the directory whose layout the destination root "
                     "mirrors (default: recorded in the destination root, "
                     "else the directory above the globs' first wildcard)")
  fleet.add_argument("--parallelism", type=int, default=2, metavar="N",
                     help="worker processes, i.e. runs migrated at the same "
                     "time (default 2)")
  fleet.add_argument("--num-shards", type=int, default=1, metavar="N",
                     help="split the fleet into N shards (machines)")
  fleet.add_argument("--shard-index", type=int, metavar="I",
                     help="the shard to migrate, 0 <= I < N (default "
                     f"${_INDEX_ENV} when --num-shards > 1)")
  fleet.add_argument("--report", metavar="FILE",
                     help="the JSON report (default migration_report.json, "
                     "or migration_report-<I>-of-<N>.json for a shard)")
  fleet.add_argument("--merge-reports", metavar="OUT",
                     help="migrate nothing: merge the reports given as "
                     "arguments into OUT")
  fleet.add_argument("--dry-run", action="store_true",
                     help="print the plan (runs, destinations, skipped paths "
                     "and why); write nothing")
  fleet.add_argument("--checkpoints", choices=("all", "latest"),
                     dest="checkpoints", default=argparse.SUPPRESS,
                     help="same as --all / --latest")
  parser.add_argument("reports", nargs="*", metavar="REPORT",
                      help="with --merge-reports: the reports to merge")
  dests = _add_migrate_options(parser)
  return parser, dests


def normalize_argv(argv: Sequence[str]) -> list[str]:
  """`--flag_name[=value]` spelled `--flag-name[=value]` (before `--`)."""
  out = []
  for i, arg in enumerate(argv):
    if arg == "--":
      return out + list(argv[i:])
    if arg.startswith("--"):
      name, eq, value = arg.partition("=")
      arg = name.replace("_", "-") + eq + value
    out.append(arg)
  return out


def migrate_options(args: argparse.Namespace, dests: Sequence[str]
                    ) -> dict[str, Any]:
  """The passed-through options' values, by destination."""
  return {d: getattr(args, d) for d in dests if hasattr(args, d)}


# --------------------------------------------------------------------------
# The worker: one process, many runs.
# --------------------------------------------------------------------------

# `clu-ckpt migrate` option -> `migration.migrate` keyword, for the options
# passed as they are.
_SAME = ("step_naming", "state_host", "compression", "verify", "step_prefix",
         "step_format_fixed_length", "allow_other_sources")


def migrate_kwargs(options: Mapping[str, Any]) -> dict[str, Any]:
  """`migration.migrate` keywords from `clu-ckpt migrate`'s option values.

  Raises:
    UsageError: An option this script does not know how to pass (a newer
      `clu-ckpt migrate` option), given a value other than its default.
  """
  known = set(_SAME) | {"checkpoints", "numbers", "max_inflight_mib",
                        "template"}
  unknown = [k for k, v in options.items() if k not in known and v not in (
      None, False)]
  if unknown:
    raise UsageError(f"--{unknown[0].replace('_', '-')} is not supported by "
                     f"{_PROG} yet; use clu-ckpt migrate")
  kwargs = {k: options[k] for k in _SAME if k in options}
  kwargs["checkpoints"] = (options.get("numbers") or
                           options.get("checkpoints") or "all")
  mib = options.get("max_inflight_mib")
  kwargs["inflight_bytes"] = None if mib is None else max(1, mib) * _MIB
  return kwargs


class _Worker:
  """The worker process's loop: read a run, migrate it, answer.

  Protocol (JSON lines): stdin first `{"options": {...}}`, then one
  `{"source", "destination"}` per run; each answered on the result pipe
  (the original stdout; stdout itself goes to stderr) by the run's entry.
  """

  def __init__(self):
    self.running = False
    self.stopped = False
    self._template: Any = None
    self._template_error: Optional[str] = None
    self._template_loaded = False

  def on_signal(self, signum: int, frame: Any) -> None:
    del frame
    if self.stopped:
      return  # one interruption per worker: the abandon runs undisturbed
    self.stopped = True
    if self.running:
      raise KeyboardInterrupt()
    sys.exit(128 + signum)

  def template(self, spec: Optional[str]) -> Any:
    """The template of `--template`, loaded once per worker."""
    if spec is None:
      return None
    if not self._template_loaded:
      from clu_ckpt import cli  # pylint: disable=g-import-not-at-top
      try:
        self._template = cli.load_template(spec)
      except Exception as e:  # pylint: disable=broad-except
        self._template_error = str(e)
      self._template_loaded = True
    if self._template_error is not None:
      raise _RunError(self._template_error)
    return self._template

  def migrate(self, task: Mapping[str, Any], options: Mapping[str, Any]
              ) -> dict[str, Any]:
    """Migrates one run; its report entry (never raises but to stop)."""
    from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
    start = time.time()
    entry = {"source": task["source"], "destination": task["destination"]}
    self.running = True  # a stop now interrupts this run
    try:
      try:
        kwargs = migrate_kwargs(options)
        template = self.template(options.get("template"))
        summary = migration.migrate(task["source"], task["destination"],
                                    template=template, **kwargs)
      finally:
        self.running = False
    except migration.MigrationInterrupted as e:
      entry.update(status="interrupted", summary=e.summary.to_json(),
                   error=_interrupted_text(e))
      self.stopped = True
    except KeyboardInterrupt:
      entry.update(status="interrupted", error="interrupted")
      self.stopped = True
    except (_RunError, UsageError) as e:
      entry.update(status="error", error=str(e))
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc()
      entry.update(status="error", error=migration.describe_error(e))
    else:
      entry["summary"] = summary.to_json()
      if summary.ok:
        entry["status"] = "ok"
      else:
        entry.update(status="failed", error="; ".join(
            f"ckpt-{s.number}: {s.error}" for s in summary.failed))
    entry["seconds"] = round(time.time() - start, 3)
    return entry


class _RunError(Exception):
  """A run that cannot start (its message is the report's error)."""


def _interrupted_text(e: Any) -> str:
  steps = e.summary.steps
  done = [s for s in steps if s.status in ("migrated", "skipped")]
  total = len(steps) + len(e.remaining)
  text = f"interrupted: {len(done)} of {total} checkpoints migrated"
  abandoned = e.abandoned
  if abandoned is not None:
    text += f"; ckpt-{abandoned.number} abandoned"
  return text + "; re-run to resume"


def _die_with_parent() -> None:
  """Asks Linux for SIGTERM (a clean stop) when the fleet process dies."""
  try:
    import ctypes  # pylint: disable=g-import-not-at-top
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
  except (OSError, AttributeError):
    pass


def worker_main() -> int:
  """The `--worker` process (started by the fleet; not for people)."""
  parent = os.getppid()
  _die_with_parent()
  if os.getppid() != parent:
    return 1
  results = os.fdopen(os.dup(1), "w", buffering=1)
  os.dup2(2, 1)  # libraries' prints go to the log, not to the results
  worker = _Worker()
  signal.signal(signal.SIGINT, worker.on_signal)
  signal.signal(signal.SIGTERM, worker.on_signal)
  try:
    options = json.loads(sys.stdin.readline() or "{}").get("options", {})
    if not os.environ.get("CLU_CKPT_FLEET_VERBOSE"):
      _quiet_libraries()
    # Imported once, before the first run: a worker that cannot import it
    # dies before taking a run (and the fleet gives up after a few).
    from clu_ckpt import migration  # pylint: disable=g-import-not-at-top,unused-import
    results.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
      if worker.stopped:
        break
      entry = worker.migrate(json.loads(line), options)
      results.write(json.dumps(entry) + "\n")
      if worker.stopped:
        break
  except (KeyboardInterrupt, SystemExit, BrokenPipeError):
    pass
  return 0


def _quiet_libraries() -> None:
  import logging  # pylint: disable=g-import-not-at-top
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  absl_logging.set_verbosity(absl_logging.FATAL)
  for name in ("absl", "asyncio", "jax", "orbax", "tensorflow",
               "google.auth"):
    logging.getLogger(name).setLevel(logging.CRITICAL)
  # An abandoned step's writes end in callbacks on a closed event loop.
  sys.unraisablehook = threading.excepthook = lambda *_: None


# --------------------------------------------------------------------------
# The pool: long-lived workers, replaced when they die.
# --------------------------------------------------------------------------


def _child_environment(environ: Mapping[str, str]) -> dict[str, str]:
  """`environ`, with this checkout's `clu_ckpt` first on PYTHONPATH."""
  checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(environ)
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  if os.path.isfile(os.path.join(checkout, "clu_ckpt", "__init__.py")):
    env["PYTHONPATH"] = os.pathsep.join(
        [checkout] + [p for p in [environ.get("PYTHONPATH")] if p])
  return env


class _WorkerProcess:
  """The fleet's handle on one worker: its process, log and current run."""

  def __init__(self, number: int, options: Mapping[str, Any],
               messages: "queue.Queue[tuple[_WorkerProcess, Any]]",
               verbose: bool):
    self.number = number
    self.run: Optional[Run] = None
    self.started: float = 0.0
    self.killed = False
    env = _child_environment(os.environ)
    if verbose:
      env["CLU_CKPT_FLEET_VERBOSE"] = "1"
      self.log = None
    else:
      self.log = tempfile.TemporaryFile(prefix="migrate_runs-worker-")
    # Its own session: a terminal's Ctrl-C reaches the fleet alone, which
    # then stops the workers itself (one SIGINT each, at the right moment).
    self.process = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
        env=env, text=True, start_new_session=True)
    self.process.stdin.write(json.dumps({"options": options}) + "\n")
    self.process.stdin.flush()
    self.ready = False
    threading.Thread(target=self._read, args=(messages,), daemon=True,
                     name=f"worker-{number}-reader").start()

  def _read(self, messages: "queue.Queue[tuple[_WorkerProcess, Any]]"
            ) -> None:
    for line in self.process.stdout:
      try:
        messages.put((self, json.loads(line)))
      except json.JSONDecodeError:
        continue
    self.process.wait()
    messages.put((self, None))

  def send(self, run: Run) -> None:
    self.run = run
    self.started = time.time()
    self.process.stdin.write(json.dumps(
        {"source": run.source, "destination": run.destination}) + "\n")
    self.process.stdin.flush()

  def close_input(self) -> None:
    try:
      self.process.stdin.close()
    except OSError:
      pass

  def signal(self, signum: int) -> None:
    try:
      self.process.send_signal(signum)
    except (OSError, ProcessLookupError):
      pass

  def death(self) -> str:
    """Why the worker died, for its run's report entry."""
    code = self.process.returncode
    if self.killed:
      return "stopped at once (second interrupt, or the stop timed out)"
    if code is not None and code < 0:
      try:
        name = signal.Signals(-code).name
      except ValueError:
        name = f"signal {-code}"
      cause = f"killed by {name}"
      if -code == signal.SIGKILL:
        cause += " (out of memory?)"
    else:
      cause = f"exit status {code}"
    last = self._last_log_line()
    return (f"worker process died ({cause}) while migrating this run"
            + (f"; its last message: {last}" if last else ""))

  def _last_log_line(self) -> str:
    if self.log is None:
      return ""
    try:
      self.log.seek(0, os.SEEK_END)
      size = self.log.tell()
      self.log.seek(max(0, size - 4096))
      lines = self.log.read().decode("utf-8", "replace").strip().splitlines()
    except OSError:
      return ""
    return lines[-1].strip()[:300] if lines else ""


class Fleet:
  """Migrates runs in `parallelism` long-lived workers; stops cleanly.

  `run` calls `on_entry(entry)` (in the main thread) as each run finishes.
  `stop(signum)` (from a signal handler) starts no new run and interrupts
  the runs under way; a second `stop` kills the workers at once.
  """

  def __init__(self, runs: Sequence[Run], options: Mapping[str, Any],
               parallelism: int, on_entry: Callable[[dict[str, Any]], None],
               verbose: bool = False, stop_seconds: float = STOP_SECONDS):
    self._pending = list(runs)
    self._options = dict(options)
    self._parallelism = max(1, parallelism)
    self._on_entry = on_entry
    self._verbose = verbose
    self._stop_seconds = stop_seconds
    self._messages: "queue.Queue[tuple[_WorkerProcess, Any]]" = queue.Queue()
    self._workers: list[_WorkerProcess] = []
    self._started = 0
    self.stop_signal: Optional[int] = None
    self._stop_deadline = float("inf")
    self._failed_starts = 0

  def stop(self, signum: int) -> None:
    """A stop request (signal handler): the first stops, the second kills."""
    if self.stop_signal is not None:
      self.kill()
      return
    self.stop_signal = signum
    self._stop_deadline = time.monotonic() + self._stop_seconds
    for w in self._workers:
      if w.run is not None:
        w.signal(signal.SIGINT)
      else:
        w.close_input()

  def kill(self) -> None:
    """Kills every worker now (their runs are reported interrupted)."""
    for w in self._workers:
      w.killed = True
      w.signal(signal.SIGKILL)

  def run(self) -> None:
    """Migrates every run (or until stopped)."""
    try:
      while True:
        self._dispatch()
        busy = [w for w in self._workers if w.run is not None]
        if not busy and (self.stop_signal is not None or not self._pending):
          break
        self._handle_next_message()
    finally:
      for w in self._workers:
        w.close_input()
      for w in self._workers:
        try:
          w.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
          w.signal(signal.SIGKILL)

  def _dispatch(self) -> None:
    if self.stop_signal is not None:
      return
    for w in self._workers:
      if w.run is None and w.ready and w.process.poll() is None and (
          self._pending):
        w.send(self._pending.pop(0))
    alive = [w for w in self._workers if w.process.poll() is None]
    waiting = sum(1 for w in alive if not w.ready)
    while (len(alive) < self._parallelism and
           len(self._pending) > waiting):
      self._started += 1
      w = _WorkerProcess(self._started, self._options, self._messages,
                         self._verbose)
      self._workers.append(w)
      alive.append(w)
      waiting += 1

  def _handle_next_message(self) -> None:
    try:
      worker, message = self._messages.get(timeout=0.2)
    except queue.Empty:
      if time.monotonic() > self._stop_deadline:
        self.kill()
        self._stop_deadline = float("inf")
      return
    if message is None:  # the worker ended
      self._workers.remove(worker)
      if not worker.ready and self.stop_signal is None:
        self._failed_start(worker)
      if worker.run is not None:
        status = "interrupted" if self.stop_signal is not None else "error"
        self._finish(worker, {"source": worker.run.source,
                              "destination": worker.run.destination,
                              "status": status, "error": worker.death(),
                              "seconds": round(time.time() - worker.started,
                                               3)})
      return
    if message.get("ready"):
      worker.ready = True
      self._failed_starts = 0
      if self.stop_signal is not None:
        worker.close_input()
      return
    self._finish(worker, message)

  def _failed_start(self, worker: _WorkerProcess) -> None:
    """A worker died before taking a run: after 3 in a row, give up."""
    self._failed_starts += 1
    if self._failed_starts < _MAX_FAILED_STARTS:
      return
    error = worker.death().replace(" while migrating this run",
                                   " before taking a run")
    while self._pending:
      run = self._pending.pop(0)
      self._on_entry({"source": run.source, "destination": run.destination,
                      "status": "error", "error": error, "seconds": 0.0})

  def _finish(self, worker: _WorkerProcess, entry: dict[str, Any]) -> None:
    worker.run = None
    self._on_entry(entry)


# --------------------------------------------------------------------------
# Progress.
# --------------------------------------------------------------------------


def format_bytes(nbytes: float) -> str:
  """`1288490188` -> "1.2 GiB" (binary units throughout)."""
  units = ("B", "KiB", "MiB", "GiB", "TiB")
  scale = 0
  while nbytes >= 1024 and scale < len(units) - 1:
    nbytes /= 1024
    scale += 1
  return f"{nbytes:.0f} B" if not scale else f"{nbytes:.1f} {units[scale]}"


def format_seconds(seconds: float) -> str:
  """`35` -> "35 s", `130` -> "2 min", `4000` -> "1 h 7 min"."""
  if seconds < 60:
    return f"{seconds:.0f} s"
  minutes = round(seconds / 60)
  return f"{minutes} min" if minutes < 60 else (
      f"{minutes // 60} h {minutes % 60} min")


def describe_run(entry: Mapping[str, Any]) -> str:
  """`source status (steps, bytes written, seconds)[: error]` of a run."""
  details = _step_details((entry.get("summary") or {}).get("steps"))
  details.append(format_seconds(entry.get("seconds", 0)))
  note = f": {entry['error']}" if entry.get("error") else ""
  return f"{entry['source']} {entry['status']} ({', '.join(details)}){note}"


def _step_details(steps: Optional[Sequence[Mapping[str, Any]]]) -> list[str]:
  """["4 steps", "1 skipped", "1.2 GiB" (not skipped)], or [] for None."""
  if steps is None:
    return []
  skipped = sum(1 for s in steps if s.get("status") == "skipped")
  nbytes = sum(s.get("nbytes", 0) for s in steps
               if s.get("status") != "skipped")
  return ([f"{len(steps)} step{'' if len(steps) == 1 else 's'}"] +
          ([f"{skipped} skipped"] if skipped else []) + [format_bytes(nbytes)])


class ProgressPrinter:
  """Prints `[i/N] <run>; <bytes> of <total>, <k> failed, ETA ...`.

  Bytes are the runs' source sizes when listed; the ETA extrapolates the
  fraction done (by bytes when sizes are known, else by runs). On a
  non-terminal, one line per run; on a terminal, one line rewritten in
  place, except that runs not ok keep their line.
  """

  def __init__(self, total: int, stream: TextIO,
               clock: Callable[[], float] = time.time,
               total_bytes: int = 0):
    self._total = total
    self._total_bytes = total_bytes
    self._stream = stream
    self._clock = clock
    self._start = clock()
    self._done = 0
    self._done_bytes = 0
    self._failures = 0
    self._tty = stream.isatty()
    self._pending_newline = False

  def run_done(self, entry: Mapping[str, Any], nbytes: int = 0) -> None:
    """Reports one finished run (of `nbytes` source bytes)."""
    self._done += 1
    if entry["status"] in FINISHED:
      self._done_bytes += nbytes
    if entry["status"] in ("failed", "error"):
      self._failures += 1
    line = (f"[{self._done}/{self._total}] {describe_run(entry)}; "
            f"{self._totals()}")
    if not self._tty:
      print(line, file=self._stream, flush=True)
      return
    self._stream.write(f"\r\x1b[K{line}")
    self._pending_newline = True
    if entry["status"] != "ok":
      self.close()
    self._stream.flush()

  def _totals(self) -> str:
    parts = []
    if self._total_bytes:
      parts.append(f"{format_bytes(self._done_bytes)} of "
                   f"{format_bytes(self._total_bytes)}")
    parts.append(f"{self._failures} failure{'' if self._failures == 1 else 's'}")
    elapsed = self._clock() - self._start
    if self._done >= self._total:
      parts.append(f"all done in {format_seconds(elapsed)}")
    else:
      fraction = (self._done_bytes / self._total_bytes if self._total_bytes
                  and self._done_bytes else self._done / self._total)
      parts.append(f"ETA {format_seconds(elapsed / fraction - elapsed)}")
    return ", ".join(parts)

  def close(self) -> None:
    """Ends a line left open on a terminal."""
    if self._pending_newline:
      self._stream.write("\n")
      self._stream.flush()
      self._pending_newline = False


# --------------------------------------------------------------------------
# Reports.
# --------------------------------------------------------------------------


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds")


def count_statuses(runs: Sequence[Mapping[str, Any]]) -> dict[str, int]:
  """{"ok": n, "failed": n, "error": n, ...other statuses present} of runs."""
  counts = {s: 0 for s in FINISHED}
  for r in runs:
    counts[r["status"]] = counts.get(r["status"], 0) + 1
  return counts


def write_report(path: str, report: Mapping[str, Any]) -> None:
  """Writes `report` as JSON, atomically (a reader never sees half of it)."""
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  with storage.atomic_writer(path) as write:
    write(json.dumps(report, indent=1).encode("utf-8"))


def prepare_report(path: str) -> None:
  """Checks that a report can be written at `path`, making its directory.

  Raises:
    UsageError: It cannot (a directory there, no permission, ...).
  """
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  if not _split_url(path)[0]:
    if os.path.isdir(path):
      raise UsageError(f"--report {path}: is a directory")
    directory = os.path.dirname(os.path.abspath(path))
    try:
      os.makedirs(directory, exist_ok=True)
    except OSError as e:
      raise UsageError(f"--report {path}: cannot make {directory}: "
                       f"{e.strerror or e}") from None
    if not os.access(directory, os.W_OK):
      raise UsageError(f"--report {path}: {directory} is not writable")
  else:
    storage.makedirs(posixpath.dirname(path))


def load_report(path: str) -> dict[str, Any]:
  """A report written by this script (complete or partial).

  Raises:
    UsageError: Unreadable, not JSON, or not a report.
  """
  try:
    with open(path) as f:
      report = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise UsageError(f"cannot read report {path}: {e}") from None
  if not (isinstance(report, dict) and isinstance(report.get("runs"), list)
          and "destination_root" in report):
    raise UsageError(f"{path} is not a {_PROG} report")
  return report


def merge_reports(reports: Sequence[tuple[str, Mapping[str, Any]]]
                  ) -> dict[str, Any]:
  """Merges shard reports of one fleet (partial ones too) into one report.

  Args:
    reports: (path, report) pairs. When a source is in several, a finished
      entry ("ok", "failed", "error") wins over an unfinished one
      ("pending", "interrupted"); among equals, that of the newest report
      ("created"; ties: the later pair).

  Returns:
    The merged report: every run with its "shard", every skipped path, the
    reports merged, the shards missing (when all reports agree on the shard
    count), counts, "complete" (every report was) and "ok" (every run ok,
    no shard missing, no run of the fleet missing).

  Raises:
    UsageError: No reports, or reports of different destination roots.
  """
  if not reports:
    raise UsageError("--merge-reports needs the reports to merge as arguments")
  root = _same_destination_root(reports)
  order = sorted(range(len(reports)),
                 key=lambda i: (reports[i][1].get("created", ""), i))
  runs: dict[str, dict[str, Any]] = {}
  skipped: dict[str, Any] = {}
  for i in order:
    path, report = reports[i]
    for run in report["runs"]:
      previous = runs.get(run["source"])
      if (previous is not None and previous["status"] in FINISHED and
          run["status"] not in FINISHED):
        continue
      runs[run["source"]] = dict(run, report=path,
                                 shard=run.get("shard", _shard(report)[0]))
    for s in report.get("skipped", []):
      skipped[s["path"]] = s
  merged_runs = [runs[s] for s in sorted(runs)]
  missing = _missing_shards([r for _, r in reports])
  fleet_size = max(r.get("fleet_size", len(r["runs"])) for _, r in reports)
  counts = count_statuses(merged_runs)
  return {
      "created": _now(),
      "destination_root": root,
      "merged_from": [_merged_from(p, r) for p, r in reports],
      "fleet_size": fleet_size,
      "missing_shards": missing,
      "complete": all(r.get("complete", True) for _, r in reports),
      "counts": counts,
      "ok": (counts["ok"] == len(merged_runs) == fleet_size and
             not missing),
      "runs": merged_runs,
      "skipped": [skipped[p] for p in sorted(skipped)],
  }


def _same_destination_root(reports: Sequence[tuple[str, Mapping[str, Any]]]
                           ) -> str:
  first_path, first = reports[0]
  root = first["destination_root"]
  for path, report in reports[1:]:
    if os.path.normpath(report["destination_root"]) != os.path.normpath(root):
      raise UsageError(
          f"refusing to merge reports of different fleets: {first_path} "
          f"migrated into {root}, {path} into {report['destination_root']}")
  return root


def _shard(report: Mapping[str, Any]) -> tuple[int, int]:
  """(shard index, shard count) of a report (0, 1 for an unsharded one)."""
  return report.get("shard_index", 0), report.get("num_shards", 1)


def _missing_shards(reports: Sequence[Mapping[str, Any]]) -> list[int]:
  counts = {_shard(r)[1] for r in reports}
  if len(counts) != 1:
    return []
  return sorted(set(range(counts.pop())) - {_shard(r)[0] for r in reports})


def _merged_from(path: str, report: Mapping[str, Any]) -> dict[str, Any]:
  index, count = _shard(report)
  return {"report": path, "created": report.get("created"),
          "shard_index": index, "num_shards": count,
          "complete": report.get("complete", True),
          "runs": len(report["runs"])}


# --------------------------------------------------------------------------
# The modes.
# --------------------------------------------------------------------------


def run_merge(args: argparse.Namespace) -> int:
  """`--merge-reports=OUTPUT PATH...`: the exit status."""
  if args.sources or args.source_glob or args.sources_file or args.report:
    raise UsageError("--merge-reports=OUT writes OUT from the reports given "
                     "as arguments; it takes no sources and no --report")
  merged = merge_reports([(p, load_report(p)) for p in args.reports])
  write_report(args.merge_reports, merged)
  counts = merged["counts"]
  others = "".join(f", {n} {s}" for s, n in counts.items()
                   if s not in FINISHED)
  missing = (f"; shards missing: {merged['missing_shards']}"
             if merged["missing_shards"] else "")
  print(f"{len(merged['runs'])} of {merged['fleet_size']} run(s): "
        f"{counts['ok']} ok, {counts['failed']} failed, {counts['error']} "
        f"error{others}{missing}; report: {args.merge_reports}")
  return 0 if merged["ok"] else 1


class _Shard:
  """One shard's migration: the plan, the report, the workers, the stop."""

  def __init__(self, args: argparse.Namespace, options: Mapping[str, Any],
               num_shards: int, shard_index: int):
    self.args = args
    self.options = dict(options)
    self.num_shards = num_shards
    self.shard_index = shard_index
    self.report_path = args.report or _default_report(num_shards,
                                                      shard_index)
    self.entries: dict[str, dict[str, Any]] = {}
    self.created = _now()

  def plan(self) -> tuple[Plan, list[Run], str]:
    """(the fleet's plan, this shard's runs, the source root)."""
    args = self.args
    if not args.destination_root:
      raise UsageError("--destination-root is required")
    migrate_kwargs(self.options)  # unknown options: refused now
    if self.options.get("template") is not None:
      from clu_ckpt import cli  # pylint: disable=g-import-not-at-top
      if not cli._TEMPLATE_SPEC.match(self.options["template"]):  # pylint: disable=protected-access
        raise UsageError(f"--template {self.options['template']!r}: "
                         "expected MODULE:FUNCTION")
    sources = [s for group in args.sources for s in group.split(",") if s]
    if args.sources_file:
      sources += read_sources_file(args.sources_file)
    if not sources and not args.source_glob:
      raise UsageError("no sources: pass --sources, --source-glob or "
                       "--sources-file")
    recorded = read_recorded_root(args.destination_root)
    root = choose_source_root(args.source_root, recorded, args.source_glob,
                              sources)
    plan = plan_fleet(sources, args.source_glob)
    assign_destinations(plan.runs, root, args.destination_root)
    mine = set(shard_sources([r.source for r in plan.runs], self.num_shards,
                             self.shard_index))
    return plan, [r for r in plan.runs if r.source in mine], root

  def report(self, plan: Plan, runs: Sequence[Run], root: str,
             complete: bool) -> dict[str, Any]:
    entries = []
    for run in runs:
      entry = self.entries.get(run.source) or {
          "source": run.source, "destination": run.destination,
          "status": "pending"}
      entries.append(dict(entry, shard=self.shard_index, kind=run.kind,
                          source_bytes=run.nbytes))
    return {
        "created": self.created,
        "updated": _now(),
        "complete": complete,
        "destination_root": self.args.destination_root,
        "source_root": root,
        "fleet_size": len(plan.runs),
        "num_shards": self.num_shards,
        "shard_index": self.shard_index,
        "options": self.options,
        "counts": count_statuses(entries),
        "runs": entries,
        "skipped": [dataclasses.asdict(s) for s in plan.skipped],
    }


def print_plan(plan: Plan, runs: Sequence[Run], out: TextIO,
               dry_run: bool) -> None:
  """The skipped paths (always), and the runs (dry run: "would migrate")."""
  for s in plan.skipped:
    print(f"skipped {s.path}: {s.reason}", file=out)
  if not dry_run:
    return
  for run in runs:
    if run.error:
      print(f"cannot migrate {run.source}: {run.error}", file=out)
      continue
    hosts = f", {len(run.hosts)} hosts" if run.hosts else ""
    print(f"would migrate {run.source} -> {run.destination} ({run.kind}"
          f"{hosts}, {format_bytes(run.nbytes)})", file=out)


def run_shard(args: argparse.Namespace, options: Mapping[str, Any],
              num_shards: int, shard_index: int) -> int:
  """Migrates the runs of one shard (all when unsharded): the status."""
  shard = _Shard(args, options, num_shards, shard_index)
  plan, runs, root = shard.plan()
  of = (f"shard {shard_index} of {num_shards}: {len(runs)} of "
        f"{len(plan.runs)} run(s)" if num_shards > 1 else
        f"{len(runs)} run(s)")
  total = sum(r.nbytes for r in runs)
  skipped = f"; {len(plan.skipped)} path(s) skipped" if plan.skipped else ""
  if args.dry_run:
    print_plan(plan, runs, sys.stdout, dry_run=True)
    print(f"dry run: would migrate {of} ({format_bytes(total)}) into "
          f"{args.destination_root} (source root {root}){skipped}; wrote "
          "nothing", flush=True)
    return 0 if all(r.error is None for r in runs) else 1
  prepare_report(shard.report_path)
  record_root(args.destination_root, root)
  write_report(shard.report_path, shard.report(plan, runs, root, False))
  print_plan(plan, runs, sys.stdout, dry_run=False)
  print(f"migrating {of} ({format_bytes(total)}) into "
        f"{args.destination_root}, {args.parallelism} at a time{skipped}",
        flush=True)
  progress = ProgressPrinter(len(runs), sys.stdout, total_bytes=total)
  sizes = {r.source: r.nbytes for r in runs}

  def on_entry(entry: dict[str, Any]) -> None:
    shard.entries[entry["source"]] = entry
    write_report(shard.report_path, shard.report(plan, runs, root, False))
    progress.run_done(entry, sizes.get(entry["source"], 0))

  for run in runs:
    if run.error is not None:
      on_entry({"source": run.source, "destination": run.destination,
                "status": "error", "error": run.error, "seconds": 0.0})
  fleet = Fleet([r for r in runs if r.error is None], options,
                args.parallelism, on_entry, verbose=args.verbose)
  previous = {s: signal.signal(s, lambda n, _: fleet.stop(n))
              for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    fleet.run()
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
    progress.close()
  report = shard.report(plan, runs, root, fleet.stop_signal is None)
  write_report(shard.report_path, report)
  counts = report["counts"]
  others = "".join(f", {n} {s}" for s, n in counts.items()
                   if s not in FINISHED)
  print(f"{counts['ok']} ok, {counts['failed']} failed, {counts['error']} "
        f"error{others}; report: {shard.report_path}", flush=True)
  if fleet.stop_signal is not None:
    name = signal.Signals(fleet.stop_signal).name
    print(f"{_PROG}: stopped by {name}: re-run the same command to resume",
          file=sys.stderr)
    return 128 + fleet.stop_signal
  return 0 if counts["ok"] == len(runs) else 1


def _default_report(num_shards: int, shard_index: int) -> str:
  if num_shards == 1:
    return "migration_report.json"
  return f"migration_report-{shard_index}-of-{num_shards}.json"


class _Terminated(KeyboardInterrupt):
  """SIGTERM, before the fleet's own handling starts."""


def _terminated(signum: int, frame: Any) -> None:
  del signum, frame
  raise _Terminated()


def main(argv: Optional[Sequence[str]] = None) -> int:
  """The command line; usage errors: one line, status 2."""
  if argv is None:
    argv = sys.argv[1:]
  if list(argv[:1]) == ["--worker"]:
    return worker_main()
  parser, dests = build_parser()
  args = parser.parse_args(normalize_argv(argv))
  # Before the workers start (planning, a bucket's listing), SIGTERM stops
  # like Ctrl-C: nothing has been written yet but the report.
  signal.signal(signal.SIGTERM, _terminated)
  try:
    if args.parallelism < 1:
      raise UsageError(f"--parallelism must be >= 1, not {args.parallelism}")
    if args.merge_reports:
      return run_merge(args)
    if args.reports:
      raise UsageError(f"unexpected arguments: {' '.join(args.reports)}")
    index = resolve_shard(args.num_shards, args.shard_index, os.environ)
    return run_shard(args, migrate_options(args, dests), args.num_shards,
                     index)
  except UsageError as e:
    print(f"{_PROG}: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt as e:
    print(f"{_PROG}: interrupted before any run started", file=sys.stderr)
    return 143 if isinstance(e, _Terminated) else 130
  except Exception as e:  # pylint: disable=broad-except
    if args.verbose:
      traceback.print_exc()
    if isinstance(e, OSError) and e.filename is not None:
      text = f"{e.filename}: {e.strerror or e}"
    else:
      text = (str(e).strip().splitlines() or [""])[0]
      text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    print(f"{_PROG}: error: {text}", file=sys.stderr)
    return 1


if __name__ == "__main__":
  sys.exit(main())
