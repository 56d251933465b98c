"""A `gs://` step staged locally, then uploaded by many streams at once.

Against fake-gcs-server on 127.0.0.1 (tests/emulators.py): the staged step
is restored bit-exactly by a stock `CheckpointManager` (dataset item
included), has the objects a direct Orbax write makes (and the same commit
files), is committed by its `commit_success.txt` after every other object,
leaves nothing listed when its upload fails or its process is killed (the
next run removes it), and its staging subdirectory is removed after success,
failure, SIGTERM, and (by the next run) after SIGKILL.
"""

import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from clu_ckpt import flax_format
from clu_ckpt import fsspec_fs
from clu_ckpt import orbax_root
from clu_ckpt.migration import orbax_target
from clu_ckpt.migration import staging

import test_migration_buckets as buckets

GOLDEN = buckets.GOLDEN


def _staged_entries(directory) -> list[str]:
  return sorted(n for n in os.listdir(directory)
                if n.startswith(staging.PREFIX))


def _objects(gcs, url) -> list[str]:
  """Object names under `url`, relative to it (no directory markers)."""
  key = url.split("://", 1)[1]
  return sorted(o[len(key) + 1:] for o in gcs.fs().find(key))


def _shape(names) -> set[str]:
  """Object names with OCDBT data files' random names as `*`."""
  return {re.sub(r"/d/[0-9a-f]{32}$", "/d/*", n) for n in names}


def _checkpoint_run(gcs, bucket, name, state, number=1):
  """A CLU run of one checkpoint in the bucket (its iterator's TensorFlow
  files those of the golden single_host's ckpt-3); its URL."""
  golden = GOLDEN / "single_host"
  if not golden.is_dir():
    pytest.skip(f"golden fixture {golden} is not available")
  fs = gcs.fs()
  for suffix in ("index", "data-00000-of-00001"):
    fs.pipe_file(f"{bucket}/{name}/ckpt-{number}.{suffix}",
                 (golden / f"ckpt-3.{suffix}").read_bytes())
  fs.pipe_file(f"{bucket}/{name}/ckpt-{number}.flax", flax_format.save(state))
  fs.pipe_file(f"{bucket}/{name}/checkpoint", (
      f'model_checkpoint_path: "ckpt-{number}"\n'
      f'all_model_checkpoint_paths: "ckpt-{number}"\n'
      "all_model_checkpoint_timestamps: 1700000000.5\n"
      "last_preserved_timestamp: 1.0\n").encode())
  return f"gs://{bucket}/{name}"


def _state(mib: int, seed: int = 3) -> dict:
  rng = np.random.default_rng(seed)
  return {"step": np.int64(7), "params": {
      "kernel": rng.standard_normal(mib * 2**18).astype(np.float32),
      "bias": np.arange(16, dtype=np.float32)}}


@pytest.fixture(scope="module")
def golden_run(gcs):
  path = GOLDEN / "single_host"
  if not path.is_dir():
    pytest.skip(f"golden fixture {path} is not available")
  bucket = gcs.bucket()
  return bucket, gcs.upload(path, "single_host", bucket=bucket), path


