"""The whole job, end to end: train, get killed, resume, migrate, resume on Orbax.

  python examples/demo.py            # ~1 minute on a laptop CPU
  python examples/demo.py --tiny     # what the soak tier runs (tests/test_examples.py)

1. `train.py` checkpoints with `clu_ckpt.checkpoint` and is SIGKILLed mid-run
   (a preemption).
2. It is restarted: it resumes from the last checkpoint, and the tf.data
   iterator continues at exactly the element after that checkpoint.
3. `clu-ckpt migrate` turns the CLU checkpoints into an Orbax CheckpointManager
   root (`--verify` compares every leaf bit for bit).
4. `train.py --orbax` resumes from the migrated step with stock Orbax and
   `clu_ckpt.TfStateRestore`, iterator included, and trains on.

Each stage is a fresh process. The script prints what happened and exits
non-zero if anything did not hold.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def run(args, expect_kill=False):
  """Runs a stage; returns its JSON event lines."""
  proc = subprocess.run([sys.executable] + args, capture_output=True,
                        text=True, env=dict(os.environ,
                                            TF_CPP_MIN_LOG_LEVEL="3"))
  killed = proc.returncode == -9
  if killed != expect_kill or (not expect_kill and proc.returncode != 0):
    sys.stderr.write(proc.stdout + proc.stderr)
    raise SystemExit(f"stage {' '.join(args[:2])} ended with exit code "
                     f"{proc.returncode}")
  events = [json.loads(line) for line in proc.stdout.splitlines()
            if line.startswith('{"event"')]
  return events, proc.stdout


def first(events, kind):
  return next(e for e in events if e.get("event") == kind)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tiny", action="store_true", help="a CI-sized run")
  parser.add_argument("--workdir", help="default: a new temporary directory")
  args = parser.parse_args(argv)
  every, kill_at, first_end, final = ((2, 5, 8, 12) if args.tiny else
                                      (10, 25, 40, 60))
  workdir = args.workdir or tempfile.mkdtemp(prefix="clu_ckpt_demo_")
  train = [os.path.join(HERE, "train.py"), "--workdir", workdir,
           "--save_every", str(every)]
  orbax_root = os.path.join(workdir, "orbax")
  print(f"workdir: {workdir}")

  events, _ = run(train + ["--steps", str(first_end), "--kill_at",
                           str(kill_at)], expect_kill=True)
  saved = [e["step"] for e in events if e["event"] == "saved"]
  print(f"1. trained with clu_ckpt.checkpoint, saved at steps {saved}, "
        f"then SIGKILLed at step {first(events, 'killed')['step']}")

  events, _ = run(train + ["--steps", str(first_end)])
  resumed = first(events, "resumed")
  expected = max(saved)
  if resumed["step"] != expected:
    raise SystemExit(f"resumed at step {resumed['step']}, expected {expected}")
  print(f"2. restarted: resumed at step {resumed['step']}, iterator at "
        f"element {resumed['next_element']} (= step x batch), trained to "
        f"step {first(events, 'done')['step']}")

  _, out = run(["-m", "clu_ckpt", "migrate",
                os.path.join(workdir, "checkpoints"), orbax_root, "--verify",
                "--json"])
  summary = json.loads(out[out.index("{"):])
  steps = sorted(s["step"] for s in summary.get("steps", [])
                 if s.get("status", "migrated") in ("migrated", "skipped"))
  print(f"3. migrated to Orbax at {orbax_root}: steps {steps}, verified "
        "bit-exact")

  events, _ = run(train + ["--steps", str(final), "--orbax", orbax_root])
  resumed = first(events, "resumed")
  if resumed["step"] != first_end or resumed["backend"] != "orbax":
    raise SystemExit(f"Orbax resume at step {resumed['step']}, expected "
                     f"{first_end}")
  print(f"4. resumed under stock Orbax at step {resumed['step']}, iterator at "
        f"element {resumed['next_element']}, trained to step "
        f"{first(events, 'done')['step']} (loss "
        f"{first(events, 'done')['loss']:.4f})")
  print("OK: nothing lost across the kill, the migration and the switch to "
        "Orbax.")
  return 0


if __name__ == "__main__":
  sys.exit(main())
