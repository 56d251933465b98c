"""Measures a test run: wall time, peak memory of its process tree, temp disk.

Issue 15 bounds the default run (`python -m pytest -q tests`): two minutes or
less, at most 2.5 GB of memory and 2 GB of temporary files on the 2-core
machine. This runs the command and samples, every `--interval` seconds:

- memory: the sum of the proportional set size (`Pss` in
  `/proc/PID/smaps_rollup`) over the command and all its descendants (pytest,
  its xdist workers, the CLI children and emulators they start). PSS counts
  a shared page once across the processes sharing it, so TensorFlow's
  libraries loaded by ten processes are not counted ten times; the sum of
  RSS, which does count them each time, is reported beside it;
- temporary files: the growth of the used space of the file system holding
  `tempfile.gettempdir()` over its value at the start (anything else writing
  to that file system during the run is counted too: measure on a quiet
  machine).

Usage::

  python benchmarks/measure_test_run.py                 # the default run
  python benchmarks/measure_test_run.py -- python -m pytest -q tests/test_cli.py

Prints the command's own output, then one line::

  wall 98.1 s, peak memory 2.01 GiB PSS (3.12 GiB RSS summed), peak temp 0.31 GiB, exit 0
"""

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time

DEFAULT = [sys.executable, "-m", "pytest", "-q", "tests"]


def _children() -> dict[int, list[int]]:
  tree: dict[int, list[int]] = {}
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat", "rb") as f:
        stat = f.read()
    except OSError:
      continue
    # The command name is in parentheses and may hold spaces.
    ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
    tree.setdefault(ppid, []).append(int(entry))
  return tree


def _descendants(root: int) -> list[int]:
  tree, out, todo = _children(), [], [root]
  while todo:
    pid = todo.pop()
    out.append(pid)
    todo.extend(tree.get(pid, []))
  return out


def _memory_kib(pid: int) -> tuple[int, int]:
  pss = rss = 0
  try:
    with open(f"/proc/{pid}/smaps_rollup") as f:
      for line in f:
        if line.startswith("Pss:"):
          pss = int(line.split()[1])
        elif line.startswith("Rss:"):
          rss = int(line.split()[1])
  except OSError:  # gone, or a zombie
    pass
  return pss, rss


def _used_bytes(path: str) -> int:
  st = os.statvfs(path)
  return (st.f_blocks - st.f_bfree) * st.f_frsize


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--interval", type=float, default=0.25)
  parser.add_argument("--peak-detail", action="store_true",
                      help="also print each process of the tree at the "
                      "memory peak, largest first")
  parser.add_argument("command", nargs="*", default=DEFAULT)
  args = parser.parse_args()
  tmp = tempfile.gettempdir()
  used0 = _used_bytes(tmp)
  peak = {"pss": 0, "rss": 0, "tmp": 0, "tree": []}
  start = time.monotonic()
  proc = subprocess.Popen(args.command)
  done = threading.Event()

  def sample():
    while not done.is_set():
      pss = rss = 0
      tree = []
      for pid in _descendants(proc.pid):
        p, r = _memory_kib(pid)
        pss, rss = pss + p, rss + r
        tree.append((p, pid))
      if pss * 1024 > peak["pss"] and args.peak_detail:
        peak["tree"] = [(p, pid, _command(pid)) for p, pid in sorted(
            tree, reverse=True)]
      peak["pss"] = max(peak["pss"], pss * 1024)
      peak["rss"] = max(peak["rss"], rss * 1024)
      peak["tmp"] = max(peak["tmp"], _used_bytes(tmp) - used0)
      done.wait(args.interval)

  sampler = threading.Thread(target=sample, daemon=True)
  sampler.start()
  code = proc.wait()
  wall = time.monotonic() - start
  done.set()
  sampler.join()
  gib = 2.0 ** 30
  print(f"wall {wall:.1f} s, peak memory {peak['pss'] / gib:.2f} GiB PSS "
        f"({peak['rss'] / gib:.2f} GiB RSS summed), peak temp "
        f"{peak['tmp'] / gib:.2f} GiB, exit {code}", flush=True)
  for kib, pid, command in peak["tree"]:
    print(f"  at the peak: {kib / 2**20:.2f} GiB PSS  pid {pid}  {command}")
  return code


def _command(pid: int) -> str:
  """A process's command line (its first 160 characters)."""
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      args = f.read().split(b"\0")
  except OSError:
    return "?"
  text = " ".join(a.decode(errors="replace") for a in args if a)[:160]
  return text


if __name__ == "__main__":
  sys.exit(main())