def test_staged_step_restores_bit_exactly_and_is_laid_out_as_a_direct_write(
    gcs, golden_run, tmp_path, monkeypatch):
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  bucket, source, local = golden_run
  area = tmp_path / "stage"
  area.mkdir()
  sent = []  # (object URL, start, end) of each upload, in the order made
  put = staging._put  # pylint: disable=protected-access

  def recording(local_path, url, data=None):
    start = time.monotonic()
    put(local_path, url, data)
    sent.append((url, start, time.monotonic()))

  monkeypatch.setattr(staging, "_put", recording)
  staged = f"gs://{bucket}/staged"
  target = orbax_target.OrbaxTarget(staged, staging_dir=str(area))
  summary = migration.migrate(source, staged, checkpoints="latest",
                              target=target)
  assert summary.ok, summary.failed
  assert target.last_write_staged
  assert _staged_entries(area) == []  # removed after success
  buckets.check_restores(staged, {0: local})  # stock Orbax, dataset too

  monkeypatch.setattr(orbax_target, "STAGE_BUCKET_STEPS", False)
  direct = f"gs://{bucket}/direct"
  target = orbax_target.OrbaxTarget(direct, staging_dir=str(area))
  assert migration.migrate(source, direct, checkpoints="latest",
                           target=target).ok
  assert not target.last_write_staged
  staged_names, direct_names = _objects(gcs, staged), _objects(gcs, direct)
  assert _shape(staged_names) == _shape(direct_names)
  # The commit files say what Orbax writes on GCS, naming their URL.
  fs = gcs.fs()
  for name in [n for n in direct_names if n.endswith("commit_success.txt")]:
    want = fs.cat(f"{direct.split('://')[1]}/{name}").replace(
        b"/direct/", b"/staged/")
    assert fs.cat(f"{staged.split('://')[1]}/{name}") == want, name
  # The step's commit file went up last, once every other object had.
  step = orbax_root.list_steps(staged)[0][-1]
  commit = f"{staged}/{step}/commit_success.txt"
  ours = [s for s in sent if s[0].startswith(f"{staged}/{step}/")]
  assert ours[-1][0] == commit
  assert [u for u, _, _ in ours].count(commit) == 1  # sent once, last
  assert ours[-1][1] >= max(end for url, _, end in ours[:-1])
  assert {u[len(staged) + 1:] for u, _, _ in ours} == {
      n for n in staged_names if n.startswith(f"{step}/")}


def test_a_failed_upload_leaves_nothing_listed_and_the_next_run_finishes(
    gcs, tmp_path, monkeypatch):
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  bucket = gcs.bucket()
  state = _state(20)
  source = _checkpoint_run(gcs, bucket, "run", state)
  destination = f"gs://{bucket}/orbax"
  area = tmp_path / "stage"
  area.mkdir()
  put = staging._put  # pylint: disable=protected-access
  calls = []

  def failing(local_path, url, data=None):
    calls.append(url)
    if len(calls) == 3:
      raise OSError(f"uploading {local_path} to {url}: 503 injected")
    put(local_path, url, data)

  monkeypatch.setattr(staging, "_put", failing)
  # As if the process died before its own clean-up: the partial step stays.
  monkeypatch.setattr(orbax_target.OrbaxTarget, "remove_partial",
                      lambda self, step: None)
  summary = migration.migrate(source, destination, staging_dir=str(area))
  assert not summary.ok and "503 injected" in summary.failed[0].error
  assert _staged_entries(area) == []  # removed after a failure too
  steps, partial = orbax_root.list_steps(destination)
  assert steps == [] and partial == ["7"], _objects(gcs, destination)
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  fsspec_fs.configure_environment()
  with ocp.CheckpointManager(destination) as mngr:
    assert mngr.all_steps() == []  # stock Orbax does not list it either
  left = [n for n in _objects(gcs, destination) if "/d/" in n]
  assert left  # the failed attempt's data files, until the next run

  monkeypatch.undo()
  assert migration.migrate(source, destination, staging_dir=str(area)).ok
  assert orbax_root.list_steps(destination) == ([7], [])
  with ocp.CheckpointManager(destination) as mngr:
    restored = mngr.restore(7)
  got = restored["state"]["params"]["kernel"]
  assert np.asarray(got).tobytes() == state["params"]["kernel"].tobytes()
  # Nothing but the one step's objects (the failed attempt's are gone).
  names = [n for n in _objects(gcs, destination)
           if not n.startswith(".clu_ckpt.lock")]  # the lease's own
  assert all(n.startswith("7/") or n.startswith("clu_ckpt_manifest")
             for n in names), names
  assert not set(left) & set(names)


