"""Soak: SIGKILL `clu-ckpt migrate` anywhere; Orbax never lists a torn step.

A source CLU directory with six checkpoints (3.5 MiB of state each, with a
tf.data iterator) is written once by the harness' training child. Each round
migrates it into a fresh Orbax root with `python -m clu_ckpt migrate`-
equivalent runs (`clu_ckpt.cli.main` inside a harness child, so that kill
points can be set without touching library code):

1. a run killed at a kill point (start of a step's Orbax save, Orbax's
   commit/rename, any `os.rename`) or at a random time after start-up;
2. half of the time a second killed run;
3. a run with `--verify` that must exit 0.

Before every run and after the last, the child lists the steps with a stock
read-only `orbax.checkpoint.CheckpointManager`, restores each listed step
with it and exactly with `migration.restore_state`, and compares it bit for
bit with the source `.flax`: a listed step must never be incomplete. After
the last run all six steps must be listed and no temporary directory left.

Usage::

  python tests/soak/soak_kill_migration.py --rounds 20 [--seed 0]
      [--workdir /tmp/soak-migration]
"""

from __future__ import annotations

import argparse
import collections
import random
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # pylint: disable=g-import-not-at-top,wrong-import-position

NUMBERS = [1, 2, 3, 4, 5, 6]


def make_source(src: Path) -> None:
  result = _harness.run_child(["single", "--dir", str(src), "--steps", "5",
                               "--max-to-keep", "6"])
  if result.returncode != 0:
    raise RuntimeError(f"could not write the source:\n{result.stderr}")


def run(src: Path, dst: Path, kill: str = "", kill_after=None,
        cli_args: str = "", check_after: bool = False,
        timeout: float = 600) -> _harness.ChildResult:
  argv = ["migrate", "--src", str(src), "--dir", str(dst)]
  if kill:
    argv += ["--kill", kill]
  if cli_args:
    argv += [f"--cli-args={cli_args}"]
  if check_after:
    argv += ["--check-after"]
  child = _harness.Child(argv)
  if kill_after is not None:
    while True:
      event = child.next_event(timeout)
      if event is None or event["ev"] == "started":
        break
    if event is not None:
      time.sleep(kill_after)
      child.kill()
  return child.wait(timeout)


def listed(result: _harness.ChildResult, ev: str = "listed") -> dict:
  found = [e for e in result.events if e["ev"] == ev]
  if not found:
    raise AssertionError(f"the child did not list the destination "
                         f"(exit code {result.returncode}):\n"
                         f"{result.stderr[-4000:]}")
  return found[0]


def one_round(rng: random.Random, src: Path, dst: Path,
              full_seconds: float, stats: collections.Counter) -> None:
  previous: list[int] = []
  for attempt in range(1 if rng.random() < 0.5 else 2):
    if rng.random() < 0.3:
      kill, kill_after = "", rng.uniform(0.0, full_seconds)
      phase = "random"
    else:
      point = rng.choice(_harness.MIGRATION_KILL_POINTS)
      kill, kill_after = point.arg(point.pick_k(rng, len(NUMBERS))), None
      phase = point.phase
    result = run(src, dst, kill, kill_after)
    steps = listed(result)["steps"]
    if 0 < len(steps) < len(NUMBERS):
      stats["partial_listings_checked"] += 1
    if not set(previous) <= set(steps):
      raise AssertionError(f"steps {previous} were listed, now {steps}")
    previous = steps
    if result.returncode == -9:
      stats[f"kills_{phase}"] += 1
      stats["kills"] += 1
    elif result.returncode == 0:
      stats["runs_not_killed"] += 1
    else:
      raise AssertionError(f"migrate run exited {result.returncode}:\n"
                           f"{result.stderr[-4000:]}")
  final = run(src, dst, cli_args="--verify", check_after=True)
  before = listed(final)["steps"]
  if 0 < len(before) < len(NUMBERS):
    stats["partial_listings_checked"] += 1
  if not set(previous) <= set(before):
    raise AssertionError(f"steps {previous} were listed, then {before}")
  cli = [e for e in final.events if e["ev"] == "cli"]
  if final.returncode != 0 or not cli or cli[0]["rc"] != 0:
    raise AssertionError(f"the re-run with --verify failed ({cli}, exit "
                         f"{final.returncode}):\n{final.stderr[-4000:]}")
  after = listed(final, "listed_after")
  if after["steps"] != NUMBERS or after["temporaries"]:
    raise AssertionError(f"after the re-run: {after}")
  stats["rounds_completed"] += 1


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=20)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--workdir", type=Path, default=None)
  parser.add_argument("--keep", action="store_true")
  args = parser.parse_args()
  workdir = args.workdir or Path(tempfile.mkdtemp(prefix="soak-migration-"))
  workdir.mkdir(parents=True, exist_ok=True)
  rng = random.Random(args.seed)
  start = time.monotonic()
  src = workdir / "src"
  if not src.exists():
    make_source(src)
  # How long a whole migration takes after start-up: random kills fall in it.
  calibration = run(src, workdir / "calibration", check_after=True)
  times = {e["ev"]: e.get("t") for e in calibration.events}
  full_seconds = times["cli"] - times["started"]
  if listed(calibration, "listed_after")["steps"] != NUMBERS:
    raise SystemExit("the calibration migration did not list every step")
  shutil.rmtree(workdir / "calibration")
  stats: collections.Counter = collections.Counter()
  failures = []
  for r in range(args.rounds):
    dst = workdir / f"dst-{r}"
    try:
      one_round(rng, src, dst, full_seconds, stats)
      shutil.rmtree(dst)
      status = "ok"
    except Exception as e:  # pylint: disable=broad-except
      failures.append(f"round {r}: {e}")
      traceback.print_exc()
      status = "FAILURE"
    print(f"[round {r:3d}] {status} {dict(stats)}", flush=True)
  summary = dict(rounds=args.rounds, **dict(sorted(stats.items())),
                 failures=len(failures),
                 failure_messages=[f.split("\n")[0] for f in failures],
                 migration_seconds=round(full_seconds, 2),
                 seconds=round(time.monotonic() - start, 1))
  return _harness.finish(summary, workdir, args.keep)


if __name__ == "__main__":
  sys.exit(main())
