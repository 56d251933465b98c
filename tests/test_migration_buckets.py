"""Migration, verify and inspect of Orbax roots in buckets, against emulators.

Golden CLU runs (written by real clu 0.0.12) are uploaded to fake-gcs-server
and moto's S3 server on 127.0.0.1 (tests/emulators.py), migrated, and every
step of the Orbax output is restored by a stock `ocp.CheckpointManager` on
the bucket and compared bit for bit with the source's `.flax` (read by
`flax.serialization.msgpack_restore`) and its TensorFlow iterator files.
The commands that must work without TensorFlow run in a child process where
`import tensorflow` fails.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from clu_ckpt import fsspec_fs
from clu_ckpt import orbax_root
from clu_ckpt.migration import codec
from clu_ckpt.migration import orbax_target

GOLDEN = pathlib.Path(__file__).resolve().parents[2] / "shared" / "fixtures" / (
    "clu-0.0.12")
BLOCK_TF = "import sys; sys.modules['tensorflow'] = None\n"


def _golden(name):
  path = GOLDEN / name
  if not path.is_dir():
    pytest.skip(f"golden fixture {path} is not available")
  return path


def _cli(env, *args, block_tf=True, timeout=240):
  """`clu-ckpt ARGS` in a child process (TensorFlow blocked by default)."""
  code = (BLOCK_TF if block_tf else "") + textwrap.dedent("""\
      import sys
      from clu_ckpt import cli
      sys.exit(cli.main(sys.argv[1:]))
      """)
  return subprocess.run([sys.executable, "-c", code, *args], env=env,
                        capture_output=True, text=True, timeout=timeout)


# --------------------------------------------------------------------------
# What the source holds, read without the code under test.
# --------------------------------------------------------------------------


def _same(a, b):
  if isinstance(a, dict):
    return (isinstance(b, dict) and sorted(a) == sorted(b) and
            all(_same(a[k], b[k]) for k in a))
  if isinstance(a, (np.ndarray, np.generic)):
    b = np.asarray(b)
    return (np.asarray(a).dtype == b.dtype and np.shape(a) == b.shape and
            np.asarray(a).tobytes() == b.tobytes())
  if isinstance(a, float):
    return np.float64(a).tobytes() == np.float64(b).tobytes()
  return type(a) is type(b) and a == b


def _source_state(host_dir, name):
  from flax import serialization  # pylint: disable=g-import-not-at-top
  return serialization.msgpack_restore(
      (pathlib.Path(host_dir) / f"{name}.flax").read_bytes())


def _tf_files(host_dir, name):
  files = {}
  for path in pathlib.Path(host_dir).glob(f"{name}.*"):
    suffix = path.name[len(name) + 1:]
    if suffix == "index" or suffix.startswith("data-"):
      files[suffix] = path.read_bytes()
  return files


def check_restores(root, hosts, *, expect_dataset=True):
  """Every step under `root`, restored by stock Orbax, equals its source.

  Args:
    root: The Orbax root (URL or path).
    hosts: Host id -> local golden directory of that host.
    expect_dataset: Whether the source has iterator state.

  Returns:
    The steps.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  # etils picks TensorFlow's gs:// once per process, at the first gs:// path;
  # an earlier test in this process may have made one before the emulator's
  # `EPATH_USE_TF=false`: choose again under it, as a fresh process would.
  fsspec_fs.configure_environment()
  with ocp.CheckpointManager(str(root)) as mngr:
    steps = mngr.all_steps()
    assert steps
    for step in steps:
      restored = mngr.restore(step)
      meta = restored["metadata"]
      name = meta["clu_checkpoint"]
      expected = _source_state(hosts[min(hosts)], name)
      # Stock Orbax's tree; the few leaves it cannot hold as they were
      # (numpy scalars...) are recorded stand-ins, turned back here.
      state = codec.decode_state(restored["state"], meta["encoded"],
                                 [leaf["path"] for leaf in meta["leaves"]])
      assert _same(expected, state), (root, step)
      if not expect_dataset:
        assert "dataset" not in restored or restored["dataset"] is None
        continue
      dataset = restored["dataset"]
      assert sorted(dataset) == [f"process_{h}" for h in sorted(hosts)]
      for host, directory in hosts.items():
        stored = dataset[f"process_{host}"]
        want = _tf_files(directory, name)
        assert sorted(stored) == sorted(want)
        for suffix, data in want.items():
          assert np.asarray(stored[suffix]).dtype == np.uint8
          assert np.asarray(stored[suffix]).tobytes() == data, (step, suffix)
  return steps


