"""Benchmarks a fleet of tiny runs: migrate_runs.py against a loop of clu-ckpt.

Synopsis::

  python benchmarks/bench_fleet.py                      # 40 runs, 3 rounds
  python benchmarks/bench_fleet.py --runs 40 --rounds 5 --parallelism 2 \
      --json /tmp/bench_fleet.json

It writes `--runs` tiny CLU runs (one checkpoint each: a few small arrays,
as a short experiment leaves) with `clu_ckpt.checkpoint.Checkpoint`, then,
in each round, migrates all of them twice, side by side, each into a fresh
destination:

- `fleet`: one `python migration/migrate_runs.py --source-glob=<runs>/*
  --parallelism=P` process (long-lived workers, each importing the
  migration once and migrating run after run in-process);
- `processes`: one `python -m clu_ckpt migrate SOURCE DESTINATION --json`
  process per run, P at a time (what a shell loop or the fleet script of
  earlier releases did).

Both are timed from the first process's start to the last one's end (the
whole thing, imports included). The order of the two alternates between
rounds. The load average of the machine is recorded before and after each
round: the machine may be shared, and both sides pay the same load in a
round. Reported: each side's median wall time, the ratio processes / fleet
(median of the per-round ratios, and the ratio of the medians), and whether
the target (>= 5x) is met.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SCRIPT = os.path.join(_ROOT, "migration", "migrate_runs.py")
TARGET = 5.0


def _environment() -> dict[str, str]:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [_ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
  env.pop("JOB_COMPLETION_INDEX", None)
  return env


def write_runs(directory: str, count: int) -> list[str]:
  """`count` tiny runs under `directory`; their paths."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from clu_ckpt import checkpoint  # pylint: disable=g-import-not-at-top
  paths = []
  for i in range(count):
    path = os.path.join(directory, f"run{i:03d}")
    state = {"step": np.int64(100 + i),
             "params": {"w": np.full((16, 16), i, np.float32),
                        "b": np.arange(16, dtype=np.float32)},
             "opt": {"count": np.int32(i), "mu": np.zeros(16, np.float32)}}
    checkpoint.Checkpoint(path).save(state)
    paths.append(path)
  return paths


def run_fleet(sources_dir: str, destination: str, parallelism: int) -> float:
  """Seconds for migrate_runs.py to migrate every run; raises on failure."""
  start = time.perf_counter()
  done = subprocess.run(
      [sys.executable, _SCRIPT, f"--source-glob={sources_dir}/*",
       f"--destination-root={destination}", f"--parallelism={parallelism}",
       f"--report={destination}.report.json"],
      capture_output=True, text=True, env=_environment(), check=False)
  seconds = time.perf_counter() - start
  if done.returncode != 0:
    raise RuntimeError(f"migrate_runs.py failed ({done.returncode}): "
                       f"{done.stderr[-2000:]}")
  return seconds


def run_processes(sources: list[str], destination: str,
                  parallelism: int) -> float:
  """Seconds for one `clu-ckpt migrate` per run, `parallelism` at a time."""
  env = _environment()

  def one(source: str) -> None:
    target = os.path.join(destination, os.path.basename(source))
    done = subprocess.run(
        [sys.executable, "-m", "clu_ckpt", "migrate", source, target,
         "--json"], capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
      raise RuntimeError(f"clu-ckpt migrate {source} failed: "
                         f"{done.stderr[-2000:]}")

  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(parallelism) as pool:
    list(pool.map(one, sources))
  return time.perf_counter() - start


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--runs", type=int, default=40, help="tiny runs")
  parser.add_argument("--rounds", type=int, default=3,
                      help="rounds (medians reported)")
  parser.add_argument("--parallelism", type=int, default=2)
  parser.add_argument("--workdir", default="/tmp/clu_ckpt_bench_fleet")
  parser.add_argument("--json", help="write the figures here too")
  args = parser.parse_args()
  shutil.rmtree(args.workdir, ignore_errors=True)
  sources_dir = os.path.join(args.workdir, "runs")
  sources = write_runs(sources_dir, args.runs)
  rounds = []
  for r in range(args.rounds):
    load_before = os.getloadavg()[0]
    times = {}
    order = ("fleet", "processes") if r % 2 == 0 else ("processes", "fleet")
    for side in order:
      destination = os.path.join(args.workdir, f"round{r}-{side}")
      if side == "fleet":
        times[side] = run_fleet(sources_dir, destination, args.parallelism)
      else:
        times[side] = run_processes(sources, destination, args.parallelism)
      shutil.rmtree(destination, ignore_errors=True)
    rounds.append({"fleet_s": times["fleet"],
                   "processes_s": times["processes"],
                   "ratio": times["processes"] / times["fleet"],
                   "load_before": load_before,
                   "load_after": os.getloadavg()[0]})
    print(f"round {r + 1}: fleet {times['fleet']:.1f} s, processes "
          f"{times['processes']:.1f} s, ratio "
          f"{rounds[-1]['ratio']:.1f}x (load {load_before:.1f} -> "
          f"{rounds[-1]['load_after']:.1f})", flush=True)
  fleet = statistics.median(x["fleet_s"] for x in rounds)
  processes = statistics.median(x["processes_s"] for x in rounds)
  ratio = statistics.median(x["ratio"] for x in rounds)
  summary = {
      "runs": args.runs, "rounds": args.rounds,
      "parallelism": args.parallelism, "cpus": os.cpu_count(),
      "fleet_median_s": fleet, "processes_median_s": processes,
      "ratio_median": ratio, "ratio_of_medians": processes / fleet,
      "target": TARGET, "target_met": ratio >= TARGET, "rounds_detail": rounds,
  }
  print(f"{args.runs} tiny runs at parallelism {args.parallelism}, "
        f"{args.rounds} rounds, {os.cpu_count()} CPUs: migrate_runs.py "
        f"{fleet:.1f} s ({fleet / args.runs:.2f} s/run), clu-ckpt migrate "
        f"processes {processes:.1f} s ({processes / args.runs:.2f} s/run); "
        f"ratio {ratio:.1f}x (median of rounds; {processes / fleet:.1f}x of "
        f"medians); target >= {TARGET:.0f}x: "
        f"{'met' if ratio >= TARGET else 'NOT met'}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(summary, f, indent=1)
  shutil.rmtree(args.workdir, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
