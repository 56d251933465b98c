"""Kill harness: training-like children that save with clu_ckpt and die on cue.

A child process (`python _harness.py single ...` or `... multihost ...`) runs
a loop that looks like training: a dict state of numpy arrays (a few MB) whose
content is a function of the step, a real `tf.data` iterator saved as
`tf_state`, `restore_or_initialize`, then `next(iterator)` and `save` per
step. It reports on stdout, one JSON object a line:

  {"ev": "restored", "number": N, "step": S, "listed": [...], ...}
  {"ev": "saved", "number": N}
  {"ev": "done"}                          # reached --steps without a kill

On restore the child checks everything it can see before it reports: the
state arrays are those of step S (= N - 1), the iterator's next batch is
S*4..S*4+3, the `checkpoint` file lists consecutive numbers, and every listed
checkpoint restores with a consistent state and iterator (except the oldest
ones beyond `max_to_keep` whose files TensorFlow was deleting when the
process died). Any mismatch is an exception, so the child dies with a
traceback and a non-zero exit code.

`python _harness.py migrate ...` instead checks an Orbax destination (every
step stock Orbax lists restores and equals its source `.flax`) and then runs
`clu-ckpt migrate` in-process, so that the same kill triggers apply.

The kill: with `--kill EVENT#K%S` the child installs a `sys.setprofile` hook
after the restore and sends itself SIGKILL at the K-th occurrence of EVENT
counted from the start of its S-th save (`EVENT#K`: from the start), without
any change to library code. EVENT is

  c:os.write             a builtin call ('c_call' event), by identity
  py:clu_ckpt.storage:remove              a Python function ('call' event),
                                          "module:qualname"

optionally scoped with `@module:qualname` (only while inside that function)
and `!module:qualname` (only while not inside it), e.g.
`py:clu_ckpt.storage:remove@clu_ckpt.checkpoint:Checkpoint.save` and
`!clu_ckpt.save_protocol:delete_future_checkpoints`.

The parent side (`run_child`, `KILL_POINTS`, `expected_numbers`) is used by
the soak scripts and by tests/test_reliability.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

REPO = Path(__file__).resolve().parents[2]
BATCH = 4
MAX_TO_KEEP = 3

# --------------------------------------------------------------------------
# The training state: every leaf is a function of the step.
# --------------------------------------------------------------------------

_BASE_SHAPE = (512, 1024)   # float32, 2 MiB


def _base() -> np.ndarray:
  return np.random.default_rng(1234).random(_BASE_SHAPE, dtype=np.float32)


def make_state(step: int, base: np.ndarray, host: int = 0) -> dict[str, Any]:
  """The state after `step` steps (about 3.5 MiB of arrays)."""
  first = (step - 1) * BATCH + host_offset(host)
  batch = (np.arange(first, first + BATCH, dtype=np.int64) if step else
           np.full(BATCH, -1, np.int64))
  return {
      "step": step,
      "params": {
          "w": base + np.float32(step),
          "counts": np.full(2**18, step + host, np.int32),
          "scale": np.linspace(0, step, 2**16, dtype=np.float64),
      },
      "batch": batch,
      "meta": {"lr": 0.5 * step, "name": f"step-{step}", "hist": [step, host]},
  }


def host_offset(host: int) -> int:
  """Host `host` reads `range(host_offset(host), ...)`: disjoint per host."""
  return host * 10**7


def check_state(state: dict[str, Any], step: int, base: np.ndarray,
                where: str, host: int = 0) -> None:
  """Raises AssertionError unless `state` is exactly `make_state(step)`."""
  want = make_state(step, base, host)
  if state["step"] != step:
    raise AssertionError(f"{where}: step {state['step']!r} != {step}")
  for key in want["params"]:
    if not np.array_equal(np.asarray(state["params"][key]),
                          want["params"][key]):
      raise AssertionError(f"{where}: params/{key} is not that of step {step}")
  if not np.array_equal(np.asarray(state["batch"]), want["batch"]):
    raise AssertionError(f"{where}: batch {state['batch']} != {want['batch']}")
  if (state["meta"]["lr"] != want["meta"]["lr"] or
      state["meta"]["name"] != want["meta"]["name"] or
      list(state["meta"]["hist"]) != want["meta"]["hist"]):
    raise AssertionError(f"{where}: meta {state['meta']} != {want['meta']}")


def check_batch(batch: Any, step: int, where: str, host: int = 0) -> None:
  """The iterator's next batch after `step` steps must be step*4..step*4+3."""
  first = step * BATCH + host_offset(host)
  want = np.arange(first, first + BATCH)
  if not np.array_equal(np.asarray(batch), want):
    raise AssertionError(f"{where}: iterator yields {np.asarray(batch)} after "
                         f"step {step}, expected {want}")


# --------------------------------------------------------------------------
# The kill trigger.
# --------------------------------------------------------------------------


_SAVE = "clu_ckpt.checkpoint:Checkpoint.save"


def _code_name(frame) -> str:
  return f"{frame.f_globals.get('__name__')}:{_qualname(frame)}"


def _qualname(frame) -> str:
  """The qualified name of the function `frame` runs ("_Sink.large")."""
  code = frame.f_code
  if sys.version_info >= (3, 11):
    return code.co_qualname
  # Python 3.10's code objects have no co_qualname: the function (or method
  # of a class) with this code among the module's names has it.
  for value in list(frame.f_globals.values()):
    members = vars(value).values() if isinstance(value, type) else [value]
    for member in list(members):
      if isinstance(member, (staticmethod, classmethod)):
        member = member.__func__
      elif isinstance(member, property):
        member = member.fget
      while isinstance(member, types.FunctionType):
        if member.__code__ is code:
          return member.__qualname__
        member = getattr(member, "__wrapped__", None)  # functools.wraps
  return code.co_name


