"""Benchmarks a migration from a bucket into a bucket, against the naive path.

Synopsis::

  python benchmarks/bench_buckets.py --size-gib 0.5 --runs 3 --json out.json
  python benchmarks/bench_buckets.py --from-json out.json   # report again

Everything runs against fake-gcs-server on 127.0.0.1 (started here, the
emulator of `tests/emulators.py`, with its file-system back end under
`--workdir`), so the figures are the client's costs plus a local store's, not
a real bucket's: read them as ratios, and as fractions of what the same
emulator takes and serves measured in the same run.

A CLU checkpoint of about `--size-gib` GiB (one checkpoint, float32
parameters and bfloat16 moments, a tf.data iterator; written as
`bench_migration.py` writes it) is uploaded to `gs://<bucket>/run`. Each
round then runs, each in a fresh process:

- `store`: the emulator's own limits: the source `.flax` downloaded in
  16 MiB ranges (4 at a time) and discarded, and as many bytes written by
  TensorStore (what both migrations write with) as 64 MiB values, all at
  once;
- `naive`: the `.flax` downloaded whole (`gcsfs.cat_file`),
  `flax.serialization.msgpack_restore`, then Orbax `CheckpointManager`
  `save(StandardSave(...))` into `gs://<bucket>/naive-<run>`;
- `clu_ckpt`: `clu_ckpt.migration.migrate("gs://<bucket>/run",
  "gs://<bucket>/clu-<run>")` (all items: state, dataset, metadata), with
  the default write window for a bucket; `clu_ckpt@N` with a window of N
  MiB (`--methods naive,clu_ckpt,clu_ckpt@64`).

Each migration child records its RssAnon (anonymous memory, not the page
cache, which also holds `map`'s spooled copy) after its imports as the
baseline, then samples it every 5 ms. Reported per method (medians): wall
time, naive / method, source MB/s (10^6 bytes/s) and that as a fraction of
the store's upload rate measured in the same round, and the extra peak
RssAnon as a fraction of the checkpoint size (issue 14 item 2: at most
0.25x) and of naive's.
"""

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import time

_HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(0, str(_HERE.parent / "tests"))

_MB = 1e6
_CHUNK = 16 * 2**20


def _peak_sampler():
  import bench_migration  # pylint: disable=g-import-not-at-top
  return bench_migration._PeakSampler()  # pylint: disable=protected-access


def _rss_anon() -> int:
  import bench_migration  # pylint: disable=g-import-not-at-top
  return bench_migration._rss_anon()  # pylint: disable=protected-access


# --------------------------------------------------------------------------
# Children: one measurement each, a JSON line on stdout.
# --------------------------------------------------------------------------


def _child_store(src: str, dst: str) -> dict:
  import gcsfs  # pylint: disable=g-import-not-at-top
  fs = gcsfs.GCSFileSystem(skip_instance_cache=True, use_listings_cache=False)
  key = src[len("gs://"):] + "/ckpt-1.flax"
  size = fs.info(key)["size"]
  start = time.perf_counter()
  starts = list(range(0, size, _CHUNK))
  for i in range(0, len(starts), 4):
    fs.cat_ranges([key] * len(starts[i:i + 4]), starts[i:i + 4],
                  [min(s + _CHUNK, size) for s in starts[i:i + 4]])
  read = time.perf_counter() - start
  # Written as the migrations write: TensorStore, 64 MiB values, concurrent.
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  bucket, _, prefix = dst[len("gs://"):].partition("/")
  kv = ts.KvStore.open({"driver": "gcs", "bucket": bucket,
                        "path": prefix + "/"}).result()
  block = os.urandom(64 * 2**20)
  start = time.perf_counter()
  futures = [kv.write(f"blob{i}", block) for i in range(0, size, len(block))]
  for f in futures:
    f.result()
  write = time.perf_counter() - start
  fs.rm(dst[len("gs://"):], recursive=True)
  return {"bytes": size, "read_s": read, "write_s": write}


def _child_naive(src: str, dst: str) -> dict:
  import gcsfs  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from flax import serialization  # pylint: disable=g-import-not-at-top
  fs = gcsfs.GCSFileSystem(skip_instance_cache=True, use_listings_cache=False)
  base = _rss_anon()
  start = time.perf_counter()
  with _peak_sampler() as peak:
    data = fs.cat_file(src[len("gs://"):] + "/ckpt-1.flax")
    state = serialization.msgpack_restore(data)
    del data
    mngr = ocp.CheckpointManager(dst)
    mngr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
    mngr.wait_until_finished()
    mngr.close()
  return {"seconds": time.perf_counter() - start,
          "extra_rss": peak.peak - base}


