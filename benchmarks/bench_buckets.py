"""Benchmarks bucket reads and writes through a modelled link, against naive paths.

Synopsis::

  python benchmarks/bench_buckets.py --size-gib 0.47 --runs 3 --json out.json
  python benchmarks/bench_buckets.py --methods load,naive_load --runs 5
  python benchmarks/bench_buckets.py --from-json out.json   # report again

Everything runs against fake-gcs-server on 127.0.0.1 (`tests/emulators.py`;
`--backend memory` for its in-memory store, whose uploads are not serialised
by one lock as the file-system store's are), or with `--store s3` against
moto's S3 server (multipart uploads in parallel; but each ranged GET costs
moto a copy of the whole object, so ranged reads are the emulator's limit
there, and the migration writes to a local directory: Orbax restores no
`s3://` step), reached through
`tests/link_proxy.py`: a proxy on 127.0.0.1 that adds `--rtt-ms` of round
trip (30) and lets each connection carry at most `--mbps` MB/s (60) each way,
and counts the bytes and requests that cross it. A CLU checkpoint of about
`--size-gib` GiB (written as `bench_migration.py` writes it: float32 kernels
and bfloat16 moments of 64 MiB, a `step` first) is uploaded to the emulator
directly. Each measurement runs in a fresh process; per round:

- Any method takes a suffix `+plain` (through the unshaped proxy) or
  `+direct` (straight to the emulator: its own service time, apart from the
  client's and the link's), and `!base` (run with `--baseline DIR` on
  PYTHONPATH: the code before, side by side).
- `uplink@N`: as many bytes as the `.flax` sent as 8 MiB parts, N at a time
  (S3: one multipart upload; GCS: separate objects): what N connections
  carry upwards, the reference of the writes and of the migration.
- `link@N`: what N connections of the modelled link carry: the `.flax`
  downloaded by N ranged reads of 32 MiB always in flight (gcsfs
  `cat_file`), through the proxy; `ceiling@N` the same through an unshaped
  proxy (the proxy's own limit) and `direct@N` straight from the emulator
  (its own service time).
- `naive_load`: gcsfs `cat_file` of the whole `.flax` (one stream), then
  `flax.serialization.msgpack_restore`; `load`: `clu_ckpt.checkpoint.
  load_state_dict(url)` (`load@N`: with CLU_CKPT_BUCKET_STREAMS=N).
- `inspect`: `clu_ckpt.inspection.inspect_path(url)` (what `clu-ckpt inspect`
  prints); `step`: `load_state_dict(url, subtree="step")`; `kernel`: one
  64 MiB kernel, `subtree="params/layer_0000/kernel"`.
- `naive_put`: gcsfs `pipe_file` of as many bytes as the `.flax` (one
  stream); `save`: `clu_ckpt.checkpoint.Checkpoint(url).save(state)` of a
  state of that size (TensorFlow imported before the clock starts);
  `save_flax`: its `.flax` alone (`flax_format.save_file`); `join s`: the
  seconds the store took to join the parts (GCS compose, S3 complete: a
  metadata operation on a real bucket, a copy of every byte in the
  emulators).
- `naive_migrate`: `cat_file`, `msgpack_restore`, Orbax `CheckpointManager.
  save`; `migrate`: `clu_ckpt.migration.migrate(url, url2)` (`migrate@W`:
  with TensorStore's in-flight window W MiB).

Reported per method (medians): seconds, MB/s of the `.flax` (10^6 bytes/s),
that as a fraction of `link@N` for the N streams it used (the most
connections open at once at the proxy), bytes downloaded and requests made,
ratio to the naive path, and extra peak RssAnon as a fraction of the
checkpoint; with the machine's load average (`uptime`) at each measurement.
"""

import argparse
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import time
from typing import Optional

_HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(0, str(_HERE.parent / "tests"))

_MB = 1e6
_RANGE = 32 * 2**20
_DEFAULT_METHODS = ("link@1,link@8,ceiling@8,direct@8,naive_load,load,"
                    "inspect,step,kernel,naive_put,save,naive_migrate,migrate")


def _peak_sampler():
  import bench_migration  # pylint: disable=g-import-not-at-top
  return bench_migration._PeakSampler()  # pylint: disable=protected-access


def _rss_anon() -> int:
  import bench_migration  # pylint: disable=g-import-not-at-top
  return bench_migration._rss_anon()  # pylint: disable=protected-access


