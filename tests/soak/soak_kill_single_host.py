"""Soak: SIGKILL a single-host training loop anywhere, restore, repeat.

Each round starts a fresh child process (see `_harness.py`) that restores the
directory, checks the restored state, its tf.data iterator and every listed
checkpoint, then trains and saves until it is killed: at the k-th occurrence
of an event inside a save (`--targeted` share of rounds; the `.flax` write,
between it and TensorFlow's commit, during pruning, during the clean-up of an
uncommitted future checkpoint), or at a random time chosen by the parent. The
next round's restore must find exactly the last committed checkpoint.

Usage::

  python tests/soak/soak_kill_single_host.py --rounds 200 [--jobs 2]
      [--seed 0] [--workdir /tmp/soak-single] [--random-share 0.25]

Prints one line per round and a JSON summary (rounds, kills per phase,
failures, time); exits 1 if any round failed.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # pylint: disable=g-import-not-at-top,wrong-import-position

FUTURE_POINTS = [p for p in _harness.KILL_POINTS if p.needs_future]
OTHER_POINTS = [p for p in _harness.KILL_POINTS if not p.needs_future]


def choose(rng: random.Random, chain: _harness.SingleHostChain,
           random_share: float):
  """(point, k, save, kill_after, steps) for the next round."""
  if chain.futures and rng.random() < 0.35:
    # Future files are removed at the start of the first save.
    point = rng.choice(FUTURE_POINTS)
    n = max(1, sum(1 for f in chain.futures if not f.endswith("_temp")))
    k = 1 if point.per_save == 1 else rng.randint(1, n)
    return point, k, 1, None, 4
  if rng.random() < random_share:
    return None, 1, 1, rng.uniform(0.0, 1.5), 1000
  point = rng.choice(OTHER_POINTS)
  k, save = point.pick(rng)
  return point, k, save, None, 8


def run_chain(job: int, rounds: int, seed: int, workdir: Path,
              random_share: float, lock) -> dict:
  """Runs `rounds` rounds in `workdir/job-<job>`; returns its records."""
  rng = random.Random(seed * 1000 + job)
  directory = workdir / f"job-{job}" / "ckpts"
  logs = workdir / f"job-{job}" / "logs"
  logs.mkdir(parents=True, exist_ok=True)
  chain = _harness.SingleHostChain(directory, logs)
  failures = []
  for r in range(rounds):
    point, k, save, kill_after, steps = choose(rng, chain, random_share)
    try:
      rec = chain.round(point, k, save, kill_after=kill_after, steps=steps)
    except Exception as e:  # pylint: disable=broad-except
      failures.append(f"job {job} round {r}: {e}")
      with lock:
        print(f"[job {job} round {r}] FAILURE: {e}", flush=True)
        traceback.print_exc()
      # Keep the directory for a look and start the chain over.
      chain.reset(keep_as=workdir / f"job-{job}" / f"broken-round-{r}")
      continue
    with lock:
      print(f"[job {job} round {r:3d}] {rec['phase']:18s} "
            f"{_harness.label(rec['spec']) if rec['spec'] else '':32s} "
            f"k={k}@save{save} "
            f"rc={rec['returncode']:3d} restored={rec['restored']:4d} "
            f"saves={rec['saves']:3d} {rec['seconds']:5.1f}s", flush=True)
  final = None
  try:
    final = chain.round(None, steps=2)
    if final["saves"] != 2:
      raise AssertionError(f"final run saved {final['saves']} times, not 2")
  except Exception as e:  # pylint: disable=broad-except
    failures.append(f"job {job} final: {e}")
  return dict(rounds=chain.rounds[:-1], final=final, failures=failures)


def summarize(results: list[dict], seconds: float) -> dict:
  rounds = [r for res in results for r in res["rounds"]]
  kills = collections.Counter(r["phase"] for r in rounds
                              if r["returncode"] == -9)
  final_orphans = [res["final"]["orphans"] for res in results if res["final"]]
  final_temps = [res["final"]["temps"] for res in results if res["final"]]
  return dict(
      rounds=len(rounds),
      kills=sum(kills.values()),
      kills_per_phase=dict(sorted(kills.items())),
      rounds_without_kill=sum(r["returncode"] == 0 for r in rounds),
      restores_mid_prune=sum(bool(r.get("midprune")) for r in rounds),
      saves_completed=sum(r["saves"] for r in rounds),
      failures=sum(len(res["failures"]) for res in results),
      failure_messages=[f.split("\n")[0] for res in results
                        for f in res["failures"]],
      orphan_files_at_end=sum(len(o) for o in final_orphans),
      orphan_file_names=[n for o in final_orphans for n in o][:20],
      temp_files_at_end=sum(len(t) for t in final_temps),
      temp_file_names=[n for t in final_temps for n in t][:20],
      seconds=round(seconds, 1))


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=200)
  parser.add_argument("--jobs", type=int, default=1,
                      help="independent chains run in parallel")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--random-share", type=float, default=0.25,
                      help="share of rounds killed at a random time")
  parser.add_argument("--workdir", type=Path, default=None)
  parser.add_argument("--keep", action="store_true",
                      help="keep the work directory")
  args = parser.parse_args()
  workdir = args.workdir or Path(tempfile.mkdtemp(prefix="soak-single-"))
  start = time.monotonic()
  lock = __import__("threading").Lock()
  per_job = [args.rounds // args.jobs + (j < args.rounds % args.jobs)
             for j in range(args.jobs)]
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    results = list(pool.map(
        lambda j: run_chain(j, per_job[j], args.seed, workdir,
                            args.random_share, lock), range(args.jobs)))
  summary = summarize(results, time.monotonic() - start)
  return _harness.finish(summary, workdir, args.keep)


if __name__ == "__main__":
  sys.exit(main())