def _child_clu_ckpt(src: str, dst: str, inflight_mib: int = 0) -> dict:
  import clu_ckpt  # pylint: disable=g-import-not-at-top
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint  # pylint: disable=g-import-not-at-top,unused-import
  base = _rss_anon()
  start = time.perf_counter()
  with _peak_sampler() as peak:
    summary = migration.migrate(
        src, dst, inflight_bytes=inflight_mib * 2**20 or None)
  failed = [str(r) for r in summary.failed]
  if failed:
    raise RuntimeError(f"migration failed: {failed}")
  return {"seconds": time.perf_counter() - start,
          "extra_rss": peak.peak - base,
          "module": clu_ckpt.__file__}


_CHILDREN = {"store": _child_store, "naive": _child_naive,
             "clu_ckpt": _child_clu_ckpt}


def _run_child(method: str, src: str, dst: str, env: dict) -> dict:
  """One measurement in a fresh process; `clu_ckpt@N` sets the window."""
  out = subprocess.run(
      [sys.executable, __file__, "--child", method, "--src", src, "--dst",
       dst], env=env, capture_output=True, text=True, timeout=3600)
  if out.returncode != 0:
    raise RuntimeError(f"{method} failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------
# The run and the report.
# --------------------------------------------------------------------------


def _measure(args) -> dict:
  import bench_migration  # pylint: disable=g-import-not-at-top
  import emulators  # pylint: disable=g-import-not-at-top
  work = pathlib.Path(args.workdir)
  shutil.rmtree(work, ignore_errors=True)
  work.mkdir(parents=True)
  os.environ.update(emulators.ENV)
  gcs = emulators.FakeGcs(work / "emulator")
  gcs.start()
  try:
    env = gcs.child_env()
    os.environ.update(env)
    source = work / "source"
    bench_migration._make_source(str(source), args.size_gib)  # pylint: disable=protected-access
    bucket = gcs.bucket()
    src = gcs.upload(source, "run", bucket=bucket)
    size = (source / "ckpt-1.flax").stat().st_size
    shutil.rmtree(source)
    runs = []
    for i in range(args.runs):
      row = {"store": _run_child("store", src, f"gs://{bucket}/store-{i}",
                                 env)}
      for method in args.methods:
        name = method.replace("@", "-")
        row[method] = _run_child(method, src, f"gs://{bucket}/{name}-{i}",
                                 env)
        gcs.fs().rm(f"{bucket}/{name}-{i}", recursive=True)
        print(f"round {i + 1}: {method} {row[method]['seconds']:.2f}s",
              file=sys.stderr)
      runs.append(row)
    return {"size_bytes": size, "size_gib": args.size_gib, "runs": runs}
  finally:
    gcs.stop()


def _report(result: dict) -> str:
  size = result["size_bytes"]
  runs = result["runs"]

  def med(method, field):
    return statistics.median(r[method][field] for r in runs)

  upload = size / med("store", "write_s") / _MB
  download = size / med("store", "read_s") / _MB
  naive_s, naive_rss = med("naive", "seconds"), med("naive", "extra_rss")
  lines = [
      f"checkpoint: {size / 2**30:.2f} GiB (.flax), {len(runs)} runs, "
      "medians; fake-gcs-server on 127.0.0.1",
      f"store: download {download:.0f} MB/s, upload {upload:.0f} MB/s",
      "",
      "method       seconds  naive/x  MB/s  of upload  extra RssAnon  x size  "
      "x naive's",
      "-----------  -------  -------  ----  ---------  -------------  ------  "
      "---------"]
  methods = [m for m in runs[0] if m != "store"]
  for method in methods:
    s, rss = med(method, "seconds"), med(method, "extra_rss")
    rate = size / s / _MB
    lines.append(
        f"{method:<11}  {s:7.2f}  {naive_s / s:7.2f}  {rate:4.0f}  "
        f"{rate / upload:9.2f}  {rss / 2**20:9.0f} MiB  {rss / size:6.2f}  "
        f"{rss / naive_rss:9.2f}")
  lines.append("")
  for method in methods:
    if method.startswith("clu_ckpt"):
      rss = med(method, "extra_rss")
      lines.append(f"issue 14 item 2, {method}: extra memory <= 0.25x the "
                   f"checkpoint: {rss / size:.2f}x -> "
                   f"{'met' if rss <= 0.25 * size else 'NOT met'}")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--size-gib", type=float, default=0.5)
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument("--workdir", default="/tmp/clu_ckpt_bench_buckets")
  parser.add_argument(
      "--methods", type=lambda t: t.split(","), default=["naive", "clu_ckpt"],
      help="naive, clu_ckpt (the default window for a bucket), clu_ckpt@N "
      "(a window of N MiB)")
  parser.add_argument("--json")
  parser.add_argument("--from-json")
  parser.add_argument("--child", help=argparse.SUPPRESS)
  parser.add_argument("--src", help=argparse.SUPPRESS)
  parser.add_argument("--dst", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    method, _, inflight = args.child.partition("@")
    extra = (int(inflight),) if inflight else ()
    print(json.dumps(_CHILDREN[method](args.src, args.dst, *extra)))
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
