"""Reading a migrated root: `load_state_dict` against stock Orbax (issue 22).

Synopsis::

  python benchmarks/bench_reader.py --size_mib 512 --runs 5
  python benchmarks/bench_reader.py --size_mib 64 --runs 3 --json out.json
  python benchmarks/bench_reader.py --from_json out.json   # report again

It writes one CLU checkpoint of about `--size_mib` MiB with
`clu_ckpt.checkpoint` (float32 kernels and bfloat16 moments in arrays of at
most 16 MiB, a Python int `step`, a float, a string), migrates it with
`clu_ckpt.migration.migrate` (zstd, the default), and then reads the newest
step, each time in a fresh process, with each method:

- `clu_ckpt`: `clu_ckpt.checkpoint.load_state_dict(root)` (TensorStore
  directly; no Orbax, JAX or TensorFlow imported);
- `orbax`: stock `ocp.CheckpointManager(root).restore(step,
  args=Composite(state=PyTreeRestore()))`, the same step's state item;
- `clu_ckpt_subtree`: `load_state_dict(root, subtree="params")`;
- `source`: `load_state_dict` of the CLU source (the `.flax` file), for
  reference: what the notebook read before the migration.

Every array of the result is read through (`_touch.touch`, the digest
checks both readers saw the same bytes). The imports (TensorStore's too,
for the migrated root: Orbax imports it) are timed apart from the read,
and both together as the total a notebook waits for. Cold: the root's files (or the
source's) are dropped from the page cache (`posix_fadvise(DONTNEED)`)
before the child starts; warm: read once before it. The disk's limit is
`dd iflag=direct` of the root's data files in the same round, as MB/s
(10^6 bytes). Reported (medians over `--runs`): the read call's wall time
(imports excluded) and with the imports, Orbax / clu_ckpt as ratios, and
the state's array bytes per second as a fraction of the disk's read speed;
and the child's peak RSS.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

_MB = 10**6
_MIB = 2**20
HERE = os.path.dirname(os.path.abspath(__file__))
METHODS = ("clu_ckpt", "orbax", "clu_ckpt_subtree", "source")


def _make(directory: str, size_mib: int) -> tuple[str, str]:
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from clu_ckpt import checkpoint  # pylint: disable=g-import-not-at-top
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  elements = 16 * _MIB // 4
  layers = max(1, size_mib * _MIB // (elements * 6))
  rng = np.random.default_rng(0)
  params, mu = {}, {}
  for i in range(layers):
    kernel = rng.standard_normal(elements, dtype=np.float32).reshape(-1, 256)
    params[f"layer_{i:04d}"] = {"kernel": kernel,
                                "bias": np.zeros(256, np.float32)}
    mu[f"layer_{i:04d}"] = {"kernel": (kernel * 0.01).astype(
        ml_dtypes.bfloat16)}
  state = {"step": 1000, "params": params,
           "opt_state": {"mu": mu, "lr": 1e-3, "name": "adam"}}
  source, root = os.path.join(directory, "src"), os.path.join(directory, "orbax")
  checkpoint.Checkpoint(source).save(state)
  summary = migration.migrate(source, root)
  assert summary.ok, summary.failed
  return source, root


def _files(directory: str) -> list[str]:
  return [os.path.join(d, f) for d, _, names in os.walk(directory)
          for f in names]


def _drop(directory: str) -> None:
  for path in _files(directory):
    fd = os.open(path, os.O_RDONLY)
    try:
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)


def _warm(directory: str) -> None:
  for path in _files(directory):
    with open(path, "rb") as f:
      while f.read(64 * _MIB):
        pass


def _disk_read(root: str) -> float:
  """MB/s of `dd iflag=direct` over the root's data files."""
  total, seconds = 0, 0.0
  for path in _files(root):
    if os.path.getsize(path) < _MIB:
      continue
    done = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M",
                           "iflag=direct"], capture_output=True, text=True,
                          check=True)
    line = [l for l in done.stderr.splitlines() if " copied, " in l][0]
    total += int(line.split()[0])
    seconds += float(line.split(" copied, ")[1].split()[0])
  return total / seconds / _MB if seconds else float("nan")