class KillTrigger:
  """SIGKILLs this process at the k-th occurrence of a profiler event.

  Occurrences are counted from the start of the `save`-th call of
  `Checkpoint.save` after the trigger is installed (any time, for processes
  that do not save).

  Attributes:
    spec: The event spec (see the module docstring).
    k: Which occurrence kills (1-based).
    seen: Occurrences counted so far.
    save: From which save on occurrences count (1-based; 0: always).
  """

  def __init__(self, spec: str, k: int, action: Optional[Callable] = None,
               save: int = 1):
    self.spec = spec
    self.k = k
    self.seen = 0
    self.save = save
    self.saves_seen = 0
    self._action = action or (lambda: os.kill(os.getpid(), signal.SIGKILL))
    target, self._within, self._outside = _parse_spec(spec)
    kind, name = target.split(":", 1)
    self._builtin = None
    self._target = None
    if kind == "c":
      module, attr = name.split(".", 1)
      self._builtin = getattr(__import__(module), attr)
    elif kind == "py":
      self._target = name
    else:
      raise ValueError(f"bad event kind in {spec!r}")
    self._names: dict[Any, str] = {}
    self._depth = {name: 0 for name in self._within + self._outside}

  def _name(self, frame) -> str:
    code = frame.f_code
    name = self._names.get(code)
    if name is None:
      name = self._names[code] = _code_name(frame)
    return name

  def _active(self) -> bool:
    return (self.saves_seen >= self.save and
            all(self._depth[n] > 0 for n in self._within) and
            all(self._depth[n] == 0 for n in self._outside))

  def _hit(self) -> None:
    self.seen += 1
    if self.seen == self.k:
      self._action()

  def profile(self, frame, event: str, arg: Any) -> None:
    if event == "c_call":
      if arg is self._builtin and self._active():
        self._hit()
      return
    if event not in ("call", "return"):
      return
    name = self._name(frame)
    if event == "call":
      if name == _SAVE:
        self.saves_seen += 1
      if name == self._target and self._active():
        self._hit()
      if name in self._depth:
        self._depth[name] += 1
    elif name in self._depth:
      self._depth[name] -= 1

  def install(self) -> None:
    sys.setprofile(self.profile)

  def uninstall(self) -> None:
    sys.setprofile(None)


def _parse_spec(spec: str) -> tuple[str, list[str], list[str]]:
  within, outside = [], []
  parts = spec.replace("!", "\0!").replace("@", "\0@").split("\0")
  for part in parts[1:]:
    (within if part[0] == "@" else outside).append(part[1:])
  return parts[0], within, outside


def finish(summary: dict[str, Any], workdir: Path, keep: bool) -> int:
  """Prints a soak's JSON summary, cleans up, and returns its exit status.

  The work directory stays when something failed (or with --keep).
  """
  print(json.dumps(summary, indent=2))
  if not keep and not summary["failures"]:
    shutil.rmtree(workdir, ignore_errors=True)
  else:
    print(f"work directory kept: {workdir}")
  return 1 if summary["failures"] else 0


# --------------------------------------------------------------------------
# Kill points: where the single-host and multihost children are killed.
# --------------------------------------------------------------------------

_CKPT = "clu_ckpt.checkpoint:Checkpoint"
_FUTURE = "clu_ckpt.save_protocol:delete_future_checkpoints"
_TFCM = "tensorflow.python.checkpoint.checkpoint_management"
_SAVE_FILE = "@clu_ckpt.flax_format:save_file"
_STATE = f"@{_TFCM}:update_checkpoint_state_internal"


@dataclasses.dataclass(frozen=True)
class KillPoint:
  """A family of kill points: an event, the occurrences to pick from.

  Attributes:
    phase: "flax_write", "flax_to_tf_commit", "pruning" or "future_cleanup".
    spec: The event (see `KillTrigger`).
    per_save: How often the event occurs in one save (for the range of k).
    committed: Whether the save being killed has committed when the event
      fires (the restore then finds it) or not.
    odd: The event occurs twice per save and only the first (True) or the
      second (False) occurrence of each save belongs to this point.
    needs_future: Only meaningful when uncommitted files of a future
      checkpoint are on disk.
  """
  phase: str
  spec: str
  per_save: int
  committed: bool
  odd: Optional[bool] = None
  needs_future: bool = False

  def pick(self, rng: random.Random, saves: int = 3) -> tuple[int, int]:
    """(k, save): an occurrence in one of the first `saves` saves."""
    save = rng.randint(1, saves)
    if self.odd is None:
      return rng.randint(1, self.per_save), save
    return (1 if self.odd else 2), save

  def pick_k(self, rng: random.Random, steps: int) -> int:
    """An occurrence among the first `steps` units of work (no save gate)."""
    return rng.randint(1, self.per_save * steps)

  def arg(self, k: int, save: int = 0) -> str:
    """The child's `--kill` argument."""
    return f"{self.spec}#{k}%{save}" if save else f"{self.spec}#{k}"


