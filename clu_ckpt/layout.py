"""What a CLU checkpoint directory is: names, containment, hosts, debris.

A CLU `Checkpoint` directory holds `<name>-<number>.flax`, TensorFlow's
`<name>-<number>.index` / `.data-*` and TensorFlow's `checkpoint` state file,
which lists checkpoints by path. That file is data, not trust: it may list
absolute paths elsewhere, `../` paths, or names of another program, and a
copied directory may hold symlinks. This module decides, in one place, which
listed paths belong to a directory (a checkpoint may be changed or deleted
only there) and what a checkpoint's name and number are (parsed from the base
name only: digits in a parent directory's name never count). It also owns the
other rules of the layout that clu defines: which `<base>-<int>` directories
are a `MultihostCheckpoint`'s hosts and which number they have in common,
when a checkpoint's files are complete, what a killed save leaves behind, and
whether a path is a checkpoint directory or a multihost base, and (through
`clu_ckpt.state_file`, re-exported here) what TensorFlow's `checkpoint` file
says. Every other module asks here; none re-derives these rules.

Synopsis::

  from clu_ckpt import layout

  layout.split_checkpoint("/runs/exp-3/ckpt-7")      # ("ckpt", 7)
  layout.split_checkpoint("/runs/exp-3/model.ckpt")  # None
  layout.is_contained("/runs/a", "/runs/a/ckpt-7")   # True
  layout.is_contained("/runs/a", "/runs/a/../b/ckpt-7")   # False
  layout.check_inside("/runs/a", "/runs/a/ckpt-7.flax")   # raises if a
                                                         # symlink leads out
  layout.host_directories("/runs/a/checkpoints")    # {0: ".../checkpoints-0"}
  layout.newest_common(layout.host_directories(base), "ckpt")   # (7, {...})
  layout.multihost_latest(base, "ckpt")   # ".../checkpoints-0/ckpt-7"
"""

from __future__ import annotations

import os
import re
from typing import Callable, Mapping, Optional, Sequence

from absl import logging

from clu_ckpt import errors
from clu_ckpt import state_file
from clu_ckpt import storage

_SCHEME_RE = re.compile(r"^(?P<scheme>[a-z][a-z0-9.+-]+://)?(?P<path>.*)",
                        re.I | re.S)
_CHECKPOINT_RE = re.compile(r"(?P<name>.*)-(?P<number>\d+)", re.S)
# A numbered `.flax` file in a directory listing.
FLAX_NAME_RE = re.compile(r"^(?P<name>.+)-(?P<number>\d+)\.flax$", re.S)
# TensorFlow's state file, parsed by `clu_ckpt.state_file`; asked through here.
STATE_FILENAME = state_file.STATE_FILENAME
CheckpointState = state_file.CheckpointState
read_checkpoint_state = state_file.read_checkpoint_state


OutsideDirectoryError = errors.OutsideDirectoryError


def split_scheme(path: str) -> tuple[str, str]:
  """("gs://", "bucket/x") for URLs, ("", path) for plain paths.

  `file://` URLs are local paths: they come back as ("", "/the/path").
  """
  m = _SCHEME_RE.match(path)
  scheme, rest = m.group("scheme") or "", m.group("path")
  if scheme.lower() == "file://":
    return "", rest
  return scheme, rest


def normpath(path: str) -> str:
  """Normalizes a path or URL, keeping the scheme's `//` intact.

  Example::

    normpath("gs://bucket//run/./ckpt/")   # "gs://bucket/run/ckpt"
  """
  m = _SCHEME_RE.match(path)
  return (m.group("scheme") or "") + os.path.normpath(m.group("path"))


def absolute(path: str) -> str:
  """The canonical form of a path a user gave: local ones absolute, plain.

  `file://` URLs become plain absolute paths, relative paths are made
  absolute against the current directory (Orbax and the recorded sources
  need absolute ones), and URLs of other schemes are only normalized.

  Example::

    absolute("file:///runs/a/")     # "/runs/a"
    absolute("runs/a")              # "/home/me/runs/a"
    absolute("gs://b//runs/a")      # "gs://b/runs/a"

  Args:
    path: A path or URL.

  Returns:
    The path, normalized; absolute and without a scheme when local.

  Raises:
    UsageError: `path` is empty.
  """
  if not path:
    raise errors.UsageError("an empty path")
  scheme, rest = split_scheme(path)
  if scheme:
    return normpath(path)
  return os.path.abspath(rest)


