"""What belongs to a CLU checkpoint directory: checkpoint names and containment.

A CLU `Checkpoint` directory holds `<name>-<number>.flax`, TensorFlow's
`<name>-<number>.index` / `.data-*` and TensorFlow's `checkpoint` state file,
which lists checkpoints by path. That file is data, not trust: it may list
absolute paths elsewhere, `../` paths, or names of another program, and a
copied directory may hold symlinks. This module decides, in one place, which
listed paths belong to a directory (a checkpoint may be changed or deleted
only there) and what a checkpoint's name and number are (parsed from the base
name only: digits in a parent directory's name never count).

Synopsis::

  from clu_ckpt import layout

  layout.split_checkpoint("/runs/exp-3/ckpt-7")      # ("ckpt", 7)
  layout.split_checkpoint("/runs/exp-3/model.ckpt")  # None
  layout.is_contained("/runs/a", "/runs/a/ckpt-7")   # True
  layout.is_contained("/runs/a", "/runs/a/../b/ckpt-7")   # False
  layout.check_inside("/runs/a", "/runs/a/ckpt-7.flax")   # raises if a
                                                         # symlink leads out
"""

from __future__ import annotations

import os
import re
from typing import Optional

from clu_ckpt import errors

_SCHEME_RE = re.compile(r"^(?P<scheme>[a-z][a-z0-9.+-]+://)?(?P<path>.*)",
                        re.I | re.S)
_CHECKPOINT_RE = re.compile(r"(?P<name>.*)-(?P<number>\d+)", re.S)


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
