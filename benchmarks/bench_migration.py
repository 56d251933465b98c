"""Benchmarks CLU -> Orbax migration against the naive path (issue 13 item 10).

Synopsis::

  python benchmarks/bench_migration.py --size_gib 2 --runs 3 --json out.json
  python benchmarks/bench_migration.py --from_json out.json   # report again
  python benchmarks/bench_migration.py --tiny --runs 5   # a tiny run's process
  python benchmarks/bench_migration.py --size_gib 26 --runs 1 \
      --methods clu_ckpt_zstd            # a checkpoint larger than RAM
  # Two trees (or settings) side by side in one run:
  python benchmarks/bench_migration.py --tree before=/tmp/e54 \
      --methods naive,clu_ckpt_zstd%before,clu_ckpt_zstd,clu_ckpt_zstd@64

It writes a CLU checkpoint directory of about `--size_gib` GiB (one
checkpoint: float32 parameters and bfloat16 optimizer moments in arrays of at
most 64 MiB, plus a tf.data iterator) with `clu_ckpt.checkpoint`, then
migrates it several times, each in a fresh process, with each method:

- `naive`: `flax.serialization.msgpack_restore(file bytes)` then
  `CheckpointManager.save(step, args=Composite(state=StandardSave(...)))`
  (zstd, Orbax's default);
- `clu_ckpt_zstd` / `clu_ckpt_none`: `clu_ckpt.migration.migrate` with
  zstd / no compression (all items: state, dataset, metadata);
- `cli_zstd` / `cli_none`: the `clu-ckpt migrate` command (`cli.main`) with
  `--compression zstd` / `none`, its imports inside the timed process. A suffix
  `@N` passes `inflight_bytes=N MiB`; a suffix `%LABEL` runs the child with
  `PYTHONPATH=<path of --tree LABEL=path>`, so that `clu_ckpt` is imported
  from that tree (the child reports the `clu_ckpt.__file__` it used);
- `tensorstore_none` / `tensorstore_zstd` (a floor, not a migration): every
  array of the state written by TensorStore alone, as Orbax lays arrays out
  (zarr v2, one chunk per array, zstd level 1 or none, in one OCDBT store on
  the local file driver with TensorStore's default, synced writes), straight
  from `flax_format.load_file`'s memory map, 128 MiB in flight (the
  migration's default window). No Orbax, no metadata, no iterator: what any
  writer built on TensorStore's write path can at best do on this disk.

Each round runs, in this order and each in a fresh process: the disk
measurement (`dd`), then every method once. Before every migration the
source files are dropped from the page cache (`posix_fadvise(DONTNEED)`), so
reads come from disk. The disk worker imports what a migration child
imports, then runs `dd if=/dev/zero of=<workdir>/ddtest bs=64M count=N
oflag=direct conv=fdatasync` (N*64 MiB >= the checkpoint; the disk's
O_DIRECT write bandwidth, the reference of item 10), the same write through
the page cache (`conv=fdatasync` only) and `dd if=<source .flax> of=/dev/null
bs=64M iflag=direct` (the disk's O_DIRECT read of the source). Each
migration child imports its libraries, records its RssAnon (anonymous
resident memory, not the page cache) as the baseline, then samples RssAnon
every 5 ms while it works.

Children import compiled bytecode, as a package installed by pip does
(`--bytecode`, the default): PYTHONDONTWRITEBYTECODE is dropped from their
environment and PYTHONPYCACHEPREFIX=<workdir>/pycache set, filled by an
untimed warm-up (a tiny `clu-ckpt migrate` per tree and the other
children's imports) before anything is timed. Without it, an environment
with PYTHONDONTWRITEBYTECODE=1 compiles clu_ckpt's modules in every child
(about 0.1 s per process on the 2-core machine).

`--tiny` times whole processes of a tiny run (two small checkpoints with a
tf.data iterator) side by side, one of each per round: `clu-ckpt migrate`
(per tree), the floor of any migration through Orbax (`python -c 'import
orbax.checkpoint'`, and a script saving the same items of the same two
steps with the same handlers, `_BARE_ORBAX_SAVE`; each also as it exits
when it skips the shutdown's garbage collection, as `clu-ckpt migrate`
does, see `clu_ckpt.quick_exit`) and an empty interpreter.

Reported per method (medians over `--runs`): the whole process's wall time
(interpreter start to exit, timed by the parent: issue 20 item 5's measure,
with the load average as each run ended); the work's wall time; the ratio naive /
method; throughput as source bytes / time and as destination bytes / time,
the latter (the bytes the destination holds, i.e. what had to be written) as
a fraction of the O_DIRECT write bandwidth measured in the same run; extra
peak RssAnon, as a fraction of the checkpoint size and of naive's; and
whether each target of issue 13 item 10 is met: speed >= 3x naive, or >= 0.8
of the O_DIRECT write bandwidth where a slow disk caps the ratio; extra peak
RssAnon <= 0.1x naive's. MB/s are 10^6 bytes per second, as dd prints them.
"""

