"""Speed and memory of clu_ckpt against the real clu.checkpoint on a large state.

Synopsis::

  python benchmarks/bench_checkpoint.py                  # 1 GiB, 3 runs
  python benchmarks/bench_checkpoint.py --runs 5 --json out.json
  python benchmarks/bench_checkpoint.py --size-gib 0.25 --only save,e2e
  python benchmarks/bench_checkpoint.py --only save_orbax   # the two layouts

Every figure is the median over `--runs` fresh worker processes (this script
re-run with `--worker`); the two libraries alternate run by run. The worker
builds a deterministic train state of JAX arrays (params plus the Adam moments
mu and nu, and a few scalars), then times one call. Memory is watched from
the parent through /proc/<pid>/status (VmRSS, RssAnon) and, exactly, through the
kernel's VmHWM after resetting it in the worker. The disk's own dd bandwidth is
measured beside the results. benchmarks/README.md explains each figure.

`save_orbax` compares clu_ckpt with itself: `Checkpoint(d, layout="orbax")`
(each save a step of an Orbax root, `clu_ckpt.orbax_layout`) against the CLU
layout's `Checkpoint(d)`, the same state, the two alternating run by run.
Each worker saves twice and both saves are timed: the first in a fresh
process (Orbax's and TensorStore's start-up included; their imports are
not, as TensorFlow's are not) and the second, a training loop's steady
state.
"""

import argparse
import contextlib
import dataclasses
import glob
import importlib
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
RESULT_TAG = "BENCH_RESULT "
MB = 1e6
GIB = 1 << 30
SAMPLE_INTERVAL_S = 0.002
WORKER_TIMEOUT_S = 900

MEASUREMENTS = ("save", "restore", "restore_cold", "load", "load_cold", "e2e",
                "e2e_touch", "save_orbax")
# e2e_touch repeats what load + touch shows, at ~50 s of clu per 3 runs.
DEFAULT = ("save", "restore", "restore_cold", "load", "load_cold", "e2e",
           "save_orbax")

# Keeps `import tensorflow` (and its submodules) from succeeding at all, so the
# end-to-end run proves the reader needs no TensorFlow.
_BLOCK_TENSORFLOW = """\
import sys
class _NoTensorFlow:
  def find_spec(self, name, path=None, target=None):
    if name == "tensorflow" or name.startswith("tensorflow."):
      raise ImportError("benchmark: tensorflow is blocked in this process")
    return None
sys.meta_path.insert(0, _NoTensorFlow())
"""


@dataclasses.dataclass(frozen=True)
class Lib:
  """One side of the comparison."""
  name: str
  module: str
  e2e_import: str
  block_tf: bool
  layout: Optional[str] = None  # Checkpoint(..., layout=...) when given


# The two sides of `save_orbax`: clu_ckpt's Orbax layout against its CLU one.
LAYOUT_LIBS = (Lib("orbax layout", "clu_ckpt.checkpoint", "", True, "orbax"),
               Lib("CLU layout", "clu_ckpt.checkpoint", "", True, "clu"))


def _libs(candidate_module: str) -> tuple[Lib, Lib]:
  """Returns (candidate, reference); the reference is always the real clu."""
  if candidate_module == "clu_ckpt.checkpoint":
    e2e_import = "from clu_ckpt import load_state_dict"
  else:
    e2e_import = f"from {candidate_module} import load_state_dict"
  candidate = Lib("clu_ckpt", candidate_module, e2e_import,
                  block_tf=not candidate_module.startswith("clu."))
  reference = Lib("clu", "clu.checkpoint",
                  "from clu.checkpoint import load_state_dict", block_tf=False)
  return candidate, reference


# ----------------------------------------------------------------------------
# The train state.


class AdamState(NamedTuple):
  count: Any
  mu: Any
  nu: Any


_HIDDEN = 1024
# (path inside params, dtype, share of the big leaves or None for a (HIDDEN,)
# vector). 24 leaves; with mu and nu and 3 scalars the state has 75.
_PARAMS = (
    [(("embed", "embedding"), "bfloat16", 8)]
    + [spec for block in range(7) for spec in (
        ((f"block_{block}", "attention", "kernel"), "float32", 3 + block % 2),
        ((f"block_{block}", "mlp", "kernel"), "float32", 5 + block % 3),
        ((f"block_{block}", "layer_norm", "scale"), "float32", None))]
    + [(("head", "kernel"), "float32", 2), (("head", "bias"), "float32", None)]
)


