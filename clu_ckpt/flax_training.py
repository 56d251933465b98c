"""Flax's own legacy checkpoint layout: `flax.training.checkpoints` files.

`flax.training.checkpoints.save_checkpoint(ckpt_dir, state, step,
prefix="checkpoint_")` with Orbax checkpointing off (every Flax before
2023, and flax 0.12 with `flax_use_orbax_checkpointing` False) writes one
msgpack file per step, in the `.flax` format (`clu_ckpt.flax_format`,
chunked arrays included)::

  <ckpt_dir>/<prefix><step>        e.g. checkpoint_1000, the state dict
  <ckpt_dir>/<prefix>tmp           being written (renamed when complete)
  <ckpt_dir>/<prefix><step>_gda/   multiprocess arrays (not read here)

`restore_checkpoint(ckpt_dir, None)` reads the file with the highest step.
This module is the one place that knows those names: it lists the steps of
a directory (skipping Flax's temporary files), finds the latest, and, when
a directory was written with another prefix, finds that prefix.

Synopsis::

  from clu_ckpt import flax_training

  flax_training.list_steps("/runs/a")          # {5: ".../checkpoint_5", ...}
  flax_training.latest("/runs/a")              # ".../checkpoint_15" or None
  flax_training.list_steps("/runs/b", prefix="model_")
  flax_training.find_prefix("/runs/b")         # "model_"
"""

from __future__ import annotations

import re
from typing import Optional

from clu_ckpt import storage

DEFAULT_PREFIX = "checkpoint_"
# Flax's temporary file (`<prefix>tmp`), its multiprocess-array directories
# and Orbax's temporary directories are not checkpoints.
_TMP_NAME = "tmp"
_MPA_SUFFIX = "_gda"
_ORBAX_TMP = ".orbax-checkpoint-tmp"
# The first byte of a msgpack map: how a Flax state file starts.
_MAP_FIRST_BYTES = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}
_NAME_RE = re.compile(r"^(?P<prefix>.*?)(?P<step>\d+)$", re.S)


def _names(directory: str) -> list[str]:
  try:
    return [n.rstrip("/") for n in storage.listdir(directory)]
  except OSError:
    return []


def list_steps(directory: str, prefix: str = DEFAULT_PREFIX
               ) -> dict[int, str]:
  """Step -> file of every checkpoint `<prefix><step>` in `directory`.

  Only regular files whose name is the prefix followed by decimal digits
  count (the steps `flax.training.checkpoints.available_steps` lists);
  `<prefix>tmp`, `_gda` directories, Orbax's temporary directories and
  Orbax-format step directories are skipped.

  Args:
    directory: A directory (local path or URL).
    prefix: The `prefix` given to `save_checkpoint`.

  Returns:
    Sorted by step; empty when there is none (or no such directory).
  """
  found = {}
  for name in _names(directory):
    if not name.startswith(prefix) or _ORBAX_TMP in name:
      continue
    digits = name[len(prefix):]
    if not digits.isdecimal() or not digits.isascii():
      continue
    path = storage.join(directory, name)
    if storage.isdir(path):
      continue
    found[int(digits)] = path
  return dict(sorted(found.items()))


def orbax_step_directories(directory: str, prefix: str = DEFAULT_PREFIX
                           ) -> list[str]:
  """`<prefix><step>` directories: Flax's Orbax-format checkpoints (not
  read by this module; `orbax.checkpoint` reads them)."""
  out = []
  for name in _names(directory):
    digits = name[len(prefix):] if name.startswith(prefix) else ""
    if digits.isdecimal() and digits.isascii() and storage.isdir(
        storage.join(directory, name)):
      out.append(storage.join(directory, name))
  return sorted(out)


def latest(directory: str, prefix: str = DEFAULT_PREFIX) -> Optional[str]:
  """The file `restore_checkpoint(directory, None, prefix=prefix)` reads."""
  steps = list_steps(directory, prefix)
  return steps[max(steps)] if steps else None


def split_name(path: str, prefix: str = DEFAULT_PREFIX) -> Optional[int]:
  """The step of a checkpoint file named `<prefix><step>`, or None."""
  name = path.rstrip("/").rsplit("/", 1)[-1]
  digits = name[len(prefix):] if name.startswith(prefix) else ""
  return int(digits) if digits.isdecimal() and digits.isascii() else None


def find_prefix(directory: str) -> Optional[str]:
  """The prefix of the Flax checkpoint files in `directory`, if one.

  `DEFAULT_PREFIX` when such files are there; otherwise the one prefix
  shared by every file named `<prefix><digits>` that starts like a msgpack
  map (a Flax state), when there is exactly one such prefix and it ends in
  a non-digit. None when there is none, or several (pass `prefix=`).

  Args:
    directory: A directory (local path or URL).

  Returns:
    The prefix, or None.
  """
  if list_steps(directory, DEFAULT_PREFIX):
    return DEFAULT_PREFIX
  prefixes = set()
  for name in _names(directory):
    m = _NAME_RE.match(name)
    if (m is None or not m.group("prefix") or "." in name or
        m.group("prefix").endswith(("-", _TMP_NAME))):
      continue  # `ckpt-7` (a CLU prefix without files), `x.data-00001`
    path = storage.join(directory, name)
    if storage.isdir(path) or not _starts_as_map(path):
      continue
    prefixes.add(m.group("prefix"))
  return prefixes.pop() if len(prefixes) == 1 else None


def _starts_as_map(path: str) -> bool:
  try:
    head = storage.filesystem(path).read_bytes(path, 0, 1)
  except (OSError, ValueError, AttributeError):
    return False
  return len(head) == 1 and head[0] in _MAP_FIRST_BYTES