# Thorough: it moves tens of MiB through the modelled link, and its worker
# made the quick run's memory peak (1.2 GiB of 3.1); the quick
# representative of staging is the restore-and-layout test above.
@pytest.mark.thorough
def test_uploads_go_up_many_at_once_through_the_link(gcs, tmp_path):
  import link_proxy  # pylint: disable=g-import-not-at-top
  bucket = gcs.bucket()
  state = _state(64)  # data files of 8-16 MiB
  source = _checkpoint_run(gcs, bucket, "run", state)
  destination = f"gs://{bucket}/orbax"
  # Slow enough per connection that the files written meanwhile queue up.
  with link_proxy.LinkProxy(gcs.port, rtt=0.01, rate=8e6) as proxy:
    result = buckets._cli(  # pylint: disable=protected-access
        gcs.child_env(STORAGE_EMULATOR_HOST=proxy.url,
                      TENSORSTORE_GCS_HTTP_URL=proxy.url,
                      CLU_CKPT_STAGING_DIR=str(tmp_path)),
        "migrate", source, destination)
    assert result.returncode == 0, result.stderr
    big = [u for u in proxy.uploads if u[1] >= 4 * 2**20]
    assert len(big) >= 4, proxy.uploads
    assert sum(u[1] for u in big) >= state["params"]["kernel"].nbytes * 0.9
    assert proxy.max_uploads > 2, proxy.uploads
  assert orbax_root.list_steps(destination) == ([7], [])
  assert _staged_entries(tmp_path) == []


def test_fallbacks_write_directly(gcs, tmp_path, monkeypatch):
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  bucket = gcs.bucket()
  state = _state(1)
  source = _checkpoint_run(gcs, bucket, "run", state)
  items = {"state": state, "metadata": {}}
  target = orbax_target.OrbaxTarget(f"gs://{bucket}/a", staging_dir=str(
      tmp_path))
  assert target._stages(items)  # pylint: disable=protected-access
  # Several JAX processes: each writes its part of the step directly.
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  assert not target._stages(items)  # pylint: disable=protected-access
  monkeypatch.undo()
  # A local destination is never staged.
  local = orbax_target.OrbaxTarget(str(tmp_path / "local"))
  assert not local._stages(items)  # pylint: disable=protected-access
  # No room in the staging directory: written directly, still restored.
  monkeypatch.setattr(staging, "SPACE_MARGIN_BYTES", 2**62)
  destination = f"gs://{bucket}/orbax"
  target = orbax_target.OrbaxTarget(destination, staging_dir=str(tmp_path))
  assert migration.migrate(source, destination, target=target).ok
  assert not target.last_write_staged
  assert orbax_root.list_steps(destination) == ([7], [])
  # A staging directory that does not exist: the same.
  assert not staging.has_room(str(tmp_path / "missing"), 0)



def test_a_small_step_is_staged_only_when_a_staging_directory_is_named(
    tmp_path, monkeypatch):
  """Staged uploads hold about `STAGED_BYTES_PER_STREAM` per stream: by
  default a step is staged only when that is at most a quarter of it."""
  monkeypatch.delenv(staging.STAGING_DIR_ENV, raising=False)
  small = {"state": {"w": np.zeros(2**20, np.float32)}, "metadata": {}}
  target = orbax_target.OrbaxTarget("gs://b/a")
  assert not target._stages(small)  # pylint: disable=protected-access
  monkeypatch.setattr(orbax_target, "STAGED_BYTES_PER_STREAM", 2**17)
  assert target._stages(small)  # pylint: disable=protected-access
  monkeypatch.setattr(orbax_target, "STAGED_BYTES_PER_STREAM", 2**17 + 1)
  assert not target._stages(small)  # pylint: disable=protected-access
  monkeypatch.setenv(staging.STAGING_DIR_ENV, str(tmp_path))
  assert target._stages(small)  # pylint: disable=protected-access
  monkeypatch.delenv(staging.STAGING_DIR_ENV)
  named = orbax_target.OrbaxTarget("gs://b/a", staging_dir=str(tmp_path))
  assert named._stages(small)  # pylint: disable=protected-access


def test_debris_of_a_killed_process_is_swept(tmp_path):
  gone = subprocess.Popen([sys.executable, "-c", "pass"])
  gone.wait()
  dead = tmp_path / f"{staging.PREFIX}{gone.pid}-0123456789ab"
  (dead / "7" / "state").mkdir(parents=True)
  (dead / "7" / "state" / "x").write_bytes(b"x")
  alive = tmp_path / f"{staging.PREFIX}{os.getppid()}-0123456789ab"
  alive.mkdir()
  other = tmp_path / "not-ours"
  other.mkdir()
  with staging.StagingArea(str(tmp_path)) as area:
    assert os.path.isdir(area.path)
    assert not dead.exists() and alive.exists() and other.exists()
  assert not os.path.exists(area.path)


