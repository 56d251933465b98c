"""Reads from buckets fetch what they use: bytes and requests counted at a proxy.

Every test runs on fake-gcs-server and moto's S3 (`bucket_store`), with the
client pointed at a `link_proxy.LinkProxy` on 127.0.0.1 in front of the
emulator, which counts the bytes downloaded and the requests made.
"""

import json
import os

import numpy as np
import pytest

import link_proxy
from clu_ckpt import bucket_spool
from clu_ckpt import bucket_upload
from clu_ckpt import flax_format
from clu_ckpt import flax_ranges
from clu_ckpt import fsspec_fs
from clu_ckpt import inspection
from clu_ckpt import storage

_MIB = 2**20


@pytest.fixture
def proxy(bucket_store, monkeypatch):
  """The emulator, reached through a counting proxy by this process."""
  with link_proxy.LinkProxy(bucket_store.port) as p:
    if bucket_store.scheme == "gs":
      monkeypatch.setenv("STORAGE_EMULATOR_HOST", p.url)
    else:
      monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
      monkeypatch.setenv("AWS_ENDPOINT_URL_S3", p.url)
    storage._INSTANCES.pop(bucket_store.scheme, None)  # pylint: disable=protected-access
    flax_ranges.cache_clear()
    p.store = bucket_store
    yield p
  storage._INSTANCES.pop(bucket_store.scheme, None)  # pylint: disable=protected-access
  flax_ranges.cache_clear()


def _state(layers=4, kib=1024):
  rng = np.random.default_rng(0)
  n = kib * 1024 // 4
  return {
      "step": np.int64(1234),
      "params": {f"layer_{i}": {"kernel": rng.standard_normal(n).astype(
          np.float32), "bias": np.arange(8, dtype=np.float32) + i}
                 for i in range(layers)},
      "opt_state": {"count": np.int32(7), "lr": 0.001,
                    "mu": {f"layer_{i}": rng.standard_normal(n // 2).astype(
                        np.float16) for i in range(layers)}},
  }


def _upload(proxy, state, name="ckpt-1.flax"):
  url = f"{proxy.store.scheme}://{proxy.store.bucket()}/run/{name}"
  data = flax_format.save(state)
  proxy.store.fs().pipe_file(url.split("://", 1)[1], data)
  proxy.reset()
  return url, len(data)


def _budget(size, wanted=0):
  """What a headers-and-wanted-arrays read may download (issue's bound)."""
  return wanted + size // 50 + 2 * _MIB


def test_a_small_subtree_downloads_headers_only(proxy):
  state = _state(layers=6, kib=2048)  # ~19 MiB
  url, size = _upload(proxy, state)
  step = flax_format.load_file(url, subtree="step")
  assert step == 1234
  assert proxy.down < _budget(size), (proxy.down, size)
  assert proxy.down < size / 4
  # A few round trips: metadata, then one per large array skipped.
  assert proxy.requests <= 3, proxy.request_lines


def test_one_array_downloads_that_array(proxy):
  state = _state(layers=6, kib=2048)
  url, size = _upload(proxy, state)
  kernel = flax_format.load_file(url, subtree="params/layer_3/kernel")
  np.testing.assert_array_equal(kernel, state["params"]["layer_3"]["kernel"])
  assert proxy.down < _budget(size, kernel.nbytes), (proxy.down, size)
  assert proxy.down < kernel.nbytes + size / 4
  layer = flax_format.load_file(url, subtree=("params", "layer_4"))
  np.testing.assert_array_equal(layer["kernel"],
                                state["params"]["layer_4"]["kernel"])
  np.testing.assert_array_equal(layer["bias"], state["params"]["layer_4"]["bias"])