KILL_POINTS = [
    # Inside the .flax write (temporary file, fsync, rename, directory fsync).
    KillPoint("flax_write", f"c:os.open{_SAVE_FILE}", 2, False),
    KillPoint("flax_write", "py:clu_ckpt.flax_encode:_Sink.large", 4, False),
    KillPoint("flax_write", f"c:os.write{_SAVE_FILE}", 1, False),
    KillPoint("flax_write", f"c:os.fsync{_SAVE_FILE}", 2, False),
    KillPoint("flax_write", f"c:os.replace{_SAVE_FILE}", 1, False),
    KillPoint("flax_write", "py:clu_ckpt.local_fs:fsync_directory"
              f"{_SAVE_FILE}", 1, False),
    # The .flax is in place; TensorFlow has not committed.
    KillPoint("flax_to_tf_commit", f"py:{_TFCM}:CheckpointManager.save", 1,
              False),
    KillPoint("flax_to_tf_commit",
              f"py:{_TFCM}:CheckpointManager.save.<locals>."
              "_record_and_sweep_state", 1, False),
    KillPoint("flax_to_tf_commit",
              f"py:{_TFCM}:update_checkpoint_state_internal", 2, False,
              odd=True),
    KillPoint("flax_to_tf_commit",
              f"py:tensorflow.python.lib.io.file_io:rename{_STATE}", 2, False,
              odd=True),
    # Committed; old checkpoints are being removed.
    KillPoint("pruning", f"py:{_TFCM}:CheckpointManager._sweep", 1, True),
    KillPoint("pruning", f"py:{_TFCM}:_delete_file_if_exists", 2, True),
    KillPoint("pruning", f"py:{_TFCM}:update_checkpoint_state_internal", 2,
              True, odd=False),
    KillPoint("pruning",
              f"py:tensorflow.python.lib.io.file_io:rename{_STATE}", 2, True,
              odd=False),
    KillPoint("pruning", f"c:os.remove@{_CKPT}.save"
              f"!{_FUTURE}", 1, True),
    # Files of numbers after the restored one are being removed before a
    # save (uncommitted leftovers, or a host's own newer checkpoints after it
    # restored the common one): first the state file that unlists them (only
    # when some are listed), then each file.
    KillPoint("future_cleanup", f"py:{_FUTURE}", 1,
              False, needs_future=True),
    KillPoint("future_cleanup",
              f"py:tensorflow.python.lib.io.file_io:rename{_STATE}"
              f"@{_FUTURE}", 1, False,
              needs_future=True),
    KillPoint("future_cleanup",
              f"c:os.remove@{_FUTURE}", 3, False,
              needs_future=True),
]


def kill_point(name: str, phase: Optional[str] = None) -> KillPoint:
  """The kill point whose event is `name` (see `label`), e.g. "os.write"."""
  found = [p for p in KILL_POINTS if label(p.spec) == name and
           (phase is None or p.phase == phase)]
  if len(found) != 1:
    raise KeyError(f"{len(found)} kill points named {name!r} ({phase})")
  return found[0]


def label(spec: str) -> str:
  """A short name for an event spec: "os.write", "_sweep", ..."""
  target = _parse_spec(spec)[0]
  kind, name = target.split(":", 1)
  return name if kind == "c" else name.rsplit(":", 1)[-1].split(".")[-1]


def expected_numbers(last: int, committed: Optional[bool]) -> set[int]:
  """Numbers a restore may find after a kill; `last` = last reported save."""
  if committed is None:  # a random-time kill
    return {last, last + 1}
  return {last + 1} if committed else {last}


# --------------------------------------------------------------------------
# What is on disk.
# --------------------------------------------------------------------------


def directory_report(directory: str, listed: Sequence[int],
                     restored: int) -> dict[str, Any]:
  """Files beyond the restored checkpoint (futures), before the listed ones
  (orphans), and temporaries."""
  import re  # pylint: disable=g-import-not-at-top
  lo, hi = (min(listed) if listed else 0), restored
  futures, orphans, temps = [], [], []
  for name in sorted(os.listdir(directory)):
    if ".tmp" in name or name.endswith("_temp"):
      m = re.match(r"ckpt-(\d+)", name)
      if m and int(m.group(1)) > hi:
        futures.append(name)
      else:
        temps.append(name)
      continue
    m = re.match(r"ckpt-(\d+)\.", name)
    if not m:
      continue
    number = int(m.group(1))
    if number > hi:
      futures.append(name)
    elif number < lo:
      orphans.append(name)
  return dict(futures=futures, orphans=orphans, temps=temps)


# --------------------------------------------------------------------------
# The children.
# --------------------------------------------------------------------------


def _emit(**fields: Any) -> None:
  print(json.dumps(fields), flush=True)


def _quiet_tf():
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.set_visible_devices([], "GPU")
  return tf


def _dataset_iterator(tf, host: int):
  start = host_offset(host)
  return iter(tf.data.Dataset.range(start, start + 10**6).batch(BATCH))


def _verify_listed(ckpt, template: dict, it, base, host: int,
                   max_to_keep: int) -> dict[str, Any]:
  """Restores every listed checkpoint, oldest first, then the latest."""
  from clu_ckpt import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  from clu_ckpt import state_file as state_file_lib  # pylint: disable=g-import-not-at-top
  state_file = state_file_lib.read_checkpoint_state(ckpt.base_directory)
  listed = ([ckpt_lib.CheckpointInfo.from_path(p).number
             for p in state_file.managed_checkpoints()] if state_file else [])
  if listed and listed != list(range(listed[0], listed[-1] + 1)):
    raise AssertionError(f"listed checkpoints not consecutive: {listed}")
  # More than max_to_keep are listed when a process died while TensorFlow
  # pruned: the excess (oldest) ones may be partly deleted; they are checked
  # only when all their files are still there.
  excess = listed[:-max_to_keep]
  pruned = 0
  for number in listed[:-1]:
    path = f"{ckpt.base_directory}/{ckpt.checkpoint_name}-{number}"
    if number in excess and not all(
        os.path.exists(path + ext)
        for ext in (".flax", ".index", ".data-00000-of-00001")):
      pruned += 1
      continue
    state = ckpt.restore(template, path)
    check_state(state, number - 1, base, f"listed {path}", host)
    check_batch(next(it), number - 1, f"listed {path}", host)
  midprune = len(excess)
  return dict(listed=listed, midprune=midprune, pruned=pruned)