import json
import math
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
    "Methods to run: naive, clu_ckpt_zstd, clu_ckpt_none, tensorstore_zstd, "
    "tensorstore_none (a floor); clu_ckpt_* take "
    "the suffixes @<inflight MiB> and %<tree label>.")
_TREES = flags.DEFINE_multi_string(
    "tree", [], "LABEL=PATH: methods ending in %LABEL import clu_ckpt from "
    "PATH (PYTHONPATH of the child).")
_DISK = flags.DEFINE_bool("disk", True, "Measure the disk with dd per round.")
_JSON = flags.DEFINE_string("json", None, "Also write every run's figures.")
_FROM_JSON = flags.DEFINE_string(
    "from_json", None, "Print the report of an earlier --json file again.")
_KEEP = flags.DEFINE_bool("keep", False, "Keep the source after the runs.")
_WARM = flags.DEFINE_bool(
    "warm", False, "Diagnosis only: read the source into the page cache "
    "before each run instead of dropping it (no disk reads).")
_TINY = flags.DEFINE_bool(
    "tiny", False, "Instead: time whole `clu-ckpt migrate` processes of a "
    "tiny run (two small checkpoints with a tf.data iterator), beside "
    "`python -c 'import orbax.checkpoint'` and an empty interpreter.")
_BYTECODE = flags.DEFINE_bool(
    "bytecode", True, "Children import compiled bytecode, as from an "
    "installed package: PYTHONDONTWRITEBYTECODE is dropped from their "
    "environment and PYTHONPYCACHEPREFIX=<workdir>/pycache is set, filled "
    "by an untimed warm-up before the timed runs. --nobytecode: the "
    "environment as it is.")
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



def _du(directory: str) -> tuple[int, int]:
  """(sum of file sizes, bytes allocated on disk) under `directory`."""
  size = blocks = 0
  for root, _, files in os.walk(directory):
    for f in files:
      st = os.lstat(os.path.join(root, f))
      size += st.st_size
      blocks += st.st_blocks * 512
  return size, blocks


_MB = 10**6
_SPEED_RATIO_TARGET = 3.0
_WRITE_SHARE_TARGET = 0.8
_MEMORY_TARGET = 0.1


def _parse_method(spec: str) -> tuple[str, str | None, str | None]:
  """`base[@MiB][%tree]` -> (base, inflight MiB or None, tree or None)."""
  base, _, tree = spec.partition("%")
  base, _, inflight = base.partition("@")
  if base not in ("naive", "clu_ckpt_zstd", "clu_ckpt_none", "cli_zstd",
                  "cli_none", "tensorstore_zstd", "tensorstore_none"):
    raise ValueError(f"unknown method {spec!r}")
  if base.startswith("tensorstore_") and inflight:
    raise ValueError(f"{base} takes no @ suffix: {spec!r}")
  if base == "naive" and (inflight or tree):
    raise ValueError(f"naive takes no suffix: {spec!r}")
  return base, inflight or None, tree or None


# --------------------------------------------------------------------------
# One run (in a fresh process).
# --------------------------------------------------------------------------