def _param_shapes(size_gib: float) -> list[tuple[tuple[str, ...], tuple, str]]:
  """Shapes of the params so that params + mu + nu come to `size_gib`."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  budget = size_gib * GIB / 3
  small = [(path, dtype) for path, dtype, share in _PARAMS if share is None]
  budget -= sum(_HIDDEN * np.dtype(dtype).itemsize for _, dtype in small)
  total_share = sum(share for _, _, share in _PARAMS if share)
  shapes = []
  for path, dtype, share in _PARAMS:
    if share is None:
      shapes.append((path, (_HIDDEN,), dtype))
      continue
    row_bytes = _HIDDEN * np.dtype(dtype).itemsize
    rows = max(1, round(budget * share / total_share / row_bytes))
    shapes.append((path, (rows, _HIDDEN), dtype))
  return shapes


def _nest(pairs) -> dict:
  tree = {}
  for path, value in pairs:
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return tree


def build_state(size_gib: float) -> Any:
  """Builds the deterministic train state (a flax struct of JAX arrays)."""
  import flax.struct  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  @flax.struct.dataclass
  class TrainState:
    step: Any
    params: Any
    opt_state: Any
    loss_scale: Any

  shapes = _param_shapes(size_gib)

  def fill(shape, dtype, seed):
    # A multiplicative hash of the element index: cheap, deterministic, dense.
    size = 1
    for dim in shape:
      size *= dim
    bits = jax.lax.iota(jnp.uint32, size) + jnp.uint32(seed * 7919)
    bits = bits * jnp.uint32(2654435761)
    bits = bits ^ (bits >> 15)
    unit = jax.lax.bitcast_convert_type(
        (bits >> 9) | jnp.uint32(0x3F800000), jnp.float32)
    return (unit - 1.5).astype(dtype).reshape(shape)

  def all_leaves():
    return [fill(shape, dtype, group * 1000 + index)
            for group in range(3)
            for index, (_, shape, dtype) in enumerate(shapes)]

  leaves = jax.jit(all_leaves)()
  jax.block_until_ready(leaves)
  n = len(shapes)
  params, mu, nu = (
      _nest((path, leaf) for (path, _, _), leaf in zip(shapes, leaves[i:i + n]))
      for i in range(0, 3 * n, n))
  return TrainState(
      step=jnp.asarray(12345, jnp.int32),
      params=params,
      opt_state=AdamState(count=jnp.asarray(12345, jnp.int32), mu=mu, nu=nu),
      loss_scale=jnp.asarray(32768.0, jnp.float32))


# ----------------------------------------------------------------------------
# /proc helpers and the page cache.


def _read_status(pid: str = "self") -> dict[str, int]:
  """Returns the kB fields of /proc/<pid>/status as bytes."""
  fields = {}
  with open(f"/proc/{pid}/status") as f:
    for line in f:
      key, _, rest = line.partition(":")
      parts = rest.split()
      if len(parts) == 2 and parts[1] == "kB":
        fields[key] = int(parts[0]) * 1024
  return fields


def _reset_peak_rss() -> bool:
  """Resets VmHWM to the current RSS (Linux >= 4.0); False if not allowed."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def resident_fraction(path: str) -> float:
  """Fraction of the file's pages in the page cache (mincore(2))."""
  import ctypes  # pylint: disable=g-import-not-at-top
  size = os.path.getsize(path)
  if not size:
    return 1.0
  libc = ctypes.CDLL(None, use_errno=True)
  libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
  pages = -(-size // mmap.PAGESIZE)
  vector = (ctypes.c_ubyte * pages)()
  with open(path, "rb") as f:
    mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
  try:
    view = (ctypes.c_char * size).from_buffer(mapped)
    failed = libc.mincore(ctypes.addressof(view), size, vector)
    del view
  finally:
    mapped.close()
  if failed:
    raise OSError(ctypes.get_errno(), f"mincore({path})")
  return 1 - bytes(vector).count(0) / pages


def _files_under(directory: str) -> list[str]:
  return [p for p in glob.glob(os.path.join(directory, "**"), recursive=True)
          if os.path.isfile(p)]


def drop_page_cache(paths: Sequence[str]) -> float:
  """Evicts the files from the page cache; returns the largest share left.

  posix_fadvise(DONTNEED) first (any user, this file only); if pages stay,
  the system-wide `echo 1 > /proc/sys/vm/drop_caches` (root only).
  """
  os.sync()
  for path in paths:
    fd = os.open(path, os.O_RDONLY)
    try:
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)
  if max(map(resident_fraction, paths), default=0) > 0.01:
    with contextlib.suppress(OSError):
      with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1")
  return max(map(resident_fraction, paths), default=0)


def warm_page_cache(paths: Sequence[str]) -> float:
  """Reads the files once; returns the smallest share of them now cached."""
  buffer = bytearray(16 << 20)
  for path in paths:
    with open(path, "rb", buffering=0) as f:
      while f.readinto(buffer):
        pass
  return min(map(resident_fraction, paths), default=1)


# ----------------------------------------------------------------------------
# Worker mode: one measurement in a fresh process.


def _flax_file(directory: str) -> str:
  found = sorted(glob.glob(os.path.join(directory, "*.flax")))
  if len(found) != 1:
    raise RuntimeError(f"expected one .flax file in {directory}: {found}")
  return found[0]


def _state_facts(state) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  leaves = jax.tree_util.tree_leaves(state)
  return {"state_bytes": sum(leaf.nbytes for leaf in leaves),
          "leaves": len(leaves)}


def _timed(call: Callable[[], Any]) -> tuple[Any, dict]:
  """Runs `call` between a memory baseline and a read of the kernel's peak."""
  import gc  # pylint: disable=g-import-not-at-top
  gc.collect()
  base = _read_status()
  hwm_reset = _reset_peak_rss()
  t0 = time.monotonic()
  value = call()
  t1 = time.monotonic()
  peak = _read_status()["VmHWM"] if hwm_reset else None
  return value, {"t0": t0, "t1": t1, "base_rss": base["VmRSS"],
                 "base_anon": base.get("RssAnon"), "hwm": peak}