def _train(ckpt, it, base, host: int, state: dict, steps: int,
           trigger: Optional[KillTrigger], barrier: Callable[[str], None],
           sleep: float) -> None:
  from clu_ckpt import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  step = state["step"]
  if trigger is not None:
    trigger.install()
  for _ in range(steps):
    batch = next(it)
    check_batch(batch, step, f"training step {step + 1}", host)
    step += 1
    barrier(f"step-{step}")
    path = ckpt.save(make_state(step, base, host))
    number = ckpt_lib.CheckpointInfo.from_path(path).number
    if trigger is not None:
      trigger.uninstall()
    _emit(ev="saved", number=number, step=step)
    if number != step + 1:
      raise AssertionError(f"save returned {path} for step {step}")
    if trigger is not None:
      trigger.install()
    if sleep:
      time.sleep(sleep)
  if trigger is not None:
    trigger.uninstall()
  _emit(ev="done")


def _restore_and_check(ckpt, it, base, host: int,
                       max_to_keep: int) -> tuple[dict, dict]:
  from clu_ckpt import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  template = make_state(0, base, host)
  info = {}
  if ckpt.get_latest_checkpoint_to_restore_from() is not None:
    info = _verify_listed(ckpt, template, it, base, host, max_to_keep)
  state = ckpt.restore_or_initialize(template)
  number = ckpt_lib.CheckpointInfo.from_path(ckpt.current_checkpoint).number
  check_state(state, number - 1, base, f"restored {ckpt.current_checkpoint}",
              host)
  if not info:
    info = dict(listed=[number], midprune=0, pruned=0)
  info.update(directory_report(ckpt.base_directory, info["listed"], number))
  return state, dict(number=number, step=state["step"], **info)


def child_single(args: argparse.Namespace) -> None:
  """A single-host training loop on `clu_ckpt.checkpoint.Checkpoint`."""
  tf = _quiet_tf()
  from clu_ckpt import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  base = _base()
  it = _dataset_iterator(tf, 0)
  ckpt = ckpt_lib.Checkpoint(args.dir, dict(ds_iter=it),
                             max_to_keep=args.max_to_keep)
  state, info = _restore_and_check(ckpt, it, base, 0, args.max_to_keep)
  _emit(ev="restored", **info)
  trigger = _make_trigger(args)
  _train(ckpt, it, base, 0, state, args.steps, trigger, lambda name: None,
         args.sleep)


class _Counters:
  """Counts every kill point's event instead of killing (`--count-events`)."""

  def __init__(self, points: Sequence[KillPoint]):
    self.triggers = [KillTrigger(p.spec, 0, lambda: None, save=0)
                     for p in points]

  def profile(self, frame, event: str, arg: Any) -> None:
    for t in self.triggers:
      t.profile(frame, event, arg)

  def install(self) -> None:
    sys.setprofile(self.profile)

  def uninstall(self) -> None:
    sys.setprofile(None)
    _emit(ev="counts", counts={t.spec: t.seen for t in self.triggers})


def _make_trigger(args: argparse.Namespace) -> Optional[KillTrigger]:
  if args.count_events:
    return _Counters(MIGRATION_KILL_POINTS if args.mode == "migrate" else
                     KILL_POINTS)
  if not args.kill:
    return None
  return parse_kill(args.kill)


def parse_kill(text: str) -> KillTrigger:
  """`EVENT#K` or `EVENT#K%S` (the K-th occurrence in or after save S)."""
  spec, rest = text.rsplit("#", 1)
  k, _, save = rest.partition("%")
  return KillTrigger(spec, int(k), save=int(save) if save else 0)


def child_multihost(args: argparse.Namespace) -> None:
  """One host of a `jax.distributed` job on `MultihostCheckpoint`."""
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_platforms", "cpu")
  jax.distributed.initialize(
      coordinator_address=f"localhost:{args.port}",
      num_processes=args.num_processes, process_id=args.process_id,
      initialization_timeout=120)
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  client = distributed.global_state.client
  host = jax.process_index()

  def barrier(name: str) -> None:
    client.wait_at_barrier(name, 120_000)

  tf = _quiet_tf()
  from clu_ckpt import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  base = _base()
  it = _dataset_iterator(tf, host)
  ckpt = ckpt_lib.MultihostCheckpoint(args.dir, dict(ds_iter=it),
                                      max_to_keep=args.max_to_keep)
  barrier("before-restore")
  state, info = _restore_and_check(ckpt, it, base, host, args.max_to_keep)
  # Every host must agree on where to resume.
  client.key_value_set(f"restored/{host}", str(info["number"]))
  barrier("restored")
  numbers = [int(client.blocking_key_value_get(f"restored/{h}", 60_000))
             for h in range(args.num_processes)]
  if len(set(numbers)) != 1:
    raise AssertionError(f"hosts restored different checkpoints: {numbers}")
  _emit(ev="restored", host=host, hosts=numbers, **info)
  trigger = _make_trigger(args)
  _train(ckpt, it, base, host, state, args.steps, trigger, barrier,
         args.sleep)