def test_writable_subtree_and_chunked_arrays(proxy, monkeypatch):
  monkeypatch.setattr(flax_format, "CHUNK_BYTES", 300_000)
  state = _state(layers=3, kib=1024)
  url, size = _upload(proxy, state)
  kernel = flax_format.load_file(url, subtree="params/layer_1/kernel",
                                 writable=True)
  np.testing.assert_array_equal(kernel, state["params"]["layer_1"]["kernel"])
  assert proxy.down < _budget(size, kernel.nbytes)
  loaded = flax_format.load_file(url)
  np.testing.assert_array_equal(loaded["opt_state"]["mu"]["layer_2"],
                                state["opt_state"]["mu"]["layer_2"])


def test_inspect_reads_headers_once(proxy):
  state = _state(layers=6, kib=2048)
  url, size = _upload(proxy, state)
  leaves = flax_format.inspect_file(url)
  assert [l.path for l in leaves][:2] == ["/step", "/params/layer_0/kernel"]
  first = proxy.down
  assert first < _budget(size)
  assert first < size / 4
  # The same object again (another caller of the same operation): its
  # headers are not downloaded again, one metadata request only.
  proxy.reset()
  with flax_format.FlaxFile(url, read_data=False) as f:
    assert f.nbytes == sum(l.nbytes for l in leaves)
    assert int(f.subtree("step")) == 1234
  assert proxy.down < 64 * 1024 and proxy.requests <= 1, proxy.request_lines


def test_inspect_and_verify_of_a_bucket_file_read_headers(proxy):
  state = _state(layers=6, kib=2048)
  url, size = _upload(proxy, state)
  report = inspection.verify_path(url)
  assert report["ok"], report
  assert proxy.down < _budget(size), (proxy.down, size)
  proxy.reset()
  flax_ranges.cache_clear()
  text = inspection.format_inspect(inspection.inspect_path(url))
  assert "layer_5" in text or "1234" in text, text
  assert proxy.down < _budget(size), (proxy.down, size)
  assert proxy.down < size / 4


def test_whole_tree_after_headers_fetches_each_byte_once(proxy, monkeypatch):
  monkeypatch.setattr(bucket_spool, "SPOOL_CHUNK", 512 * 1024)
  state = _state(layers=6, kib=2048)
  url, size = _upload(proxy, state)
  with flax_format.FlaxFile(url, read_data=False) as f:
    assert len(f.leaves) == 21
    tree = f.tree
    np.testing.assert_array_equal(tree["params"]["layer_5"]["kernel"],
                                  state["params"]["layer_5"]["kernel"])
  # Each byte once: the file, plus HTTP headers and one metadata answer.
  assert size <= proxy.down <= size + 4096 * proxy.requests, (
      proxy.down, size, proxy.requests)


def test_map_keeps_n_reads_in_flight(proxy, monkeypatch):
  monkeypatch.setattr(bucket_spool, "SPOOL_CHUNK", 256 * 1024)
  monkeypatch.setenv("CLU_CKPT_BUCKET_STREAMS", "6")
  data = os.urandom(5 * _MIB + 17)
  url = f"{proxy.store.scheme}://{proxy.store.bucket()}/run/blob"
  proxy.store.fs().pipe_file(url.split("://", 1)[1], data)
  storage._INSTANCES.pop(proxy.store.scheme, None)  # pylint: disable=protected-access
  proxy.reset()  # a fresh client: no pooled connections
  proxy.rtt = 0.05  # so that reads overlap visibly
  try:
    buf = storage.map_file(url)
  finally:
    proxy.rtt = 0.0
  assert bytes(buf) == data
  ranged = [r for _, r in proxy.request_lines if r]
  assert len(ranged) == 21  # each byte once, in 256 KiB ranges
  assert proxy.max_open >= 6, proxy.max_open


def test_streams_setting_is_checked(monkeypatch):
  monkeypatch.setenv("CLU_CKPT_BUCKET_STREAMS", "0")
  with pytest.raises(ValueError, match="CLU_CKPT_BUCKET_STREAMS"):
    fsspec_fs.streams()
  monkeypatch.setenv("CLU_CKPT_BUCKET_STREAMS", "3")
  assert fsspec_fs.streams() == 3
  monkeypatch.setenv("CLU_CKPT_BUCKET_UPLOAD_STREAMS", "x")
  with pytest.raises(ValueError, match="CLU_CKPT_BUCKET_UPLOAD_STREAMS"):
    fsspec_fs.upload_streams()