def _objects(gcs, url):
  bucket_key = url.split("://", 1)[1]
  return sorted(gcs.fs().find(bucket_key))


def _assert_clean(gcs, url):
  """No unfinished step, temporary or discarded object under `url`."""
  steps, partial = orbax_root.list_steps(url)
  assert partial == []
  objects = _objects(gcs, url)
  assert not [o for o in objects if orbax_target.ORBAX_TMP_MARKER in o or
              orbax_target.DISCARDED_MARKER in o]
  for step in steps:
    assert f"{url.split('://', 1)[1]}/{step}/commit_success.txt" in objects


# --------------------------------------------------------------------------
# Shared uploads and one TensorFlow-free migration.
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(gcs):
  bucket = gcs.bucket()
  urls = {name: gcs.upload(_golden(name), name, bucket=bucket)
          for name in ("single_host", "flax_only", "multihost")}
  urls["bucket"] = f"gs://{bucket}"
  return urls


@pytest.fixture(scope="module")
def migrated(gcs, runs):
  """single_host migrated gs -> gs with --verify, TensorFlow blocked."""
  destination = f"{runs['bucket']}/orbax"
  result = _cli(gcs.child_env(), "migrate", runs["single_host"], destination,
                "--verify", "--json")
  return result, destination


def test_gs_to_gs_without_tensorflow_restores_bit_exactly(gcs, runs,
                                                          migrated):
  result, destination = migrated
  assert result.returncode == 0, result.stderr
  summary = json.loads(result.stdout[result.stdout.index("{"):])
  assert [(s["number"], s["status"], s["verified"])
          for s in summary["steps"]] == [(3, "migrated", True),
                                         (4, "migrated", True),
                                         (5, "migrated", True)]
  steps = check_restores(destination, {0: _golden("single_host")})
  assert steps == [300, 400, 500]
  _assert_clean(gcs, destination)
  # The commit time is the source's save time (set before the commit file).
  stamps = [float(line.split(":")[1]) for line in
            (_golden("single_host") / "checkpoint").read_text().splitlines()
            if line.startswith("all_model_checkpoint_timestamps:")]
  for step, stamp in zip(steps, stamps):
    meta = json.loads(gcs.fs().cat_file(
        f"{destination.split('://')[1]}/{step}/_CHECKPOINT_METADATA"))
    assert meta["commit_timestamp_nsecs"] == int(round(stamp * 1e9))


@pytest.mark.thorough
def test_verify_and_inspect_orbax_root_without_tensorflow(gcs, runs,
                                                          migrated):
  _, destination = migrated
  env = gcs.child_env()
  verify = _cli(env, "verify", destination, "--source", runs["single_host"])
  assert verify.returncode == 0, verify.stderr
  assert "3 checked, 0 problems" in verify.stdout
  inspect = _cli(env, "inspect", destination)
  assert inspect.returncode == 0, inspect.stderr
  for step in ("300", "400", "500"):
    assert step in inspect.stdout
  assert "tensorflow" not in inspect.stderr.lower()


def test_rerun_skips_committed_steps(gcs, runs, migrated):
  _, destination = migrated
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  summary = migration.migrate(runs["single_host"], destination)
  assert [s.status for s in summary.steps] == ["skipped"] * 3


@pytest.mark.thorough
def test_s3_source_to_gs_destination(gcs, s3, runs):
  # In this process: a source without iterator state needs no TensorFlow.
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  source = s3.upload(_golden("flax_only"), "run")
  destination = f"{runs['bucket']}/orbax-from-s3"
  summary = migration.migrate(source, destination, verify=True)
  assert summary.ok and all(s.verified for s in summary.steps)
  assert check_restores(destination, {0: _golden("flax_only")},
                        expect_dataset=False) == [10, 20]
  _assert_clean(gcs, destination)