def _child(method: str, source: str, dest: str) -> dict:
  if method == "dd":
    return _child_dd(source, dest)
  base, inflight, _ = _parse_method(method)
  if base == "naive":
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
    module = None
  elif base.startswith("tensorstore_"):
    import orbax.checkpoint  # pylint: disable=g-import-not-at-top,unused-import
    import tensorflow  # pylint: disable=g-import-not-at-top,unused-import
    import clu_ckpt  # pylint: disable=g-import-not-at-top
    module = clu_ckpt.__file__
    baseline = _rss_anon()
    cpu = _cpu_seconds()
    with _PeakSampler() as sampler:
      start = time.perf_counter()
      _tensorstore_floor(source, dest, base.rsplit("_", 1)[1])
      seconds = time.perf_counter() - start
      read = 0.0
  elif base.startswith("cli_"):
    # `clu-ckpt migrate` itself (the whole process is timed by the parent).
    # Orbax is imported before the memory baseline, as in the other
    # children, so that the extra memory is the work's.
    import orbax.checkpoint  # pylint: disable=g-import-not-at-top,unused-import
    import clu_ckpt  # pylint: disable=g-import-not-at-top
    from clu_ckpt import cli  # pylint: disable=g-import-not-at-top
    module = clu_ckpt.__file__
    argv = ["migrate", source, dest, "--compression",
            base.rsplit("_", 1)[1]]
    if inflight:
      argv += ["--max-inflight-mib", inflight]
    baseline = _rss_anon()
    cpu = _cpu_seconds()
    with _PeakSampler() as sampler:
      start = time.perf_counter()
      with open(os.devnull, "w") as devnull:
        saved, sys.stdout = sys.stdout, devnull
        try:
          code = cli.main(argv)
        finally:
          sys.stdout = saved
      seconds = time.perf_counter() - start
      read = 0.0
    if code != 0:
      raise RuntimeError(f"clu-ckpt migrate exited {code}")
  else:
    import orbax.checkpoint  # pylint: disable=g-import-not-at-top,unused-import
    import clu_ckpt  # pylint: disable=g-import-not-at-top
    from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
    module = clu_ckpt.__file__
    compression = base.rsplit("_", 1)[1]
    kwargs = {}
    if inflight:
      kwargs["inflight_bytes"] = int(float(inflight) * 2**20)
    baseline = _rss_anon()
    cpu = _cpu_seconds()
    with _PeakSampler() as sampler:
      start = time.perf_counter()
      summary = migration.migrate(source, dest, compression=compression,
                                  **kwargs)
      seconds = time.perf_counter() - start
      read = 0.0
    if not summary.ok:
      raise RuntimeError(f"migration failed: {summary.failed}")
  return {"method": method, "seconds": seconds, "read_seconds": read,
          "cpu_seconds": _cpu_seconds() - cpu, "baseline": baseline,
          "peak_above_baseline": sampler.peak - baseline,
          "clu_ckpt_file": module}


def _tensorstore_floor(source: str, dest: str, compression: str) -> None:
  """Writes the state's arrays with TensorStore alone (see the module doc)."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  from clu_ckpt import flax_format  # pylint: disable=g-import-not-at-top

  def arrays(tree):  # in file order: tree_leaves would sort keys, and so
    # read the map out of order
    if isinstance(tree, dict):
      for value in tree.values():
        yield from arrays(value)
    elif getattr(tree, "ndim", 0) >= 1:
      yield tree

  compressor = {"id": "zstd", "level": 1} if compression == "zstd" else None
  kvstore = {"driver": "ocdbt", "base": f"file://{dest}/state"}
  context = ts.Context({})
  pending, inflight = [], 0
  for i, value in enumerate(arrays(flax_format.load_file(_flax_file(source)))):
    store = ts.open(
        {"driver": "zarr", "kvstore": dict(kvstore, path=f"a{i}/"),
         "metadata": {"compressor": compressor, "chunks": list(value.shape)}},
        create=True, dtype=ts.dtype(value.dtype.name), shape=value.shape,
        context=context).result()
    pending.append((store.write(value), value.nbytes))
    inflight += value.nbytes
    while inflight > 128 * 2**20 and len(pending) > 1:
      future, nbytes = pending.pop(0)
      future.result()
      inflight -= nbytes
  for future, _ in pending:
    future.result()


def _dd(*operands: str) -> tuple[int, float]:
  """Runs dd; (bytes, seconds) from its summary line."""
  done = subprocess.run(["dd", *operands], capture_output=True, text=True,
                        check=True)
  for line in done.stderr.splitlines():
    if " copied, " in line:
      return (int(line.split()[0]),
              float(line.split(" copied, ")[1].split()[0]))
  raise RuntimeError(f"unexpected dd output: {done.stderr!r}")


def _child_dd(source: str, dest: str) -> dict:
  """The disk's figures, in a process set up like a migration child."""
  import orbax.checkpoint  # pylint: disable=g-import-not-at-top,unused-import
  import tensorflow  # pylint: disable=g-import-not-at-top,unused-import
  flax_file = _flax_file(source)
  count = max(1, math.ceil(os.path.getsize(flax_file) / (64 * 2**20)))
  os.makedirs(dest, exist_ok=True)
  path = os.path.join(dest, "ddtest")
  result = {"method": "dd", "dd_count_64mib": count}
  try:
    n, s = _dd("if=/dev/zero", f"of={path}", "bs=64M", f"count={count}",
               "oflag=direct", "conv=fdatasync")
    result["direct_write_mb_s"] = n / s / _MB
    os.unlink(path)
    n, s = _dd("if=/dev/zero", f"of={path}", "bs=64M", f"count={count}",
               "conv=fdatasync")
    result["buffered_write_mb_s"] = n / s / _MB
  finally:
    if os.path.exists(path):
      os.unlink(path)
  n, s = _dd(f"if={flax_file}", "of=/dev/null", "bs=64M", "iflag=direct")
  result["source_direct_read_mb_s"] = n / s / _MB
  return result


