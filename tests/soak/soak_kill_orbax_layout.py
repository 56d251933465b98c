"""Soak: SIGKILL a training loop saving in the Orbax layout anywhere, restore.

The run starts in the CLU layout (a child saves 3 checkpoints with
`Checkpoint(...)`), then every round's child switches to
`Checkpoint(..., layout="orbax")`: it restores every checkpoint of either
layout it sees (state exact, tf.data iterator at the right batch: see
`_harness.check_state`, `check_batch`), then `restore_or_initialize`, then
trains and saves until it is killed: at the k-th occurrence of an event of
the Orbax save (`--targeted` rounds: before the fsync of the step, among its
fsyncs, at the rename that commits it, while pruning, while removing
leftovers), or at a random time chosen by the parent. The next round's
restore must find exactly the last committed checkpoint: the last reported
save, or the one after it when the kill came after its commit.

Usage::

  python tests/soak/soak_kill_orbax_layout.py --rounds 100 [--seed 0]
      [--workdir /tmp/soak-orbax] [--random-share 0.4] [--keep]

Prints one line per round and a JSON summary (rounds, kills per phase,
failures, leftovers, time); exits 1 if any round failed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # pylint: disable=g-import-not-at-top,wrong-import-position

MAX_TO_KEEP = 3
CLU_SAVES = 3  # checkpoints 1 (initial) .. 4 in the CLU layout
_SAVE_STEP = "clu_ckpt.migration.orbax_target:OrbaxTarget._save"
_DISCARD = "clu_ckpt.migration.orbax_target:OrbaxTarget.discard"

# (phase, event spec, occurrences per save, committed when it fires).
KILL_POINTS = [
    ("before_commit", "py:clu_ckpt.orbax_items:serialize_tf_state", 1, False),
    ("before_commit", "py:clu_ckpt.orbax_layout:fsync_tree", 1, False),
    ("before_commit", "c:os.fsync@clu_ckpt.orbax_layout:fsync_tree", 12,
     False),
    ("before_commit", f"c:os.rename@{_SAVE_STEP}", 1, False),
    ("pruning", f"py:{_DISCARD}", 1, True),
    ("pruning", f"c:os.replace@{_DISCARD}", 1, True),
    ("pruning", f"py:clu_ckpt.storage:remove_tree@{_DISCARD}", 1, True),
    ("leftovers", "py:clu_ckpt.orbax_layout:OrbaxSteps.sweep_partial", 1,
     True),
]


# --------------------------------------------------------------------------
# The child.
# --------------------------------------------------------------------------


def _emit(**fields: Any) -> None:
  print(json.dumps(fields), flush=True)


def _numbers(ckpt) -> tuple[list[int], list[int]]:
  """(CLU checkpoint numbers listed, Orbax steps) of the directory."""
  from clu_ckpt import layout  # pylint: disable=g-import-not-at-top
  from clu_ckpt import orbax_root  # pylint: disable=g-import-not-at-top
  clu = sorted(layout.listed_numbers(ckpt.base_directory, "ckpt"))
  return clu, orbax_root.list_steps(ckpt.base_directory)[0]


def child(args: argparse.Namespace) -> None:
  """Restores and checks everything, then trains and saves until killed."""
  tf = _harness._quiet_tf()  # pylint: disable=protected-access
  from clu_ckpt import checkpoint  # pylint: disable=g-import-not-at-top
  base = _harness._base()  # pylint: disable=protected-access
  it = _harness._dataset_iterator(tf, 0)  # pylint: disable=protected-access
  ckpt = checkpoint.Checkpoint(args.dir, dict(ds_iter=it),
                               max_to_keep=MAX_TO_KEEP, layout=args.layout)
  template = _harness.make_state(0, base)
  clu, steps = _numbers(ckpt)
  # Every checkpoint of either layout restores exactly, iterator included.
  for number in sorted(set(clu) | set(steps)):
    path = f"{ckpt.base_directory}/ckpt-{number}"
    check = checkpoint.Checkpoint(args.dir, dict(ds_iter=it),
                                  layout=args.layout)
    state = check.restore(template, path)
    _harness.check_state(state, number - 1, base, f"listed {path}")
    _harness.check_batch(next(it), number - 1, f"listed {path}")
  state = ckpt.restore_or_initialize(template)
  number = checkpoint.CheckpointInfo.from_path(ckpt.current_checkpoint).number
  _harness.check_state(state, number - 1, base, f"restored {number}")
  leftovers = [n for n in os.listdir(args.dir) if ".orbax-checkpoint-tmp" in n]
  _emit(ev="restored", number=number, clu=clu, steps=steps,
        leftovers=leftovers)
  trigger = _harness.parse_kill(args.kill) if args.kill else None
  if trigger is not None:
    trigger.install()
    threading.setprofile(trigger.profile)  # Orbax renames in its threads
  step = state["step"]
  for _ in range(args.steps):
    _harness.check_batch(next(it), step, f"training step {step + 1}")
    step += 1
    path = ckpt.save(_harness.make_state(step, base))
    saved = checkpoint.CheckpointInfo.from_path(path).number
    if saved != step + 1:
      raise AssertionError(f"save returned {path} for step {step}")
    _emit(ev="saved", number=saved)
  if trigger is not None:
    trigger.uninstall()
  clu, steps = _numbers(ckpt)
  _emit(ev="done", clu=clu, steps=steps,
        entries=sorted(os.listdir(args.dir)))


# --------------------------------------------------------------------------
# The parent.
# --------------------------------------------------------------------------


def run_child(directory: Path, *, layout: str = "orbax", kill: str = "",
              steps: int = 6, kill_after: Optional[float] = None,
              timeout: float = 300.0) -> dict[str, Any]:
  """Runs one child; returns its events, return code and stderr tail."""
  env = _harness.child_env()
  with tempfile.TemporaryFile("w+") as log:
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "child",
         "--dir", str(directory), "--layout", layout, "--kill", kill,
         "--steps", str(steps)],
        stdout=subprocess.PIPE, stderr=log, env=env, text=True)
    events = []
    killer = None
    start = time.monotonic()
    for line in proc.stdout:
      if line.startswith("{"):
        events.append(json.loads(line))
        if events[-1]["ev"] == "restored" and kill_after is not None:
          killer = threading.Timer(kill_after, proc.send_signal,
                                   (signal.SIGKILL,))
          killer.start()
      if time.monotonic() - start > timeout:
        proc.kill()
    proc.wait()
    if killer is not None:
      killer.cancel()
    log.seek(0)
    return dict(returncode=proc.returncode, events=events,
                stderr=log.read()[-3000:])


class Chain:
  """Rounds in one directory; each restore is checked against the last."""

  def __init__(self, directory: Path):
    self.directory = directory
    self.last: Optional[int] = None  # newest number reported by a child
    self.rounds: list[dict[str, Any]] = []

  def start(self) -> dict[str, Any]:
    """The CLU-layout run the switch starts from (no kill)."""
    result = run_child(self.directory, layout="clu", steps=CLU_SAVES)
    self._expect_ok(result, "CLU-layout start")
    self.last = 1 + CLU_SAVES
    return result

  def round(self, point: Optional[tuple] = None, k: int = 1, save: int = 1,
            kill_after: Optional[float] = None, steps: int = 6
            ) -> dict[str, Any]:
    kill = f"{point[1]}#{k}%{save}" if point else ""
    result = run_child(self.directory, kill=kill, steps=steps,
                       kill_after=kill_after)
    restored = next((e for e in result["events"] if e["ev"] == "restored"),
                    None)
    if restored is None:
      raise AssertionError(f"no restore (rc {result['returncode']}):\n"
                           f"{result['stderr']}")
    record = dict(phase=point[0] if point else (
        "random" if kill_after is not None else "none"),
                  spec=point[1] if point else "", k=k, save=save,
                  returncode=result["returncode"],
                  restored=restored["number"],
                  saves=sum(e["ev"] == "saved" for e in result["events"]))
    self._check_restored(restored["number"])
    self.rounds.append(record)
    numbers = [e["number"] for e in result["events"]
               if e["ev"] in ("restored", "saved")]
    reported = max(numbers)
    if result["returncode"] == -9:
      committed = point[3] if point else None
      self.pending = committed
    elif result["returncode"] == 0:
      self.pending = False
    else:
      raise AssertionError(f"child failed (rc {result['returncode']}):\n"
                           f"{result['stderr']}")
    self.last = reported
    record["done"] = next((e for e in result["events"] if e["ev"] == "done"),
                          None)
    return record

  def _check_restored(self, number: int) -> None:
    if self.last is None:
      return
    pending = getattr(self, "pending", False)
    expected = ({self.last, self.last + 1} if pending is None else
                {self.last + 1} if pending else {self.last})
    if number not in expected:
      raise AssertionError(f"restored {number}, expected one of "
                           f"{sorted(expected)} (last reported {self.last})")

  @staticmethod
  def _expect_ok(result: dict[str, Any], what: str) -> None:
    if result["returncode"] != 0:
      raise AssertionError(f"{what} failed (rc {result['returncode']}):\n"
                           f"{result['stderr']}")


def choose(rng: random.Random, random_share: float):
  """(point, k, save, kill_after, steps) for the next round."""
  if rng.random() < random_share:
    return None, 1, 1, rng.uniform(0.0, 2.0), 50
  point = rng.choice(KILL_POINTS)
  return point, rng.randint(1, point[2]), rng.randint(1, 3), None, 6


def final_check(chain: Chain) -> list[str]:
  """A last round without a kill: no leftovers, max_to_keep holds."""
  problems = []
  record = chain.round(None, steps=2)
  done = record["done"] or {}
  leftovers = [n for n in done.get("entries", [])
               if ".orbax-checkpoint-tmp" in n or "discarded" in n]
  if leftovers:
    problems.append(f"leftovers after a clean save: {leftovers}")
  if len(done.get("steps", [])) > MAX_TO_KEEP:
    problems.append(f"{done['steps']}: more than {MAX_TO_KEEP} Orbax steps")
  kept = list(range(2 + CLU_SAVES - MAX_TO_KEEP, 2 + CLU_SAVES))
  if done.get("clu") != kept:
    problems.append(f"CLU checkpoints {done.get('clu')}: the only copies "
                    f"{kept} must stay")
  return problems


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("mode", nargs="?", default="soak",
                      choices=["soak", "child"])
  parser.add_argument("--rounds", type=int, default=100)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--random-share", type=float, default=0.4)
  parser.add_argument("--workdir", type=Path, default=None)
  parser.add_argument("--keep", action="store_true")
  # The child's options.
  parser.add_argument("--dir")
  parser.add_argument("--layout", default="orbax")
  parser.add_argument("--kill", default="")
  parser.add_argument("--steps", type=int, default=6)
  args = parser.parse_args(argv)
  if args.mode == "child":
    child(args)
    return 0
  workdir = args.workdir or Path(tempfile.mkdtemp(prefix="soak-orbax-"))
  rng = random.Random(args.seed)
  chain = Chain(workdir / "ckpts")
  start = time.monotonic()
  failures = []
  try:
    chain.start()
    for r in range(args.rounds):
      point, k, save, kill_after, steps = choose(rng, args.random_share)
      rec = chain.round(point, k, save, kill_after=kill_after, steps=steps)
      print(f"[round {r:3d}] {rec['phase']:13s} "
            f"{_harness.label(rec['spec']) if rec['spec'] else '':22s} "
            f"k={k}@save{save} rc={rec['returncode']:3d} "
            f"restored={rec['restored']:4d} saves={rec['saves']:3d}",
            flush=True)
    failures += final_check(chain)
  except AssertionError as e:
    failures.append(str(e))
  kills = collections.Counter(r["phase"] for r in chain.rounds
                              if r["returncode"] == -9)
  summary = dict(rounds=len(chain.rounds), kills=sum(kills.values()),
                 kills_per_phase=dict(sorted(kills.items())),
                 saves_completed=sum(r["saves"] for r in chain.rounds),
                 failures=len(failures),
                 failure_messages=[f.split("\n")[0] for f in failures],
                 seconds=round(time.monotonic() - start, 1))
  if failures:
    for f in failures:
      print(f, file=sys.stderr)
  return _harness.finish(summary, workdir, args.keep)


if __name__ == "__main__":
  sys.exit(main())