def test_local_to_gs_and_gs_to_local(gcs, runs, tmp_path):
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  up = f"{runs['bucket']}/orbax-from-local"
  summary = migration.migrate(str(_golden("flax_only")), up, verify=True)
  assert summary.ok
  assert check_restores(up, {0: _golden("flax_only")},
                        expect_dataset=False) == [10, 20]
  down = tmp_path / "orbax"
  summary = migration.migrate(runs["flax_only"], str(down), verify=True)
  assert summary.ok and summary.destination == str(down)
  assert check_restores(down, {0: _golden("flax_only")},
                        expect_dataset=False) == [10, 20]


@pytest.mark.thorough
def test_multihost_base_on_gs_without_tensorflow(gcs, runs):
  golden = _golden("multihost")
  destination = f"{runs['bucket']}/orbax-mh"
  result = _cli(gcs.child_env(), "migrate", f"{runs['multihost']}/checkpoints",
                destination, "--verify", "--json")
  assert result.returncode == 0, result.stderr
  summary = json.loads(result.stdout[result.stdout.index("{"):])
  assert summary["kind"] == "MultihostCheckpoint"
  assert summary["not_on_all_hosts"] == [3]
  assert all(s["verified"] for s in summary["steps"])
  hosts = {0: golden / "checkpoints-0", 1: golden / "checkpoints-1"}
  assert check_restores(destination, hosts) == [1, 2]


@pytest.mark.thorough
def test_s3_destination_refused_before_anything_is_written(gcs, s3, runs):
  bucket = s3.bucket()
  result = _cli(gcs.child_env(**s3.env()), "migrate", runs["flax_only"],
                f"s3://{bucket}/orbax")
  assert result.returncode == 1
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr
  assert "s3://" in lines[0] and "not supported" in lines[0]
  assert s3.fs().find(bucket) == []


def test_uncommitted_step_is_unlisted_verified_as_unfinished_and_redone(
    gcs, runs):
  from clu_ckpt import cli  # pylint: disable=g-import-not-at-top
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  destination = f"{runs['bucket']}/orbax-uncommitted"
  assert migration.migrate(runs["flax_only"], destination, checkpoints=[1]).ok
  key = destination.split("://")[1]
  # What a write of step 20 killed before its commit leaves on GCS: objects
  # under the final name, no commit_success.txt.
  gcs.fs().pipe_file(f"{key}/20/_CHECKPOINT_METADATA", b"{}")
  gcs.fs().pipe_file(f"{key}/20/state/manifest.ocdbt", b"partial")
  assert orbax_root.list_steps(destination) == ([10], ["20"])
  assert cli.main(["verify", destination]) == 1
  summary = migration.migrate(runs["flax_only"], destination)
  assert [s.status for s in summary.steps] == ["skipped", "migrated"]
  assert check_restores(destination, {0: _golden("flax_only")},
                        expect_dataset=False) == [10, 20]
  _assert_clean(gcs, destination)
  # A step taken away (failed verification): unlisted, then removed.
  target = orbax_target.OrbaxTarget(destination)
  target.discard(20)
  assert orbax_root.list_steps(destination) == ([10], [])
  assert not [o for o in _objects(gcs, destination) if f"{key}/20/" in o]