def _worker_save(spec: dict) -> dict:
  """Times a save; kind "dd" sets up the same way, then runs dd instead."""
  # Saving needs TensorFlow on both sides (the TF checkpoint is the commit):
  # clu imports it with the module, clu_ckpt on the first save. The one-off
  # import (seconds, ~0.4 GiB RSS) is not what this figure is about.
  importlib.import_module("tensorflow")
  module = importlib.import_module(spec["module"])
  state = build_state(spec["size_gib"])
  kwargs = {}
  if spec.get("layout"):
    kwargs["layout"] = spec["layout"]
    # Imported once per training run, like TensorFlow above.
    for name in ("orbax.checkpoint", "clu_ckpt.orbax_items",
                 "clu_ckpt.migration.run"):
      importlib.import_module(name)
  ckpt = module.Checkpoint(spec["dir"], **kwargs)
  os.sync()  # Earlier runs' dirty pages must not be flushed on our clock.
  if spec["kind"] == "dd":
    os.makedirs(spec["dir"], exist_ok=True)
    return {"dd_mb_s": dd_write(spec["dir"]), **_state_facts(state)}
  if spec.get("saves", 1) == 2:
    first, first_timing = _timed(lambda: ckpt.save(state))
    first_timing["bytes"] = _saved_bytes(first)
    os.sync()
    saved, result = _timed(lambda: ckpt.save(state))
    result["first"] = first_timing
  else:
    saved, result = _timed(lambda: ckpt.save(state))
  t_sync = time.monotonic()
  os.sync()
  result["sync_s"] = time.monotonic() - t_sync
  result["file_bytes"] = (_saved_bytes(saved) if spec.get("layout") else
                          os.path.getsize(_flax_file(spec["dir"])))
  return {**result, **_state_facts(state)}


def _saved_bytes(checkpoint: str) -> int:
  """Bytes of one checkpoint: its `.flax`, or its Orbax step directory."""
  if os.path.exists(checkpoint + ".flax"):
    return os.path.getsize(checkpoint + ".flax")
  number = checkpoint.rsplit("-", 1)[1]
  step = os.path.join(os.path.dirname(checkpoint), number)
  return sum(os.path.getsize(p) for p in _files_under(step))


def _worker_read(spec: dict) -> dict:
  """restore(template) or load_state_dict(d), then touch, warm or cold."""
  sys.path.insert(0, BENCH_DIR)
  from _touch import touch, tree_leaves  # pylint: disable=g-import-not-at-top
  module = importlib.import_module(spec["module"])
  files = _files_under(spec["dir"])
  if spec["kind"] == "restore":
    import jax  # pylint: disable=g-import-not-at-top
    template = build_state(spec["size_gib"])
    ckpt = module.Checkpoint(spec["dir"])
    call = lambda: ckpt.restore(template)
    leaves_of = jax.tree_util.tree_leaves
  else:
    call = lambda: module.load_state_dict(spec["dir"])
    leaves_of = tree_leaves
  if spec["cold"]:
    resident = drop_page_cache(files)
  else:
    resident = warm_page_cache(files)

  def call_and_touch():
    restored = call()
    t_called = time.monotonic()
    return restored, t_called, touch(leaves_of(restored))

  (restored, t_called, digest), result = _timed(call_and_touch)
  t_again = time.monotonic()
  touch(leaves_of(restored))
  result.update(call_s=t_called - result["t0"],
                touch_again_s=time.monotonic() - t_again,
                digest=f"{digest:016x}", resident_before=resident)
  return result


def _worker_prepare(spec: dict) -> dict:
  module = importlib.import_module(spec["module"])
  state = build_state(spec["size_gib"])
  module.Checkpoint(spec["dir"]).save(state)
  os.sync()
  return _state_facts(state)


_WORKERS = {"save": _worker_save, "dd": _worker_save, "restore": _worker_read,
            "load": _worker_read, "prepare": _worker_prepare}


