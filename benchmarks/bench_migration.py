"""Benchmarks CLU -> Orbax migration against the naive path.

Synopsis::

  python benchmarks/bench_migration.py --size_gib 2 --runs 3
  python benchmarks/bench_migration.py --size_gib 26 --runs 1 \
      --methods clu_ckpt_zstd            # a checkpoint larger than RAM

It writes a CLU checkpoint directory of about `--size_gib` GiB (one
checkpoint: float32 parameters and bfloat16 optimizer moments in arrays of at
most 64 MiB, plus a tf.data iterator) with `clu_ckpt.checkpoint`, then
migrates it several times, each in a fresh process, with each method:

- `naive`: `flax.serialization.msgpack_restore(file bytes)` then
  `CheckpointManager.save(step, args=Composite(state=StandardSave(...)))`
  (zstd, Orbax's default);
- `clu_ckpt_zstd` / `clu_ckpt_none`: `clu_ckpt.migration.migrate` with
  zstd / no compression (all items: state, dataset, metadata).

Before every run the source files are dropped from the page cache
(`posix_fadvise(DONTNEED)`), so reads come from disk. Each child process
imports its libraries, records its RssAnon (anonymous resident memory, not
the page cache) as the baseline, then samples RssAnon every 5 ms while it
works. Reported per method: median wall time of the migration, median peak
RssAnon above the baseline (also as a fraction of the checkpoint size), and
the destination's size on disk.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

from absl import app
from absl import flags

_SIZE_GIB = flags.DEFINE_float("size_gib", 2.0, "Checkpoint size in GiB.")
_RUNS = flags.DEFINE_integer("runs", 3, "Runs per method (median reported).")
_WORKDIR = flags.DEFINE_string(
    "workdir", "/tmp/clu_ckpt_bench", "Where source and outputs are written.")
_METHODS = flags.DEFINE_list(
    "methods", ["naive", "clu_ckpt_zstd", "clu_ckpt_none"],
    "Methods to run.")
_KEEP = flags.DEFINE_bool("keep", False, "Keep the source after the runs.")
_CHILD = flags.DEFINE_string("child", None, "Internal: run one method.")
_SOURCE = flags.DEFINE_string("source", None, "Internal: source directory.")
_DEST = flags.DEFINE_string("dest", None, "Internal: destination directory.")

_ARRAY_BYTES = 64 * 2**20
_GIB = 2**30


def _rss_anon() -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("RssAnon:"):
        return int(line.split()[1]) * 1024
  raise RuntimeError("no RssAnon in /proc/self/status")


class _PeakSampler:
  """Samples RssAnon in a thread; `peak` is the largest value seen."""

  def __init__(self, period: float = 0.005):
    self.peak = _rss_anon()
    self._period = period
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    while not self._stop.is_set():
      self.peak = max(self.peak, _rss_anon())
      time.sleep(self._period)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    self.peak = max(self.peak, _rss_anon())


# --------------------------------------------------------------------------
# The source checkpoint.
# --------------------------------------------------------------------------


def _make_source(directory: str, size_gib: float) -> None:
  """Writes one CLU checkpoint of about `size_gib` GiB, in bounded memory.

  `clu_ckpt.checkpoint` writes `ckpt-1` (a tf.data iterator, the `checkpoint`
  file) with a small state; then `ckpt-1.flax` is replaced by a large state
  streamed to disk one array at a time, encoded as Flax does (a msgpack map;
  arrays as msgpack extension 1 holding `(shape, dtype name, C-order bytes)`),
  so that checkpoints larger than RAM can be produced.

  Args:
    directory: Where to write.
    size_gib: Approximate size.
  """
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  import msgpack  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from clu_ckpt import checkpoint  # pylint: disable=g-import-not-at-top
  ds_iter = iter(tf.data.Dataset.range(10**6).shuffle(1000).batch(8))
  next(ds_iter)
  checkpoint.Checkpoint(directory, dict(ds_iter=ds_iter)).save({"step": 0})

  # 4 bytes of float32 parameter + 2 bytes of bfloat16 moment per element.
  elements = _ARRAY_BYTES // 4 // 256 * 256
  layers = max(1, int(size_gib * _GIB) // (elements * 6))
  packer = msgpack.Packer(use_bin_type=True)

  def array(arr):
    payload = msgpack.packb((list(arr.shape), arr.dtype.name, arr.tobytes()),
                            use_bin_type=True)
    return packer.pack(msgpack.ExtType(1, payload))

  def layer_kernels(i):
    kernel = np.random.default_rng(i).standard_normal(
        elements, dtype=np.float32).reshape(-1, 256)
    return kernel, (kernel * 0.01).astype(ml_dtypes.bfloat16)

  path = _flax_file(directory)
  with open(path + ".tmp", "wb") as f:
    f.write(packer.pack_map_header(3))
    f.write(packer.pack("step") + array(np.asarray(1000, np.int64)))
    f.write(packer.pack("params") + packer.pack_map_header(layers))
    for i in range(layers):
      kernel, _ = layer_kernels(i)
      f.write(packer.pack(f"layer_{i:04d}") + packer.pack_map_header(2))
      f.write(packer.pack("kernel") + array(kernel))
      f.write(packer.pack("bias") + array(np.zeros(256, np.float32)))
    f.write(packer.pack("opt_state") + packer.pack_map_header(3))
    f.write(packer.pack("count") + array(np.asarray(1000, np.int32)))
    f.write(packer.pack("lr") + packer.pack(1e-3))
    f.write(packer.pack("mu") + packer.pack_map_header(layers))
    for i in range(layers):
      _, moment = layer_kernels(i)
      f.write(packer.pack(f"layer_{i:04d}") + packer.pack_map_header(1))
      f.write(packer.pack("kernel") + array(moment))
  os.replace(path + ".tmp", path)


def _flax_file(source: str) -> str:
  return os.path.join(source, "ckpt-1.flax")


def _drop_page_cache(directory: str) -> None:
  for name in os.listdir(directory):
    fd = os.open(os.path.join(directory, name), os.O_RDONLY)
    try:
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)


def _du(directory: str) -> int:
  return sum(os.path.getsize(os.path.join(root, f))
             for root, _, files in os.walk(directory) for f in files)


# --------------------------------------------------------------------------
# One run (in a fresh process).
# --------------------------------------------------------------------------


def _child(method: str, source: str, dest: str) -> dict:
  if method == "naive":
    import flax.serialization  # pylint: disable=g-import-not-at-top
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    baseline = _rss_anon()
    cpu = _cpu_seconds()
    with _PeakSampler() as sampler:
      start = time.perf_counter()
      with open(_flax_file(source), "rb") as f:
        state = flax.serialization.msgpack_restore(f.read())
      read = time.perf_counter() - start
      with ocp.CheckpointManager(dest) as mngr:
        mngr.save(1000, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state)))
        mngr.wait_until_finished()
      seconds = time.perf_counter() - start
  else:
    import orbax.checkpoint  # pylint: disable=g-import-not-at-top,unused-import
    import tensorflow  # pylint: disable=g-import-not-at-top,unused-import
    from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
    compression = method.rsplit("_", 1)[1]
    baseline = _rss_anon()
    cpu = _cpu_seconds()
    with _PeakSampler() as sampler:
      start = time.perf_counter()
      summary = migration.migrate(source, dest, compression=compression)
      seconds = time.perf_counter() - start
      read = 0.0
    if not summary.ok:
      raise RuntimeError(f"migration failed: {summary.failed}")
  return {"method": method, "seconds": seconds, "read_seconds": read,
          "cpu_seconds": _cpu_seconds() - cpu, "baseline": baseline,
          "peak_above_baseline": sampler.peak - baseline}


def _cpu_seconds() -> float:
  """CPU time (user + system) of this process so far, all threads."""
  t = os.times()
  return t.user + t.system


def _run_once(method: str, source: str, dest: str) -> dict:
  shutil.rmtree(dest, ignore_errors=True)
  _drop_page_cache(source)
  out = subprocess.run(
      [sys.executable, os.path.abspath(__file__), f"--child={method}",
       f"--source={source}", f"--dest={dest}"],
      check=True, capture_output=True, text=True,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  result = json.loads(out.stdout.strip().splitlines()[-1])
  result["dest_bytes"] = _du(dest)
  shutil.rmtree(dest, ignore_errors=True)
  return result


def _print_speedup(method: str, naive: list, runs: list) -> None:
  median = lambda rs, key: statistics.median(r[key] for r in rs)
  overall = median(naive, "seconds") / median(runs, "seconds")
  paired = [n["seconds"] / r["seconds"] for n, r in zip(naive, runs)]
  cpu = median(naive, "cpu_seconds") / median(runs, "cpu_seconds")
  print(f"speed-up of {method} over naive: {overall:.2f}x (medians); "
        f"per round median {statistics.median(paired):.2f}x, range "
        f"{min(paired):.2f}-{max(paired):.2f}; CPU time {cpu:.2f}x less")


def main(argv):
  del argv
  if _CHILD.value:
    print(json.dumps(_child(_CHILD.value, _SOURCE.value, _DEST.value)))
    return
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))
  work = _WORKDIR.value
  source = os.path.join(work, f"source_{_SIZE_GIB.value:g}gib")
  if not os.path.exists(_flax_file(source)):
    shutil.rmtree(source, ignore_errors=True)
    start = time.perf_counter()
    _make_source(source, _SIZE_GIB.value)
    print(f"wrote {source} in {time.perf_counter() - start:.1f} s")
  size = _du(source)
  print(f"checkpoint: {size / _GIB:.2f} GiB; {_RUNS.value} run(s) per method;"
        " fresh process per run; page cache of the source dropped per run")
  results = {m: [] for m in _METHODS.value}
  for run in range(_RUNS.value):
    for method in _METHODS.value:
      r = _run_once(method, source, os.path.join(work, f"out_{method}"))
      results[method].append(r)
      print(f"  run {run + 1} {method:14s} {r['seconds']:7.2f} s "
            f"(CPU {r['cpu_seconds']:6.2f} s)  peak RssAnon "
            f"+{r['peak_above_baseline'] / _GIB:.3f} GiB", flush=True)
  print(f"load average at the end: {os.getloadavg()[0]:.1f} "
        f"({os.cpu_count()} CPUs)")
  print(f"\n{'method':14s} {'median s':>9s} {'GiB/s':>6s} {'CPU s':>6s} "
        f"{'peak RssAnon':>13s} {'x size':>7s} {'output GiB':>10s}")
  for method, rs in results.items():
    seconds = statistics.median(r["seconds"] for r in rs)
    cpu = statistics.median(r["cpu_seconds"] for r in rs)
    peak = statistics.median(r["peak_above_baseline"] for r in rs)
    print(f"{method:14s} {seconds:9.2f} {size / _GIB / seconds:6.2f} "
          f"{cpu:6.1f} {peak / _GIB:9.3f} GiB {peak / size:7.2f} "
          f"{rs[0]['dest_bytes'] / _GIB:10.2f}")
  if "naive" in results:
    for method, rs in results.items():
      if method != "naive":
        _print_speedup(method, results["naive"], rs)
  print(json.dumps({"size_bytes": size, "results": results}))
  if not _KEEP.value:
    shutil.rmtree(source, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