@pytest.mark.thorough
def test_killed_migration_resumes_on_the_bucket(gcs, runs):
  destination = f"{runs['bucket']}/orbax-killed"
  env = gcs.child_env(CLU_CKPT_LOCK_LEASE_SECONDS="1")
  # The second step's commit (its commit time, then commit_success.txt)
  # waits, so the kill finds it written but uncommitted.
  code = BLOCK_TF + textwrap.dedent("""\
      import sys, time
      from clu_ckpt.migration import orbax_target
      update = orbax_target._CommitTimeStore.update
      calls = []
      def slow_update(self, *args, **kwargs):
        if orbax_target.COMMIT_TIME_FIELD in kwargs:
          calls.append(1)
          if len(calls) == 2:
            time.sleep(120)
        update(self, *args, **kwargs)
      orbax_target._CommitTimeStore.update = slow_update
      from clu_ckpt import cli
      sys.exit(cli.main(sys.argv[1:]))
      """)
  child = subprocess.Popen(
      [sys.executable, "-c", code, "migrate", runs["single_host"],
       destination], env=env, stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE)
  try:
    deadline = time.monotonic() + 120
    while True:
      steps, partial = orbax_root.list_steps(destination)
      if steps and partial:
        break
      assert child.poll() is None, child.stderr.read()
      assert time.monotonic() < deadline
      time.sleep(0.05)
  finally:
    child.send_signal(signal.SIGKILL)
    child.wait()
  assert steps == [300] and partial == ["400"]
  time.sleep(2.5)  # the killed run's 1 s lease goes stale (+ the margin)
  for _ in range(5):
    result = _cli(env, "migrate", runs["single_host"], destination,
                  "--verify")
    if "another migration" not in result.stderr:
      break
    time.sleep(1)
  assert result.returncode == 0, result.stderr
  assert "ckpt-3 -> step 300: skipped, verified" in result.stdout
  assert "ckpt-4 -> step 400: migrated, verified" in result.stdout
  assert check_restores(destination, {0: _golden("single_host")}) == [
      300, 400, 500]
  _assert_clean(gcs, destination)