def test_a_corrupt_file_is_fetched_whole_and_named(proxy):
  state = _state(layers=2, kib=256)
  url, size = _upload(proxy, state)
  key = url.split("://", 1)[1]
  data = proxy.store.fs().cat_file(key)
  proxy.store.fs().pipe_file(key, data[:-100])  # truncated
  with pytest.raises(flax_format.FlaxFormatError, match="ckpt-1.flax"):
    flax_format.inspect_file(url)
  with pytest.raises(flax_format.FlaxFormatError, match="truncated"):
    flax_format.load_file(url, subtree="opt_state")
  proxy.store.fs().pipe_file(key, data + b"\xc0")  # trailing bytes
  with pytest.raises(flax_format.FlaxFormatError, match="extra data"):
    flax_format.inspect_file(url)


# -- writes: parts in parallel, joined by the store ---------------------------


def _leftovers(proxy, bucket):
  """Temporary parts and unfinished multipart uploads left in `bucket`."""
  fs = proxy.store.fs()
  if proxy.store.scheme == "gs":
    return fs.find(f"{bucket}/{fsspec_fs.PARTS_PREFIX}")
  out = fs.call_s3("list_multipart_uploads", Bucket=bucket)
  return out.get("Uploads", [])


def test_a_large_object_goes_up_in_parallel_parts(proxy, monkeypatch):
  monkeypatch.setattr(bucket_upload, "UPLOAD_BLOCK", 5 * _MIB)
  monkeypatch.setenv("CLU_CKPT_BUCKET_UPLOAD_STREAMS", "4")
  bucket = proxy.store.bucket()
  url = f"{proxy.store.scheme}://{bucket}/run/ckpt-1.flax"
  data = os.urandom(23 * _MIB + 5)
  storage.makedirs(url)  # the bucket checked, by the client used below
  proxy.reset()
  proxy.rtt = 0.05  # so that parts overlap visibly
  try:
    with storage.atomic_writer(url) as write:
      for i in range(0, len(data), 3 * _MIB):
        write(memoryview(data)[i:i + 3 * _MIB])
  finally:
    proxy.rtt = 0.0
  assert proxy.max_open >= 4, proxy.max_open
  assert proxy.up < len(data) * 1.05  # each byte sent once
  assert proxy.store.fs().cat_file(url.split("://", 1)[1]) == data
  assert storage.listdir(f"{proxy.store.scheme}://{bucket}/run") == [
      "ckpt-1.flax"]
  assert not _leftovers(proxy, bucket)


def test_a_failed_parallel_upload_leaves_nothing(proxy, monkeypatch):
  monkeypatch.setattr(bucket_upload, "UPLOAD_BLOCK", 5 * _MIB)
  monkeypatch.setenv("CLU_CKPT_BUCKET_UPLOAD_STREAMS", "3")
  bucket = proxy.store.bucket()
  url = f"{proxy.store.scheme}://{bucket}/run/ckpt-1.flax"
  with pytest.raises(KeyError):
    with storage.atomic_writer(url) as write:
      write(os.urandom(12 * _MIB))  # two parts sent
      raise KeyError("killed")
  assert not storage.exists(url)
  assert not _leftovers(proxy, bucket)
  # An old object stays as it was.
  with storage.atomic_writer(url) as write:
    write(b"old")
  with pytest.raises(KeyError):
    with storage.atomic_writer(url) as write:
      write(os.urandom(11 * _MIB))
      raise KeyError("killed")
  assert storage.read_bytes(url) == b"old"
  assert not _leftovers(proxy, bucket)


