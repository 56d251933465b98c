"""Soak: SIGKILL `clu-ckpt migrate` gs:// -> gs://; Orbax never lists a torn step.

fake-gcs-server runs on 127.0.0.1 (tests/emulators.py). The harness'
training child writes a local CLU directory with six checkpoints (3.5 MiB of
state each, with a tf.data iterator), which is uploaded to
`gs://<bucket>/src`; each `.flax` is downloaded once and decoded with
`flax.serialization.msgpack_restore` as the reference. A full
`python -m clu_ckpt migrate gs://<bucket>/src gs://<bucket>/calibration`
is timed. Each round then migrates into a fresh `gs://<bucket>/dst-<r>`:

1. one or two `python -m clu_ckpt migrate` processes, each SIGKILLed at a
   uniform random time in [0, full] after its start (a run may finish
   first); the lease is 2 s (`CLU_CKPT_LOCK_LEASE_SECONDS=2`), so the lock
   object a killed run leaves is stale `lease.stale_after(2)` = 4 s after
   its last refresh, and the next run starts only then;
2. after each run, this process lists the steps with a stock read-only
   `orbax.checkpoint.CheckpointManager` (its gcsfs listing cache dropped
   first, as a fresh reader would), restores each listed step with
   `clu_ckpt.migration.restore_state`, and compares it with the reference: same types, key order, dtypes, shapes and bytes. A
   listed step must never disappear later in the round;
3. a run with `--verify` that must exit 0, after which all six steps are
   listed and restore, and the destination holds nothing but the step
   directories (each with `commit_success.txt`), `clu_ckpt_manifest.json`
   and maybe lock takeover markers: no `.clu_ckpt.lock`, no Orbax
   temporary, no discarded step.

A run refused as locked ("another migration is writing here") is expected
only when it started before the killed holder's lock was stale; this script
waits longer than that, so a refusal is a failure (the run is retried so
the round can still be checked).

Usage::

  python tests/soak/soak_kill_bucket_migration.py --rounds 10 [--seed 0]
      [--workdir /tmp/soak-bucket-migration] [--keep]
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import _harness  # pylint: disable=g-import-not-at-top,wrong-import-position
import emulators  # pylint: disable=g-import-not-at-top,wrong-import-position

NUMBERS = [1, 2, 3, 4, 5, 6]
LEASE = 2.0
# After a kill, wait this long past the lock's staleness (stale_after(2) = 4 s
# from its last refresh, which is at the latest the kill).
STALE_WAIT = 1.5 * LEASE + 1.0 + 0.5
LOCKED = "another migration is writing here"
LOCK_NAME = ".clu_ckpt.lock"


class SoakFailure(AssertionError):
  """A promise was broken; the message says which."""


class Soak:
  """The emulator, the source, and the runs against it."""

  def __init__(self, workdir: Path):
    self.workdir = workdir
    os.environ.update(emulators.ENV)
    self.gcs = emulators.FakeGcs(workdir / "emulator")
    self.gcs.start()
    os.environ.update(self.gcs.env())
    self.bucket = self.gcs.bucket()
    self.env = _harness.child_env()
    self.env.update(emulators.ENV)
    self.env.update(self.gcs.env())
    self.env["CLU_CKPT_LOCK_LEASE_SECONDS"] = str(LEASE)
    self.logs = workdir / "logs"
    self.logs.mkdir(parents=True, exist_ok=True)
    self.runs = 0

  def url(self, name: str) -> str:
    return f"gs://{self.bucket}/{name}"

  def make_source(self) -> None:
    local = self.workdir / "src"
    if not local.exists():
      result = _harness.run_child(["single", "--dir", str(local), "--steps",
                                   "5", "--max-to-keep", "6"])
      if result.returncode != 0:
        raise RuntimeError(f"could not write the source:\n{result.stderr}")
    found = sorted(int(p.name[5:-5]) for p in local.glob("ckpt-*.flax"))
    if found != NUMBERS:
      raise RuntimeError(f"the source has checkpoints {found}")
    self.src = self.gcs.upload(local, "src", bucket=self.bucket)
    from flax import serialization  # pylint: disable=g-import-not-at-top
    fs = self.gcs.fs()
    self.expected = {
        n: serialization.msgpack_restore(
            fs.cat_file(f"{self.bucket}/src/ckpt-{n}.flax"))
        for n in NUMBERS}

  def start(self, dst: str, *extra: str) -> subprocess.Popen:
    self.runs += 1
    log = open(self.logs / f"run-{self.runs}.log", "w+")  # pylint: disable=consider-using-with
    proc = subprocess.Popen(
        [sys.executable, "-m", "clu_ckpt", "migrate", self.src, dst,
         "--step-naming", "number", *extra],
        env=self.env, cwd=str(_harness.REPO), stdout=log,
        stderr=subprocess.STDOUT, text=True)
    proc.log = log  # type: ignore[attr-defined]
    return proc

  @staticmethod
  def output(proc: subprocess.Popen) -> str:
    proc.log.flush()  # type: ignore[attr-defined]
    proc.log.seek(0)  # type: ignore[attr-defined]
    text = proc.log.read()  # type: ignore[attr-defined]
    proc.log.close()  # type: ignore[attr-defined]
    return text

  def run(self, dst: str, *extra: str, kill_after: Optional[float] = None,
          timeout: float = 600) -> tuple[int, str, float]:
    """Runs migrate; returns (exit code, output, time of the kill or end)."""
    proc = self.start(dst, *extra)
    try:
      proc.wait(kill_after if kill_after is not None else timeout)
    except subprocess.TimeoutExpired:
      proc.send_signal(signal.SIGKILL)
      proc.wait()
      if kill_after is None:
        raise SoakFailure(f"migrate into {dst} hung for {timeout} s:\n"
                          f"{self.output(proc)[-3000:]}") from None
    return proc.returncode, self.output(proc), time.monotonic()

  def objects(self, dst: str) -> list[str]:
    prefix = dst.split("://", 1)[1]
    fs = self.gcs.fs()
    if not fs.exists(prefix):
      return []
    return sorted(o[len(prefix) + 1:] for o in fs.find(prefix))

  def check(self, dst: str) -> list[int]:
    """Lists `dst` with stock Orbax; every listed step must be complete."""
    import gcsfs  # pylint: disable=g-import-not-at-top
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
    from etils.epath import backend  # pylint: disable=g-import-not-at-top
    # A fresh reader's view: stock Orbax lists gs:// through epath's one
    # cached gcsfs instance, whose directory listings are cached too.
    gcsfs.GCSFileSystem.clear_instance_cache()
    backend.fsspec_backend.fs(dst).invalidate_cache()
    if not self.objects(dst):
      return []
    manager = ocp.CheckpointManager(
        dst, options=ocp.CheckpointManagerOptions(read_only=True))
    try:
      steps = sorted(manager.all_steps())
      for step in steps:
        if step not in self.expected:
          raise SoakFailure(f"{dst}: Orbax lists step {step}, not a source "
                            f"checkpoint")
        try:
          restored = migration.restore_state(dst, step)
        except Exception as e:  # pylint: disable=broad-except
          raise SoakFailure(f"{dst}: listed step {step} does not restore: "
                            f"{type(e).__name__}: {e}") from e
        where = _harness.same_tree(restored, self.expected[step], strict=True)
        if where is not None:
          raise SoakFailure(f"{dst}: step {step} differs from ckpt-{step} "
                            f"at {where}")
    finally:
      manager.close()
    return steps

  def leftovers(self, dst: str, steps: list[int]) -> list[str]:
    """Objects under `dst` other than the listed steps, manifest, markers."""
    from clu_ckpt.migration import destination  # pylint: disable=g-import-not-at-top
    from clu_ckpt.migration import lease  # pylint: disable=g-import-not-at-top
    from clu_ckpt.migration import orbax_target  # pylint: disable=g-import-not-at-top
    objects = self.objects(dst)
    bad = []
    for name in objects:
      top = name.split("/", 1)[0]
      if name == destination.MANIFEST_NAME:
        continue
      if top.startswith(destination.LOCK_NAME + lease.TAKEOVER_INFIX):
        continue
      if (orbax_target.ORBAX_TMP_MARKER in name or
          orbax_target.DISCARDED_MARKER in name or "/" not in name or
          not top.isdigit() or int(top) not in steps):
        bad.append(name)
    for step in steps:
      if f"{step}/commit_success.txt" not in objects:
        bad.append(f"{step}/commit_success.txt (missing)")
    return bad


def one_round(soak: Soak, rng: random.Random, r: int, full: float,
              stats: collections.Counter, failures: list[str]) -> None:
  dst = soak.url(f"dst-{r}")
  previous: list[int] = []
  last_kill: Optional[float] = None

  def wait_stale() -> None:
    if last_kill is not None:
      time.sleep(max(0.0, last_kill + STALE_WAIT - time.monotonic()))

  def listed(when: str) -> list[int]:
    steps = soak.check(dst)
    if not set(previous) <= set(steps):
      raise SoakFailure(f"{dst}: steps {previous} were listed, {when} "
                        f"{steps}")
    if 0 < len(steps) < len(NUMBERS):
      stats["partial_listings_checked"] += 1
    return steps

  for _ in range(1 if rng.random() < 0.5 else 2):
    wait_stale()
    kill_after = rng.uniform(0.0, full)
    started = time.monotonic()
    rc, out, ended = soak.run(dst, kill_after=kill_after)
    if rc == -signal.SIGKILL:
      stats["kills"] += 1
      last_kill = ended
      left = soak.objects(dst)
      if LOCK_NAME in left:
        stats["kills_leaving_the_lock"] += 1
      if any(".orbax-checkpoint-tmp" in o or (
          o.split("/", 1)[0].isdigit() and
          o.split("/", 1)[0] + "/commit_success.txt" not in left)
             for o in left):
        stats["kills_leaving_an_uncommitted_step"] += 1
    elif rc == 0:
      stats["runs_not_killed"] += 1
    elif rc == 1 and LOCKED in out:
      early = last_kill is not None and started < last_kill + 4.0
      stats["refused_locked"] += 1
      if not early:
        failures.append(f"round {r}: a run was refused as locked "
                        f"{started - (last_kill or started):.1f} s after the "
                        f"kill: {out.strip().splitlines()[-1]}")
    else:
      raise SoakFailure(f"migrate into {dst} exited {rc}:\n{out[-3000:]}")
    previous = listed("after a killed run")

  for _ in range(5):
    wait_stale()
    started = time.monotonic()
    rc, out, _ = soak.run(dst, "--verify")
    if not (rc == 1 and LOCKED in out):
      break
    stats["refused_locked"] += 1
    failures.append(f"round {r}: the --verify run was refused as locked "
                    f"{started - (last_kill or started):.1f} s after the "
                    f"last kill: {out.strip().splitlines()[-1]}")
    time.sleep(1.0)
  if rc != 0:
    raise SoakFailure(f"the --verify run into {dst} exited {rc}:\n"
                      f"{out[-3000:]}")
  steps = listed("after the --verify run")
  if steps != NUMBERS:
    raise SoakFailure(f"{dst}: after the --verify run Orbax lists {steps}")
  bad = soak.leftovers(dst, steps)
  if bad:
    raise SoakFailure(f"{dst}: leftover objects after the --verify run: "
                      f"{bad}")
  stats["rounds_completed"] += 1


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--workdir", type=Path, default=None)
  parser.add_argument("--keep", action="store_true")
  args = parser.parse_args()
  workdir = args.workdir or Path(
      tempfile.mkdtemp(prefix="soak-bucket-migration-"))
  workdir.mkdir(parents=True, exist_ok=True)
  rng = random.Random(args.seed)
  from absl import logging  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.ERROR)
  start = time.monotonic()
  soak = Soak(workdir)
  try:
    soak.make_source()
    # A whole migration, start-up included: random kills fall in it.
    began = time.monotonic()
    rc, out, ended = soak.run(soak.url("calibration"))
    full = ended - began
    if rc != 0:
      raise SystemExit(f"the calibration migration exited {rc}:\n{out}")
    if soak.check(soak.url("calibration")) != NUMBERS:
      raise SystemExit("the calibration migration did not list every step")
    soak.gcs.fs().rm(f"{soak.bucket}/calibration", recursive=True)
    print(f"[calibration] a full migration takes {full:.1f} s", flush=True)
    stats: collections.Counter = collections.Counter()
    failures: list[str] = []
    for r in range(args.rounds):
      before = len(failures)
      try:
        one_round(soak, rng, r, full, stats, failures)
      except Exception as e:  # pylint: disable=broad-except
        failures.append(f"round {r}: {e}")
        traceback.print_exc()
      status = "ok" if len(failures) == before else "FAILURE"
      print(f"[round {r:3d}] {status} {dict(sorted(stats.items()))}",
            flush=True)
  finally:
    soak.gcs.stop()
  summary = dict(rounds=args.rounds, seed=args.seed,
                 **dict(sorted(stats.items())), failures=len(failures),
                 failure_messages=[f.split("\n")[0] for f in failures],
                 migration_seconds=round(full, 2),
                 seconds=round(time.monotonic() - start, 1))
  return _harness.finish(summary, workdir, args.keep)


if __name__ == "__main__":
  sys.exit(main())