_CHILD = textwrap.dedent("""\
    import sys
    from clu_ckpt import cli
    sys.exit(cli.main(sys.argv[1:]))
    """)


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_signal_during_the_upload_leaves_nothing_listed(gcs, tmp_path, how):
  import link_proxy  # pylint: disable=g-import-not-at-top
  bucket = gcs.bucket()
  state = _state(24)
  source = _checkpoint_run(gcs, bucket, "run", state)
  destination = f"gs://{bucket}/orbax"
  area = tmp_path / "stage"
  area.mkdir()
  with link_proxy.LinkProxy(gcs.port, rtt=0.01, rate=4e6) as proxy:
    env = gcs.child_env(STORAGE_EMULATOR_HOST=proxy.url,
                        TENSORSTORE_GCS_HTTP_URL=proxy.url,
                        CLU_CKPT_LOCK_LEASE_SECONDS="1")
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, "migrate", source, destination,
         "--staging-dir", str(area)], env=env, stderr=subprocess.PIPE,
        text=True)
    try:
      deadline = time.monotonic() + 120
      while not proxy.uploads and time.monotonic() < deadline:
        assert child.poll() is None, child.stderr.read()
        time.sleep(0.05)  # until a data file is on its way
      assert proxy.uploads
      assert _staged_entries(area)
      child.send_signal(getattr(signal, how))
      _, err = child.communicate(timeout=120)
    finally:
      if child.poll() is None:
        child.kill()
        child.wait()
  if how == "SIGTERM":
    assert child.returncode == 130, err
    assert _staged_entries(area) == []
  else:
    assert child.returncode == -signal.SIGKILL
    assert _staged_entries(area)  # its debris, until the next run
  steps, _ = orbax_root.list_steps(destination)
  assert steps == []
  left = [n for n in _objects(gcs, destination) if "/d/" in n]
  if how == "SIGKILL":
    time.sleep(2.5)  # the killed run's 1 s lease goes stale (+ the margin)
  for _ in range(5):
    result = buckets._cli(  # pylint: disable=protected-access
        gcs.child_env(CLU_CKPT_LOCK_LEASE_SECONDS="1"), "migrate", source,
        destination, "--staging-dir", str(area))
    if "another migration" not in result.stderr:
      break
    time.sleep(1)
  assert result.returncode == 0, result.stderr
  assert orbax_root.list_steps(destination) == ([7], [])
  assert _staged_entries(area) == []
  names = [n for n in _objects(gcs, destination)
           if not n.startswith(".clu_ckpt.lock")]  # the lease's own
  assert all(n.startswith("7/") or n.startswith("clu_ckpt_manifest")
             for n in names), names
  assert not set(left) & set(names)  # the killed run's objects are gone


def _file_kvstores(spec) -> list[dict]:
  """The `file` key-value stores of a TensorStore spec (JSON)."""
  found = []
  if isinstance(spec, dict):
    if spec.get("driver") == "file":
      found.append(spec)
    for key in ("kvstore", "base", "manifest"):
      found += _file_kvstores(spec.get(key))
  return found


def test_a_staged_step_is_not_fsynced_and_a_local_one_is(gcs, tmp_path,
                                                         monkeypatch):
  # The staged files are temporary (committed by their upload): TensorStore
  # writes them without fsync. A local destination keeps it (durability).
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  import tensorstore  # pylint: disable=g-import-not-at-top
  bucket = gcs.bucket()
  state = _state(2)
  source = _checkpoint_run(gcs, bucket, "run", state)
  opened = []
  real_open = tensorstore.open

  def recording(spec, *args, **kwargs):
    opened.append(spec.to_json() if hasattr(spec, "to_json") else spec)
    return real_open(spec, *args, **kwargs)

  monkeypatch.setattr(tensorstore, "open", recording)
  destination = f"gs://{bucket}/orbax"
  target = orbax_target.OrbaxTarget(destination, staging_dir=str(tmp_path))
  assert migration.migrate(source, destination, target=target).ok
  assert target.last_write_staged
  # The state's arrays (the dataset's few bytes go through Orbax's own).
  staged = [kv for spec in opened for kv in _file_kvstores(spec)
            if "/state." in kv["path"]]
  assert staged, opened  # the arrays went through the local file driver
  assert all(kv.get("file_io_sync") is False for kv in staged), staged
  with ocp_manager(destination) as mngr:
    got = mngr.restore(7)["state"]["params"]["kernel"]
  assert np.asarray(got).tobytes() == state["params"]["kernel"].tobytes()

  opened.clear()
  local = tmp_path / "local"
  assert migration.migrate(source, str(local)).ok
  written = [kv for spec in opened for kv in _file_kvstores(spec)
             if "/state" in kv["path"]]
  assert written, opened
  assert all(kv.get("file_io_sync", True) is not False for kv in written)