def _cpu_seconds() -> float:
  """CPU time (user + system) of this process so far, all threads."""
  t = os.times()
  return t.user + t.system


def _child_env(tree: str | None = None) -> dict[str, str]:
  """The environment of a timed child: clu_ckpt from `tree` when given;
  with --bytecode, compiled modules read from (and written to) one cache
  of the work directory, as an installed package reads its own."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  if _BYTECODE.value:
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = os.path.join(
        os.path.abspath(_WORKDIR.value), "pycache")
  if tree:
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (tree, env.get("PYTHONPATH")) if p)
  return env


def _warm_bytecode(trees: dict[str, str]) -> None:
  """Fills the bytecode cache (--bytecode) before anything is timed: a
  tiny `clu-ckpt migrate` with clu_ckpt from each tree, and the imports of
  the other children."""
  if not _BYTECODE.value:
    return
  source = os.path.join(_WORKDIR.value, "warm_source")
  dest = os.path.join(_WORKDIR.value, "warm_out")
  if not os.path.exists(source):
    _make_tiny_source(source)
  for tree in [None, *trees.values()]:
    shutil.rmtree(dest, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "clu_ckpt", "migrate", source,
                    dest, "--verify"], check=True, capture_output=True,
                   cwd="/", env=_child_env(tree))
    subprocess.run([sys.executable, "-c", "import tensorflow, "
                    "flax.serialization, orbax.checkpoint, tensorstore"],
                   check=True, capture_output=True, cwd="/",
                   env=_child_env(tree))
  shutil.rmtree(dest, ignore_errors=True)
  shutil.rmtree(source, ignore_errors=True)


def _run_once(method: str, source: str, dest: str, trees: dict) -> dict:
  shutil.rmtree(dest, ignore_errors=True)
  if _WARM.value and method != "dd":
    for name in os.listdir(source):
      with open(os.path.join(source, name), "rb") as f:
        while f.read(64 * 2**20):
          pass
  else:
    _drop_page_cache(source)
  tree = None if method == "dd" else _parse_method(method)[2]
  env = _child_env(trees[tree] if tree else None)
  start = time.perf_counter()
  out = subprocess.run(
      [sys.executable, os.path.abspath(__file__), f"--child={method}",
       f"--source={source}", f"--dest={dest}"],
      check=True, capture_output=True, text=True, env=env, cwd="/")
  process_seconds = time.perf_counter() - start
  result = json.loads(out.stdout.strip().splitlines()[-1])
  # The whole process: interpreter start, imports, the work, exit.
  result["process_seconds"] = process_seconds
  result["load"] = os.getloadavg()[0]
  if method != "dd":
    result["dest_bytes"], result["dest_disk_bytes"] = _du(dest)
  shutil.rmtree(dest, ignore_errors=True)
  return result


# --------------------------------------------------------------------------
# The report.
# --------------------------------------------------------------------------


def _median(runs: list, key: str) -> float:
  return statistics.median(r[key] for r in runs)


def _met(ok: bool) -> str:
  return "yes" if ok else "**no**"


def _copy_limit(size: float, out: float, read: float, write: float) -> float:
  """Seconds to read `size` and then write `out` bytes at dd's O_DIRECT
  speeds (MB/s): a lower bound for a migration whose source and destination
  share one disk that does not overlap reads and writes."""
  return size / _MB / read + out / _MB / write


def report(data: dict) -> str:
  """The markdown report of a run (`data` as written by --json)."""
  size = data["size_bytes"]
  results = data["results"]
  disk = data.get("disk") or []
  lines = []
  meta = data.get("meta", {})
  lines.append(
      f"Checkpoint {size / _GIB:.2f} GiB; median of {data['runs']} fresh "
      f"process(es) per method; page cache of the source dropped before "
      f"each; {meta.get('cpus', '?')} CPUs, 1-minute load average "
      f"{meta.get('load_start', float('nan')):.1f} at the start, "
      f"{meta.get('load_end', float('nan')):.1f} at the end.")
  for label, path in sorted(data.get("trees", {}).items()):
    files = {r.get("clu_ckpt_file") for m, rs in results.items()
             if m.endswith("%" + label) for r in rs}
    lines.append(f"Tree `{label}`: PYTHONPATH={path}; clu_ckpt imported from "
                 f"{', '.join(sorted(str(f) for f in files))}.")
  others = {r.get("clu_ckpt_file") for m, rs in results.items()
            if "%" not in m for r in rs} - {None}
  if others:
    lines.append("Other methods: clu_ckpt imported from "
                 f"{', '.join(sorted(others))}.")
  direct = None
  if disk:
    direct = _median(disk, "direct_write_mb_s")
    fmt = lambda key: "/".join(f"{r[key]:.0f}" for r in disk)
    lines.append(
        f"\nDisk (in a worker set up like a migration child, once per "
        f"round): O_DIRECT write (`dd bs=64M count={disk[0]['dd_count_64mib']}"
        f" oflag=direct conv=fdatasync`) **{direct:.0f} MB/s** (runs "
        f"{fmt('direct_write_mb_s')}); page-cache write + fdatasync "
        f"{_median(disk, 'buffered_write_mb_s'):.0f} MB/s (runs "
        f"{fmt('buffered_write_mb_s')}); O_DIRECT read of the source .flax "
        f"{_median(disk, 'source_direct_read_mb_s'):.0f} MB/s (runs "
        f"{fmt('source_direct_read_mb_s')}). MB = 10^6 bytes. \"Share of "
        f"copy limit\": (source bytes / O_DIRECT read + output bytes / "
        f"O_DIRECT write) / time, both medians of this run (information, not "
        f"a target).")
  if "bytecode" in data:
    lines.append("Children import compiled bytecode (--bytecode)." if
                 data["bytecode"] else "Bytecode as the environment has it "
                 "(--nobytecode).")
  if data.get("warm"):
    lines.append("\n**Diagnosis run: the source was in the page cache "
                 "(`--warm`), no disk reads.**")
  naive = results.get("naive")
  t_naive = _median(naive, "seconds") if naive else None
  m_naive = _median(naive, "peak_above_baseline") if naive else None
  lines.append(
      "\n| method | median s (range) | CPU s | naive / method | source MB/s "
      "| output GiB (on disk) | output MB/s | share of O_DIRECT write | "
      "share of copy limit | extra peak RssAnon | x checkpoint | x naive's |")
  lines.append("|---" * 12 + "|")
  read = _median(disk, "source_direct_read_mb_s") if disk else None
  for method, rs in results.items():
    t = _median(rs, "seconds")
    out = _median(rs, "dest_bytes")
    out_disk = _median(rs, "dest_disk_bytes")
    peak = _median(rs, "peak_above_baseline")
    ts = [r["seconds"] for r in rs]
    lines.append(
        f"| {method} | {t:.2f} ({min(ts):.2f}-{max(ts):.2f}) | "
        f"{_median(rs, 'cpu_seconds'):.1f} | "
        f"{'' if t_naive is None else f'{t_naive / t:.2f}x'} | "
        f"{size / t / _MB:.0f} | {out / _GIB:.2f} ({out_disk / _GIB:.2f}) | "
        f"{out / t / _MB:.0f} | "
        f"{'' if direct is None else f'{out / t / _MB / direct:.2f}'} | "
        f"{'' if direct is None else f'{_copy_limit(size, out, read, direct) / t:.2f}'} | "
        f"{peak / _GIB:.3f} GiB | {peak / size:.3f} | "
        f"{'' if not m_naive else f'{peak / m_naive:.3f}'} |")
  if naive and all("process_seconds" in r for rs in results.values()
                   for r in rs):
    p_naive = _median(naive, "process_seconds")
    lines.append(
        "\nWhole processes (interpreter start, imports, the work, exit; timed "
        "by the parent), the measure of issue 20 item 5: >= 3x naive, or >= "
        "0.8 of the same-disk copy limit, at <= 0.1x naive's extra peak "
        "RssAnon. Load: 1-minute load average when each run ended.\n")
    lines.append("| method | median process s (range) | naive / method "
                 "| per round (range) | share of copy limit | extra RssAnon x "
                 "naive's | load | target met |")
    lines.append("|---" * 8 + "|")
    for method, rs in results.items():
      t = _median(rs, "process_seconds")
      ts = [r["process_seconds"] for r in rs]
      paired = [n["process_seconds"] / r["process_seconds"]
                for n, r in zip(naive, rs)]
      limit = (None if direct is None else _copy_limit(
          size, _median(rs, "dest_bytes"), read, direct) / t)
      mem = _median(rs, "peak_above_baseline") / m_naive
      speed = p_naive / t >= _SPEED_RATIO_TARGET or (
          limit is not None and limit >= _WRITE_SHARE_TARGET)
      loads = [r.get("load", float("nan")) for r in rs]
      lines.append(
          f"| {method} | {t:.2f} ({min(ts):.2f}-{max(ts):.2f}) | "
          f"{p_naive / t:.2f}x | {min(paired):.2f}-{max(paired):.2f} | "
          f"{'' if limit is None else f'{limit:.2f}'} | {mem:.3f} | "
          f"{min(loads):.1f}-{max(loads):.1f} | "
          f"{'' if method == 'naive' else _met(speed and mem <= _MEMORY_TARGET)} |")
  if naive:
    lines.append(
        "\nIssue 13 item 10 (speed: >= 3x naive, or >= 0.8 of the O_DIRECT "
        "write bandwidth where a slow disk caps the ratio; memory: extra peak "
        "RssAnon <= 0.1x naive's). Throughput numerator: the bytes the "
        "destination holds (sum of its file sizes) / median time.\n")
    lines.append("| method | naive / method | share of O_DIRECT write | "
                 "speed met | extra RssAnon x naive's | memory met | "
                 "item 10 met |")
    lines.append("|---" * 7 + "|")
    for method, rs in results.items():
      if method == "naive":
        continue
      t = _median(rs, "seconds")
      ratio = t_naive / t
      share = (None if direct is None else
               _median(rs, "dest_bytes") / t / _MB / direct)
      speed = ratio >= _SPEED_RATIO_TARGET or (
          share is not None and share >= _WRITE_SHARE_TARGET)
      mem = _median(rs, "peak_above_baseline") / m_naive
      memory_ok = mem <= _MEMORY_TARGET
      lines.append(
          f"| {method} | {ratio:.2f}x | "
          f"{'' if share is None else f'{share:.2f}'} | {_met(speed)} | "
          f"{mem:.3f} | {_met(memory_ok)} | {_met(speed and memory_ok)} |")
    lines.append("")
    for method, rs in results.items():
      if method == "naive":
        continue
      paired = [n["seconds"] / r["seconds"] for n, r in zip(naive, rs)]
      cpu = _median(naive, "cpu_seconds") / _median(rs, "cpu_seconds")
      lines.append(
          f"- {method}: per round naive / method median "
          f"{statistics.median(paired):.2f}x, range {min(paired):.2f}-"
          f"{max(paired):.2f}; {cpu:.2f}x less CPU time than naive")
  return "\n".join(lines)


def _make_tiny_source(directory: str) -> None:
  """Two small checkpoints with a tf.data iterator, as `clu.checkpoint`
  writes them."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from clu_ckpt import checkpoint  # pylint: disable=g-import-not-at-top
  ds_iter = iter(tf.data.Dataset.range(1000).batch(4))
  ckpt = checkpoint.Checkpoint(directory, dict(ds_iter=ds_iter))
  for step in (100, 200):
    next(ds_iter)
    ckpt.save({"step": np.int64(step),
               "params": {"w": np.arange(6, dtype=np.float32) * step},
               "opt": {"lr": 0.1, "name": "sgd"}})


