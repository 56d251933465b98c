r"""Where each run of a fleet goes: its destination, and its shard (machine).

Synopsis::

  from clu_ckpt.migration import fleet_assignment, fleet_discovery

  plan = fleet_discovery.plan_fleet([], ["/runs/*/checkpoints"])
  recorded = fleet_assignment.read_recorded_root("/orbax_runs")
  root = fleet_assignment.choose_source_root(
      None, recorded, ["/runs/*/checkpoints"])              # "/runs"
  fleet_assignment.assign_destinations(plan.runs, root, "/orbax_runs")
  # /runs/a/checkpoints -> /orbax_runs/a/checkpoints
  mine = fleet_assignment.shard_sources(
      [r.source for r in plan.runs], num_shards=3, shard_index=0)

A run's destination is `<destination-root>/<the run's path relative to the
source root>`: a function of the run and of the source root alone, so a
retry naming one run writes where the fleet did. The source root is
`--source-root`, or the one recorded in `<destination-root>/FLEET_FILE` by an
earlier run, or (first run) the directory above the first wildcard of the
globs. It is recorded by the first migration into the destination root; a
later command giving another root is refused.

Layout of the record::

  <destination-root>/clu_ckpt_fleet.json
    {"format": "clu_ckpt.fleet/1", "source_root": "/runs", "created": ...}

Shards: a run's shard is the SHA-256 of its source path (as listed) modulo
the shard count: the same on every machine, independent of the other runs.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import posixpath
from typing import Mapping, Optional, Sequence

from clu_ckpt.errors import UsageError
from clu_ckpt.migration.fleet_discovery import absolute_path
from clu_ckpt.migration.fleet_discovery import glob_prefix
from clu_ckpt.migration.fleet_discovery import join_path
from clu_ckpt.migration.fleet_discovery import normalize_path
from clu_ckpt.migration.fleet_discovery import parent_path
from clu_ckpt.migration.fleet_discovery import relative_path
from clu_ckpt.migration.fleet_discovery import Run
from clu_ckpt.migration.fleet_discovery import split_url

# The source root recorded in a destination root.
FLEET_FILE = "clu_ckpt_fleet.json"
_FLEET_FORMAT = "clu_ckpt.fleet/1"
# The environment variable of a Kubernetes indexed Job's index.
INDEX_ENV = "JOB_COMPLETION_INDEX"


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds")


# --------------------------------------------------------------------------
# Destinations.
# --------------------------------------------------------------------------


def read_recorded_root(destination_root: str) -> Optional[str]:
  """The source root a destination root records (`FLEET_FILE`).

  Args:
    destination_root: The fleet's destination root (local or a URL).

  Returns:
    The recorded source root, or None when nothing is recorded yet.

  Raises:
    UsageError: The record is unreadable or not a fleet record.
  """
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  path = join_path(destination_root, FLEET_FILE)
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

  Made with an exclusive create: of shards starting together, the first
  records, the others read what it recorded.

  Args:
    destination_root: The fleet's destination root (made if missing).
    source_root: The absolute source root this command uses.

  Raises:
    UsageError: Another source root is recorded (a concurrent shard wrote
      first with another root).
  """
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  storage.makedirs(destination_root)
  data = json.dumps({"format": _FLEET_FORMAT, "source_root": source_root,
                     "created": _now()}, indent=1).encode("utf-8")
  try:
    storage.create_exclusive(join_path(destination_root, FLEET_FILE), data)
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
    root = normalize_path(absolute_path(explicit))
    if recorded is not None and normalize_path(recorded) != root:
      raise UsageError(f"--source-root={explicit}: the destination root "
                       f"mirrors {recorded} (recorded in {FLEET_FILE})")
    return root
  if recorded is not None:
    return normalize_path(recorded)
  if not globs:
    raise UsageError(
        "--sources without --source-glob needs --source-root (the directory "
        "whose layout the destination root mirrors), e.g. --source-root=/runs"
        " for --sources=/runs/a/checkpoints -> <destination-root>/a/"
        "checkpoints")
  prefixes = [absolute_path(glob_prefix(g)) for g in globs] + [
      parent_path(absolute_path(normalize_path(s))) for s in sources]
  schemes = {split_url(p)[0] for p in prefixes}
  if len(schemes) > 1:
    raise UsageError("globs on different stores: give --source-root, or "
                     "migrate each store's runs with its own command")
  scheme = schemes.pop()
  if scheme:
    keys = [split_url(p)[1] for p in prefixes]
    if len({k.split("/", 1)[0] for k in keys}) > 1:
      raise UsageError("globs in several buckets: migrate each bucket's runs "
                       "with its own command")
    return scheme + posixpath.commonpath(keys)
  return os.path.commonpath(prefixes)