def ocp_manager(root):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  return ocp.CheckpointManager(root)


# The round trips of a one-checkpoint gs:// -> gs:// migration (8 arrays
# of 1 MiB, its iterator files), counted at a proxy: before the step's
# first upload (planning, the lock, the manifest, the destination's
# listing, the leftovers' removal) and after its commit (the manifest, the
# lock's release). Before they were cut: 53 and 5.
SETUP_REQUESTS = 30
TAIL_REQUESTS = 4


def test_a_bucket_migration_asks_few_questions_before_and_after_its_step(
    gcs, tmp_path, monkeypatch):
  import link_proxy  # pylint: disable=g-import-not-at-top
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  bucket = gcs.bucket()
  rng = np.random.default_rng(5)
  state = {"step": np.int64(7), "params": {
      f"w{i}": rng.standard_normal(2**18).astype(np.float32)
      for i in range(8)}}
  source = _checkpoint_run(gcs, bucket, "run", state)
  destination = f"gs://{bucket}/orbax"
  sent = []  # (url, start, end) of each staged upload
  put = staging._put  # pylint: disable=protected-access

  def recording(local_path, url, data=None):
    start = time.monotonic()
    put(local_path, url, data)
    sent.append((url, start, time.monotonic()))

  monkeypatch.setattr(staging, "_put", recording)
  with link_proxy.LinkProxy(gcs.port) as proxy:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
    storage._INSTANCES.pop("gs", None)  # pylint: disable=protected-access
    try:
      storage.filesystem(destination).fs  # pylint: disable=expression-not-assigned
      proxy.reset()
      summary = migration.migrate(source, destination,
                                  staging_dir=str(tmp_path))
      times = list(proxy.request_times)
      lines = list(proxy.request_lines)
      assert orbax_root.list_steps(destination) == ([7], [])
    finally:
      storage._INSTANCES.pop("gs", None)  # pylint: disable=protected-access
  assert summary.ok, summary.failed
  first = min(start for _, start, _ in sent)
  commit = [end for url, _, end in sent if url.endswith(
      f"/7/{staging.COMMIT_FILE}")]
  assert len(commit) == 1, sent
  setup = [line for t, line in zip(times, lines) if t < first]
  tail = [line for t, line in zip(times, lines) if t > commit[0]]
  assert len(setup) <= SETUP_REQUESTS, (len(setup), setup)
  assert len(tail) <= TAIL_REQUESTS, (len(tail), tail)
  # The source's `.flax` and iterator files are each downloaded whole once
  # (beside the `.flax`'s first MiB, read while planning).
  downloads = [line for line, rng in lines if "alt=media" in line and
               "/run%2F" in line and rng is None]
  assert len(downloads) == len(set(downloads)), downloads


def test_a_killed_runs_leftovers_are_gone_before_anything_goes_up(
    gcs, tmp_path, monkeypatch):
  # The leftovers' removal runs beside the local write; no file of the step
  # may go up before it has ended (it would remove what went up). Here the
  # removal waits for an upload to start (up to 5 s): one that starts is a
  # failure, none starting is the contract.
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  bucket = gcs.bucket()
  state = _state(8)
  source = _checkpoint_run(gcs, bucket, "run", state)
  destination = f"gs://{bucket}/orbax"
  fs = gcs.fs()
  key = destination.split("://", 1)[1]
  fs.pipe_file(f"{key}/7/state/d/leftover", b"x" * 100)  # no commit file
  events = []
  uploading = threading.Event()
  put = staging._put  # pylint: disable=protected-access

  def recording_put(local_path, url, data=None):
    events.append(("put", url))
    uploading.set()
    put(local_path, url, data)

  remove = orbax_target.OrbaxTarget._remove_remote_partial  # pylint: disable=protected-access

  def slow_remove(self, step):
    uploading.wait(5)  # an upload that does not wait for us shows here
    remove(self, step)
    events.append(("removed", step))

  monkeypatch.setattr(staging, "_put", recording_put)
  monkeypatch.setattr(orbax_target.OrbaxTarget, "_remove_remote_partial",
                      slow_remove)
  assert migration.migrate(source, destination,
                           staging_dir=str(tmp_path)).ok
  assert events[0] == ("removed", 7), events[:3]
  assert orbax_root.list_steps(destination) == ([7], [])
  names = _objects(gcs, destination)
  assert "7/state/d/leftover" not in names
  with ocp_manager(destination) as mngr:
    got = mngr.restore(7)["state"]["params"]["kernel"]
  assert np.asarray(got).tobytes() == state["params"]["kernel"].tobytes()