def _timed(argv: list[str], tree: str | None = None) -> tuple[float, float]:
  """(wall, CPU) seconds of a fresh process running `argv` (with clu_ckpt
  imported from `tree` when given)."""
  env = _child_env(tree)
  before = os.times()
  start = time.perf_counter()
  subprocess.run(argv, check=True, capture_output=True, cwd="/", env=env)
  wall = time.perf_counter() - start
  after = os.times()
  return wall, (after.children_user - before.children_user +
                after.children_system - before.children_system)


# The floor of a tiny migration through Orbax, as a script: the same three
# items (a PyTree state with zstd, a PyTree dataset of byte arrays, a JSON
# metadata item) of the tiny run's two steps, saved by a `Checkpointer` of a
# `CompositeCheckpointHandler` with the handlers the migration registers; no
# source read, no check, no manifest, no lock. argv[1]: the destination;
# argv[2] == "freeze": exit as `clu-ckpt migrate` does (`quick_exit`).
_BARE_ORBAX_SAVE = """
import sys
import numpy as np
import orbax.checkpoint as ocp
if sys.argv[2:] == ["freeze"]:
  import atexit, gc
  atexit.register(gc.freeze)
for step in (100, 200):
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  registry.add("state", ocp.args.PyTreeSave,
               ocp.handlers.PyTreeCheckpointHandler(use_compression=True))
  registry.add("dataset", ocp.args.PyTreeSave,
               ocp.handlers.PyTreeCheckpointHandler())
  registry.add("metadata", ocp.args.JsonSave,
               ocp.handlers.JsonCheckpointHandler())
  checkpointer = ocp.Checkpointer(
      ocp.handlers.CompositeCheckpointHandler(handler_registry=registry))
  state = {"step": np.int64(step),
           "params": {"w": np.arange(6, dtype=np.float32) * step},
           "opt": {"lr": 0.1, "name": "sgd"}}
  dataset = {"process_0": {"index": np.zeros(120, np.uint8),
                           "data": np.zeros(400, np.uint8)}}
  checkpointer.save(f"{sys.argv[1]}/{step}", args=ocp.args.Composite(
      state=ocp.args.PyTreeSave(state),
      dataset=ocp.args.PyTreeSave(dataset),
      metadata=ocp.args.JsonSave({"step": step, "format": "bare"})))
  checkpointer.close()
"""