class _Series:
  """RssAnon above `base` every `period` seconds, in a thread: [(s, MiB)]."""

  def __init__(self, base: int, period: float = 0.2):
    import threading  # pylint: disable=g-import-not-at-top
    self.base, self.period, self.points = base, period, []
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    start = time.perf_counter()
    while not self._stop.is_set():
      self.points.append((round(time.perf_counter() - start, 2),
                          round((_rss_anon() - self.base) / 2**20, 1)))
      # Woken at once by the stop: its join is not timed with the method.
      self._stop.wait(self.period)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()


# --------------------------------------------------------------------------
# Children: one measurement each, a JSON line on stdout.
# --------------------------------------------------------------------------


def _gcsfs(url: str = "gs://"):
  """The naive client of `url`'s store: gcsfs or s3fs, no caches."""
  if url.startswith("s3://"):
    import s3fs  # pylint: disable=g-import-not-at-top
    return s3fs.S3FileSystem(endpoint_url=os.environ["AWS_ENDPOINT_URL"],
                             skip_instance_cache=True,
                             use_listings_cache=False)
  import gcsfs  # pylint: disable=g-import-not-at-top
  return gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True,
                             use_listings_cache=False)


def _key(url: str) -> str:
  """`bucket/key` of a bucket URL."""
  return url.split("://", 1)[1]


def _child_link(src: str, dst: str, n: str = "1") -> dict:
  """The `.flax` by N ranged reads always in flight, discarded."""
  del dst
  import concurrent.futures  # pylint: disable=g-import-not-at-top
  fs = _gcsfs(src)
  key = _key(src) + "/ckpt-1.flax"
  size = fs.info(key)["size"]
  starts = list(range(0, size, _RANGE))
  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(int(n)) as pool:
    for data in pool.map(
        lambda s: len(fs.cat_file(key, start=s, end=min(s + _RANGE, size))),
        starts):
      pass
  return {"seconds": time.perf_counter() - start, "bytes": size}


def _warm(url: str) -> None:
  """Imports the bucket client before the clock starts (as naive's does)."""
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  storage.filesystem(url).fs  # pylint: disable=expression-not-assigned


def _child_naive_load(src: str, dst: str) -> dict:
  del dst
  from flax import serialization  # pylint: disable=g-import-not-at-top
  fs = _gcsfs(src)
  base = _rss_anon()
  start = time.perf_counter()
  with _peak_sampler() as peak:
    data = fs.cat_file(_key(src) + "/ckpt-1.flax")
    state = serialization.msgpack_restore(data)
    del data, state
  return {"seconds": time.perf_counter() - start,
          "extra_rss": peak.peak - base}


def _child_load(src: str, dst: str, n: str = "") -> dict:
  del dst
  if n:
    os.environ["CLU_CKPT_BUCKET_STREAMS"] = n
  from clu_ckpt import checkpoint  # pylint: disable=g-import-not-at-top
  base = _rss_anon()
  _warm(src)
  start = time.perf_counter()
  with _peak_sampler() as peak:
    state = checkpoint.load_state_dict(src)
    del state
  return {"seconds": time.perf_counter() - start,
          "extra_rss": peak.peak - base}


def _child_inspect(src: str, dst: str) -> dict:
  del dst
  from clu_ckpt import inspection  # pylint: disable=g-import-not-at-top
  _warm(src)
  start = time.perf_counter()
  text = inspection.format_inspect(inspection.inspect_path(src))
  assert "layer_0000" in text or "ckpt-1" in text, text
  return {"seconds": time.perf_counter() - start}


def _child_subtree(src: str, subtree: str) -> dict:
  from clu_ckpt import checkpoint  # pylint: disable=g-import-not-at-top
  _warm(src)
  start = time.perf_counter()
  value = checkpoint.load_state_dict(src, subtree=subtree)
  del value
  return {"seconds": time.perf_counter() - start}


def _child_step(src: str, dst: str) -> dict:
  del dst
  return _child_subtree(src, "step")


def _child_kernel(src: str, dst: str) -> dict:
  del dst
  return _child_subtree(src, "params/layer_0000/kernel")