def _peak_rss_mib() -> float:
  """VmHWM of this process (ru_maxrss would count the parent's, forked)."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) / 1024
  return float("nan")


def _child(method: str, source: str, root: str) -> dict:
  sys.path.insert(0, HERE)
  from _touch import touch, tree_leaves  # pylint: disable=g-import-not-at-top
  start = time.perf_counter()
  if method == "orbax":
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    imported = time.perf_counter()
    with ocp.CheckpointManager(root) as mngr:
      tree = mngr.restore(mngr.latest_step(), args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore()))["state"]
  else:
    from clu_ckpt import checkpoint  # pylint: disable=g-import-not-at-top
    if method != "source":
      import tensorstore  # pylint: disable=g-import-not-at-top,unused-import
    imported = time.perf_counter()
    kwargs = {"subtree": "params"} if method == "clu_ckpt_subtree" else {}
    tree = checkpoint.load_state_dict(source if method == "source" else root,
                                      **kwargs)
  leaves = list(tree_leaves(tree))
  nbytes = sum(getattr(l, "nbytes", 0) for l in leaves)
  digest = touch(leaves)
  done = time.perf_counter()
  return dict(method=method, seconds=done - imported,
              import_seconds=imported - start, nbytes=nbytes, digest=digest,
              peak_rss_mib=_peak_rss_mib(),
              modules=sorted(m for m in ("tensorflow", "jax", "orbax")
                             if m in sys.modules))


def _run(method: str, source: str, root: str, cold: bool) -> dict:
  directory = source if method == "source" else root
  (_drop if cold else _warm)(directory)
  out = subprocess.run(
      [sys.executable, os.path.abspath(__file__), f"--child={method}",
       f"--source={source}", f"--root={root}"], check=True,
      capture_output=True, text=True, cwd="/",
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
  return json.loads(out.stdout.strip().splitlines()[-1])


def report(data: dict) -> str:
  lines = [f"# Reading a migrated root ({data['size_mib']} MiB state, "
           f"{data['runs']} runs, medians; a fresh process per read)", ""]
  disk = statistics.median(data["disk_mb_s"])
  lines.append(f"disk: dd iflag=direct of the root's data files: "
               f"{disk:.0f} MB/s")
  lines.append("")
  lines.append("| cache | method | read (s) | imports (s) | total (s) | "
               "MB/s | of disk | orbax / this | orbax / this, total | "
               "peak RSS (MiB) | imported |")
  lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
  for cache in ("cold", "warm"):
    runs = data[cache]
    orbax = statistics.median(r["seconds"] for r in runs["orbax"])
    orbax_total = statistics.median(r["seconds"] + r["import_seconds"]
                                    for r in runs["orbax"])
    for method in METHODS:
      rows = runs[method]
      seconds = statistics.median(r["seconds"] for r in rows)
      total = statistics.median(r["seconds"] + r["import_seconds"]
                                for r in rows)
      nbytes = rows[0]["nbytes"]
      speed = nbytes / seconds / _MB
      lines.append(
          f"| {cache} | {method} | {seconds:.3f} | "
          f"{statistics.median(r['import_seconds'] for r in rows):.2f} | "
          f"{total:.2f} | {speed:.0f} | {speed / disk:.2f} | "
          f"{orbax / seconds:.2f} | {orbax_total / total:.2f} | "
          f"{statistics.median(r['peak_rss_mib'] for r in rows):.0f} | "
          f"{','.join(rows[0]['modules']) or '-'} |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--size_mib", type=int, default=256)
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument("--json")
  parser.add_argument("--from_json")
  parser.add_argument("--workdir")
  parser.add_argument("--child")
  parser.add_argument("--source")
  parser.add_argument("--root")
  args = parser.parse_args()
  if args.child:
    print(json.dumps(_child(args.child, args.source, args.root)))
    return
  if args.from_json:
    with open(args.from_json) as f:
      print(report(json.load(f)))
    return
  workdir = tempfile.mkdtemp(prefix="bench_reader_", dir=args.workdir)
  try:
    source, root = _make(workdir, args.size_mib)
    data = {"size_mib": args.size_mib, "runs": args.runs, "disk_mb_s": [],
            "cold": {m: [] for m in METHODS},
            "warm": {m: [] for m in METHODS}}
    for _ in range(args.runs):
      data["disk_mb_s"].append(_disk_read(root))
      for cache in ("cold", "warm"):
        for method in METHODS:
          data[cache][method].append(_run(method, source, root,
                                          cache == "cold"))
    digests = {r["digest"] for c in ("cold", "warm")
               for m in ("clu_ckpt", "orbax", "source") for r in data[c][m]}
    assert len(digests) == 1, "the readers read different bytes"
    if args.json:
      with open(args.json, "w") as f:
        json.dump(data, f, indent=1)
    print(report(data))
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
  main()