# --------------------------------------------------------------------------
# Migration: `clu-ckpt migrate` under kills.
# --------------------------------------------------------------------------

MIGRATION_KILL_POINTS = [
    # Per migrated step: 1 `_save_step`, 15 `finalize` resumes, 4 renames.
    # A step's Orbax save begins (its temporary directory is created next).
    KillPoint("orbax_write", "py:clu_ckpt.migration:_save_step", 1, False),
    # Everything written, the commit marker and the rename are still to come.
    KillPoint("orbax_commit", "py:orbax.checkpoint._src.path.atomicity:"
              "AtomicRenameTemporaryPath.finalize", 15, False),
    # Any Python os.rename (Orbax's, mostly from its worker threads).
    KillPoint("orbax_commit", "c:os.rename", 4, False),
]


def same_tree(a: Any, b: Any, path: str = "", *,
              strict: bool = False) -> Optional[str]:
  """None if `a` and `b` are the same state dict bit for bit, else where not.

  With `strict`, also the types (of dicts, numpy values and scalars), the key
  order, and floats by their bits (what `msgpack_restore` returns exactly).
  """
  if isinstance(a, dict) or isinstance(b, dict):
    if strict:
      differ = type(a) is not type(b) or list(a) != list(b)
    else:
      differ = not (isinstance(a, dict) and isinstance(b, dict)) or (
          set(a) != set(b))
    if differ:
      return f"{path or '/'} (keys {_keys(a)} vs {_keys(b)})"
    for key in a:
      where = same_tree(a[key], b[key], f"{path}/{key}", strict=strict)
      if where:
        return where
    return None
  if isinstance(a, (np.ndarray, np.generic)) or isinstance(
      b, (np.ndarray, np.generic)):
    if strict and type(a) is not type(b):
      return f"{path} ({type(a).__name__} vs {type(b).__name__})"
    x, y = np.asarray(a), np.asarray(b)
    if x.dtype != y.dtype or x.shape != y.shape:
      return f"{path} ({x.dtype}{x.shape} vs {y.dtype}{y.shape})"
    if (np.ascontiguousarray(x).tobytes() !=
        np.ascontiguousarray(y).tobytes()):
      return f"{path} (bytes differ)"
    return None
  if strict and isinstance(a, float) and isinstance(b, float):
    same_bits = np.float64(a).tobytes() == np.float64(b).tobytes()
    return None if same_bits else f"{path} ({a!r} vs {b!r})"
  return None if (type(a) is type(b) and a == b) else (
      f"{path} ({a!r} vs {b!r})")


def _keys(value: Any) -> Any:
  return list(value)[:8] if isinstance(value, dict) else type(value).__name__