def test_data_files_written_during_the_step_go_up_early_whole_and_once(
    gcs, tmp_path, monkeypatch):
  """While Orbax writes, each settled data file (`d/`) goes up at once,
  under the step's final name, with all its bytes (a large one streamed
  in blocks); `finish` sends the rest, not those again, and commits last.
  A lock or temporary file is not sent while the step is written."""
  monkeypatch.setattr(staging, "SETTLE_SECONDS", 0)
  monkeypatch.setattr(staging, "SINGLE_REQUEST_BYTES", 2**20)
  sent = []
  real_put = staging._put  # pylint: disable=protected-access

  def counting_put(local, url, data=None):
    sent.append(url)
    return real_put(local, url, data)

  monkeypatch.setattr(staging, "_put", counting_put)
  rng = np.random.default_rng(5)
  area, url = tmp_path / "area", f"gs://{gcs.bucket()}/root/7"
  tmp = area / "7.orbax-checkpoint-tmp-123"
  data_dir = tmp / "state" / "ocdbt.process_0" / "d"
  data_dir.mkdir(parents=True)
  big = rng.bytes(20 * 2**20 + 5)  # 3 blocks of 8 MiB, streamed
  small = rng.bytes(1000)
  (data_dir / ("a" * 32)).write_bytes(big)
  (data_dir / ("b" * 32)).write_bytes(small)
  (data_dir / ("c" * 32)).write_bytes(b"")  # empty: sent by finish
  (data_dir / "x.lock").write_bytes(b"lock")
  (tmp / "state" / "manifest.ocdbt").write_bytes(b"manifest")
  uploader = staging.StepUploader(str(area), "7", url, streams=2)
  uploader._poll()  # pylint: disable=protected-access
  uploader._poll()  # pylint: disable=protected-access  (settled: sent)
  uploader._poll()  # pylint: disable=protected-access  (under way: not again)
  for future in uploader._futures:  # pylint: disable=protected-access
    future.result()
  early = {f"state/ocdbt.process_0/d/{n * 32}" for n in "ab"}
  assert set(uploader.uploaded) == early, uploader.uploaded
  assert _objects(gcs, url) == sorted(early)  # nothing committed yet
  # Orbax commits the step locally (TensorStore's lock gone): its final
  # name, its commit file.
  (data_dir / "x.lock").unlink()
  tmp.rename(area / "7")
  (area / "7" / "_CHECKPOINT_METADATA").write_bytes(b"{}")
  (area / "7" / "commit_success.txt").write_bytes(b"done")
  uploader.finish()
  fs = gcs.fs()
  key = url.split("://", 1)[1]
  objects = _objects(gcs, url)
  assert objects == sorted([
      "_CHECKPOINT_METADATA", "commit_success.txt", "state/manifest.ocdbt",
      *early, f"state/ocdbt.process_0/d/{'c' * 32}"]), objects
  base = area / "7"
  for name in objects:
    if name != "commit_success.txt":  # Orbax's text on GCS, naming the URL
      assert fs.cat_file(f"{key}/{name}") == (base / name).read_bytes(), name
  assert fs.cat_file(f"{key}/commit_success.txt").endswith(key.encode())
  assert sorted(sent) == sorted(set(sent)), sent  # each file sent once
  assert sent[-1] == f"{url}/commit_success.txt"
