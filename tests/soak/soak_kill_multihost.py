"""Soak: kill one host of a real `jax.distributed` job mid-save, restart all.

Each round starts N processes (`jax.distributed.initialize` on a fresh
localhost coordinator port, CPU), each a `MultihostCheckpoint` host with its
own tf.data iterator, training in lock step (a barrier before every save).
One host is SIGKILLed at a kill point inside a save (see `_harness.py`) or
at a random time; the others are killed after a random grace period (they
finish their in-flight save and block, as a real job's hosts would). The
next round restarts all hosts: each must restore the same number, not older
than the newest save every host had reported, with its own state and
iterator consistent, and train on in step. See `MultihostChain`.

Usage::

  python tests/soak/soak_kill_multihost.py --rounds 60 [--hosts 2,3,4]
      [--seed 0] [--workdir /tmp/soak-multihost] [--random-share 0.25]

Rounds are split evenly over the host counts (one chain, i.e. one base
directory, per count). Prints a line per round and a JSON summary; exits 1
if any round failed.
"""

from __future__ import annotations

import argparse
import collections
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


def run_chain(num_hosts: int, rounds: int, rng: random.Random, workdir: Path,
              random_share: float) -> dict:
  root = workdir / f"hosts-{num_hosts}"
  logs = root / "logs"
  logs.mkdir(parents=True, exist_ok=True)
  chain = _harness.MultihostChain(root / "checkpoints", num_hosts, logs)
  failures = []
  for r in range(rounds):
    victim = rng.randrange(num_hosts)
    grace = rng.uniform(0.0, 1.0)
    kw = dict(grace=grace, steps=8)
    save = 1
    if chain.futures[victim] and rng.random() < 0.6:
      point = rng.choice(FUTURE_POINTS)
      n = len(chain.futures[victim])
      k = 1 if point.per_save == 1 else rng.randint(1, n)
    elif rng.random() < random_share:
      point, k = None, 1
      kw.update(kill_after=rng.uniform(0.0, 1.5), steps=1000)
    else:
      point = rng.choice(OTHER_POINTS)
      k, save = point.pick(rng)
    try:
      rec = chain.round(victim, point, k, save, **kw)
    except Exception as e:  # pylint: disable=broad-except
      failures.append(f"{num_hosts} hosts, round {r}: {e}")
      print(f"[{num_hosts} hosts, round {r}] FAILURE: {e}", flush=True)
      traceback.print_exc()
      # A directory no host can restore stays that way: keep it for a look
      # and start the chain over.
      chain.reset(keep_as=root / f"broken-round-{r}")
      continue
    label = _harness.label(rec["spec"]) if rec["spec"] else ""
    print(f"[{num_hosts} hosts, round {r:3d}] victim {victim} "
          f"{rec['phase']:18s} {label:32s} k={k}@save{save} "
          f"rc={rec['returncodes']} restored={rec['restored']:4d} "
          f"saves={rec['saves']} {rec['seconds']:5.1f}s", flush=True)
  final = None
  try:
    final = chain.round(None, steps=2)
    if final["saves"] != [2] * num_hosts:
      raise AssertionError(f"final run saved {final['saves']}")
  except Exception as e:  # pylint: disable=broad-except
    failures.append(f"{num_hosts} hosts, final: {e}")
    print(f"[{num_hosts} hosts, final] FAILURE: {e}", flush=True)
  return dict(hosts=num_hosts, rounds=chain.rounds[:-1] if final else
              chain.rounds, final=final, failures=failures)


def summarize(results: list[dict], seconds: float) -> dict:
  rounds = [r for res in results for r in res["rounds"]]
  killed = [r for r in rounds if r.get("victim") is not None and
            r.get("returncodes") and r["returncodes"][r["victim"]] == -9]
  return dict(
      rounds=len(rounds),
      rounds_per_host_count={res["hosts"]: len(res["rounds"])
                             for res in results},
      victim_kills=len(killed),
      kills_per_phase=dict(sorted(collections.Counter(
          r["phase"] for r in killed).items())),
      rounds_without_kill=sum(r["phase"] == "none" for r in rounds),
      failures=sum(len(res["failures"]) for res in results),
      failure_messages=[f.split("\n")[0][:400] for res in results
                        for f in res["failures"]],
      seconds=round(seconds, 1))


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=60)
  parser.add_argument("--hosts", default="2,3,4",
                      help="comma-separated host counts")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--random-share", type=float, default=0.25)
  parser.add_argument("--workdir", type=Path, default=None)
  parser.add_argument("--keep", action="store_true")
  args = parser.parse_args()
  counts = [int(h) for h in args.hosts.split(",")]
  workdir = args.workdir or Path(tempfile.mkdtemp(prefix="soak-multihost-"))
  rng = random.Random(args.seed)
  start = time.monotonic()
  results = []
  for i, hosts in enumerate(counts):
    rounds = args.rounds // len(counts) + (i < args.rounds % len(counts))
    results.append(run_chain(hosts, rounds, rng, workdir, args.random_share))
  summary = summarize(results, time.monotonic() - start)
  return _harness.finish(summary, workdir, args.keep)


if __name__ == "__main__":
  sys.exit(main())