def tiny(workdir: str, runs: int, trees: dict[str, str]) -> str:
  """Whole `clu-ckpt migrate` processes of a tiny run, side by side with
  the floor of any migration through Orbax (the import of Orbax alone, and
  a script saving the same items with the same handlers, each as a plain
  process and exiting as `clu-ckpt migrate` does, see `quick_exit`) and an
  empty interpreter, one of each per round; medians, with the load.
  Each of `trees` (label -> path) adds the command with clu_ckpt from
  there. With --bytecode, one untimed round first fills the cache."""
  source = os.path.join(workdir, "tiny_source")
  dest = os.path.join(workdir, "tiny_out")
  shutil.rmtree(source, ignore_errors=True)
  _make_tiny_source(source)
  commands = {
      "clu-ckpt migrate (tiny run)": [sys.executable, "-m", "clu_ckpt",
                                      "migrate", source, dest],
      "python -c 'import orbax.checkpoint'": [
          sys.executable, "-c", "import orbax.checkpoint"],
      "the same, skipping the exit's collection (`quick_exit`)": [
          sys.executable, "-c", "import atexit, gc, orbax.checkpoint; "
          "atexit.register(gc.freeze)"],
      "bare Orbax save of the same 2 steps, same handlers (a script)": [
          sys.executable, "-c", _BARE_ORBAX_SAVE, dest, "plain"],
      "the same script, skipping the exit's collection": [
          sys.executable, "-c", _BARE_ORBAX_SAVE, dest, "freeze"],
      "python -c 'pass'": [sys.executable, "-c", "pass"],
  }
  tree_of = {}
  for label, path in sorted(trees.items()):
    name = f"clu-ckpt migrate (tiny run), tree {label}"
    commands[name] = commands["clu-ckpt migrate (tiny run)"]
    tree_of[name] = path
  times = {name: [] for name in commands}
  loads = []
  for round_ in range(runs + (1 if _BYTECODE.value else 0)):
    warm_up = _BYTECODE.value and round_ == 0
    for name, argv in commands.items():
      shutil.rmtree(dest, ignore_errors=True)
      timed = _timed(argv, tree_of.get(name))
      if not warm_up:
        times[name].append(timed)
    if not warm_up:
      loads.append(os.getloadavg()[0])
  shutil.rmtree(dest, ignore_errors=True)
  shutil.rmtree(source, ignore_errors=True)
  lines = [f"Whole processes, median of {runs} rounds (range); "
           f"{os.cpu_count()} CPUs, 1-minute load average "
           f"{min(loads):.1f}-{max(loads):.1f}; "
           + ("compiled bytecode (an untimed round first)" if _BYTECODE.value
              else "bytecode as the environment has it (--nobytecode)")
           + ".\n",
           "| process | wall s | CPU s (user + system) |", "|---|---|---|"]
  for name, ts in times.items():
    walls, cpus = [t[0] for t in ts], [t[1] for t in ts]
    lines.append(f"| {name} | {statistics.median(walls):.2f} "
                 f"({min(walls):.2f}-{max(walls):.2f}) | "
                 f"{statistics.median(cpus):.2f} ({min(cpus):.2f}-"
                 f"{max(cpus):.2f}) |")
  return "\n".join(lines)