def test_many_parts_are_composed_in_rounds(proxy, monkeypatch):
  if proxy.store.scheme != "gs":
    pytest.skip("GCS composes at most 32 objects a request; S3 has no limit")
  monkeypatch.setattr(bucket_upload, "UPLOAD_BLOCK", 256 * 1024)
  monkeypatch.setattr(bucket_upload, "_COMPOSE_MAX", 4)
  bucket = proxy.store.bucket()
  url = f"gs://{bucket}/run/blob"
  data = os.urandom(19 * 256 * 1024 + 7)  # 20 parts: 5, then 2 rounds
  with storage.atomic_writer(url) as write:
    write(data)
  assert storage.read_bytes(url) == data
  assert not _leftovers(proxy, bucket)


# --------------------------------------------------------------------------
# A migration from a bucket: each source file downloaded once, and the
# arrays downloaded as the writer reaches them.
# --------------------------------------------------------------------------

_GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                       "shared", "fixtures", "clu-0.0.12", "single_host")


def _downloads(proxy):
  """{object name: downloads of its bytes} among the proxy's requests."""
  import collections  # pylint: disable=g-import-not-at-top
  import urllib.parse  # pylint: disable=g-import-not-at-top
  out = collections.Counter()
  for line, _ in proxy.request_lines:
    method, target = line.split()[:2]
    path, _, query = target.partition("?")
    if method != "GET" or "list-type" in query or "prefix=" in query:
      continue
    if proxy.store.scheme == "gs" and "alt=media" not in query:
      continue  # a metadata request
    name = urllib.parse.unquote(path).rstrip("/").rsplit("/", 1)[-1]
    out[name] += 1
  return out


@pytest.mark.thorough("s3")  # the same code as on gs://
def test_a_migration_downloads_each_source_file_once(proxy, tmp_path):
  if not os.path.isdir(_GOLDEN):
    pytest.skip(f"golden fixture {_GOLDEN} is not available")
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  src = proxy.store.upload(_GOLDEN, "run")
  proxy.reset()
  summary = migration.migrate(src, str(tmp_path / "orbax"))
  assert summary.ok, summary.failed
  downloads = _downloads(proxy)
  files = [n for n in os.listdir(_GOLDEN) if n.startswith("ckpt-")]
  assert len(files) == 9
  # .index, .data-* and .flax of each checkpoint: once each (they were read
  # 2 to 4 times: planning, the iterator's checks, the dataset item).
  assert {n: downloads[n] for n in files} == {n: 1 for n in files}, (
      downloads, proxy.request_lines)


def test_will_need_on_a_spool_fetches_that_range(proxy):
  from clu_ckpt.migration import memory  # pylint: disable=g-import-not-at-top
  state = _state(layers=4, kib=2048)
  url, size = _upload(proxy, state)
  spool = storage.filesystem(url).spool(url)
  view = np.frombuffer(spool.map, np.uint8)[3 * _MIB:4 * _MIB]
  assert not view.any()  # not fetched: the sparse file's zeros
  memory.will_need(view)
  assert spool.has(3 * _MIB, 4 * _MIB)
  assert _MIB <= proxy.down < _MIB + 64 * 1024, proxy.down
  data = proxy.store.fs().cat_file(url.split("://", 1)[1], start=3 * _MIB,
                                    end=4 * _MIB)
  assert view.tobytes() == data


def test_streaming_tree_leaves_the_arrays_for_later(proxy):
  state = _state(layers=6, kib=2048)
  url, size = _upload(proxy, state)
  with flax_format.FlaxFile(url, read_data=False) as f:
    tree = f.streaming_tree()
    assert len(f.leaves) == 21
    assert int(tree["step"]) == 1234
    assert tree["opt_state"]["lr"] == 0.001
    # The headers and small values only; the arrays are advised, then read.
    assert proxy.down < _budget(size), (proxy.down, size)
    kernel = tree["params"]["layer_3"]["kernel"]
    from clu_ckpt.migration import memory  # pylint: disable=g-import-not-at-top
    memory.will_need(kernel)
    np.testing.assert_array_equal(kernel, state["params"]["layer_3"]["kernel"])
    assert proxy.down < _budget(size, kernel.nbytes), (proxy.down, size)
    # `tree` is whole: every byte, each once.
    whole = f.tree
    np.testing.assert_array_equal(whole["opt_state"]["mu"]["layer_5"],
                                  state["opt_state"]["mu"]["layer_5"])
  assert size <= proxy.down <= size + 4096 * proxy.requests