def check_orbax_destination(src: str, dst: str) -> dict[str, Any]:
  """What stock Orbax lists at `dst`; every listed step must be complete.

  Each listed step is restored by a stock, read-only `CheckpointManager`
  (no arguments) and, exactly, by `migration.restore_state`, and compared
  bit for bit with the source `ckpt-<step>.flax` (steps named by number).

  Returns:
    `steps` (listed) and `temporaries` (Orbax's unfinished step dirs).

  Raises:
    AssertionError: A listed step does not restore or differs.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from clu_ckpt import flax_format  # pylint: disable=g-import-not-at-top
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  if not os.path.isdir(dst):
    return dict(steps=[], temporaries=[])
  manager = ocp.CheckpointManager(
      dst, options=ocp.CheckpointManagerOptions(read_only=True))
  steps = sorted(manager.all_steps())
  for step in steps:
    manager.restore(step)
    restored = migration.restore_state(dst, step)
    source = flax_format.load_file(os.path.join(src, f"ckpt-{step}.flax"))
    where = same_tree(restored, source)
    if where is not None:
      raise AssertionError(f"step {step} differs from ckpt-{step} at {where}")
  manager.close()
  temporaries = sorted(n for n in os.listdir(dst) if "tmp" in n)
  return dict(steps=steps, temporaries=temporaries)


def child_migrate(args: argparse.Namespace) -> None:
  """Checks the destination, then runs `clu-ckpt migrate` (maybe to a kill)."""
  _quiet_tf()
  import jax  # pylint: disable=g-import-not-at-top,unused-import
  import orbax.checkpoint  # pylint: disable=g-import-not-at-top,unused-import
  from clu_ckpt import cli  # pylint: disable=g-import-not-at-top
  _emit(ev="listed", **check_orbax_destination(args.src, args.dir))
  trigger = _make_trigger(args)
  if trigger is not None:
    trigger.install()
    threading.setprofile(trigger.profile)
  _emit(ev="started", t=time.time())
  rc = cli.main(["migrate", args.src, args.dir, "--step-naming", "number",
                 *args.cli_args.split()])
  if trigger is not None:
    trigger.uninstall()
    threading.setprofile(None)
  _emit(ev="cli", rc=rc, t=time.time())
  if args.check_after:
    _emit(ev="listed_after", **check_orbax_destination(args.src, args.dir))


def main(argv: Optional[Sequence[str]] = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("mode", choices=["single", "multihost", "migrate"])
  parser.add_argument("--dir", required=True)
  parser.add_argument("--steps", type=int, default=1000)
  parser.add_argument("--kill", default="", help="EVENT#K")
  parser.add_argument("--max-to-keep", type=int, default=MAX_TO_KEEP)
  parser.add_argument("--sleep", type=float, default=0.0)
  parser.add_argument("--count-events", action="store_true",
                      help="print how often each kill point's event fires")
  parser.add_argument("--port", type=int)
  parser.add_argument("--num-processes", type=int)
  parser.add_argument("--process-id", type=int)
  parser.add_argument("--src", help="migrate: the CLU directory")
  parser.add_argument("--cli-args", default="",
                      help="migrate: more `clu-ckpt migrate` flags")
  parser.add_argument("--check-after", action="store_true")
  args = parser.parse_args(argv)
  {"single": child_single, "multihost": child_multihost,
   "migrate": child_migrate}[args.mode](args)


# --------------------------------------------------------------------------
# The parent side.
# --------------------------------------------------------------------------


@dataclasses.dataclass
class ChildResult:
  """What a child reported before it ended.

  Attributes:
    returncode: -9 when killed.
    events: The JSON lines it printed.
    stderr: Its standard error (for failure messages).
    seconds: Wall time.
    killed_by_parent: The parent sent the SIGKILL (random-time kills).
  """
  returncode: int
  events: list[dict[str, Any]]
  stderr: str
  seconds: float
  killed_by_parent: bool = False

  @property
  def restored(self) -> Optional[dict[str, Any]]:
    return next((e for e in self.events if e["ev"] == "restored"), None)

  @property
  def last_number(self) -> Optional[int]:
    """The newest checkpoint the child restored or saved (and reported)."""
    numbers = [e["number"] for e in self.events
               if e["ev"] in ("restored", "saved")]
    return max(numbers) if numbers else None

  @property
  def saves(self) -> int:
    return sum(e["ev"] == "saved" for e in self.events)


def child_env() -> dict[str, str]:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                     if p])
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  env.setdefault("JAX_PLATFORMS", "cpu")
  return env


class Child:
  """A running child; its JSON lines are collected by a reader thread."""

  def __init__(self, argv: Sequence[str], log: Optional[Path] = None):
    self.start = time.monotonic()
    self.log_path = log
    # A file, not a pipe: a chatty child must never block on its stderr.
    self._log = (open(log, "w+") if log else  # pylint: disable=consider-using-with
                 tempfile.TemporaryFile("w+"))
    self.proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), *argv],
        stdout=subprocess.PIPE, stderr=self._log, env=child_env(), text=True)
    self.lines: "queue.Queue[Optional[dict]]" = queue.Queue()
    self.events: list[dict[str, Any]] = []
    self.killed_by_parent = False
    self._eof = False
    self._result: Optional[ChildResult] = None
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self) -> None:
    for line in self.proc.stdout:
      line = line.strip()
      if line.startswith("{"):
        self.lines.put(json.loads(line))
    self.lines.put(None)

  def next_event(self, timeout: float) -> Optional[dict[str, Any]]:
    """The next JSON line; None at EOF; raises queue.Empty on timeout."""
    if self._eof:
      return None
    event = self.lines.get(timeout=timeout)
    if event is None:
      self._eof = True
    else:
      self.events.append(event)
    return event

  def kill(self) -> None:
    if self.proc.poll() is None:
      self.killed_by_parent = True
      self.proc.send_signal(signal.SIGKILL)

  def wait(self, timeout: float) -> ChildResult:
    """Collects the rest of its output; kills it after `timeout` s from now."""
    deadline = time.monotonic() + timeout
    try:
      while self.next_event(max(0.01, deadline - time.monotonic())) is not None:
        pass
      self.proc.wait(max(0.01, deadline - time.monotonic()))
    except (queue.Empty, subprocess.TimeoutExpired):
      self.kill()
      self.proc.wait()
      raise TimeoutError(f"child {self.proc.args} hung for {timeout}s:\n"
                         f"{self.stderr()[-3000:]}") from None
    return self.result()

  def stderr(self) -> str:
    if self._log.closed:
      return ""
    self._log.flush()
    self._log.seek(0)
    return self._log.read()

  def result(self) -> ChildResult:
    if self._result is not None:
      return self._result
    result = self._result = ChildResult(self.proc.returncode, self.events, self.stderr(),
                         time.monotonic() - self.start, self.killed_by_parent)
    self._log.close()
    self.proc.stdout.close()
    return result


def run_child(argv: Sequence[str], *, timeout: float = 300.0,
              kill_after: Optional[float] = None,
              log: Optional[Path] = None) -> ChildResult:
  """Runs a child to its end; `kill_after` s after its restore, SIGKILLs it."""
  child = Child(argv, log)
  if kill_after is not None:
    deadline = time.monotonic() + timeout
    while True:
      event = child.next_event(max(0.01, deadline - time.monotonic()))
      if event is None or event["ev"] == "restored":
        break
    if event is not None:
      time.sleep(kill_after)
      child.kill()
  return child.wait(max(1.0, timeout - (time.monotonic() - child.start)))


class ChainError(AssertionError):
  """A round broke the promise; the message says how, with the child's log."""