def main(argv):
  del argv
  if _TINY.value:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
        __file__))))
    os.makedirs(_WORKDIR.value, exist_ok=True)
    print(tiny(_WORKDIR.value, _RUNS.value,
               dict(t.split("=", 1) for t in _TREES.value)))
    return
  if _CHILD.value:
    print(json.dumps(_child(_CHILD.value, _SOURCE.value, _DEST.value)))
    return
  if _FROM_JSON.value:
    with open(_FROM_JSON.value) as f:
      print(report(json.load(f)))
    return
  trees = dict(t.split("=", 1) for t in _TREES.value)
  for method in _METHODS.value:
    tree = _parse_method(method)[2]
    if tree and tree not in trees:
      raise app.UsageError(f"{method}: no --tree {tree}=PATH")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))
  work = _WORKDIR.value
  source = os.path.join(work, f"source_{_SIZE_GIB.value:g}gib")
  if not os.path.exists(_flax_file(source)):
    shutil.rmtree(source, ignore_errors=True)
    start = time.perf_counter()
    _make_source(source, _SIZE_GIB.value)
    print(f"wrote {source} in {time.perf_counter() - start:.1f} s",
          file=sys.stderr)
  size = _du(source)[0]
  _warm_bytecode(trees)
  data = {"size_bytes": size, "runs": _RUNS.value, "trees": trees,
          "warm": _WARM.value, "bytecode": _BYTECODE.value,
          "meta": {"cpus": os.cpu_count(), "load_start": os.getloadavg()[0],
                   "argv": sys.argv},
          "disk": [], "results": {m: [] for m in _METHODS.value}}
  for run in range(_RUNS.value):
    if _DISK.value:
      r = _run_once("dd", source, os.path.join(work, "dd"), trees)
      data["disk"].append(r)
      print(f"  run {run + 1} dd O_DIRECT write {r['direct_write_mb_s']:.0f}"
            f" MB/s, page-cache write {r['buffered_write_mb_s']:.0f} MB/s, "
            f"O_DIRECT read {r['source_direct_read_mb_s']:.0f} MB/s",
            file=sys.stderr, flush=True)
    for method in _METHODS.value:
      r = _run_once(method, source, os.path.join(work, "out"), trees)
      data["results"][method].append(r)
      print(f"  run {run + 1} {method:22s} {r['seconds']:7.2f} s "
            f"(process {r['process_seconds']:6.2f} s, load {r['load']:.1f}) "
            f"(CPU {r['cpu_seconds']:6.2f} s)  peak RssAnon "
            f"+{r['peak_above_baseline'] / _GIB:.3f} GiB  "
            f"[{r.get('clu_ckpt_file')}]", file=sys.stderr, flush=True)
  data["meta"]["load_end"] = os.getloadavg()[0]
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(data, f, indent=1)
  print(report(data))
  if not _KEEP.value:
    shutil.rmtree(source, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
