r"""Which runs a fleet holds: every path a glob matches, a run or skipped.

Synopsis::

  from clu_ckpt.migration import fleet_discovery

  plan = fleet_discovery.plan_fleet(
      sources=["/runs/x/checkpoints"], globs=["/runs/*/checkpoints"])
  for run in plan.runs:        # Run(source, kind, hosts, nbytes, ...)
    print(run.source, run.kind, run.hosts)
  for s in plan.skipped:       # Skipped(path, reason, glob)
    print("skipped", s.path, s.reason)

Every path a glob matches, every `<base>-<int>` a matched base implies,
and every directory under the glob the walk cannot list or enter is a run
(an error when it cannot be migrated as found) or is skipped with its
reason (an empty directory, not a checkpoint directory, a host directory
of a run listed as its base). A `MultihostCheckpoint` keeps its hosts in
`<base>-<int>` directories: a glob or path naming `<base>` covers them
(host 0 missing, a host empty or not CLU's: the run's error), and a glob
matching them only covers their `<base>` (`Run.through_hosts`: they may be
runs of their own, so what some of them lack is kept; one matching `<base>` and
`<base>-<int>` alike cannot tell hosts from runs named so: an error). One
function, `classify`, says what a directory is from its listing. A glob
that matches nothing is an error naming it. In a bucket, each glob costs
one listing.

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
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

from clu_ckpt.errors import UsageError

# CLU names a host's directory `<base>-<host_id>`, the number unpadded.
_HOST_DIR_RE = re.compile(r"^(?P<base>.+)-(?P<host>0|[1-9]\d*)$")
_URL_RE = re.compile(r"^[a-z][a-z0-9.+-]*://", re.I)
# Flax's own `flax.training.checkpoints` layout: `checkpoint_<step>` files.
_FLAX_TRAINING_RE = re.compile(r"^checkpoint_\d+$")


# --------------------------------------------------------------------------
# Paths.
# --------------------------------------------------------------------------


def split_url(path: str) -> tuple[str, str]:
  """A path's scheme and the rest.

  Args:
    path: A local path or a URL.

  Returns:
    ("gs://", "bucket/key") for a URL; ("", path) for a local path.
  """
  m = _URL_RE.match(path)
  return (m.group(0), path[m.end():]) if m else ("", path)


def plain_local(path: str) -> str:
  """A `file://` URL as the local path it names; anything else as is.

  Example::

    plain_local("file:///runs/a")   # "/runs/a"
  """
  from clu_ckpt import layout  # pylint: disable=g-import-not-at-top
  scheme, rest = layout.split_scheme(path)  # file:// -> ("", the path)
  return path if scheme else rest


def normalize_path(path: str) -> str:
  """`path` spelled one way (the key of the plan's comparisons).

  Args:
    path: A local path (relative ones stay relative) or a URL.

  Returns:
    A local path through `os.path.normpath`; a URL with its scheme
    lower-cased and its key normalized (`//`, `..`, a trailing slash).
  """
  scheme, rest = split_url(path)
  if not scheme:
    return os.path.normpath(path)
  return scheme.lower() + posixpath.normpath(rest).lstrip("/")


def absolute_path(path: str) -> str:
  """`path` made absolute against the current directory (a URL: as is).

  Args:
    path: A local path or a URL.

  Returns:
    The absolute path, or the URL.
  """
  return path if split_url(path)[0] else os.path.abspath(path)


def join_path(root: str, relative: str) -> str:
  """`relative` under `root`, with the separator of `root`'s kind.

  Args:
    root: A local directory or a URL.
    relative: A relative path ("/"-separated for a URL).

  Returns:
    The joined path.
  """
  if split_url(root)[0]:
    return f"{root.rstrip('/')}/{relative}"
  return os.path.join(root, relative)


def relative_path(path: str, root: str) -> Optional[str]:
  """`path` relative to `root`, when it is strictly inside it.

  Args:
    path: An absolute path or a URL.
    root: An absolute path or a URL.

  Returns:
    The relative path, or None when `path` is `root` itself, outside it,
    or on another store.
  """
  (s1, p1), (s2, p2) = split_url(path), split_url(root)
  if s1 != s2:
    return None
  module = posixpath if s1 else os.path
  relative = module.relpath(p1, p2)
  if relative == "." or relative == ".." or relative.startswith(".." + "/"):
    return None
  return relative


def parent_path(path: str) -> str:
  """The directory holding `path`.

  Args:
    path: A local path or a URL.

  Returns:
    Its parent (a URL keeps its scheme).
  """
  scheme, rest = split_url(path)
  return scheme + (posixpath if scheme else os.path).dirname(rest)


def _has_wildcard(component: str) -> bool:
  return any(c in component for c in "*?[")


def glob_prefix(pattern: str) -> str:
  """The directory above the first wildcard of `pattern` (its parent if none).

  Args:
    pattern: A glob, e.g. `/runs/*/checkpoints` or `gs://b/x/run-*`.

  Returns:
    The directory, e.g. `/runs` or `gs://b/x`: the default source root.
  """
  scheme, rest = split_url(normalize_path(pattern))
  parts = rest.split("/")
  for i, part in enumerate(parts):
    if _has_wildcard(part):
      return scheme + ("/".join(parts[:i]) or ("/" if not scheme else ""))
  return scheme + ("/".join(parts[:-1]) or
                   ("." if not scheme and not rest.startswith("/") else "/"))


def _matches(path: str, pattern: str) -> bool:
  """Whether `path` matches the glob `pattern` component by component
  (`**`, a whole component, matches any number of them, none included)."""
  return _match_parts(normalize_path(path).split("/"),
                      normalize_path(pattern).split("/"))


def _match_parts(parts: Sequence[str], patterns: Sequence[str]) -> bool:
  if not patterns:
    return not parts
  if patterns[0] == "**":
    return any(_match_parts(parts[i:], patterns[1:])
               for i in range(len(parts) + 1))
  return bool(parts) and fnmatch.fnmatchcase(parts[0], patterns[0]) and (
      _match_parts(parts[1:], patterns[1:]))


# --------------------------------------------------------------------------
# What a directory is: one function.
# --------------------------------------------------------------------------

# Kinds `classify` returns.
CLU = "clu"
FLAX_TRAINING = "flax_training"
EMPTY = "empty"
OTHER = "other"
NOT_DIRECTORY = "not_directory"
UNLISTABLE = "unlistable"
# A directory under a glob that the walk could not list or enter.
UNSEARCHED = "unsearched"

# The reason of a host directory skipped because its base is a run.
HOST_REASON = "host directory of "

_REASONS = {
    EMPTY: "empty directory",
    OTHER: "not a checkpoint directory (no `checkpoint` file, no "
           "<name>-<N>.flax)",
    NOT_DIRECTORY: "not a directory",
}


@dataclasses.dataclass(frozen=True)
class Unlistable:
  """A matched path whose listing failed, and why (a broken symbolic link,
  a link loop, no permission): likely a run, so an error, never a skip."""
  reason: str


@dataclasses.dataclass(frozen=True)
class Unsearched(Unlistable):
  """A directory the glob walk could not list or enter (no permission, an
  I/O error): the runs below it cannot be seen, so an error."""


def classify(entries: "Optional[Mapping[str, int]] | Unlistable") -> str:
  """What a directory is, from its listing alone.

  The one place that decides; a layout the library learns to migrate is
  added here (and to `_MIGRATED_KINDS`).

  Args:
    entries: Name -> size of each entry (-1 for a subdirectory), None
      when the path is not a directory, or `Unlistable`.

  Returns:
    CLU (a `checkpoint` file or a `<name>-<N>.flax`), FLAX_TRAINING (Flax's
    `checkpoint_<step>` files), EMPTY, OTHER, NOT_DIRECTORY or UNLISTABLE.
  """
  from clu_ckpt import layout  # pylint: disable=g-import-not-at-top
  if entries is None:
    return NOT_DIRECTORY
  if isinstance(entries, Unlistable):
    return UNLISTABLE
  if layout.STATE_FILENAME in entries or any(
      layout.FLAX_NAME_RE.match(n) for n in entries):
    return CLU
  if any(_FLAX_TRAINING_RE.match(n) and size >= 0
         for n, size in entries.items()):
    return FLAX_TRAINING
  return EMPTY if not entries else OTHER


# Directories of the Orbax era: a step (`3`, `step_0003`), Flax's Orbax
# checkpoints (`checkpoint_10/`).
_ORBAX_STEP_DIR_RE = re.compile(r"^(?:[^.]*_)?\d+$")


def _orbax_era(entries: "Optional[Mapping[str, int]] | Unlistable") -> str:
  """What a skipped directory says when it holds Orbax-era checkpoint
  directories: checkpoints, but not what this migration reads (not to be
  taken for something the fleet covered)."""
  if not isinstance(entries, Mapping):
    return ""
  steps = sorted(n for n, size in entries.items()
                 if size < 0 and _ORBAX_STEP_DIR_RE.match(n))
  if not steps:
    return ""
  return (f"; it holds Orbax-era checkpoint directories ({', '.join(steps[:3])}"
          f"{', ...' if len(steps) > 3 else ''}: an Orbax root, Flax's Orbax "
          "checkpoints, or a MultihostCheckpoint's layout=\"orbax\" steps), "
          "which this migration does not read: not migrated, keep it")


_NUMBERED_FILE_RE = re.compile(r"^[^.]*\D\d+$")
_FLAX_NAME_RE = re.compile(r"^(?P<prefix>[^.]*\D)\d+$")
# The first byte of a msgpack map (a Flax state): fixmap, map 16, map 32.
_MAP_FIRST_BYTES = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}


def _flax_files_of_another_prefix(path: str, entries: Mapping[str, int]
                                  ) -> bool:
  """Whether `path` holds Flax checkpoint files named with a prefix other
  than `checkpoint_` (`model_100`), as `migrate` finds them
  (`flax_training.find_prefix`, which reads the candidates' first bytes;
  asked only of directories the listing alone does not classify)."""
  if not any(_NUMBERED_FILE_RE.match(n) and size > 0
             for n, size in entries.items()):
    return False
  from clu_ckpt import flax_training  # pylint: disable=g-import-not-at-top
  return flax_training.find_prefix(path) is not None


def _flax_prefixes(path: str, entries: Mapping[str, int]
                   ) -> tuple[list[str], dict[str, str]]:
  """The prefixes of the files in `path` named `<prefix><digits>` that
  start as a msgpack map (Flax states: `model_3`, `ema_10`), sorted; and
  those of such names that could not be read (name -> why): Flax states
  or not, that cannot be told."""
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  prefixes, unread = set(), {}
  for name, size in entries.items():
    m = _FLAX_NAME_RE.match(name)
    if m is None or size <= 0 or m.group("prefix").endswith(("-", "tmp")):
      continue  # `ckpt-7` (CLU's), a Flax temporary file
    file_path = join_path(path, name)
    try:
      head = storage.filesystem(file_path).read_bytes(file_path, 0, 1)
    except (OSError, ValueError, AttributeError) as e:
      if not isinstance(e, FileNotFoundError):  # not gone since listed
        unread[name] = (e.strerror if isinstance(e, OSError) else None) or (
            str(e))
      continue
    if len(head) == 1 and head[0] in _MAP_FIRST_BYTES:
      prefixes.add(m.group("prefix"))
  return sorted(prefixes), unread


# The kinds this version migrates (`clu_ckpt.migration.migrate` reads both).
_MIGRATED_KINDS = (CLU, FLAX_TRAINING)


# --------------------------------------------------------------------------
# Listing: every candidate path of a glob with its entries.
# --------------------------------------------------------------------------

# A path's listing: name -> size (-1: a directory); None: not a directory.
Entries = Union[None, dict[str, int], Unlistable]


def _list_local_directory(path: str) -> Entries:
  """The entries of `path`; None for a file; `Unlistable` when it fails."""
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
  except NotADirectoryError:
    return None
  except FileNotFoundError:
    if os.path.islink(path):  # matched by name, its target is not there
      return Unlistable(f"a broken symbolic link to {os.readlink(path)}")
    return None  # removed since it was matched
  except OSError as e:
    return Unlistable(e.strerror or str(e))


def list_candidates(pattern: str) -> dict[str, Entries]:
  """Paths matching `pattern` or `pattern-<int>`, each with its entries.

  Locally: two globs and one directory listing per path. In a bucket: one
  flat listing under the pattern's fixed prefix, kept two levels deeper
  than the pattern (every level with `**`), matched here; a listing that
  fails is that prefix `Unsearched` (an error naming it, never a skip).

  Args:
    pattern: A glob (a literal path is a glob matching itself): `*`, `?`,
      `[...]` within a name, and `**` as a whole name for any number of
      directories (none included), as a shell with globstar reads it.

  Returns:
    Normalized path -> entries (see `classify`), with, for every
    `<base>-<int>` found, its other hosts and `<base>` itself when there
    (whether `<base>` is a run decides what its `-<int>` siblings are),
    and every directory the walk could not list or enter, as `Unsearched`.
  """
  pattern = normalize_path(pattern)
  if split_url(pattern)[0]:
    return _list_bucket(pattern)
  unsearched: dict[str, str] = {}
  paths = set(local_glob(pattern, unsearched))
  paths.update(p for p in local_glob(pattern + "-[0-9]*", unsearched)
               if _HOST_DIR_RE.match(p))
  for base in {m.group("base") for m in map(_HOST_DIR_RE.match, list(paths))
               if m}:  # the other hosts of a host directory matched
    paths.update(p for p in local_glob(glob.escape(base) + "-[0-9]*",
                                       unsearched)
                 if _HOST_DIR_RE.match(p))
    if os.path.lexists(base):  # its base: a run of its own, or their base
      paths.add(base)
  found: dict[str, Entries] = {
      normalize_path(p): _list_local_directory(p) for p in sorted(paths)}
  for path, reason in sorted(unsearched.items()):
    found.setdefault(normalize_path(path), Unsearched(reason))
  return found


def local_glob(pattern: str,
               unsearched: Optional[dict[str, str]] = None) -> list[str]:
  """Local paths matching `pattern`, names beginning with "." included.

  As `glob.glob(pattern, recursive=True)` but for hidden names, which a
  wildcard matches here as it does in a bucket's listing: a run under
  `runs/.exp1/` is found by `runs/*/checkpoints`, not left out unseen.
  `**` follows symbolic links to directories, but not around a loop.
  Unlike `glob.glob`, a directory the walk cannot list or enter (no
  permission, an I/O error) is not passed over without a word: it goes
  into `unsearched`.

  Args:
    pattern: A normalized local glob (`normalize_path`).
    unsearched: Filled with each directory the walk could not list or
      enter (what may hold matching paths) -> the OS error's message.

  Returns:
    The matching paths (that exist, or are symbolic links), spelled as
    `pattern` is (relative ones relative), sorted.
  """
  failed = {} if unsearched is None else unsearched
  parts = pattern.split(os.sep)
  paths = [os.sep if parts[0] == "" else ""]
  for part in parts[1:] if parts[0] == "" else parts:
    matched = []
    for base in paths:
      if part == "**":
        matched.extend(_paths_under(base, failed))
      elif not _has_wildcard(part):
        path = os.path.join(base, part)
        try:
          os.lstat(path)
          matched.append(path)
        except (FileNotFoundError, NotADirectoryError):
          pass  # not there (or `base` is a file): nothing to find
        except OSError as e:  # `base` cannot be searched
          failed[base or os.curdir] = e.strerror or str(e)
      else:
        try:
          names = os.listdir(base or os.curdir)
        except (FileNotFoundError, NotADirectoryError):
          continue
        except OSError as e:
          failed[base or os.curdir] = e.strerror or str(e)
          continue
        matched.extend(os.path.join(base, n) for n in names
                       if fnmatch.fnmatchcase(n, part))
    paths = matched
  return sorted({p for p in paths if p})


def _paths_under(base: str, failed: dict[str, str]) -> list[str]:
  """`base` and every path below it, for `**`.

  Symbolic links to directories are followed (as `glob.glob` does: a
  disk mounted through a link holds runs too), but not one that leads back
  to a directory above it (a loop). A directory that cannot be listed goes
  into `failed` (path -> why).
  """
  def walk_error(e: OSError) -> None:
    if not isinstance(e, (FileNotFoundError, NotADirectoryError)):
      path = e.filename if isinstance(e.filename, str) else base
      if not base and path:
        path = os.path.relpath(path, os.curdir)
      failed[path or os.curdir] = e.strerror or str(e)

  found = [base] if os.path.isdir(base or os.curdir) else []
  # The real paths of the directories a walked directory was reached
  # through: a link to one of them (or above) is a loop.
  entered: dict[str, frozenset[str]] = {}
  for top, names, files in os.walk(base or os.curdir, onerror=walk_error,
                                   followlinks=True):
    real_top = os.path.realpath(top)
    chain = entered.pop(top, frozenset()) | {real_top}
    for name in files:
      path = os.path.join(top, name)
      found.append(path if base else os.path.relpath(path, os.curdir))
    for name in list(names):
      path = os.path.join(top, name)
      if os.path.islink(path):
        real = os.path.realpath(path)
        if real in chain or real_top.startswith(real.rstrip(os.sep) +
                                                os.sep):
          names.remove(name)  # a loop: listed, not entered
        else:
          entered[path] = chain
      else:
        entered[path] = chain
      found.append(path if base else os.path.relpath(path, os.curdir))
  return found


def _list_bucket(pattern: str) -> dict[str, Entries]:
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  scheme, key_pattern = split_url(pattern)
  backend = storage.filesystem(pattern)
  fs = getattr(backend, "fs", None)
  if fs is None or not hasattr(fs, "find"):
    return _list_bucket_slowly(pattern)
  prefix = split_url(glob_prefix(pattern))[1].rstrip("/")
  depth = (None if "**" in key_pattern.split("/") else
           key_pattern.count("/") - prefix.count("/") + 1)
  try:
    # One flat listing, not fsspec's walk (`maxdepth`): its walk passes
    # over a prefix whose listing fails (s3fs), leaving its runs out unseen.
    found = fs.find(prefix, withdirs=True, detail=True)
  except Exception as e:  # pylint: disable=broad-except
    from clu_ckpt import bucket_client  # pylint: disable=g-import-not-at-top
    e = bucket_client.translate(e, scheme + prefix)
    why = " ".join(((e.strerror if isinstance(e, OSError) else None) or
                    str(e)).split())  # one line
    return {scheme + prefix: Unsearched(f"{type(e).__name__}: {why}")}
  host_pattern = key_pattern + "-[0-9]*"
  candidates: dict[str, Entries] = {}
  found = {key.rstrip("/"): info for key, info in found.items()
           if depth is None or
           key.rstrip("/").count("/") <= prefix.count("/") + depth}
  for key, info in found.items():
    if _matches(key, key_pattern) or (_matches(key, host_pattern) and
                                      _HOST_DIR_RE.match(key)):
      candidates[key] = ({} if info.get("type") == "directory" else None)
  bases = {m.group("base") for m in map(_HOST_DIR_RE.match, list(candidates))
           if m}  # the other hosts of a host directory matched
  for key, info in found.items():
    m = _HOST_DIR_RE.match(key)
    if (m and m.group("base") in bases or key in bases) and (
        key not in candidates):  # their other hosts, and their base
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
    through_hosts: A `MultihostCheckpoint` reached through its host
      directories only (`runs/seed-*`: no glob or path names its base):
      they may be single-host runs of their own named like hosts, so a
      checkpoint only some of them keep is not taken for an unfinished
      save (the run's entry lists it and its source is kept).
  """
  source: str
  kind: str
  hosts: list[str] = dataclasses.field(default_factory=list)
  nbytes: int = 0
  destination: str = ""
  error: Optional[str] = None
  through_hosts: bool = False


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
  if not isinstance(entries, dict):
    return 0
  return sum(s for s in entries.values() if s > 0)


_HOST_KIND_PROBLEMS = {
    EMPTY: "is empty",
    OTHER: "is not a CLU checkpoint directory",
    FLAX_TRAINING: "holds Flax's checkpoint_<step> files, not CLU's",
}


def _host_error(base: str, hosts: Mapping[int, str],
                candidates: Mapping[str, Entries]) -> Optional[str]:
  """Why a multihost run's hosts cannot be migrated as found, or None.

  A gap in the host numbers (`-0` and `-2`, no `-1`; or no `-0`) means a
  host's checkpoints are missing or misnamed: migrating the others would
  drop that host's iterator without a word. A host that cannot be listed,
  is empty or is not a CLU directory is the run's error too.
  """
  for host in sorted(hosts):
    entries = candidates[hosts[host]]
    if isinstance(entries, Unlistable):
      return f"cannot list {hosts[host]}: {entries.reason}"
  problems = [f"host directory {hosts[h]} "
              f"{_HOST_KIND_PROBLEMS[classify(candidates[hosts[h]])]}"
              for h in sorted(hosts)
              if classify(candidates[hosts[h]]) in _HOST_KIND_PROBLEMS]
  missing = sorted(set(range(max(hosts) + 1)) - set(hosts))
  if missing:
    names = ", ".join(f"{base}-{h}" for h in missing)
    found = ", ".join(map(str, sorted(hosts)))
    plural = "ies" if len(missing) > 1 else "y"
    problems.insert(0, f"host director{plural} {names} missing (found hosts "
                    f"{found})")
  if not problems:
    return None
  return ("; ".join(problems) + ": restore it, or migrate the hosts found "
          "with clu-ckpt migrate")


def _is_run_directory(entries: Entries) -> bool:
  return classify(entries) in _MIGRATED_KINDS


def _plan_hosts(pattern: str, base: str, hosts: Mapping[int, str],
                candidates: Mapping[str, Entries], explicit: Optional[str]
                ) -> tuple[Plan, set[str], set[str]]:
  """What `<base>-<int>` directories are: hosts of one run, or not.

  Returns:
    The runs and skipped paths decided here, the paths they cover, and the
    host directories to plan one by one as if the pattern matched them
    (those a matched base implies, when they are not its hosts).
  """
  ordered = [hosts[h] for h in sorted(hosts)]
  matched = [h for h in ordered if _matches(h, pattern)]
  base_named = _matches(base, pattern)
  if not base_named and not matched:
    return Plan([], []), set(), set()  # not this pattern's
  kinds = [classify(candidates[h]) for h in ordered]
  # The directories only the base's name reached.
  implied = set(ordered) - set(matched) if base_named else set()
  if _is_run_directory(candidates.get(base)):
    # `<base>` is a run of its own: the directories the pattern matched are
    # runs of their own too; those only its name implies cannot be told.
    runs = [Run(h, "Checkpoint" if kind == CLU else kind, error=(
        f"beside {base}, itself a checkpoint directory: a host of a "
        "MultihostCheckpoint or a run of its own? Name it with --sources "
        f"to migrate it as a run of its own, or move {base} aside to "
        f"migrate {base}-<N> as one MultihostCheckpoint"))
            for h, kind in zip(ordered, kinds)
            if h in implied and kind in (CLU, UNLISTABLE)]
    return Plan(runs, []), {r.source for r in runs}, {
        h for h, kind in zip(ordered, kinds)
        if h in implied and kind not in (CLU, UNLISTABLE)}
  if not any(kind in (CLU, UNLISTABLE) for kind in kinds):
    return Plan([], []), set(), implied  # no CLU host: one by one
  if matched and (0 not in hosts or explicit is not None):
    # `exp-1`, `exp-2` matched: no host 0, no MultihostCheckpoint; a
    # directory named with --sources is the run asked for.
    return Plan([], []), set(), implied
  if matched and base_named and len(hosts) > 1:
    # `runs/*` matching `seed-0` and `seed-1`: the hosts of one run, or
    # runs of their own? Read as hosts, seed-1's state would be lost (a
    # MultihostCheckpoint's state is host 0's).
    absent = "" if _is_directory(candidates.get(base)) else (
        " (no such directory)")
    return Plan([Run(base, "MultihostCheckpoint", ordered, error=(
        f"{', '.join(ordered)}: the hosts of one MultihostCheckpoint {base}"
        f"{absent}, or runs of their own? The glob matches both names; name "
        f"them with --sources={base} (one run) or --sources="
        f"{','.join(ordered)} (runs of their own)"))], []), {
            base, *ordered}, set()
  run = Run(base, "MultihostCheckpoint", ordered,
            sum(_size(candidates[h]) for h in ordered),
            error=_host_error(base, hosts, candidates),
            through_hosts=not base_named and explicit is None)
  skipped = [Skipped(h, f"{HOST_REASON}{base}", pattern) for h in matched]
  return Plan([run], skipped), {base, *ordered}, set()


def _is_directory(entries: Entries) -> bool:
  return classify(entries) != NOT_DIRECTORY


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
  runs, skipped, covered, implied = [], [], set(), set()
  for path, entries in candidates.items():
    if isinstance(entries, Unsearched) and explicit:
      runs.append(Run(explicit, UNLISTABLE, error=(
          f"cannot list {path}: {entries.reason}")))
      return Plan(runs, [])
    if isinstance(entries, Unsearched):  # what it holds cannot be seen
      runs.append(Run(path, UNSEARCHED, error=(
          f"cannot list: {entries.reason} (runs below it that {pattern} "
          "would match cannot be seen)")))
      covered.add(path)
  # `<base>-<int>` directories: the hosts of a MultihostCheckpoint or not.
  groups: dict[str, dict[int, str]] = {}
  for path in candidates:
    m = _HOST_DIR_RE.match(path)
    if m and path not in covered and _is_directory(candidates[path]):
      groups.setdefault(m.group("base"), {})[int(m.group("host"))] = path
  for base, hosts in sorted(groups.items()):
    plan, covers, one_by_one = _plan_hosts(pattern, base, hosts, candidates,
                                           explicit)
    runs += plan.runs
    skipped += plan.skipped
    covered |= covers
    implied |= one_by_one
  for path, entries in candidates.items():
    if path in covered or not (_matches(path, pattern) or path in implied):
      continue
    kind = classify(entries)
    if kind == OTHER and _flax_files_of_another_prefix(path, entries):
      kind = FLAX_TRAINING
    if kind in _MIGRATED_KINDS:
      runs.append(Run(path, "Checkpoint" if kind == CLU else kind,
                      nbytes=_size(entries)))
    elif kind == UNLISTABLE:  # likely a run: an error, whoever named it
      runs.append(Run(path, kind, error=f"cannot list: {entries.reason}"))
    elif kind == OTHER and len((flax := _flax_prefixes(path,
                                                      entries))[0]) > 1:
      runs.append(Run(path, FLAX_TRAINING, error=(
          "Flax checkpoint files of several prefixes "
          f"({', '.join(flax[0])}): which is the run's state cannot be "
          "told; move each prefix's files into a directory of its own")))
    elif kind == OTHER and flax[1]:  # likely a run: an error, not a skip
      name, why = sorted(flax[1].items())[0]
      more = (f" (and {len(flax[1]) - 1} more such file(s))"
              if len(flax[1]) > 1 else "")
      runs.append(Run(path, UNLISTABLE, error=(
          f"cannot read {name} ({why}){more}: whether it is a Flax "
          "checkpoint cannot be told")))
    elif explicit:
      runs.append(Run(path, kind, error=_REASONS[kind] + _orbax_era(entries)))
    else:
      reason = _REASONS[kind] + _orbax_era(entries)
      if path in implied:
        reason += (f" (a host directory of {path.rsplit('-', 1)[0]}, "
                   "which the glob names)")
      skipped.append(Skipped(path, reason, pattern))
  if explicit and not runs:
    runs.append(Run(explicit, "Checkpoint", error=(
        "no such directory, and no "
        f"{posixpath.basename(explicit)}-<host_id> directories beside it")))
  return Plan(runs, skipped)


def plan_fleet(sources: Sequence[str], globs: Sequence[str],
               lister: Callable[[str], Mapping[str, Entries]] = list_candidates,
               excludes: Sequence[str] = ()) -> Plan:
  """Every run named or matched, and every matched path skipped.

  Args:
    sources: Paths named directly (`--sources`, `--sources-file`).
    globs: `--source-glob` patterns.
    lister: `list_candidates` (a test may count its calls).
    excludes: `--exclude` globs: a run (or a directory the walk cannot
      list, such as a root-only `lost+found`) that one matches, or that is
      below a path one matches, is skipped with the pattern as its reason.
      A host directory of a run whose base is not excluded makes the run an
      error (a `MultihostCheckpoint` goes with all its hosts or none).

  Returns:
    The plan, runs and skipped paths sorted and de-duplicated (a path that
    is a run is not also skipped).

  Raises:
    UsageError: A glob matched nothing, or the directory its walk starts
      from (or one above it) cannot be listed.
  """
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  sources, globs = map(plain_local, sources), map(plain_local, globs)
  excludes = [plain_local(e) for e in excludes]
  plans = []
  for pattern in globs:
    plan = plan_pattern(pattern, lister(pattern))
    if not plan.runs and not plan.skipped:
      raise UsageError(f"--source-glob {pattern!r} matched nothing")
    top = _identity(glob_prefix(pattern))
    for run in plan.runs:
      if run.kind == UNSEARCHED and (_identity(run.source) == top or
                                     relative_path(top, _identity(run.source))):
        raise UsageError(f"--source-glob {pattern!r}: {run.source}: "
                         f"{run.error}")
    plans.append(plan)
  for source in sources:
    if split_url(source)[0] and not _is_utf8(source):
      plans.append(Plan([Run(normalize_path(source), "Checkpoint", error=(
          "not valid UTF-8 (a line of --sources-file in another encoding?): "
          "a bucket's names are UTF-8"))], []))
      continue
    escaped = storage.glob_escape(normalize_path(source))
    plans.append(plan_pattern(escaped, lister(escaped),
                              explicit=normalize_path(source)))
  # One entry per path, however spelled (relative or absolute, `./`, a
  # trailing slash): the first spelling listed, the globs' first.
  runs: dict[str, Run] = {}
  for plan in plans:
    for run in plan.runs:
      key = _identity(run.source)
      # A base some glob or path names is not reached through its hosts
      # only, whichever plan's entry stays.
      hosts_only = run.through_hosts and runs.get(key, run).through_hosts
      if key not in runs or (runs[key].error and not run.error):
        runs[key] = run
      runs[key].through_hosts = hosts_only
  skipped: dict[str, Skipped] = {}
  for key, why in _excluded_runs(runs, excludes).items():
    skipped[key] = Skipped(runs.pop(key).source, why, "")
  _fold_unsearched(runs)
  for twice in _reached_twice(list(runs.values())):
    del runs[_identity(twice.path)]
    skipped[_identity(twice.path)] = twice
  for plan in plans:
    for s in plan.skipped:
      if _identity(s.path) not in runs:
        skipped.setdefault(_identity(s.path), s)
  return Plan(sorted(runs.values(), key=lambda r: r.source),
              sorted(skipped.values(), key=lambda s: s.path))


def _excluded_by(path: str, excludes: Sequence[str]) -> Optional[str]:
  """The first of `excludes` matching `path` or a directory above it (a
  pattern starting with `**` anywhere; another relative one relative to the
  current directory, as a relative glob is)."""
  # A link and what it leads to are one run: `--exclude /runs/a` leaves out
  # `/runs/b` when it is a link to `/runs/a`, and the other way round.
  for key in _spellings(path):
    while True:
      for pattern in excludes:
        if pattern.startswith("**"):
          if _matches(key, pattern):
            return pattern
        elif any(_matches(key, p) for p in _spellings(pattern)):
          return pattern
      parent = parent_path(key)
      if parent == key or not split_url(parent)[1]:
        break
      key = parent
  return None


def _spellings(path: str) -> list[str]:
  """`path` as named, and, on a local disk, where its links lead."""
  key = _identity(path)
  if "://" in key:
    return [key]
  real = os.path.realpath(key)
  return [key] if real == key else [key, real]


def _excluded_runs(runs: Mapping[str, Run], excludes: Sequence[str]
                   ) -> dict[str, str]:
  """The runs `--exclude` leaves out (key -> the skip's reason); a run with
  an excluded host directory gets an error instead. A directory the walk
  could not list inside a run that stays is that run's error still (the
  run's source holds it)."""
  if not excludes:
    return {}
  out = {}
  for key, run in runs.items():
    pattern = _excluded_by(run.source, excludes)
    if pattern is not None and run.kind == UNSEARCHED and any(
        r.kind != UNSEARCHED and relative_path(key, k) and
        _excluded_by(r.source, excludes) is None for k, r in runs.items()):
      continue
    if pattern is not None:
      out[key] = f"excluded (--exclude {pattern})"
      continue
    hosts = [(h, p) for h in run.hosts
             if (p := _excluded_by(h, excludes)) is not None]
    if hosts and run.error is None:
      run.error = (f"host directory {hosts[0][0]} is excluded (--exclude "
                   f"{hosts[0][1]}): a MultihostCheckpoint is migrated with "
                   f"all its hosts or not at all; exclude {run.source} "
                   "instead, or none of its hosts")
  return out


def _is_utf8(text: str) -> bool:
  try:
    text.encode("utf-8")
  except UnicodeEncodeError:  # bytes that are not, as surrogates
    return False
  return True


def _fold_unsearched(runs: dict[str, Run]) -> None:
  """A directory that cannot be listed inside a run (`**` walked into it)
  is that run's error: a run nested in it would go with its source. One
  listed but not entered, with runs planned inside it, is their error (one
  run inside another is refused)."""
  for key, inner in list(runs.items()):
    if inner.kind != UNSEARCHED:
      continue
    outer = [r for k, r in runs.items()
             if r.kind != UNSEARCHED and relative_path(key, k)]
    below = [r for k, r in runs.items() if relative_path(k, key)]
    for run in outer[:1] or [r for r in below if r.kind != UNSEARCHED]:
      why = f"cannot list {inner.source}: {inner.error.split(': ', 1)[1]}"
      run.error = f"{run.error}; {why}" if run.error else why
    if outer or below:
      del runs[key]


def _reached_twice(runs: Iterable[Run]) -> list[Skipped]:
  """Local runs reached under two names (through symbolic links): all but
  one, as skipped (one run migrated twice, into two destinations).

  The name kept is the one without links, else the first in order.
  """
  by_target: dict[str, list[Run]] = {}
  for run in runs:
    if not split_url(run.source)[0] and run.error is None:
      by_target.setdefault(os.path.realpath(run.source), []).append(run)
  twice = []
  for target, same in by_target.items():
    same.sort(key=lambda r: (_identity(r.source) != target, r.source))
    twice += [Skipped(r.source, f"the same run as {same[0].source} (through "
                      "a symbolic link)", "") for r in same[1:]]
  return twice


def _identity(path: str) -> str:
  """What two spellings of one path have in common."""
  return normalize_path(absolute_path(path))


# A comment: a line starting with "#", or "#" after a blank ("a#b" is a
# path: run names may hold "#").
_COMMENT_RE = re.compile(r"(^|\s)#.*$")


def read_sources_file(path: str) -> list[str]:
  """The paths listed in a file, one a line.

  Args:
    path: The file (`--sources-file`; local, or a bucket URL). Blank lines
      are ignored; "#" starts a comment at the start of a line or after a
      blank, so that a "#" inside a name (`runs/exp#3`) stays part of it.

  Returns:
    The paths, as written (surrounding blanks removed). A line that is not
    UTF-8 is decoded as Python decodes file names (`os.fsdecode`: each
    byte that is not becomes a lone surrogate): a local name in those
    bytes is found, and that run, whose name Orbax cannot write, is an
    error naming it, as when a glob finds it; the other lines go on.

  Raises:
    UsageError: The file cannot be read.
  """
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  try:
    text = storage.read_bytes(path).decode("utf-8", "surrogateescape")
  except OSError as e:
    raise UsageError(f"--sources-file {path}: {e.strerror or e}") from None
  text = text[1:] if text.startswith("\ufeff") else text  # an editor's BOM
  lines = [_COMMENT_RE.sub("", l).strip() for l in text.splitlines()]
  return [l for l in lines if l]