class SingleHostChain:
  """Kill after kill in one directory, each restore checked against the last.

  Each round starts a fresh child: it restores (checking state, iterator and
  every listed checkpoint itself) and reports the number; the chain checks
  that number against what the previous child reported and where it died.

  Attributes:
    directory: The checkpoint directory.
    last: The newest number the previous child reported (restored or saved).
    futures: Uncommitted files of future checkpoints after the last restore.
    rounds: One dict per round (kill point, restored number, saves, time).
  """

  def __init__(self, directory: Path, log_dir: Optional[Path] = None,
               timeout: float = 300.0):
    self.directory = Path(directory)
    self.log_dir = log_dir
    self.timeout = timeout
    self.last: Optional[int] = None
    self.futures: list[str] = []
    self.rounds: list[dict[str, Any]] = []
    self._expected: Optional[set[int]] = None
    self._resync = False

  def resync(self) -> None:
    """After a failure: accept whatever the next restore finds, then go on."""
    self._resync = True

  def reset(self, keep_as: Optional[Path] = None) -> None:
    """Starts over with no checkpoints (moving the old ones to `keep_as`)."""
    import shutil  # pylint: disable=g-import-not-at-top
    if self.directory.exists():
      if keep_as is not None:
        keep_as.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(self.directory), str(keep_as))
      else:
        shutil.rmtree(self.directory)
    self.last = None
    self.futures = []
    self._expected = None
    self._resync = False

  def round(self, point: Optional[KillPoint] = None, k: int = 1,
            save: int = 1, *, kill_after: Optional[float] = None,
            steps: int = 6) -> dict[str, Any]:
    """Runs one child; returns the round's record; raises ChainError.

    Args:
      point: Where to kill, or None (no kill, or `kill_after`).
      k: The occurrence of the point's event that kills...
      save: ...counted from the start of this save after the restore.
      kill_after: Kill this many seconds after the restore instead.
      steps: Saves the child makes if nothing kills it.
    """
    argv = ["single", "--dir", str(self.directory), "--steps", str(steps)]
    if point is not None:
      argv += ["--kill", point.arg(k, save)]
    log = (self.log_dir / f"round-{len(self.rounds):04d}.log"
           if self.log_dir else None)
    result = run_child(argv, timeout=self.timeout, kill_after=kill_after,
                       log=log)
    record = dict(phase=("random" if kill_after is not None else
                         point.phase if point else "none"),
                  spec=point.spec if point else None, k=k, save=save,
                  kill_after=kill_after, returncode=result.returncode,
                  seconds=round(result.seconds, 2), saves=result.saves)
    self.rounds.append(record)
    restored = self._check(result, record)
    record.update(restored=restored["number"], orphans=restored["orphans"],
                  temps=restored["temps"], midprune=restored["midprune"])
    self.futures = restored["futures"]
    self.last = result.last_number
    if result.returncode == 0:
      record["phase"] = "none"   # the kill point was never reached
      self._expected = {self.last}
    elif kill_after is not None:
      self._expected = expected_numbers(self.last, None)
    else:
      self._expected = expected_numbers(self.last, point.committed)
    if log is not None:
      log.unlink()
    return record

  def _check(self, result: ChildResult,
             record: dict[str, Any]) -> dict[str, Any]:
    def fail(message: str) -> None:
      raise ChainError(f"round {len(self.rounds) - 1} {record}: {message}\n"
                       f"--- child stderr (tail) ---\n"
                       f"{result.stderr[-4000:]}")

    restored = result.restored
    if restored is None:
      previous = self.rounds[-2] if len(self.rounds) > 1 else None
      fail(f"the child died before it restored: the directory left by the "
           f"previous round ({previous}) does not restore")
    expected = self._expected if self._expected is not None else {1}
    if self._resync:
      self._resync = False
    elif restored["number"] not in expected:
      fail(f"restored checkpoint {restored['number']}, expected one of "
           f"{sorted(expected)} (the previous child reported {self.last})")
    if result.returncode not in (0, -signal.SIGKILL):
      fail(f"exit code {result.returncode}")
    if result.returncode == 0 and result.events[-1]["ev"] != "done":
      fail("exit code 0 without finishing")
    if (result.returncode == -signal.SIGKILL and not result.killed_by_parent
        and not record["spec"]):
      fail("killed, but by nobody in this harness")
    saved = [e["number"] for e in result.events if e["ev"] == "saved"]
    if saved != list(range(restored["number"] + 1,
                           restored["number"] + 1 + len(saved))):
      fail(f"saves after restoring {restored['number']}: {saved}")
    return restored