def split_checkpoint(checkpoint: str) -> Optional[tuple[str, int]]:
  """The (name, number) of a checkpoint path, from its base name only.

  Example::

    split_checkpoint("/runs/exp-3/ckpt-7")       # ("ckpt", 7)
    split_checkpoint("/runs/exp-3/model.ckpt")   # None: no number
    split_checkpoint("model.ckpt-5")             # ("model.ckpt", 5)

  Args:
    checkpoint: A checkpoint prefix (`<directory>/<name>-<number>`).

  Returns:
    (name, number), or None when the base name does not end in
    `-<number>`.
  """
  m = _CHECKPOINT_RE.fullmatch(_basename(checkpoint))
  if m is None:
    return None
  return m.group("name"), int(m.group("number"))


def checkpoint_number(checkpoint: str, name: str) -> Optional[int]:
  """The number of `checkpoint` if its base name is `<name>-<number>`."""
  parts = split_checkpoint(checkpoint)
  return parts[1] if parts is not None and parts[0] == name else None


def _basename(path: str) -> str:
  return split_scheme(path)[1].rsplit("/", 1)[-1]


def _comparable(path: str) -> tuple[str, str]:
  scheme, rest = split_scheme(path)
  if scheme:
    return scheme.lower(), os.path.normpath(rest)
  return "", os.path.abspath(rest)


def is_contained(directory: str, path: str) -> bool:
  """Whether `path` names an entry directly inside `directory`, lexically.

  Absolute paths elsewhere, `..` components and other URL schemes or buckets
  are outside. Symlinks are not looked at (see `check_inside`).

  Example::

    is_contained("/runs/a", "/runs/a/ckpt-3")            # True
    is_contained("/runs/a", "/runs/a/sub/../../b/ckpt-3")  # False

  Args:
    directory: The checkpoint directory.
    path: A path listed in, or found in, that directory.

  Returns:
    True when `path`'s parent is `directory` and its name is a real name.
  """
  d_scheme, d = _comparable(directory)
  p_scheme, p = _comparable(path)
  name = os.path.basename(p)
  return (d_scheme == p_scheme and os.path.dirname(p) == d and
          name not in ("", ".", ".."))


def check_inside(directory: str, path: str) -> None:
  """Raises unless `path` is in `directory`, also after following symlinks.

  Use it before reading a file on behalf of a directory (inspect, verify,
  migrate): a symlink or a listed path leading elsewhere is refused. For
  URLs only the lexical check applies (object stores have no symlinks).

  Example::

    check_inside("/runs/a", "/runs/a/ckpt-7.flax")

  Args:
    directory: The checkpoint directory.
    path: The file or checkpoint prefix to be read.

  Raises:
    OutsideDirectoryError: `path` is outside `directory` (named, with how).
  """
  if not is_contained(directory, path):
    how = ("a path through '..'" if ".." in split_scheme(path)[1].split("/")
           else "a path elsewhere")
    raise OutsideDirectoryError(path, directory, how)
  scheme, local = split_scheme(path)
  if scheme:
    return
  real_directory = os.path.realpath(split_scheme(directory)[1])
  real = os.path.realpath(local)
  if os.path.commonpath([real_directory, real]) != real_directory:
    raise OutsideDirectoryError(path, directory, f"a symlink to {real}")


# --------------------------------------------------------------------------
# Checkpoint files.
# --------------------------------------------------------------------------


def checkpoint_files(checkpoint: str) -> list[str]:
  """Every file of a checkpoint: `<checkpoint>.*` and TensorFlow's `_temp`."""
  pattern = storage.glob_escape(checkpoint)
  return storage.glob(f"{pattern}.*") + storage.glob(f"{pattern}_temp")


def has_files(checkpoint: str,
              listing: Optional[dict[str, set[str]]] = None) -> bool:
  """Whether the `.flax`, `.index` and `.data-*` files of `checkpoint` exist.

  Example::

    listing = {}
    complete = [c for c in listed if has_files(c, listing)]   # one listdir

  Args:
    checkpoint: A checkpoint path (`<directory>/ckpt-N`).
    listing: Directory -> names in it, filled on first use: one listing per
      directory however many checkpoints are checked.

  Returns:
    True when all three kinds of file are there.
  """
  listing = {} if listing is None else listing
  directory, name = os.path.split(checkpoint)
  if directory not in listing:
    try:
      listing[directory] = set(storage.listdir(directory))
    except OSError:  # e.g. a listed checkpoint in a directory that is gone
      listing[directory] = set()
  names = listing[directory]
  return (f"{name}.flax" in names and f"{name}.index" in names and
          any(n.startswith(f"{name}.data-") for n in names))