def run_worker(spec: dict) -> None:
  result = _WORKERS[spec["kind"]](spec)
  print(RESULT_TAG + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------
# Parent side.


class _RssSampler(threading.Thread):
  """Samples another process's VmRSS/RssAnon/RssFile until it exits."""

  def __init__(self, pid: int):
    super().__init__(daemon=True)
    self._pid = str(pid)
    self._done = threading.Event()
    self.samples = []  # (monotonic time, rss, anon, file)

  def run(self):
    while not self._done.is_set():
      try:
        fields = _read_status(self._pid)
      except OSError:
        return
      if "VmRSS" in fields:
        self.samples.append((time.monotonic(), fields["VmRSS"],
                             fields.get("RssAnon", 0), fields.get("RssFile", 0)))
      self._done.wait(SAMPLE_INTERVAL_S)

  def stop(self):
    self._done.set()
    self.join()

  def peaks(self, t0: float, t1: float) -> Optional[tuple[int, int, int]]:
    window = [s[1:] for s in self.samples if t0 <= s[0] <= t1]
    if not window:
      return None
    return tuple(max(column) for column in zip(*window))


def _env() -> dict:
  env = dict(os.environ)
  env.setdefault("JAX_PLATFORMS", "cpu")
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  return env


def _spawn_worker(spec: dict) -> dict:
  """Runs one worker, returns its result with the sampled memory peaks."""
  command = [sys.executable, os.path.abspath(__file__), "--worker",
             json.dumps(spec)]
  with subprocess.Popen(command, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True, env=_env()) as proc:
    sampler = _RssSampler(proc.pid)
    sampler.start()
    try:
      out, err = proc.communicate(timeout=WORKER_TIMEOUT_S)
    finally:
      sampler.stop()
  lines = [l for l in out.splitlines() if l.startswith(RESULT_TAG)]
  if proc.returncode or not lines:
    tail = "\n".join(err.strip().splitlines()[-15:])
    raise RuntimeError(f"worker {spec['kind']} ({spec['module']}) failed "
                       f"with exit code {proc.returncode}:\n{tail}")
  result = json.loads(lines[-1][len(RESULT_TAG):])
  if "t0" in result:
    result["sampled_peaks"] = sampler.peaks(result["t0"], result["t1"])
  if "first" in result:
    result["first_peaks"] = sampler.peaks(result["first"]["t0"],
                                          result["first"]["t1"])
  return result


def _memory_metrics(result: dict, state_bytes: int) -> dict:
  metrics = {}
  if result.get("hwm") is not None:
    metrics["extra_rss_x"] = (result["hwm"] - result["base_rss"]) / state_bytes
  peaks = result.get("sampled_peaks")
  if peaks and result.get("base_anon") is not None:
    metrics["extra_anon_x"] = (peaks[1] - result["base_anon"]) / state_bytes
    metrics["peak_file_gib"] = peaks[2] / GIB
  return metrics


class Bench:
  """Runs the selected measurements and keeps their per-run metrics."""

  def __init__(self, args: argparse.Namespace, root: str):
    self.args = args
    self.root = root
    self.libs = _libs(args.candidate_module)
    self.src = os.path.join(root, "restore_src")
    self.facts = {}
    self.disk = {}
    self.dd_writes = []
    self.runs = {}    # measurement -> lib name -> [metrics]
    self.errors = {}  # measurement -> lib name -> message

  def _spec(self, kind: str, lib: Lib, directory: str, cold=False) -> dict:
    return {"kind": kind, "module": lib.module, "dir": directory,
            "size_gib": self.args.size_gib, "cold": cold,
            "layout": lib.layout}

  def measure(self, name: str, one_run: Callable[[Lib, int], dict],
              before_run: Optional[Callable[[], Any]] = None,
              libs: Optional[Sequence[Lib]] = None) -> None:
    """Alternates the libraries run by run; a failing side is recorded."""
    print(f"[bench] {name}", end="", file=sys.stderr, flush=True)
    for run in range(self.args.runs):
      if before_run:
        before_run()
      for lib in libs or self.libs:
        if lib.name in self.errors.get(name, {}):
          continue
        try:
          metrics = one_run(lib, run)
        except Exception as e:  # pylint: disable=broad-except
          self.errors.setdefault(name, {})[lib.name] = str(e)
          print(f"\n[bench] {name}/{lib.name} failed: {e}", file=sys.stderr)
          continue
        self.runs.setdefault(name, {}).setdefault(lib.name, []).append(metrics)
        print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)

  def save_run(self, lib: Lib, run: int) -> dict:
    directory = os.path.join(self.root, f"save-{lib.name}-{run}")
    try:
      result = _spawn_worker(self._spec("save", lib, directory))
    finally:
      if run < self.args.runs - 1:
        shutil.rmtree(directory, ignore_errors=True)
    self.facts.setdefault("state_bytes", result["state_bytes"])
    self.facts.setdefault("leaves", result["leaves"])
    seconds = result["t1"] - result["t0"]
    return {"time_s": seconds, "mb_s": result["file_bytes"] / seconds / MB,
            "durable_s": seconds + result["sync_s"],
            "file_bytes": result["file_bytes"],
            **_memory_metrics(result, result["state_bytes"])}

  def save_layout_run(self, lib: Lib, run: int) -> dict:
    """One worker of `save_orbax`: two saves, both timed."""
    directory = os.path.join(self.root, f"save-{lib.layout}-{run}")
    try:
      spec = dict(self._spec("save", lib, directory), saves=2)
      result = _spawn_worker(spec)
    finally:
      shutil.rmtree(directory, ignore_errors=True)
    state_bytes = result["state_bytes"]
    first = result["first"]
    first_s = first["t1"] - first["t0"]
    seconds = result["t1"] - result["t0"]
    first_memory = _memory_metrics(
        {**first, "sampled_peaks": result.get("first_peaks")}, state_bytes)
    return {"time_s": seconds, "first_time_s": first_s,
            "mb_s": result["file_bytes"] / seconds / MB,
            "durable_s": seconds + result["sync_s"],
            "file_bytes": result["file_bytes"],
            **_memory_metrics(result, state_bytes),
            **{f"first_{k}": v for k, v in first_memory.items()}}

  def compare_saved_files(self) -> Optional[bool]:
    """Compares the last saves; clu's becomes the restore source."""
    last = self.args.runs - 1
    cand, ref = (os.path.join(self.root, f"save-{lib.name}-{last}")
                 for lib in self.libs)
    try:
      same = _same_bytes(_flax_file(cand), _flax_file(ref))
      os.rename(ref, self.src)
    except (RuntimeError, OSError):
      same = None
    shutil.rmtree(cand, ignore_errors=True)
    shutil.rmtree(ref, ignore_errors=True)
    return same

  def prepare_source(self) -> None:
    if os.path.isdir(self.src):
      return
    print("[bench] writing the restore source with clu", file=sys.stderr)
    facts = _spawn_worker(self._spec("prepare", self.libs[1], self.src))
    self.facts.update(facts)

  def read_run(self, kind: str, cold: bool, lib: Lib, run: int) -> dict:
    del run
    result = _spawn_worker(self._spec(kind, lib, self.src, cold))
    resident = result["resident_before"]
    as_asked = resident <= 0.01 if cold else resident >= 0.99
    if not as_asked:
      raise RuntimeError(f"{resident:.0%} of the checkpoint was in the page "
                         f"cache before a {'cold' if cold else 'warm'} run")
    return {"time_s": result["t1"] - result["t0"], "call_s": result["call_s"],
            "touch_again_s": result["touch_again_s"],
            "digest": result["digest"],
            "resident_before": resident,
            **_memory_metrics(result, self.facts["state_bytes"])}

  def e2e_run(self, touch: bool, lib: Lib, run: int) -> dict:
    del run
    code = _BLOCK_TENSORFLOW if lib.block_tf else "import sys\n"
    code += f"{lib.e2e_import}\nd = load_state_dict({self.src!r})\n"
    if touch:
      code += (f"sys.path.insert(0, {BENCH_DIR!r})\n"
               "from _touch import touch, tree_leaves\n"
               "print(f'{touch(tree_leaves(d)):016x}')\n")
    if lib.block_tf:
      code += "assert 'tensorflow' not in sys.modules\n"
    warm_page_cache(_files_under(self.src))
    return _time_process([sys.executable, "-c", code])

  def _dd_write(self) -> None:
    directory = os.path.join(self.root, "dd")
    try:
      result = _spawn_worker(self._spec("dd", self.libs[0], directory))
    finally:
      shutil.rmtree(directory, ignore_errors=True)
    self.dd_writes.append(result["dd_mb_s"])

  def run_all(self, selected: Sequence[str]) -> None:
    """The disk's figures, then each selected measurement in turn."""
    self.facts["load_average_start"] = os.getloadavg()[0]
    print("[bench] dd", file=sys.stderr)
    self.disk = dd_reads(self.root, self.args.runs)
    cold_ok = "cold_read_mb_s" in self.disk
    if "save" in selected:
      # dd runs beside the saves, in a worker set up like theirs, so that
      # both see the same conditions (see README: freshly freed memory).
      self.measure("save", self.save_run, before_run=self._dd_write)
      self.facts["saved_files_identical"] = self.compare_saved_files()
    else:
      for _ in range(self.args.runs):
        self._dd_write()
    self.disk["dd_write_fdatasync_mb_s"] = statistics.median(self.dd_writes)
    self.disk["dd_write_fdatasync_runs_mb_s"] = self.dd_writes
    if any(m not in ("save", "save_orbax") for m in selected):
      self.prepare_source()
      if cold_ok and any(m.endswith("_cold") for m in selected):
        print("[bench] cold reads of the source .flax", file=sys.stderr)
        self.disk.update(file_reads(_flax_file(self.src), self.args.runs))
    for kind in ("restore", "load"):
      for cold in (False, True):
        name = kind + ("_cold" if cold else "")
        if name in selected and (cold_ok or not cold):
          self.measure(name, lambda lib, run, k=kind, c=cold:
                       self.read_run(k, c, lib, run))
    for name, touch in (("e2e", False), ("e2e_touch", True)):
      if name in selected:
        self.measure(name, lambda lib, run, t=touch: self.e2e_run(t, lib, run))
    if "save_orbax" in selected:
      self.measure("save_orbax", self.save_layout_run, libs=LAYOUT_LIBS)
    self.facts["load_average_end"] = os.getloadavg()[0]