def assign_destinations(runs: Sequence[Run], source_root: str,
                        destination_root: str) -> None:
  """Sets each run's destination: `<destination_root>/<source - root>`.

  Checks the whole fleet before anything is written.

  Args:
    runs: The plan's runs; their `destination` is set.
    source_root: The absolute source root (`choose_source_root`).
    destination_root: The fleet's destination root, as given.

  Raises:
    UsageError: A run outside the source root (or the root itself), two
      runs with one destination, a destination inside another, or a
      destination inside a source.
  """
  owner: dict[str, str] = {}
  for run in runs:
    relative = relative_path(absolute_path(run.source), source_root)
    if relative is None:
      raise UsageError(f"{run.source} is not inside the source root "
                       f"{source_root}: give a --source-root above every run")
    run.destination = normalize_path(join_path(destination_root, relative))
    if run.destination in owner:
      raise UsageError(f"{owner[run.destination]} and {run.source} would both "
                       f"migrate into {run.destination}")
    owner[run.destination] = run.source
  absolute = sorted((absolute_path(d), s) for d, s in owner.items())
  for (d1, s1), (d2, s2) in zip(absolute, absolute[1:]):
    if relative_path(d2, d1) is not None:
      raise UsageError(f"the destination of {s2} ({d2}) is inside that of "
                       f"{s1} ({d1})")
  destinations = _spellings(destination_root)
  for run in runs:
    for directory in [run.source, *run.hosts]:
      for destination in destinations:
        for directory_path in _spellings(directory):
          if (relative_path(destination, directory_path) or
              destination == directory_path):
            raise UsageError(f"--destination-root={destination_root} is "
                             f"inside the source {directory}" +
                             _through_links(destination_root, destination))


def _spellings(path: str) -> list[str]:
  """`path` absolute, and locally also with its symbolic links resolved.

  Both are compared: a destination root reached through a link into a
  source is inside it (deleting the sources after the migration would
  delete the migrated steps too).
  """
  absolute = normalize_path(absolute_path(path))
  if split_url(path)[0]:
    return [absolute]
  return list(dict.fromkeys([absolute, os.path.realpath(absolute)]))


def _through_links(given: str, compared: str) -> str:
  if compared == normalize_path(absolute_path(given)):
    return ""
  return f" (through symbolic links it is {compared})"


# --------------------------------------------------------------------------
# Shards.
# --------------------------------------------------------------------------


def shard_of(source: str, num_shards: int) -> int:
  """The shard of `source`: SHA-256 of its path, modulo `num_shards`.

  The same on every machine and Python process (unlike `hash`), and
  independent of the other sources.

  Args:
    source: A run's source path, as listed (a local name that is not
      UTF-8 holds its bytes as surrogates: hashed as those bytes).
    num_shards: The shard count (>= 1).

  Returns:
    Its shard index, in [0, num_shards).
  """
  digest = hashlib.sha256(
      source.encode("utf-8", "surrogateescape")).digest()
  return int.from_bytes(digest[:8], "big") % num_shards


def shard_sources(sources: Sequence[str], num_shards: int,
                  shard_index: int) -> list[str]:
  """The sources one shard migrates.

  Args:
    sources: Every run's source path (the whole fleet).
    num_shards: The shard count.
    shard_index: The shard.

  Returns:
    The sources whose `shard_of` is `shard_index`, sorted.
  """
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
    if INDEX_ENV not in environ:
      raise UsageError(f"--num-shards={num_shards} needs --shard-index (or "
                       f"${INDEX_ENV})")
    try:
      shard_index = int(environ[INDEX_ENV])
    except ValueError:
      raise UsageError(f"${INDEX_ENV}={environ[INDEX_ENV]!r} is not an "
                       "integer") from None
  if not 0 <= shard_index < num_shards:
    raise UsageError(f"--shard-index must be in [0, {num_shards}) with "
                     f"--num-shards={num_shards}, not {shard_index}")
  return shard_index