def is_debris(entry: str, names: set[str], checkpoint_name: str, oldest: int,
              latest: int) -> bool:
  """Whether a directory entry is what a killed or pruned save left behind.

  That is TensorFlow's temporary `checkpoint.tmp*` state files, its unfinished
  `<name>-N_temp/` up to the latest number, temporary `.flax` files below the
  oldest kept number, and `.flax` files below it whose `.index` is gone.
  A checkpoint that still has its `.index` is never debris.

  Args:
    entry: A name in the directory.
    names: Every name in the directory.
    checkpoint_name: The checkpoints' name (`ckpt`).
    oldest: The oldest number TensorFlow keeps.
    latest: The latest number.

  Returns:
    True when `entry` may be removed.
  """
  if entry.startswith(f"{STATE_FILENAME}.tmp"):
    return True
  match = re.fullmatch(
      rf"{re.escape(checkpoint_name)}-(\d+)(\.flax(\.tmp-.*)?|_temp)",
      entry, re.S)
  if not match:
    return False
  number, suffix = int(match.group(1)), match.group(2)
  if suffix == "_temp":
    return number <= latest
  if suffix == ".flax":
    return number < oldest and f"{checkpoint_name}-{number}.index" not in names
  return number < oldest  # a temporary .flax


# --------------------------------------------------------------------------
# Directories: single host, multihost bases.
# --------------------------------------------------------------------------


def host_directories(multihost_base_directory: str) -> dict[int, str]:
  """The host directories of a `MultihostCheckpoint` base.

  Only directories named `<base>-<integer>` count (clu globbed `<base>-*`).

  Example::

    host_directories("/work/checkpoints")
    # {0: "/work/checkpoints-0", 1: "/work/checkpoints-1"}

  Args:
    multihost_base_directory: The shared prefix passed to
      `MultihostCheckpoint`.

  Returns:
    Host id -> normalized directory, sorted by host id.
  """
  prefix = f"{normpath(multihost_base_directory.rstrip('/'))}-"
  found = {}
  for path in storage.glob(f"{storage.glob_escape(prefix)}*"):
    suffix = path[len(prefix):]
    if suffix.isdigit() and storage.isdir(path):
      found[int(suffix)] = normpath(path)
  return dict(sorted(found.items()))


def is_checkpoint_directory(directory: str) -> bool:
  """Whether `directory` holds a `checkpoint` file or a numbered `.flax`."""
  try:
    names = storage.listdir(directory)
  except OSError:
    return False
  return STATE_FILENAME in names or any(FLAX_NAME_RE.match(n) for n in names)


def source_directories(path: str) -> dict[Optional[int], str]:
  """What a path names: a checkpoint directory or a multihost base.

  Example::

    source_directories("/work/ckpts")        # {None: "/work/ckpts"}
    source_directories("/work/checkpoints")  # {0: ".../checkpoints-0", ...}

  Args:
    path: A `Checkpoint` directory or a `MultihostCheckpoint` base.

  Returns:
    `{None: path}` for a checkpoint directory (one that holds checkpoints, or
    has no host directories beside it), else host id -> directory; empty
    when `path` is neither.
  """
  hosts = host_directories(path)
  if storage.isdir(path) and (is_checkpoint_directory(path) or not hosts):
    return {None: path}
  return dict(hosts)


def listed_numbers(directory: str, checkpoint_name: str,
                   state=None) -> dict[int, str]:
  """Number -> path of the checkpoints TensorFlow manages in `directory`.

  Only entries inside `directory` named `<checkpoint_name>-<number>` count.

  Args:
    directory: A checkpoint directory.
    checkpoint_name: The checkpoints' name.
    state: Its `state_file.CheckpointState` if already read.

  Returns:
    The numbers, each with the path as listed.
  """
  if state is None:
    state = read_checkpoint_state(directory)
  paths = state.managed_checkpoints() if state else []
  numbers = {}
  for path in paths:
    number = checkpoint_number(path, checkpoint_name)
    if number is not None and is_contained(directory, path):
      numbers[number] = path
  return numbers