def _state_like(src: str) -> dict:
  """A state of as many bytes as the source's `.flax` (random float32s)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  size = _gcsfs(src).info(_key(src) + "/ckpt-1.flax")["size"]
  rng = np.random.default_rng(0)
  n = 16 * 2**20
  return {"step": 1, "params": {
      f"w{i:03d}": rng.standard_normal(min(n, (size - i * n * 4) // 4),
                                       dtype=np.float32)
      for i in range(-(-size // (n * 4)))}}


def _child_naive_put(src: str, dst: str) -> dict:
  from clu_ckpt import flax_format  # pylint: disable=g-import-not-at-top
  data = flax_format.save(_state_like(src))
  fs = _gcsfs(dst)
  start = time.perf_counter()
  fs.pipe_file(_key(dst) + "/blob", data)
  return {"seconds": time.perf_counter() - start}


def _child_uplink(src: str, dst: str, n: str = "1") -> dict:
  """As many bytes as the `.flax`, as parts of 8 MiB, N uploads at a time.

  What N connections carry upwards: on S3 the parts of one multipart
  upload, on GCS separate objects (as a composite upload's parts).
  """
  import concurrent.futures  # pylint: disable=g-import-not-at-top
  fs = _gcsfs(dst)
  size = fs.info(_key(src) + "/ckpt-1.flax")["size"]
  part = 8 * 2**20
  data = os.urandom(part)
  starts = list(range(0, size, part))
  bucket, key = (_key(dst) + "/blob").split("/", 1)
  start = time.perf_counter()
  if dst.startswith("s3://"):
    upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    uid = upload["UploadId"]

    def put(i):
      body = data[:min(part, size - starts[i])]
      return fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=uid,
                        PartNumber=i + 1, Body=body)["ETag"]
  else:
    def put(i):
      fs.pipe_file(f"{bucket}/{key}-{i:06d}",
                   data[:min(part, size - starts[i])])
  with concurrent.futures.ThreadPoolExecutor(int(n)) as pool:
    tags = list(pool.map(put, range(len(starts))))
  seconds = time.perf_counter() - start
  if dst.startswith("s3://"):
    fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key,
               UploadId=uid, MultipartUpload={"Parts": [
                   {"PartNumber": i + 1, "ETag": t}
                   for i, t in enumerate(tags)]})
  return {"seconds": seconds, "bytes": size}


def _timing_joins() -> list:
  """Seconds each upload's join (GCS compose, S3 complete) takes, appended.

  The store's own work of joining parts: on a real bucket a metadata
  operation; the emulators copy every byte (fake-gcs-server's compose,
  moto's complete), which is their service time, not the client's.
  """
  from clu_ckpt import bucket_upload  # pylint: disable=g-import-not-at-top
  seconds = []
  join = bucket_upload.PartsUpload._join  # pylint: disable=protected-access

  def timed(self):
    start = time.perf_counter()
    try:
      join(self)
    finally:
      seconds.append(time.perf_counter() - start)

  bucket_upload.PartsUpload._join = timed  # pylint: disable=protected-access
  return seconds


def _child_save(src: str, dst: str) -> dict:
  from clu_ckpt import checkpoint  # pylint: disable=g-import-not-at-top
  state = _state_like(src)
  base = _rss_anon()
  _warm(src)
  ckpt = checkpoint.Checkpoint(dst)
  ckpt.tf_checkpoint_manager  # pylint: disable=pointless-statement
  joins = _timing_joins()
  start = time.perf_counter()  # TensorFlow imported, the manager made
  with _peak_sampler() as peak:
    ckpt.save(state)
  return {"seconds": time.perf_counter() - start,
          "extra_rss": peak.peak - base, "join": sum(joins)}


def _child_save_flax(src: str, dst: str) -> dict:
  """The `.flax` part of a save alone: `flax_format.save_file`."""
  from clu_ckpt import flax_format  # pylint: disable=g-import-not-at-top
  state = _state_like(src)
  base = _rss_anon()
  _warm(src)
  joins = _timing_joins()
  start = time.perf_counter()
  with _peak_sampler() as peak:
    flax_format.save_file(state, dst + "/ckpt-1.flax")
  return {"seconds": time.perf_counter() - start,
          "extra_rss": peak.peak - base, "join": sum(joins)}


def _child_naive_migrate(src: str, dst: str) -> dict:
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from flax import serialization  # pylint: disable=g-import-not-at-top
  fs = _gcsfs(src)
  base = _rss_anon()
  start = time.perf_counter()
  with _peak_sampler() as peak:
    data = fs.cat_file(_key(src) + "/ckpt-1.flax")
    state = serialization.msgpack_restore(data)
    del data
    mngr = ocp.CheckpointManager(dst)
    mngr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
    mngr.wait_until_finished()
    mngr.close()
  return {"seconds": time.perf_counter() - start,
          "extra_rss": peak.peak - base}


def _child_migrate(src: str, dst: str, window_mib: str = "") -> dict:
  """`migration.migrate`; `migrate@W`: TensorStore's window W MiB.

  `migrate@W[xF][rN][sK][bM]`: `xF` also asks Orbax for OCDBT data files of F MiB
  (`orbax_target.REMOTE_DATA_FILE_BYTES`, passed as PyTreeSave's
  `ocdbt_target_data_file_size`; F = 0: Orbax's own default, 400 MiB on
  GCS), which lets TensorStore upload a flush as parallel files; `rN`
  read-ahead ranges of N MiB; `sK` K slices of a large array in flight,
  `bM` slices of M MiB (`orbax_target.SLICES_IN_FLIGHT`, `SLICE_BYTES`;
  b0: arrays handed to TensorStore whole, as before); `uN` N files
  uploaded at once from the staging directory (`staging.UPLOAD_STREAMS`);
  `e0`/`e1` a staged step's arrays not / all read ahead from the start
  (`orbax_target.STAGED_READ_AHEAD`); `aN` N read-ahead ranges in flight (`bucket_spool.READ_AHEAD_STREAMS`);
  `o0` / `o1` data files uploaded after the step is written / while it is
  (`staging.OVERLAP`);
  a final `d`: the direct write, not staged (`orbax_target.
  STAGE_BUCKET_STEPS = False`). A staged run reports its phases: `write_s`
  (download and local write), `upload_s` (the upload and commit) and
  `staged_mib` (the staging disk used).
  """
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  from clu_ckpt.migration import orbax_target  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint  # pylint: disable=g-import-not-at-top,unused-import
  knobs = re.fullmatch(
      r"(\d*)(?:x(\d+))?(?:r(\d+))?(?:s(\d+))?(?:b(\d+))?(?:u(\d+))?(?:o(\d))?(?:a(\d+))?(?:e(\d))?(d?)",
      window_mib)
  if knobs is None:
    raise ValueError(f"migrate@{window_mib}: expected W[xF][rN][sK][bM][uN][d]")
  (window_mib, file_mib, ahead, slices, slice_mib, uploads, overlap,
   ahead_streams, read_all, direct) = knobs.groups()
  from clu_ckpt.migration import staging  # pylint: disable=g-import-not-at-top
  if read_all:  # `e0`/`e1`: a staged step's arrays read ahead from the start
    orbax_target.STAGED_READ_AHEAD = read_all == "1"
  if ahead_streams:  # `aN`: N read-ahead ranges in flight (bucket_spool)
    from clu_ckpt import bucket_spool  # pylint: disable=g-import-not-at-top
    bucket_spool.READ_AHEAD_STREAMS = int(ahead_streams)
    orbax_target.STAGED_READ_AHEAD_STREAMS = int(ahead_streams)
  if uploads:
    staging.UPLOAD_STREAMS = int(uploads)
  if overlap:
    staging.OVERLAP = overlap == "1"
  if direct:
    orbax_target.STAGE_BUCKET_STEPS = False
  else:
    # Staged whatever the step's size (the default stages from ~1 GiB:
    # `orbax_target.STAGED_BYTES_PER_STREAM`), as the figures were taken.
    orbax_target.STAGED_BYTES_PER_STREAM = 0
  phases = {}
  upload_step = staging.upload_step

  def timed_upload(*args, **kwargs):
    # Called once Orbax has written the step (with OVERLAP, for what the
    # data files' uploads beside the writing did not send).
    phases["write_end"] = time.perf_counter()
    try:
      phases["staged_bytes"] = upload_step(*args, **kwargs)
    finally:
      phases["upload_end"] = time.perf_counter()
    return phases["staged_bytes"]

  staging.upload_step = timed_upload
  # The phases on this clock: the step's write starts (setup before it:
  # planning, the lock, the manifest), the source's last array arrives,
  # Orbax's local write ends (the uploader's finish starts), the staged
  # step's write returns (`step_end`: its staging area removed), the
  # manifest's record starts and ends.
  write_step = orbax_target.OrbaxTarget.write_step
  fetch_ahead = orbax_target._fetch_ahead  # pylint: disable=protected-access
  finish = staging.StepUploader.finish

  def timed_write_step(self, *args, **kwargs):
    phases.setdefault("step_start", time.perf_counter())
    return write_step(self, *args, **kwargs)

  def timed_fetch(value):
    fetch_ahead(value)
    phases["download_end"] = time.perf_counter()

  def timed_finish(self):
    phases["local_end"] = time.perf_counter()
    return finish(self)

  save_staged = orbax_target.OrbaxTarget._save_staged  # pylint: disable=protected-access
  from clu_ckpt.migration import destination  # pylint: disable=g-import-not-at-top
  record = destination.Manifest.record

  def timed_save_staged(self, *args, **kwargs):
    try:
      return save_staged(self, *args, **kwargs)
    finally:  # the staging area removed
      phases["step_end"] = time.perf_counter()

  def timed_record(self, *args, **kwargs):
    phases.setdefault("record_start", time.perf_counter())
    try:
      return record(self, *args, **kwargs)
    finally:
      phases["record_end"] = time.perf_counter()

  orbax_target.OrbaxTarget._save_staged = timed_save_staged  # pylint: disable=protected-access
  destination.Manifest.record = timed_record
  orbax_target.OrbaxTarget.write_step = timed_write_step
  orbax_target._fetch_ahead = timed_fetch  # pylint: disable=protected-access
  staging.StepUploader.finish = timed_finish
  if file_mib:
    orbax_target.REMOTE_DATA_FILE_BYTES = int(file_mib) * 2**20 or None
  if ahead:  # `rN`: the read-ahead's ranges of N MiB (bucket_spool)
    from clu_ckpt import bucket_spool  # pylint: disable=g-import-not-at-top
    bucket_spool.READ_AHEAD_CHUNK = int(ahead) * 2**20
  if slices:  # `sK`: K slices of a large array in flight at once
    orbax_target.SLICES_IN_FLIGHT = int(slices)
  if slice_mib:  # `bM`: slices of M MiB (0: arrays written whole)
    orbax_target.SLICE_BYTES = int(slice_mib) * 2**20
  inflight = int(window_mib) * 2**20 if window_mib else None
  base = _rss_anon()
  _warm(src)
  start = time.perf_counter()
  with _peak_sampler() as peak, _Series(base) as series:
    summary = migration.migrate(src, dst, inflight_bytes=inflight)
  failed = [str(r) for r in summary.failed]
  if failed:
    raise RuntimeError(f"migration failed: {failed}")
  result = {"seconds": time.perf_counter() - start,
            "extra_rss": peak.peak - base, "rss_series": series.points,
            "thread_cpu": _thread_cpu()}
  if "write_end" in phases:
    result.update(write_s=phases["write_end"] - start,
                  upload_s=phases["upload_end"] - phases["write_end"],
                  staged_mib=phases.get("staged_bytes", 0) / 2**20)
  # Seconds from the clock's start to each phase's end (see above).
  result["phases"] = {k: round(v - start, 3) for k, v in phases.items()
                      if k != "staged_bytes"}
  return result


def _thread_cpu() -> dict:
  """CPU seconds of this process' live threads by name (`comm`): where
  the cores went (TensorStore's pools name their threads; Python's are
  all `python`)."""
  out: dict = {}
  for task in os.listdir("/proc/self/task"):
    try:
      with open(f"/proc/self/task/{task}/stat") as f:
        text = f.read()
    except OSError:
      continue
    name = text[text.index("(") + 1:text.rindex(")")]
    fields = text.rsplit(")", 1)[1].split()
    seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    name = re.sub(r"[0-9]+$", "", name)
    out[name] = round(out.get(name, 0.0) + seconds, 2)
  return out


_CHILDREN = {"link": _child_link, "ceiling": _child_link,
             "direct": _child_link, "uplink": _child_uplink, "naive_load": _child_naive_load,
             "load": _child_load, "inspect": _child_inspect,
             "step": _child_step, "kernel": _child_kernel,
             "naive_put": _child_naive_put, "save": _child_save,
             "save_flax": _child_save_flax,
             "naive_migrate": _child_naive_migrate, "migrate": _child_migrate}


def _cpu_seconds(pid: Optional[int] = None) -> float:
  """User + system CPU seconds of process `pid` (None: this process,
  without its children)."""
  if pid is None:
    t = os.times()
    return t.user + t.system
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run_child(method: str, src: str, dst: str, env: dict) -> dict:
  out = subprocess.run(
      [sys.executable, __file__, "--child", method, "--src", src, "--dst",
       dst], env=env, capture_output=True, text=True, timeout=3600)
  if out.returncode != 0:
    raise RuntimeError(f"{method} failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------
# The run and the report.
# --------------------------------------------------------------------------


def _load_average() -> float:
  return os.getloadavg()[0]


def _emulator(args, work: pathlib.Path):
  import emulators  # pylint: disable=g-import-not-at-top
  if args.store == "s3":
    return emulators.MotoS3(work / "emulator")
  return emulators.FakeGcs(work / "emulator", backend=args.backend)


def _route(method: str) -> tuple[str, str]:
  """(method, proxy): "shaped", "plain" (unshaped) or "direct" (none).

  `ceiling@N` and `direct@N` are `link@N` through the plain proxy and
  straight to the emulator; any other method takes a suffix `+plain` or
  `+direct` for the same (the emulator's own service time).
  """
  name, _, route = method.partition("+")
  kind = name.split("@")[0]
  if kind == "ceiling":
    return "link" + name[len(kind):], "plain"
  if kind == "direct":
    return "link" + name[len(kind):], "direct"
  return name, route or "shaped"


class _Flow:
  """The proxy's byte counts every `period` seconds, in a thread."""

  def __init__(self, proxy, period: float = 0.25):
    import threading  # pylint: disable=g-import-not-at-top
    self.points, self._proxy, self._period = [], proxy, period
    self._stop = threading.Event()
    self._start = time.perf_counter()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _run(self):
    while not self._stop.wait(self._period):
      self.points.append([round(time.perf_counter() - self._start, 2),
                          round(self._proxy.down / 2**20, 1),
                          round(self._proxy.up / 2**20, 1)])

  def stop(self):
    self._stop.set()
    self._thread.join()


def _measure(args) -> dict:
  import bench_migration  # pylint: disable=g-import-not-at-top
  import emulators  # pylint: disable=g-import-not-at-top
  import link_proxy  # pylint: disable=g-import-not-at-top
  work = pathlib.Path(args.workdir)
  shutil.rmtree(work, ignore_errors=True)
  work.mkdir(parents=True)
  os.environ.update(emulators.ENV)
  store = _emulator(args, work)
  store.start()
  shaped = link_proxy.LinkProxy(store.port, rtt=args.rtt_ms / 1000,
                                rate=args.mbps * _MB).start()
  plain = link_proxy.LinkProxy(store.port).start()
  proxies = {"shaped": shaped, "plain": plain, "direct": None}
  try:
    direct_env = store.child_env()
    os.environ.update(direct_env)
    source = work / "source"
    if args.array_mib:
      bench_migration._ARRAY_BYTES = args.array_mib * 2**20  # pylint: disable=protected-access
    bench_migration._make_source(str(source), args.size_gib)  # pylint: disable=protected-access
    bucket = store.bucket()
    src = store.upload(source, "run", bucket=bucket)
    size = (source / "ckpt-1.flax").stat().st_size
    shutil.rmtree(source)

    def env_for(proxy):
      if proxy is None:
        return direct_env
      if args.store == "s3":
        return store.child_env(AWS_ENDPOINT_URL=proxy.url,
                               AWS_ENDPOINT_URL_S3=proxy.url)
      return store.child_env(STORAGE_EMULATOR_HOST=proxy.url,
                             TENSORSTORE_GCS_HTTP_URL=proxy.url)

    runs = []
    for i in range(args.runs):
      row = {}
      for method in args.methods:
        child, route = _route(method)
        proxy = proxies[route]
        env = env_for(proxy)
        name = re.sub(r"[^a-z0-9]+", "-", method.lower())
        dst = f"{store.scheme}://{bucket}/{name}-{i}"
        if args.store == "s3" and "migrate" in child:
          # Orbax restores no s3:// step (orbax_target.check_destination):
          # the s3 migration writes to a local directory.
          dst = str(work / f"{name}-{i}")
        load = _load_average()
        if proxy is not None:
          proxy.reset()
        if child.endswith("!base"):  # the baseline tree's code
          child = child[:-len("!base")]
          env["PYTHONPATH"] = args.baseline
        cpu = (_cpu_seconds(), _cpu_seconds(store.proc.pid))
        wall = time.perf_counter()
        flow = _Flow(proxy) if args.timeline and proxy is not None else None
        try:
          result = _run_child(child, src, dst, env)
        finally:
          if flow is not None:
            flow.stop()
        if flow is not None:
          # [seconds, MiB down, MiB up] every 0.25 s: the phases as the
          # link saw them.
          result["flow"] = flow.points
        result["wall_child"] = time.perf_counter() - wall
        # CPU seconds of the proxies (this process) and of the emulator
        # during the measurement, beside the child's own (`cpu_child`, its
        # whole life): with 2 cores, their sum near 2 x the wall time means
        # the machine, not the link, is the limit.
        result.update(cpu_proxy=_cpu_seconds() - cpu[0],
                      cpu_store=_cpu_seconds(store.proc.pid) - cpu[1])
        if proxy is not None:
          result.update(down=proxy.down, up=proxy.up,
                        requests=proxy.requests, streams=proxy.max_open,
                        **_upload_stats(proxy))
          if args.timeline:
            result["requests_timeline"] = [
                [round(t - proxy.request_times[0], 3), line[:90], rng]
                for t, (line, rng) in zip(proxy.request_times,
                                          proxy.request_lines)]
            t0 = min([u[2] for u in proxy.uploads], default=0)
            result["timeline"] = [[u[0][:60], u[1], round(u[2] - t0, 3),
                                   None if u[3] is None else
                                   round(u[3] - t0, 3)]
                                  for u in proxy.uploads]
        result["load"] = load
        row[method] = result
        if dst.startswith(store.scheme + "://"):
          fs = store.fs()
          with_prefix = dst.split("://", 1)[1]
          if fs.exists(with_prefix):
            fs.rm(with_prefix, recursive=True)
        else:
          shutil.rmtree(dst, ignore_errors=True)
        print(f"round {i + 1}: {method} {result['seconds']:.2f}s "
              f"(load {load:.1f})", file=sys.stderr)
      runs.append(row)
    return {"size_bytes": size, "size_gib": args.size_gib, "runs": runs,
            "array_mib": args.array_mib or 64,
            "rtt_ms": args.rtt_ms, "mbps": args.mbps, "store": args.store,
            "backend": args.backend if args.store == "gcs" else "moto"}
  finally:
    shaped.stop()
    plain.stop()
    store.stop()


def _upload_stats(proxy) -> dict:
  """What the proxy saw of uploads (requests with a body of 1 MiB or more).

  `uploads_max`: the most in flight at once; `uploads_mean`: how many were
  in flight on average while any was; `upload_count`, `upload_mib` (the
  median body).
  """
  spans = [(u[2], u[3]) for u in proxy.uploads if u[3] is not None]
  if not spans:
    return {"uploads_max": 0, "upload_count": 0}
  busy, edges = 0.0, sorted(spans)
  start, end = edges[0]
  for s, e in edges[1:]:
    if s > end:
      busy += end - start
      start, end = s, e
    else:
      end = max(end, e)
  busy += end - start
  return {"uploads_max": proxy.max_uploads, "upload_count": len(spans),
          "uploads_mean": sum(e - s for s, e in spans) / busy if busy else 0,
          "upload_mib": statistics.median(u[1] for u in proxy.uploads) / 2**20}


def _report(result: dict) -> str:
  size = result["size_bytes"]
  runs = result["runs"]
  methods = list(runs[0])

  for row in runs:  # CPU-seconds of all three processes per wall second
    for r in row.values():
      if r.get("wall_child") and r.get("cpu_proxy") is not None:
        r["cores"] = (r.get("cpu_child", 0) + r["cpu_proxy"] +
                      r["cpu_store"]) / r["wall_child"]

  def med(method, field, default=None):
    values = [r[method][field] for r in runs
              if r.get(method, {}).get(field) is not None]
    return statistics.median(values) if values else default

  def link_rate(streams, kind="link"):
    """MB/s `kind` (link: down, uplink: up) carries on `streams` connections.

    Measured, or from the nearest measured point's per-stream rate.
    """
    measured = {int(m.split("@")[1]): size / med(m, "seconds") / _MB
                for m in methods if m.startswith(kind + "@") and "+" not in m}
    if not measured:
      return None
    if streams in measured:
      return measured[streams]
    nearest = min(measured, key=lambda k: abs(k - streams))
    return min(measured[nearest] * streams / nearest,
               max(measured.values()))

  # Writes against the upward link, the migration against the slower of
  # the two (its download overlaps its upload).
  upward = ("save", "save_flax", "naive_put", "uplink", "migrate",
            "naive_migrate")
  naive = {"load": "naive_load", "save": "naive_put",
           "save_flax": "naive_put",
           "migrate": "naive_migrate"}
  lines = [
      f"checkpoint: {size / 2**20:.0f} MiB (.flax), {len(runs)} runs, medians;"
      f" {'moto (S3)' if result.get('store') == 's3' else 'fake-gcs-server'}"
      f" ({result.get('backend', 'filesystem')} back end) on "
      f"127.0.0.1 behind a proxy of {result['rtt_ms']} ms round trip and "
      f"{result['mbps']} MB/s per connection; arrays of "
      f"{result.get('array_mib', 64)} MiB; cores: CPU-seconds of the child "
      "(its whole life), the proxies and the emulator per second of the "
      "child's whole life (2 = both cores busy)",
      "",
      "method          seconds   MB/s  streams  of link  x naive  MiB down  "
      "requests  RssAnon/size  load  join s  cpu s child+proxy+store  "
      "cores  uploads max/mean x MiB",
      "--------------  -------  -----  -------  -------  -------  --------  "
      "--------  ------------  ----  ------  -----------------------  "
      "-----  ----------------------"]
  for method in methods:
    s = med(method, "seconds")
    rate = size / s / _MB
    streams = med(method, "streams")
    kind = method.split("@")[0].split("+")[0].split("!")[0]
    if "@" in method and kind in ("link", "uplink", "ceiling", "direct",
                                  "load"):
      streams = int(method.split("@")[1].split("+")[0])
    elif method.startswith("naive"):
      streams = 1
    link = link_rate(int(streams), "uplink" if kind in upward else "link"
                     ) if streams else None
    frac = f"{rate / link:7.2f}" if link and kind not in (
        "inspect", "step", "kernel", "ceiling", "direct") and (
            "+" not in method) else "      -"
    base = naive.get(kind)
    ratio = (f"{med(base, 'seconds') / s:7.2f}" if base in methods
             else "      -")
    down = med(method, "down")
    rss = med(method, "extra_rss")
    lines.append(
        f"{method:<14}  {s:7.2f}  {rate:5.0f}  "
        f"{streams if streams is not None else '-':>7}  {frac}  {ratio}  "
        f"{(down or 0) / 2**20:8.1f}  {med(method, 'requests', 0):8.0f}  "
        f"{(rss / size) if rss is not None else float('nan'):12.2f}  "
        f"{med(method, 'load'):4.1f}  " +
        (f"{med(method, 'join'):6.2f}" if med(method, "join") is not None
         else "     -") +
        (f"  {med(method, 'cpu_child', 0):7.1f}+{med(method, 'cpu_proxy', 0):5.1f}"
         f"+{med(method, 'cpu_store', 0):5.1f}     "
         if med(method, "cpu_proxy") is not None else "  " + " " * 23) +
        (f"  {med(method, 'cores'):5.2f}" if med(method, "cores") is not None
         else "      ") +
        (f"  {med(method, 'uploads_max'):3.0f}/{med(method, 'uploads_mean', 0):4.1f}"
         f" x {med(method, 'upload_mib', 0):5.1f}"
         if med(method, "upload_count") else "") +
        (f"  staged: write {med(method, 'write_s'):5.2f} s + upload "
         f"{med(method, 'upload_s'):5.2f} s, {med(method, 'staged_mib'):.0f} MiB"
         if med(method, "write_s") is not None else ""))
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--size-gib", type=float, default=0.47)
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument("--array-mib", type=int, default=0,
                      help="the float32 kernels' size (their bfloat16 "
                      "moments are half that); 0: bench_migration's 64")
  parser.add_argument("--rtt-ms", type=float, default=30)
  parser.add_argument("--mbps", type=float, default=60)
  parser.add_argument("--store", default="gcs", choices=["gcs", "s3"],
                      help="fake-gcs-server (gs://) or moto's server (s3://)")
  parser.add_argument("--backend", default="filesystem",
                      choices=["filesystem", "memory"],
                      help="fake-gcs-server's back end")

  parser.add_argument("--workdir", default="/tmp/clu_ckpt_bench_buckets")
  parser.add_argument("--methods", type=lambda t: t.split(","),
                      default=_DEFAULT_METHODS.split(","),
                      help="comma-separated; see the module docstring")
  parser.add_argument("--baseline", default="",
                      help="a checkout of the code before: methods ending in "
                      "`!base` run with it on PYTHONPATH")
  parser.add_argument("--json")
  parser.add_argument("--timeline", action="store_true",
                      help="keep each upload the proxy saw (request line, "
                      "bytes, start and end seconds) in the JSON")
  parser.add_argument("--from-json")
  parser.add_argument("--child", help=argparse.SUPPRESS)
  parser.add_argument("--src", help=argparse.SUPPRESS)
  parser.add_argument("--dst", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    method, _, arg = args.child.partition("@")
    extra = (arg,) if arg else ()
    result = _CHILDREN[method](args.src, args.dst, *extra)
    result["cpu_child"] = _cpu_seconds()
    print(json.dumps(result))
    return
  if args.from_json:
    with open(args.from_json) as f:
      print(_report(json.load(f)))
    return
  result = _measure(args)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  print(_report(result))


if __name__ == "__main__":
  main()