@pytest.mark.thorough
def test_migrate_runs_over_two_runs_in_a_bucket(gcs, tmp_path):
  bucket = gcs.bucket()
  gcs.upload(_golden("flax_only"), "runs/a/checkpoints", bucket=bucket)
  gcs.upload(_golden("single_host"), "runs/b/checkpoints", bucket=bucket)
  script = pathlib.Path(__file__).resolve().parents[1] / "migration" / (
      "migrate_runs.py")
  report = tmp_path / "report.json"
  # Each run's `clu-ckpt migrate` child without TensorFlow.
  (tmp_path / "sitecustomize.py").write_text(BLOCK_TF)
  env = gcs.child_env(PYTHONPATH=os.pathsep.join(
      [str(tmp_path)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  result = subprocess.run(
      [sys.executable, str(script),
       f"--source-glob=gs://{bucket}/runs/*/checkpoints",
       f"--destination-root=gs://{bucket}/orbax_runs", "--parallelism=2",
       f"--report={report}"],
      env=env, capture_output=True, text=True, timeout=240)
  assert result.returncode == 0, result.stdout + result.stderr
  runs = json.loads(report.read_text())["runs"]
  assert [(r["source"], r["destination"], r["status"]) for r in runs] == [
      (f"gs://{bucket}/runs/a/checkpoints",
       f"gs://{bucket}/orbax_runs/a/checkpoints", "ok"),
      (f"gs://{bucket}/runs/b/checkpoints",
       f"gs://{bucket}/orbax_runs/b/checkpoints", "ok")]
  assert orbax_root.list_steps(
      f"gs://{bucket}/orbax_runs/b/checkpoints")[0] == [300, 400, 500]
  assert orbax_root.list_steps(
      f"gs://{bucket}/orbax_runs/a/checkpoints")[0] == [10, 20]


def test_default_window_is_smaller_for_buckets():
  assert orbax_target.default_inflight_bytes("/x/orbax") == (
      orbax_target.DEFAULT_INFLIGHT_BYTES)
  assert orbax_target.default_inflight_bytes("gs://b/orbax") == (
      orbax_target.REMOTE_INFLIGHT_BYTES)
  assert orbax_target.REMOTE_INFLIGHT_BYTES < (
      orbax_target.DEFAULT_INFLIGHT_BYTES)
  assert orbax_target.OrbaxTarget("gs://b/o").inflight_bytes == (
      orbax_target.REMOTE_INFLIGHT_BYTES)
  with pytest.raises(Exception, match="s3://"):
    orbax_target.OrbaxTarget("s3://b/o")


def test_a_run_that_lost_its_lease_stops_writing(gcs, runs, monkeypatch):
  """Another migration takes the lease mid-run: no further step is written."""
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  from clu_ckpt.migration import destination  # pylint: disable=g-import-not-at-top
  from clu_ckpt.migration import migrate  # pylint: disable=g-import-not-at-top
  # A lease far longer than the run: the refresher never rewrites the lock
  # here (a rewrite racing the theft below could put ours back), so the loss
  # must be seen by the check before the next step itself.
  monkeypatch.setenv(destination.LEASE_ENV, "600")
  dest = f"gs://{gcs.bucket()}/orbax"
  lock = f"{dest}/{destination.LOCK_NAME}"

  def progress(event):
    if event.event == "done" and not storage.exists(f"{lock}.stolen"):
      with storage.atomic_writer(lock) as write:  # another holder's lease
        write(json.dumps({"host": "elsewhere", "pid": 4242, "since": "now",
                          "token": "theirs", "seq": 1}).encode())
      storage.create_exclusive(f"{lock}.stolen", b"")

  with pytest.raises(destination.MigrationError,
                     match="lost the lock.*elsewhere pid 4242"):
    migrate(runs["single_host"], dest, progress=progress)
  steps, _ = orbax_root.list_steps(dest)
  assert steps == [300]  # the first step, written before the loss
  # The new holder's lock is left alone.
  assert json.loads(storage.read_bytes(lock))["token"] == "theirs"


@pytest.mark.thorough
def test_missing_buckets_are_one_line_naming_them(gcs, runs):
  for args in (("migrate", runs["flax_only"], "gs://no-such-bucket-q7/orbax"),
               ("migrate", "gs://no-such-bucket-q7/run", f"{runs['bucket']}/x"),
               ("inspect", "gs://no-such-bucket-q7/run")):
    out = _cli(gcs.child_env(), *args)
    assert out.returncode == 1, (args, out.stderr)
    lines = [l for l in out.stderr.splitlines() if l.startswith("clu-ckpt")]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "bucket 'no-such-bucket-q7' does not exist" in lines[0], lines


def test_progress_totals_match_what_was_done_from_a_bucket(runs, tmp_path):
  from clu_ckpt.migration import migrate  # pylint: disable=g-import-not-at-top
  events = []
  summary = migrate(runs["single_host"], str(tmp_path / "orbax"),
                    progress=events.append)
  done = [e for e in events if e.event == "done"]
  assert len(done) == len(summary.steps) == 3
  # Planned from the files' sizes (not downloaded), corrected as each is read.
  assert events[0].total_nbytes > sum(r.nbytes for r in summary.steps)
  assert events[-1].total_nbytes == sum(r.nbytes for r in summary.steps)


# --------------------------------------------------------------------------
# Many streams up: the data files TensorStore writes to a bucket.
# --------------------------------------------------------------------------


@pytest.mark.thorough  # ~1 GiB in its worker: the quick run's memory bound
def test_a_bucket_destination_uploads_data_files_in_parallel(gcs, tmp_path):
  # Orbax asks TensorStore for 400 MiB data files on GCS by default: every
  # array then goes up as one upload, one at a time. With
  # `orbax_target.REMOTE_DATA_FILE_BYTES` files a large array goes up as
  # several uploads at once. Stock Orbax restores the step bit-exactly.
  import link_proxy  # pylint: disable=g-import-not-at-top
  from clu_ckpt import flax_format  # pylint: disable=g-import-not-at-top
  files = orbax_target.REMOTE_DATA_FILE_BYTES
  assert files and files <= 16 * 2**20, files
  rng = np.random.default_rng(5)
  state = {"step": np.int64(9), "params": {
      "kernel": rng.standard_normal(5 * files // 4).astype(np.float32),
      "bias": np.arange(16, dtype=np.float32)}}
  bucket = gcs.bucket()
  fs = gcs.fs()
  fs.pipe_file(f"{bucket}/run/ckpt-1.flax", flax_format.save(state))
  fs.pipe_file(f"{bucket}/run/checkpoint", (
      b'model_checkpoint_path: "ckpt-1"\n'
      b'all_model_checkpoint_paths: "ckpt-1"\n'
      b"all_model_checkpoint_timestamps: 1700000000.5\n"
      b"last_preserved_timestamp: 1.0\n"))
  destination = f"gs://{bucket}/orbax"
  with link_proxy.LinkProxy(gcs.port) as proxy:
    result = _cli(gcs.child_env(STORAGE_EMULATOR_HOST=proxy.url,
                                TENSORSTORE_GCS_HTTP_URL=proxy.url),
                  "migrate", f"gs://{bucket}/run", destination)
    assert result.returncode == 0, result.stderr
    uploads = [(line, size) for line, size, *_ in proxy.uploads]
    assert proxy.max_uploads >= 2, uploads
  # The array's bytes went up as files of about the target size.
  big = [size for line, size in uploads if "ocdbt" in line or "/d/" in line
         or "uploadType" in line]
  assert sum(big) >= 0.8 * state["params"]["kernel"].nbytes, uploads
  assert max(big) <= 2 * files + 2**20, uploads
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  fsspec_fs.configure_environment()
  with ocp.CheckpointManager(destination) as mngr:
    assert mngr.all_steps() == [9]
    restored = mngr.restore(9)
  assert _same(state["params"], {
      k: np.asarray(v) for k, v in restored["state"]["params"].items()})


def test_the_read_ahead_does_not_stall_the_writes(tmp_path, monkeypatch):
  # On a bucket the read-ahead downloads the next arrays (a spool's madvise
  # fetches); run on Orbax's event loop it stalled every write meanwhile,
  # so downloads and uploads took turns. Here a slow read-ahead: arrays
  # must finish writing while it runs.
  import threading  # pylint: disable=g-import-not-at-top
  from clu_ckpt.migration import memory  # pylint: disable=g-import-not-at-top
  reading = []
  up_to = memory.Prefetcher.up_to

  def slow(self, current):
    start = time.monotonic()
    up_to(self, current)
    if current > 0:
      time.sleep(0.3)
    reading.append((start, time.monotonic(), threading.get_ident()))

  monkeypatch.setattr(memory.Prefetcher, "up_to", slow)
  written = []
  state = {f"w{i}": np.full(2**18, i, np.float32) for i in range(6)}
  target = orbax_target.OrbaxTarget(str(tmp_path / "orbax"),
                                    inflight_bytes=2**20)
  target.write_step(1, {"state": state, "metadata": {}},
                    on_bytes=lambda n: written.append(time.monotonic()))
  assert len(written) == 6
  during = [t for t in written
            if any(s < t < e for s, e, _ in reading[1:])]
  assert during, (written, reading)
  restored, _ = target.restore(1)
  for name, value in state.items():
    np.testing.assert_array_equal(restored[name], value)


# A child that migrates a local run with one large array to a bucket and
# prints the peak of its RssAnon above what it held once JAX and Orbax were
# imported and JAX's backend made.
_PEAK_CHILD = textwrap.dedent("""\
    import json, sys, threading, time
    import jax
    import orbax.checkpoint  # pylint: disable=unused-import
    from clu_ckpt import migration
    source, destination, window = sys.argv[1:4]

    def rss_anon():
      with open("/proc/self/status") as f:
        for line in f:
          if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
      raise RuntimeError("no RssAnon")

    jax.devices()
    base, peak, done = rss_anon(), [0], threading.Event()

    def sample():
      while not done.is_set():
        peak[0] = max(peak[0], rss_anon())
        time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    summary = migration.migrate(source, destination,
                                inflight_bytes=int(window))
    done.set()
    sampler.join()
    assert not summary.failed, summary.failed
    print(json.dumps({"extra": max(peak[0], rss_anon()) - base}))
    """)


def _local_run(directory, state):
  from clu_ckpt import flax_format  # pylint: disable=g-import-not-at-top
  directory.mkdir()
  flax_format.save_file(state, str(directory / "ckpt-1.flax"))
  (directory / "checkpoint").write_text(
      'model_checkpoint_path: "ckpt-1"\n'
      'all_model_checkpoint_paths: "ckpt-1"\n'
      "all_model_checkpoint_timestamps: 1700000000.5\n"
      "last_preserved_timestamp: 1.0\n")
  return str(directory)


@pytest.mark.thorough  # ~20 s: the child's imports, 128 MiB up and back
def test_a_large_array_does_not_set_the_memory_of_a_bucket_migration(
    gcs, tmp_path):
  # TensorStore holds what it is given at once (a copy of the unaligned
  # view of the `.flax`, its compressed chunks, the uploads), so an array
  # handed over whole made the migration's peak follow the largest array,
  # whatever the in-flight window: 162 MiB above the base for one array of
  # 64 MiB, 260 MiB for 128 MiB. Written in slices of whole chunks
  # (`orbax_target.write_in_slices`) it follows the window: 78 and 92 MiB
  # (of which about 75 MiB is the same for any array: TensorStore's and
  # Orbax's own, the bucket client).
  mib = 2**20
  window = 16 * mib
  rng = np.random.default_rng(11)
  big = rng.standard_normal((128 * mib // 1024, 256), dtype=np.float32)
  state = {"step": np.int64(3), "params": {
      "kernel": big, "bias": np.arange(8, dtype=np.float32)}}
  source = _local_run(tmp_path / "run", state)
  destination = f"gs://{gcs.bucket()}/orbax"
  # Run from tmp_path: `python -c` puts the current directory first on
  # sys.path, which would shadow PYTHONPATH's clu_ckpt from a checkout.
  out = subprocess.run(
      [sys.executable, "-c", _PEAK_CHILD, source, destination, str(window)],
      env=gcs.child_env(), cwd=tmp_path, capture_output=True, text=True,
      timeout=240)
  assert out.returncode == 0, out.stderr[-3000:]
  extra = json.loads(out.stdout.strip().splitlines()[-1])["extra"]
  assert extra < big.nbytes, (extra / mib, "MiB above the base")
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  fsspec_fs.configure_environment()
  with ocp.CheckpointManager(destination) as mngr:
    assert mngr.all_steps() == [3]
    restored = mngr.restore(3)
  assert _same(state["params"], {
      k: np.asarray(v) for k, v in restored["state"]["params"].items()})


def test_slices_are_whole_chunks_of_at_most_the_slice_size():
  kib = 1024
  # 64 rows of 1 KiB, chunks of 8 rows (8 KiB): 16 KiB slices of 2 chunks.
  assert orbax_target.slice_rows((64, 256), 4, (8, 256), 16 * kib) == [
      (s, s + 16) for s in range(0, 64, 16)]
  # Not a whole number of chunks per slice: rounded down, at least one.
  assert orbax_target.slice_rows((64, 256), 4, (8, 256), 20 * kib) == [
      (s, s + 16) for s in range(0, 64, 16)]
  assert orbax_target.slice_rows((64, 256), 4, (8, 256), kib) == [
      (s, s + 8) for s in range(0, 64, 8)]
  # The last slice is what is left.
  assert orbax_target.slice_rows((20, 256), 4, (8, 256), 8 * kib) == [
      (0, 8), (8, 16), (16, 20)]
  # One slice: small enough, chunks spanning axis 0, a scalar, no layout.
  assert orbax_target.slice_rows((64, 256), 4, (8, 256), 64 * kib) == [
      (0, 64)]
  assert orbax_target.slice_rows((64, 256), 4, (64, 32), kib) == [(0, 64)]
  assert orbax_target.slice_rows((), 4, (), kib) == []
  assert orbax_target.slice_rows((64, 256), 4, None, kib) == [(0, 64)]


def test_an_array_written_in_slices_reads_back_the_same(tmp_path):
  import asyncio  # pylint: disable=g-import-not-at-top
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  value = np.random.default_rng(2).standard_normal((50, 64)).astype(
      np.float32)
  # An unaligned view, as a `.flax` map's arrays are.
  raw = np.zeros(value.nbytes + 1, np.uint8)
  raw[1:] = value.view(np.uint8).ravel()
  unaligned = np.ndarray(value.shape, np.float32, raw.data, 1)
  assert not unaligned.flags.aligned
  spec = {"driver": "zarr", "kvstore": {"driver": "file",
                                        "path": str(tmp_path / "a")},
          "metadata": {"shape": [50, 64], "chunks": [8, 64],
                       "dtype": "<f4", "compressor": {"id": "zstd"}}}

  async def write():
    t = await ts.open(spec, create=True, open=True)
    await orbax_target.write_in_slices(t, unaligned, 2 * 8 * 64 * 4, 2)

  asyncio.run(write())
  np.testing.assert_array_equal(
      ts.open(spec).result().read().result(), value)