_OVERLAP_CHILD = """
import json, sys
from clu_ckpt import migration
from clu_ckpt.migration import orbax_target
# The direct write's read-ahead (a staged step's: test_migration_staging).
orbax_target.STAGE_BUCKET_STEPS = False
summary = migration.migrate(sys.argv[1], sys.argv[2], verify=True,
                            inflight_bytes=2 * 2**20)
print(json.dumps({"ok": summary.ok, "failed": [str(f) for f in summary.failed]}))
"""


def test_a_bucket_migration_downloads_arrays_while_it_uploads(gcs):
  # gs:// -> gs:// through one counting proxy, in a child process (its
  # TensorStore reaches the emulator through the proxy too).
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(1)
  state = {"step": np.int64(3), "params": {
      f"w{i}": rng.standard_normal(2 * _MIB // 4).astype(np.float32)
      for i in range(8)}}
  bucket = gcs.bucket()
  fs = gcs.fs()
  fs.pipe_file(f"{bucket}/run/ckpt-3.flax", flax_format.save(state))
  fs.pipe_file(f"{bucket}/run/checkpoint",  # a run of the .flax alone
               b'model_checkpoint_path: "ckpt-3"\n'
               b'all_model_checkpoint_paths: "ckpt-3"\n')
  with link_proxy.LinkProxy(gcs.port) as p:
    env = gcs.child_env(STORAGE_EMULATOR_HOST=p.url,
                        TENSORSTORE_GCS_HTTP_URL=p.url)
    done = subprocess.run(
        [sys.executable, "-c", _OVERLAP_CHILD, f"gs://{bucket}/run",
         f"gs://{bucket}/orbax"], env=env, capture_output=True, text=True,
        timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ok"], result  # verified against the source
    lines = [line for line, _ in p.request_lines]
  flax_reads = [i for i, line in enumerate(lines)
                if "ckpt-3.flax" in line and "alt=media" in line]
  uploads = [i for i, line in enumerate(lines)
             if line.startswith(("POST", "PUT")) and
             "orbax/3/state/" in line.replace("%2F", "/")]
  assert flax_reads and uploads, [l for l in lines if not l.startswith("GET")]
  # The arrays are downloaded as the writer reaches them: some after the
  # state's first upload (the whole file was downloaded before any).
  assert flax_reads[-1] > uploads[0], (flax_reads, uploads, lines)


def test_object_cache_keeps_the_source_only(proxy):
  from clu_ckpt import bucket_cache  # pylint: disable=g-import-not-at-top
  bucket = proxy.store.bucket()
  root = f"{proxy.store.scheme}://{bucket}"
  fs = proxy.store.fs()
  for name in ("run/ckpt-1.index", "run/orbax/lock", "run-1/ckpt-1.index",
               "other/a"):
    fs.pipe_file(f"{bucket}/{name}", name.encode())
  proxy.reset()
  with bucket_cache.object_cache(f"{root}/run", but_not=f"{root}/run/orbax"):
    for _ in range(3):
      for name in ("run/ckpt-1.index", "run/orbax/lock", "run-1/ckpt-1.index",
                   "other/a"):
        assert storage.read_bytes(f"{root}/{name}") == name.encode()
    assert storage.filesystem(root).read_bytes(
        f"{root}/run/ckpt-1.index", 4, 5) == b"ckpt-"
    downloads = _downloads(proxy)
    # The source's (a multi-host run's `-1` directory too) once; what is
    # under the destination (a lock others write) and elsewhere each time.
    assert downloads["ckpt-1.index"] == 2, downloads  # run/ and run-1/
    assert downloads["lock"] == 3 and downloads["a"] == 3, downloads
    # A write through this module forgets the object.
    with storage.atomic_writer(f"{root}/run/ckpt-1.index") as write:
      write(b"new")
    assert storage.read_bytes(f"{root}/run/ckpt-1.index") == b"new"
  proxy.reset()
  storage.read_bytes(f"{root}/run/ckpt-1.index")  # outside: no cache
  storage.read_bytes(f"{root}/run/ckpt-1.index")
  assert _downloads(proxy)["ckpt-1.index"] == 2


@pytest.mark.thorough("s3")  # the same code as on gs://
def test_a_failed_fetch_of_a_streamed_array_fails_the_step(proxy, tmp_path,
                                                            monkeypatch):
  # The arrays are fetched as Orbax's writer advises them: a read that
  # fails there must fail the step, never let it write the spool's zeros.
  from clu_ckpt import bucket_cache  # pylint: disable=g-import-not-at-top
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  # Not a small object (those are copied whole when first opened).
  monkeypatch.setattr(bucket_cache, "SMALL_OBJECT_BYTES", 64 * 1024)
  state = {"step": np.int64(3), "params": {
      f"w{i}": np.full(_MIB // 4, i + 1, np.float32) for i in range(4)}}
  bucket = proxy.store.bucket()
  fs = proxy.store.fs()
  fs.pipe_file(f"{bucket}/run/ckpt-3.flax", flax_format.save(state))
  fs.pipe_file(f"{bucket}/run/checkpoint",
               b'model_checkpoint_path: "ckpt-3"\n')
  streaming = flax_format.FlaxFile.streaming_tree

  def then_fail(self):
    tree = streaming(self)

    def broken(*args, **kwargs):
      raise OSError(5, "link down", self.path)

    monkeypatch.setattr(fsspec_fs.FsspecFileSystem, "fetch_into", broken)
    return tree

  monkeypatch.setattr(flax_format.FlaxFile, "streaming_tree", then_fail)
  dst = tmp_path / "orbax"
  summary = migration.migrate(f"{proxy.store.scheme}://{bucket}/run",
                              str(dst))
  assert not summary.ok
  (failed,) = summary.failed
  assert "could not be fetched" in failed.error and "link down" in (
      failed.error), failed.error
  from clu_ckpt import orbax_root  # pylint: disable=g-import-not-at-top
  assert orbax_root.list_steps(str(dst))[0] == []


def test_object_cache_prefix_is_the_run_and_its_hosts_not_siblings():
  from clu_ckpt import bucket_cache  # pylint: disable=g-import-not-at-top
  with bucket_cache.object_cache("gs://b/run", but_not="gs://b/run/orbax"):
    kept = {key: bucket_cache.caching_objects(key) for key in (
        "gs://b/run/ckpt-1.index", "gs://b/run-1/ckpt-1.index",
        "gs://b/run2/ckpt-1.index", "gs://b/run_old/ckpt-1.index",
        "gs://b/run-x/ckpt-1.index", "gs://b/run/orbax/lock")}
  assert kept == {"gs://b/run/ckpt-1.index": True,
                  "gs://b/run-1/ckpt-1.index": True,
                  "gs://b/run2/ckpt-1.index": False,
                  "gs://b/run_old/ckpt-1.index": False,
                  "gs://b/run-x/ckpt-1.index": False,
                  "gs://b/run/orbax/lock": False}


def test_a_nested_object_cache_excludes_its_own_but_not_while_it_runs():
  # A migration inside another operation's block (the fleet's, a test's):
  # the inner block's destination must not be kept by the outer block.
  from clu_ckpt import bucket_cache  # pylint: disable=g-import-not-at-top
  with bucket_cache.object_cache("gs://b/run"):
    assert bucket_cache.caching_objects("gs://b/run/dst/lock")
    with bucket_cache.object_cache("gs://b/run", but_not="gs://b/run/dst"):
      assert not bucket_cache.caching_objects("gs://b/run/dst/lock")
      assert bucket_cache.caching_objects("gs://b/run/ckpt-1.index")
      assert bucket_cache.caching_objects("gs://b/run/dst2/x")
    assert bucket_cache.caching_objects("gs://b/run/dst/lock")


def test_a_nested_object_cache_forgets_what_its_but_not_covers(proxy):
  from clu_ckpt import bucket_cache  # pylint: disable=g-import-not-at-top
  bucket = proxy.store.bucket()
  root = f"{proxy.store.scheme}://{bucket}"
  fs = proxy.store.fs()
  fs.pipe_file(f"{bucket}/run/dst/lock", b"one")
  with bucket_cache.object_cache(f"{root}/run"):
    assert storage.read_bytes(f"{root}/run/dst/lock") == b"one"
    with bucket_cache.object_cache(f"{root}/run", but_not=f"{root}/run/dst"):
      fs.pipe_file(f"{bucket}/run/dst/lock", b"two")  # another's write
      assert storage.read_bytes(f"{root}/run/dst/lock") == b"two"


@pytest.mark.thorough("s3")  # the same code as on gs://
def test_small_flax_files_peeked_at_are_not_downloaded_twice(
    proxy, tmp_path, monkeypatch):
  # Planning peeks at every `.flax` before any is written; a small one kept
  # whole then could be dropped by the cache's limit before its turn and be
  # downloaded again. Each is now downloaded whole once (plus its first
  # PEEK_BYTES at planning).
  import collections  # pylint: disable=g-import-not-at-top
  import urllib.parse  # pylint: disable=g-import-not-at-top
  from clu_ckpt import bucket_cache  # pylint: disable=g-import-not-at-top
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  from clu_ckpt.migration import plan  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(bucket_cache, "OBJECT_CACHE_BYTES", 5 * _MIB)
  bucket = proxy.store.bucket()
  fs = proxy.store.fs()
  sizes = {}
  for n in range(1, 5):
    state = {"step": np.int64(n), "params": {
        "w": np.full(3 * _MIB // 4, n, np.float32)}}
    data = flax_format.save(state)
    sizes[f"ckpt-{n}.flax"] = len(data)
    fs.pipe_file(f"{bucket}/run/ckpt-{n}.flax", data)
  fs.pipe_file(f"{bucket}/run/checkpoint", (
      'model_checkpoint_path: "ckpt-4"\n' + "".join(
          f'all_model_checkpoint_paths: "ckpt-{n}"\n' for n in range(1, 5)) +
      "".join(f"all_model_checkpoint_timestamps: 170000000{n}.5\n"
              for n in range(1, 5)) + "last_preserved_timestamp: 1.0\n"
  ).encode())
  proxy.reset()
  summary = migration.migrate(f"{proxy.store.scheme}://{bucket}/run",
                              str(tmp_path / "orbax"))
  assert summary.ok, summary.failed
  assert len(summary.steps) == 4, summary
  down = collections.Counter()
  for line, rng in proxy.request_lines:
    method, target = line.split()[:2]
    path, _, query = target.partition("?")
    name = urllib.parse.unquote(path).rstrip("/").rsplit("/", 1)[-1]
    if method != "GET" or name not in sizes or (
        proxy.store.scheme == "gs" and "alt=media" not in query):
      continue
    if rng is None:
      down[name] += sizes[name]
    else:
      start, _, end = rng.split("=", 1)[1].partition("-")
      down[name] += min(int(end) + 1, sizes[name]) - int(start)
  assert down == {name: size + plan.PEEK_BYTES
                  for name, size in sizes.items()}, (down, proxy.request_lines)