def newest_common(directories: Mapping[int, str], checkpoint_name: str
                  ) -> Optional[tuple[int, dict[str, str]]]:
  """The newest number every host lists with complete files.

  The rule `MultihostCheckpoint` restores by: a number counts only where
  every host lists it (`listed_numbers`) and has its `.flax`, `.index` and
  `.data` files (`has_files`). If no common number is complete, the newest
  common one is returned all the same, so that the restore fails naming the
  missing file instead of starting over (which would delete every host's
  checkpoints).

  Example::

    found = newest_common(host_directories(base), "ckpt")
    number, paths = found   # paths: directory -> that host's checkpoint

  Args:
    directories: Host id -> directory.
    checkpoint_name: The checkpoints' name.

  Returns:
    (number, directory -> listed path), or None when the hosts have no
    number in common.
  """
  listed = {d: listed_numbers(d, checkpoint_name) for d in directories.values()}
  sets = [set(numbers) for numbers in listed.values()]
  common = set.intersection(*sets) if sets else set()
  every = set().union(*sets)
  logging.info("Checked checkpoint directories %s: common numbers %s, "
               "exclusive numbers %s", list(directories.values()), common,
               every - common)
  if not common:
    return None
  listing: dict[str, set[str]] = {}
  for number in sorted(common, reverse=True):
    missing = [d for d, numbers in listed.items()
               if not has_files(numbers[number], listing)]
    if not missing:
      return number, {d: numbers[number] for d, numbers in listed.items()}
    logging.warning("Checkpoint number %d is listed by every host, but files "
                    "are missing in %s; trying older ones", number, missing)
  number = max(common)
  return number, {d: numbers[number] for d, numbers in listed.items()}


def multihost_latest(base_directory: str,
                     checkpoint_name: str) -> Optional[str]:
  """The checkpoint `load_state_dict` reads when given a multihost base.

  When `base_directory` is not a checkpoint directory (`source_directories`)
  but `<base_directory>-<host>` directories exist, that is the newest number
  every host has (`newest_common`, the rule `MultihostCheckpoint.restore`
  follows), read from the lowest host's directory (host 0's, normally). The
  choice is logged.

  Example::

    multihost_latest("/work/checkpoints", "ckpt")   # ".../checkpoints-0/ckpt-4"
    multihost_latest("/work/ckpts", "ckpt")         # None: a plain directory

  Args:
    base_directory: A `Checkpoint` directory or a `MultihostCheckpoint` base.
    checkpoint_name: The checkpoints' name (`ckpt`).

  Returns:
    That checkpoint's path, or None when `base_directory` is a checkpoint
    directory or has no host directories (read it as a single directory).

  Raises:
    CheckpointNotFoundError: The hosts have no checkpoint number in common.
  """
  hosts = source_directories(base_directory)
  if not hosts or None in hosts:
    return None
  found = newest_common(hosts, checkpoint_name)
  if found is None:
    raise errors.CheckpointNotFoundError(
        f"No checkpoint found at {base_directory}: it is a MultihostCheckpoint "
        f"base, but its host directories {list(hosts.values())} have no "
        f"{checkpoint_name}-<number> in common")
  host, directory = min(hosts.items())
  path = found[1][directory]
  logging.info("%s is a MultihostCheckpoint base: loading %s, from host %d's "
               "directory %s (checkpoint %d is the newest every host has)",
               base_directory, path, host, directory, found[0])
  return path


def latest_restorable(directory: str,
                      checkpoint_name: str = "ckpt") -> Optional[str]:
  """The checkpoint a restore of `directory` reads by default.

  The rule of `Checkpoint.get_latest_checkpoint_to_restore_from`
  (`restorable`), applied to what TensorFlow's `checkpoint` file lists.

  Example::

    latest_restorable("/work/ckpts")   # "/work/ckpts/ckpt-7", or None

  Args:
    directory: A `Checkpoint` directory.
    checkpoint_name: Unused by the rule (the name is read from the latest
      path); kept for symmetry with `multihost_latest`.

  Returns:
    A checkpoint path, or None when the directory lists none.
  """
  del checkpoint_name
  state = read_checkpoint_state(directory)
  if state is None:
    return None
  return restorable(state.model_checkpoint_path, state.managed_checkpoints)


def restorable(latest: Optional[str],
               listed: Callable[[], Sequence[str]]) -> Optional[str]:
  """`latest`, unless some of its files are missing (a directory damaged
  outside clu_ckpt, e.g. by clu killed while deleting newer checkpoints after
  restoring an older one): then the newest of `listed` with a lower number
  whose files are all there, with a warning.

  Example::

    restorable("/work/ckpts/ckpt-7", lambda: manager.checkpoints)

  Args:
    latest: The latest checkpoint path, or None.
    listed: Gives the listed checkpoints, oldest first (called only when
      `latest` is damaged).

  Returns:
    A checkpoint path, or None when `latest` is None.
  """
  listing: dict[str, set[str]] = {}
  if latest is None or has_files(latest, listing):
    return latest
  parts = split_checkpoint(latest)
  if parts is None:
    return latest
  for path in reversed(listed()):
    number = checkpoint_number(path, parts[0])
    if number is not None and number < parts[1] and has_files(path, listing):
      logging.warning("Files of the latest checkpoint %s are missing; "
                      "restoring %s instead", latest, path)
      return path
  return latest