class MultihostChain:
  """Rounds of a `jax.distributed` job: one host dies mid-save, all restart.

  Each round starts every host (`num_hosts` processes on a fresh coordinator
  port). The hosts restore, and each checks inside that every host restored
  the same number (through the coordinator's key-value store) and that its
  own state and iterator are those of that number; they then train in lock
  step (a barrier before every save, as a collective would). One host, the
  victim, is SIGKILLed at a kill point or at a random time; the others go on
  until they block at the next barrier and are killed after a random grace
  period, as a scheduler tearing down the job would. The next round checks
  that the number every host restored is not older than the newest save all
  hosts had reported (nothing of the common set lost) and at most one newer.

  Attributes:
    base: The multihost base directory (hosts write `<base>-<i>`).
    num_hosts: Processes per round.
    last: Per host, the newest number it reported in the previous round.
    futures: Per host, uncommitted future files seen at the last restore.
    rounds: One dict per round.
  """

  def __init__(self, base: Path, num_hosts: int,
               log_dir: Optional[Path] = None, timeout: float = 300.0):
    self.base = Path(base)
    self.num_hosts = num_hosts
    self.log_dir = log_dir
    self.timeout = timeout
    self.last: Optional[list[int]] = None
    self.futures: list[list[str]] = [[] for _ in range(num_hosts)]
    self.rounds: list[dict[str, Any]] = []
    self._victim_uncommitted: Optional[bool] = None
    self._last_victim: Optional[int] = None
    self._resync = False

  def resync(self) -> None:
    """After a failure: accept whatever the next restore finds."""
    self._resync = True

  def reset(self, keep_as: Optional[Path] = None) -> None:
    """Starts over with no checkpoints (moving the old ones to `keep_as`)."""
    import shutil  # pylint: disable=g-import-not-at-top
    for directory in self.base.parent.glob(f"{self.base.name}-*"):
      if keep_as is not None:
        keep_as.mkdir(parents=True, exist_ok=True)
        shutil.move(str(directory), str(keep_as / directory.name))
      else:
        shutil.rmtree(directory)
    self.last = None
    self.futures = [[] for _ in range(self.num_hosts)]
    self._resync = False

  def round(self, victim: Optional[int] = None,
            point: Optional[KillPoint] = None, k: int = 1, save: int = 1, *,
            kill_after: Optional[float] = None, grace: float = 0.5,
            steps: int = 8) -> dict[str, Any]:
    """Runs one round; returns its record; raises ChainError."""
    port = free_port()
    n = len(self.rounds)
    children = []
    for host in range(self.num_hosts):
      argv = ["multihost", "--dir", str(self.base), "--steps", str(steps),
              "--port", str(port), "--num-processes", str(self.num_hosts),
              "--process-id", str(host)]
      if host == victim and point is not None:
        argv += ["--kill", point.arg(k, save)]
      log = (self.log_dir / f"round-{n:04d}-host-{host}.log"
             if self.log_dir else None)
      children.append(Child(argv, log))
    record = dict(phase=("random" if kill_after is not None else
                         point.phase if point else "none"),
                  spec=point.spec if point else None, k=k, save=save,
                  victim=victim,
                  kill_after=kill_after, grace=grace)
    self.rounds.append(record)
    try:
      self._drive(children, victim, kill_after, grace)
    finally:
      for child in children:
        child.kill()
      results = [child.wait(30) for child in children]
    record.update(returncodes=[r.returncode for r in results],
                  saves=[r.saves for r in results],
                  seconds=round(max(r.seconds for r in results), 2))
    restored = self._check(results, record, victim)
    record.update(restored=restored)
    self.futures = [r.restored["futures"] for r in results]
    self.last = [r.last_number for r in results]
    if victim is not None and point is not None:
      self._victim_uncommitted = (results[victim].returncode == -9 and
                                  not point.committed)
    else:
      self._victim_uncommitted = None
    if all(r.returncode == 0 for r in results):
      record["phase"] = "none"
    if self.log_dir is not None:
      for child in children:
        child.log_path.unlink()
    return record

  def _drive(self, children: list["Child"], victim: Optional[int],
             kill_after: Optional[float], grace: float) -> None:
    deadline = time.monotonic() + self.timeout
    # All hosts restore; if one dies first, the round is over.
    pending = set(range(len(children)))
    while pending:
      for h in sorted(pending):
        try:
          event = children[h].next_event(0.05)
        except queue.Empty:
          continue
        if event is None:
          return
        if event["ev"] == "restored":
          pending.discard(h)
      if time.monotonic() > deadline:
        return
    if victim is None:
      for child in children:
        child.wait(max(1.0, deadline - time.monotonic()))
      return
    if kill_after is not None:
      time.sleep(kill_after)
      children[victim].kill()
    # The victim dies (at its kill point) or finishes.
    children[victim].proc.wait(max(1.0, deadline - time.monotonic()))
    time.sleep(grace)

  def _check(self, results: list[ChildResult], record: dict[str, Any],
             victim: Optional[int]) -> int:
    def fail(message: str) -> None:
      logs = "\n".join(
          f"--- host {h} stderr (tail) ---\n{r.stderr[-3000:]}"
          for h, r in enumerate(results))
      raise ChainError(f"round {len(self.rounds) - 1} {record}: {message}\n"
                       f"{logs}")

    missing = [h for h, r in enumerate(results) if r.restored is None]
    if missing:
      previous = self.rounds[-2] if len(self.rounds) > 1 else None
      fail(f"hosts {missing} died before they restored: the directories "
           f"left by the previous round ({previous}) do not restore")
    numbers = [r.restored["number"] for r in results]
    if len(set(numbers)) != 1:
      fail(f"hosts restored different checkpoints: {numbers}")
    number = numbers[0]
    if self._resync:
      self._resync = False
    elif self.last is None:
      if number != 1:
        fail(f"a fresh job restored {number}")
    else:
      # A host that was killed before it committed may still hold an older
      # committed copy of the next number (from before the previous restore):
      # one newer than the common reported number is allowed either way.
      low = min(self.last)
      allowed = {low, low + 1}
      if number not in allowed:
        fail(f"restored {number}; the hosts had reported {self.last}, so "
             f"one of {sorted(allowed)} was expected")
    for h, r in enumerate(results):
      saved = [e["number"] for e in r.events if e["ev"] == "saved"]
      if saved != list(range(number + 1, number + 1 + len(saved))):
        fail(f"host {h} saved {saved} after restoring {number}")
      if h != victim and r.returncode not in (0, -signal.SIGKILL):
        if "AssertionError" in r.stderr or r.returncode == 1:
          fail(f"host {h} failed (exit code {r.returncode})")
    if victim is not None and results[victim].returncode not in (
        0, -signal.SIGKILL):
      fail(f"the victim exited with {results[victim].returncode}")
    self._last_victim = victim
    return number


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


if __name__ == "__main__":
  main()