def _time_process(command: list[str]) -> dict:
  """Wall time and peak RSS (wait4 rusage) of a whole child process."""
  with tempfile.TemporaryFile() as err:
    t0 = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err,
                            env=_env())
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.monotonic() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    out = proc.stdout.read().decode()
    proc.stdout.close()
    if proc.returncode:
      err.seek(0)
      tail = b"\n".join(err.read().strip().splitlines()[-15:]).decode()
      raise RuntimeError(f"exit code {proc.returncode}:\n{tail}")
  metrics = {"time_s": seconds, "peak_rss_gib": usage.ru_maxrss * 1024 / GIB}
  if out.strip():
    metrics["digest"] = out.strip()
  return metrics


def _same_bytes(a: str, b: str) -> bool:
  if os.path.getsize(a) != os.path.getsize(b):
    return False
  with open(a, "rb") as fa, open(b, "rb") as fb:
    while True:
      chunk = fa.read(16 << 20)
      if chunk != fb.read(16 << 20):
        return False
      if not chunk:
        return True


# ----------------------------------------------------------------------------
# The disk's own figures.


def _dd(*operands: str) -> float:
  """Runs dd, returns MB/s (10^6 bytes/s) computed from its byte/second line."""
  done = subprocess.run(["dd", *operands], capture_output=True, text=True,
                        check=True)
  for line in done.stderr.splitlines():
    if " copied, " in line:
      nbytes = int(line.split()[0])
      seconds = float(line.split(" copied, ")[1].split()[0])
      return nbytes / seconds / MB
  raise RuntimeError(f"unexpected dd output: {done.stderr!r}")


def dd_write(directory: str) -> float:
  """`dd if=/dev/zero of=<dir>/ddtest bs=1M count=1024 conv=fdatasync`."""
  path = os.path.join(directory, "ddtest")
  try:
    return _dd("if=/dev/zero", f"of={path}", "bs=1M", "count=1024",
               "conv=fdatasync")
  finally:
    with contextlib.suppress(OSError):
      os.remove(path)


def dd_reads(directory: str, runs: int) -> dict:
  """Page-cache read (after a warm read), cold read where evictable, and dd
  write + fdatasync run back to back (each right after the previous one)."""
  path = os.path.join(directory, "ddtest")
  cached, cold, direct, back_to_back = [], [], [], []
  try:
    _dd("if=/dev/zero", f"of={path}", "bs=1M", "count=1024", "conv=fdatasync")
    for _ in range(runs):
      back_to_back.append(_dd("if=/dev/zero", f"of={path}", "bs=1M",
                              "count=1024", "conv=fdatasync"))
      _dd(f"if={path}", "of=/dev/null", "bs=1M")
      cached.append(_dd(f"if={path}", "of=/dev/null", "bs=1M"))
      if drop_page_cache([path]) <= 0.01:
        cold.append(_dd(f"if={path}", "of=/dev/null", "bs=1M"))
      direct += _direct_read(path)
  finally:
    with contextlib.suppress(OSError):
      os.remove(path)
  figures = {"page_cache_read_mb_s": statistics.median(cached),
             "dd_write_back_to_back_mb_s": statistics.median(back_to_back)}
  if len(cold) == runs:
    figures["cold_read_mb_s"] = statistics.median(cold)
  if direct:
    figures["direct_read_mb_s"] = statistics.median(direct)
  return figures


def _direct_read(path: str) -> list[float]:
  """`dd if=<path> of=/dev/null bs=16M iflag=direct` ([] where refused)."""
  try:
    return [_dd(f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct")]
  except subprocess.CalledProcessError:
    return []  # no O_DIRECT here (tmpfs)


def file_reads(path: str, runs: int) -> dict:
  """Cold sequential reads of `path` itself: dd through the page cache after
  evicting it, and dd with O_DIRECT (the disk, no page cache)."""
  cold, direct = [], []
  for _ in range(runs):
    if drop_page_cache([path]) <= 0.01:
      cold.append(_dd(f"if={path}", "of=/dev/null", "bs=1M"))
    direct += _direct_read(path)
  figures = {}
  if len(cold) == runs:
    figures["source_cold_read_mb_s"] = statistics.median(cold)
  if direct:
    figures["source_direct_read_mb_s"] = statistics.median(direct)
  return figures


_SEQ_READS = ("cold_read_mb_s", "direct_read_mb_s", "source_cold_read_mb_s",
              "source_direct_read_mb_s")


def best_sequential_read(disk: dict) -> Optional[float]:
  """The best of the disk's cold sequential read figures (MB/s), if any."""
  figures = [disk[k] for k in _SEQ_READS if k in disk]
  return max(figures) if figures else None


def filesystem_type(path: str) -> str:
  """The type of the file system holding `path`, from /proc/mounts."""
  path = os.path.realpath(path)
  best, fstype = "", "unknown"
  with open("/proc/mounts") as f:
    for line in f:
      _, mount_point, kind = line.split()[:3]
      inside = path == mount_point or path.startswith(
          mount_point.rstrip("/") + "/")
      if inside and len(mount_point) > len(best):
        best, fstype = mount_point, kind
  return fstype


def _default_parent() -> str:
  for candidate in (tempfile.gettempdir(), "/var/tmp", os.getcwd()):
    if (os.path.isdir(candidate)
        and filesystem_type(candidate) not in ("tmpfs", "ramfs")):
      return candidate
  raise SystemExit("no disk-backed directory found: pass --dir")


# ----------------------------------------------------------------------------
# Report.


_TITLES = {
    "save": "`Checkpoint.save(state)`",
    "restore": "`Checkpoint.restore(template)` + touch, warm",
    "restore_cold": "`Checkpoint.restore(template)` + touch, cold",
    "load": "`load_state_dict(d)` + touch, warm",
    "load_cold": "`load_state_dict(d)` + touch, cold",
    "e2e": "process: `python -c` import + `load_state_dict(d)`",
    "e2e_touch": "process: `python -c` import + `load_state_dict(d)` + touch",
    "save_orbax": "`Checkpoint(d, layout=\"orbax\").save(state)` vs the CLU "
                  "layout's",
}
_SPEED_TARGETS = {"save": 3, "restore": 5, "restore_cold": 5, "load": 5,
                  "load_cold": 5, "e2e": 10}
_SAVE_MEMORY_TARGET = 0.1
_SAVE_DD_SHARE_TARGET = 0.7
_COLD_READ_SHARE_TARGET = 0.8


def _medians(runs: list[dict]) -> dict:
  keys = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
  return {k: statistics.median(r[k] for r in runs if k in r) for k in keys}


def _row(figure: str, cand: str, ref: str, ratio: str = "", target: str = "",
         ok: Optional[bool] = None) -> list[str]:
  met = "" if ok is None else ("yes" if ok else "**no**")
  return [figure, cand, ref, ratio, target, met]


def _times(ratio: float) -> str:
  return f"{ratio:.2f}x" if ratio < 10 else f"{ratio:.0f}x"


def _speed_rows(name: str, cand: dict, ref: dict, state_bytes: int,
                disk: dict) -> list[list[str]]:
  speedup = ref["time_s"] / cand["time_s"]
  goal = _SPEED_TARGETS.get(name)
  rows = [_row("time", f"{cand['time_s']:.3f} s", f"{ref['time_s']:.3f} s",
               _times(speedup), f">= {goal}x" if goal else "",
               speedup >= goal if goal else None)]
  if "call_s" in cand:
    rows.append(_row("throughput (state bytes / time)",
                     f"{state_bytes / cand['time_s'] / MB:.0f} MB/s",
                     f"{state_bytes / ref['time_s'] / MB:.0f} MB/s"))
    best = best_sequential_read(disk)
    if name.endswith("_cold") and best:
      share = state_bytes / cand["time_s"] / MB / best
      rows.append(_row(
          f"share of the disk's best sequential read ({best:.0f} MB/s)",
          f"{share:.0%}", f"{state_bytes / ref['time_s'] / MB / best:.0%}",
          "", f">= {_COLD_READ_SHARE_TARGET:.0%}",
          share >= _COLD_READ_SHARE_TARGET))
    rows.append(_row("of which the call", f"{cand['call_s']:.3f} s",
                     f"{ref['call_s']:.3f} s",
                     _times(ref["call_s"] / cand["call_s"])))
    if name.endswith("_cold") and best:
      # The call is what reads the file; the touch after it is a pass over
      # the data in memory (its cost shows as "touch alone" warm).
      share = state_bytes / cand["call_s"] / MB / best
      rows.append(_row(
          "the call alone (the read): share of the best sequential read",
          f"{share:.0%}", f"{state_bytes / ref['call_s'] / MB / best:.0%}",
          "", f">= {_COLD_READ_SHARE_TARGET:.0%}",
          share >= _COLD_READ_SHARE_TARGET))
  if "touch_again_s" in cand and name == "restore":
    rows.append(_row("touch alone, 2nd pass (data in RAM)",
                     f"{cand['touch_again_s']:.3f} s",
                     f"{ref['touch_again_s']:.3f} s"))
  return rows


def _save_rows(cand: dict, ref: dict, disk: dict) -> list[list[str]]:
  dd = disk["dd_write_fdatasync_mb_s"]
  share = cand["mb_s"] / dd
  return [
      _row("throughput (share of dd)",
           f"{cand['mb_s']:.0f} MB/s ({share:.0%})",
           f"{ref['mb_s']:.0f} MB/s ({ref['mb_s'] / dd:.0%})", "",
           f">= {_SAVE_DD_SHARE_TARGET:.0%} of dd",
           share >= _SAVE_DD_SHARE_TARGET),
      _row("save, then `os.sync()`", f"{cand['durable_s']:.3f} s",
           f"{ref['durable_s']:.3f} s",
           _times(ref["durable_s"] / cand["durable_s"])),
  ]


def _memory_rows(name: str, cand: dict, ref: dict) -> list[list[str]]:
  rows = []
  for key, what in (("extra_rss_x", "extra peak RSS (VmHWM), x state"),
                    ("extra_anon_x", "extra peak RssAnon (sampled), x state")):
    # The save target is judged on VmHWM, the exact and stricter figure.
    goal = _SAVE_MEMORY_TARGET if (name, key) == ("save", "extra_rss_x") else None
    if key in cand and key in ref:
      rows.append(_row(what, f"{cand[key]:.2f}", f"{ref[key]:.2f}", "",
                       f"<= {goal}" if goal else "",
                       cand[key] <= goal if goal else None))
  if "peak_rss_gib" in cand:
    rows.append(_row("peak RSS of the process", f"{cand['peak_rss_gib']:.2f} GiB",
                     f"{ref['peak_rss_gib']:.2f} GiB"))
  return rows


def _table(bench: "Bench") -> list[list[str]]:
  cand_name, ref_name = (lib.name for lib in bench.libs)
  table = [["measurement", "figure", cand_name, ref_name,
            f"{ref_name} / {cand_name}", "target", "met"]]
  for name in MEASUREMENTS:
    if name == "save_orbax":
      continue  # its own table (`_layout_table`)
    per_lib = bench.runs.get(name, {})
    errors = bench.errors.get(name, {})
    if errors or len(per_lib) == 1:
      rows = [_row("FAILED", errors.get(cand_name, "ok")[:80],
                   errors.get(ref_name, "ok")[:80])]
    elif not per_lib:
      continue
    else:
      cand, ref = _medians(per_lib[cand_name]), _medians(per_lib[ref_name])
      rows = _speed_rows(name, cand, ref, bench.facts["state_bytes"],
                         bench.disk)
      if name == "save":
        rows += _save_rows(cand, ref, bench.disk)
      rows += _memory_rows(name, cand, ref)
    for i, row in enumerate(rows):
      table.append([_TITLES[name] if i == 0 else ""] + row)
  return table


def _layout_table(bench: "Bench") -> list[list[str]]:
  """`save_orbax`: the Orbax layout against the CLU layout, both clu_ckpt."""
  per_lib = bench.runs.get("save_orbax", {})
  errors = bench.errors.get("save_orbax", {})
  orbax_name, clu_name = (lib.name for lib in LAYOUT_LIBS)
  table = [["figure", orbax_name, clu_name, f"{clu_name} / {orbax_name}",
            "target", "met"]]
  if errors or len(per_lib) != 2:
    return table + [["FAILED", errors.get(orbax_name, "ok")[:80],
                     errors.get(clu_name, "ok")[:80], "", "", ""]]
  cand, ref = _medians(per_lib[orbax_name]), _medians(per_lib[clu_name])
  dd = bench.disk.get("dd_write_fdatasync_mb_s")
  rows = []
  for key, what in (("time_s", "steady save (2nd in the process)"),
                    ("first_time_s", "first save in a fresh process"),
                    ("durable_s", "steady save, then `os.sync()`")):
    ratio = ref[key] / cand[key]
    rows.append([what, f"{cand[key]:.3f} s", f"{ref[key]:.3f} s",
                 _times(ratio), ">= 1.00x" if key == "time_s" else "",
                 ("yes" if ratio >= 1 else "**no**") if key == "time_s"
                 else ""])
  if dd:
    rows.append(["throughput (share of dd)",
                 f"{cand['mb_s']:.0f} MB/s ({cand['mb_s'] / dd:.0%})",
                 f"{ref['mb_s']:.0f} MB/s ({ref['mb_s'] / dd:.0%})", "", "",
                 ""])
  rows.append(["bytes written", f"{cand['file_bytes'] / MB:.1f} MB",
               f"{ref['file_bytes'] / MB:.1f} MB", "", "", ""])
  for key, what in (("extra_anon_x", "extra peak RssAnon, steady, x state"),
                    ("first_extra_anon_x",
                     "extra peak RssAnon, first save, x state"),
                    ("extra_rss_x", "extra peak RSS (VmHWM), steady, x state")):
    if key in cand and key in ref:
      ok = cand[key] <= max(ref[key], 0) + 0.02
      target = "<= CLU layout" if key == "extra_anon_x" else ""
      rows.append([what, f"{cand[key]:.3f}", f"{ref[key]:.3f}", "", target,
                   ("yes" if ok else "**no**") if target else ""])
  return table + rows


def _markdown(table: list[list[str]]) -> list[str]:
  cells = [[c.replace("|", "\\|").replace("\n", " ") for c in row]
           for row in table]
  lines = ["| " + " | ".join(cells[0]) + " |",
           "|" + "---|" * len(cells[0])]
  lines += ["| " + " | ".join(row) + " |" for row in cells[1:]]
  return lines


def _disk_line(disk: dict) -> str:
  runs = disk["dd_write_fdatasync_runs_mb_s"]
  line = (f"Disk: dd write + fdatasync **{disk['dd_write_fdatasync_mb_s']:.0f} "
          f"MB/s** (in a worker set up like a save worker; runs "
          f"{min(runs):.0f} to {max(runs):.0f}), "
          f"{disk['dd_write_back_to_back_mb_s']:.0f} MB/s back to back; "
          f"page-cache read {disk['page_cache_read_mb_s']:.0f} MB/s; ")
  if "cold_read_mb_s" in disk:
    line += f"cold read {disk['cold_read_mb_s']:.0f} MB/s"
    reads = [f"{what} {disk[key]:.0f} MB/s" for key, what in (
        ("direct_read_mb_s", "O_DIRECT read"),
        ("source_cold_read_mb_s", "cold read of the restored .flax"),
        ("source_direct_read_mb_s", "its O_DIRECT read")) if key in disk]
    line += "".join(f", {r}" for r in reads)
    line += (f"; best sequential read **{best_sequential_read(disk):.0f} "
             "MB/s**.")
  else:
    line += "cold read: the page cache could not be dropped, no cold figures."
  return line + " (MB = 10^6 bytes.)"


def _checks(bench: "Bench") -> list[str]:
  notes = []
  same = bench.facts.get("saved_files_identical")
  if same is not None:
    notes.append("- Saved .flax files byte-identical across libraries: "
                  + ("yes" if same else "**NO**"))
  for name, per_lib in bench.runs.items():
    digests = {r["digest"] for runs in per_lib.values() for r in runs
               if "digest" in r}
    if digests:
      notes.append(f"- {_TITLES[name]}: touch digests agree across libraries "
                   "and runs: " + ("yes" if len(digests) == 1 else "**NO**"))
  return notes


def report(bench: "Bench", fstype: str) -> str:
  """The markdown report: setting, disk figures, one table, sanity checks."""
  facts = bench.facts
  lines = [
      f"## clu_ckpt vs clu.checkpoint: {facts.get('state_bytes', 0) / GIB:.2f}"
      f" GiB train state, {facts.get('leaves', '?')} leaves",
      "",
      f"Median of {bench.args.runs} fresh processes per figure; directory "
      f"`{bench.root}` ({fstype}); clu_ckpt side: `{bench.libs[0].module}`; "
      f"{os.cpu_count()} CPUs, 1-minute load average "
      f"{facts.get('load_average_start', 0):.1f} at the start, "
      f"{facts.get('load_average_end', 0):.1f} at the end.",
      "",
      _disk_line(bench.disk),
      "",
      *(_markdown(_table(bench)) if any(
          m != "save_orbax" for m in bench.runs) else []),
      "",
      *_checks(bench),
  ]
  if "save_orbax" in bench.runs or "save_orbax" in bench.errors:
    lines += ["", "### clu_ckpt's Orbax layout vs its CLU layout "
              "(`save_orbax`)", "", *_markdown(_layout_table(bench))]
  return "\n".join(lines)

# ----------------------------------------------------------------------------
# Command line.


def _parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--size-gib", type=float, default=1.0,
                      help="size of the train state (default 1.0)")
  parser.add_argument("--runs", type=int, default=3,
                      help="fresh processes per figure; the median is shown")
  parser.add_argument("--dir", help="working directory on the disk to test "
                      "(default: a new directory under a non-tmpfs temp dir)")
  parser.add_argument("--only", default=",".join(DEFAULT),
                      help="comma-separated subset of: "
                      + ", ".join(MEASUREMENTS) + " (default: all but e2e_touch)")
  parser.add_argument("--json", help="also write all runs to this JSON file")
  parser.add_argument("--candidate-module", default="clu_ckpt.checkpoint",
                      help="module measured as clu_ckpt (debugging only)")
  parser.add_argument("--keep", action="store_true",
                      help="keep the working directory")
  parser.add_argument("--from-json", metavar="PATH",
                      help="print the report of an earlier --json file; "
                      "measure nothing")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  unknown = set(args.only.split(",")) - set(MEASUREMENTS)
  if unknown:
    parser.error(f"unknown measurements in --only: {sorted(unknown)}")
  if args.runs < 1:
    parser.error("--runs must be at least 1")
  return args


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = _parse_args(argv)
  if args.worker:
    run_worker(json.loads(args.worker))
    return 0
  if args.from_json:
    print(_report_from_json(args.from_json))
    return 0
  selected = [m for m in MEASUREMENTS if m in args.only.split(",")]
  parent = args.dir or _default_parent()
  os.makedirs(parent, exist_ok=True)
  fstype = filesystem_type(parent)
  if fstype in ("tmpfs", "ramfs"):
    print(f"[bench] warning: {parent} is {fstype}: the figures measure RAM",
          file=sys.stderr)
  root = tempfile.mkdtemp(prefix="clu_ckpt_bench-", dir=parent)
  try:
    bench = Bench(args, root)
    bench.run_all(selected)
    print(report(bench, fstype))
    if args.json:
      with open(args.json, "w") as f:
        json.dump({"config": {k: v for k, v in vars(args).items()
                              if k != "worker"},
                   "directory": root, "filesystem": fstype, "disk": bench.disk,
                   "facts": bench.facts, "runs": bench.runs,
                   "errors": bench.errors}, f, indent=2)
  finally:
    if not args.keep:
      shutil.rmtree(root, ignore_errors=True)
  return 1 if bench.errors else 0


def _report_from_json(path: str) -> str:
  with open(path) as f:
    saved = json.load(f)
  bench = Bench(argparse.Namespace(**saved["config"]), saved["directory"])
  bench.disk, bench.facts = saved["disk"], saved["facts"]
  bench.runs, bench.errors = saved["runs"], saved["errors"]
  return report(bench, saved["filesystem"])


if __name__ == "__main__":
  sys.exit(main())
