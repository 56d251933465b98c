"""`clu_ckpt.bucket_upload`: an object appears whole or not at all.

Against the emulators on 127.0.0.1 (tests/emulators.py): fake-gcs-server for
parallel composite uploads (parts composed, then removed) and moto's S3 for
multipart uploads. Parts are made small on GCS (`UPLOAD_BLOCK` patched to
256 KiB, what GCS allows) to keep the tests quick; S3 refuses parts under
5 MiB but the last.
"""

import array
import os
import threading
import time

import pytest

from clu_ckpt import bucket_upload
from clu_ckpt import storage

_KIB = 1024
_MIB = 2**20


@pytest.fixture
def gs_root(gcs):
  return f"gs://{gcs.bucket()}/run"


def _leftovers(emulator, bucket):
  """Temporary parts and unfinished multipart uploads left in `bucket`."""
  fs = emulator.fs()
  if emulator.scheme == "gs":
    return fs.find(f"{bucket}/{bucket_upload.PARTS_PREFIX}")
  return fs.call_s3("list_multipart_uploads", Bucket=bucket).get(
      "Uploads", [])


def _bucket(url):
  return url.split("://", 1)[1].split("/", 1)[0]


def _read(emulator, url):
  return emulator.fs().cat_file(url.split("://", 1)[1])


def test_upload_streams_reads_the_variable(monkeypatch):
  monkeypatch.delenv("CLU_CKPT_BUCKET_UPLOAD_STREAMS", raising=False)
  assert bucket_upload.upload_streams() == bucket_upload.UPLOAD_STREAMS == 4
  monkeypatch.setenv("CLU_CKPT_BUCKET_UPLOAD_STREAMS", "2")
  assert bucket_upload.upload_streams() == 2
  monkeypatch.setenv("CLU_CKPT_BUCKET_UPLOAD_STREAMS", "0")
  with pytest.raises(ValueError, match="CLU_CKPT_BUCKET_UPLOAD_STREAMS='0'"):
    bucket_upload.upload_streams()


@pytest.mark.parametrize("size", [0, 1, 256 * _KIB - 1, 256 * _KIB,
                                  256 * _KIB + 1, 512 * _KIB,
                                  3 * 256 * _KIB + 5])
def test_every_size_arrives_whole_in_parts_of_a_block(gcs, gs_root, size,
                                                      monkeypatch):
  monkeypatch.setattr(bucket_upload, "UPLOAD_BLOCK", 256 * _KIB)
  monkeypatch.setenv("CLU_CKPT_BUCKET_UPLOAD_STREAMS", "2")
  url = f"{gs_root}/blob"
  data = os.urandom(size)
  fs = storage.filesystem(url)
  fs.makedirs(url)
  upload = bucket_upload.PartsUpload(fs, url)
  parts = []
  real = fs.fs.pipe_file

  def counting(path, value, *args, **kwargs):  # sees each request's body
    parts.append(len(value))
    return real(path, value, *args, **kwargs)
  monkeypatch.setattr(fs.fs, "pipe_file", counting)
  for i in range(0, size, 100 * _KIB):  # pieces across the parts' edges
    upload.write(memoryview(data)[i:i + 100 * _KIB])
  if not size:
    upload.write(b"")
  assert not fs.fs.exists(url.split("://", 1)[1])  # nothing before commit
  upload.commit()
  assert _read(gcs, url) == data
  if size <= 256 * _KIB:
    assert parts == [size]  # one request, no parts
  else:
    whole, rest = divmod(size, 256 * _KIB)
    assert sorted(parts) == sorted([256 * _KIB] * whole + ([rest] if rest
                                                            else []))
  assert not _leftovers(gcs, _bucket(url))
  upload.abort()  # after a commit: nothing to undo
  assert _read(gcs, url) == data


def test_writes_of_any_buffer_type(gcs, gs_root, monkeypatch):
  monkeypatch.setattr(bucket_upload, "UPLOAD_BLOCK", 256 * _KIB)
  url = f"{gs_root}/ints"
  numbers = array.array("i", range(100_000))  # 400,000 bytes: two parts
  with storage.atomic_writer(url) as write:
    write(numbers)
    write(bytearray(b"tail"))
  assert _read(gcs, url) == numbers.tobytes() + b"tail"


def test_parts_go_up_in_order_however_they_finish(gcs, gs_root, monkeypatch):
  # 40 parts, composed in rounds of 32: the object is the parts in order.
  monkeypatch.setattr(bucket_upload, "UPLOAD_BLOCK", 256 * _KIB)
  monkeypatch.setenv("CLU_CKPT_BUCKET_UPLOAD_STREAMS", "8")
  url = f"{gs_root}/many"
  data = b"".join(bytes([i]) * (256 * _KIB) for i in range(40)) + b"end"
  with storage.atomic_writer(url) as write:
    write(data)
  assert _read(gcs, url) == data
  assert not _leftovers(gcs, _bucket(url))


class _HttpError(Exception):
  """What gcsfs raises for a 5xx after its retries."""

  def __init__(self, code):
    super().__init__("Service Unavailable")
    self.code = code


_HttpError.__module__ = "gcsfs.retry"


def test_a_failed_part_fails_the_upload_naming_it_and_leaves_nothing(
    gcs, gs_root, monkeypatch):
  monkeypatch.setattr(bucket_upload, "UPLOAD_BLOCK", 256 * _KIB)
  monkeypatch.setenv("CLU_CKPT_BUCKET_UPLOAD_STREAMS", "2")
  url = f"{gs_root}/torn"
  fs = storage.filesystem(url)
  real = fs.fs.pipe_file
  sent = []

  def second_part_fails(path, value, *args, **kwargs):
    if path.endswith("/000002"):
      raise _HttpError(503)
    sent.append(path)
    return real(path, value, *args, **kwargs)
  monkeypatch.setattr(fs.fs, "pipe_file", second_part_fails)
  with pytest.raises(OSError) as raised:
    with storage.atomic_writer(url) as write:
      for _ in range(12):  # the failure is seen by a later write, or commit
        write(os.urandom(256 * _KIB))
  assert raised.value.filename == url
  assert "_HttpError: Service Unavailable" in raised.value.strerror
  assert sent and all(f"/{bucket_upload.PARTS_PREFIX}/" in p for p in sent)
  assert not storage.exists(url)
  assert not _leftovers(gcs, _bucket(url))


def test_a_failed_upload_seen_at_commit_leaves_nothing(gcs, gs_root,
                                                       monkeypatch):
  monkeypatch.setattr(bucket_upload, "UPLOAD_BLOCK", 256 * _KIB)
  url = f"{gs_root}/late"
  fs = storage.filesystem(url)
  real = fs.fs.merge

  def compose_fails(path, paths, *args, **kwargs):
    del path, paths, args, kwargs
    raise _HttpError(503)
  monkeypatch.setattr(fs.fs, "merge", compose_fails)
  with pytest.raises(OSError) as raised:
    with storage.atomic_writer(url) as write:
      write(os.urandom(600 * _KIB))
  assert raised.value.filename == url
  assert not storage.exists(url)
  assert not _leftovers(gcs, _bucket(url))
  monkeypatch.setattr(fs.fs, "merge", real)


def test_abort_before_anything_was_sent_writes_nothing(gcs, gs_root):
  url = f"{gs_root}/never"
  fs = storage.filesystem(url)
  fs.makedirs(url)
  upload = bucket_upload.PartsUpload(fs, url)
  upload.write(b"abc")
  upload.abort()
  upload.abort()  # twice: still nothing
  assert not storage.exists(url)
  assert not _leftovers(gcs, _bucket(url))


def test_an_aborted_multipart_upload_leaves_nothing(s3, monkeypatch):
  monkeypatch.setattr(bucket_upload, "UPLOAD_BLOCK", 5 * _MIB)
  bucket = s3.bucket()
  url = f"s3://{bucket}/run/torn"
  fs = storage.filesystem(url)
  fs.makedirs(url)
  upload = bucket_upload.PartsUpload(fs, url)
  upload.write(os.urandom(5 * _MIB + 1))  # a part sent, an upload open
  assert _leftovers(s3, bucket)
  upload.abort()
  assert not _leftovers(s3, bucket)
  assert not storage.exists(url)
  upload.abort()


def test_a_multipart_upload_joins_its_parts_in_order(s3, monkeypatch):
  monkeypatch.setattr(bucket_upload, "UPLOAD_BLOCK", 5 * _MIB)
  monkeypatch.setenv("CLU_CKPT_BUCKET_UPLOAD_STREAMS", "3")
  bucket = s3.bucket()
  url = f"s3://{bucket}/run/whole"
  data = b"".join(bytes([i]) * (5 * _MIB) for i in range(3)) + b"end"
  with storage.atomic_writer(url) as write:
    write(data)
  assert _read(s3, url) == data
  assert not _leftovers(s3, bucket)
  # Exactly two blocks: no empty third part.
  url = f"s3://{bucket}/run/even"
  with storage.atomic_writer(url) as write:
    write(data[:10 * _MIB])
  assert _read(s3, url) == data[:10 * _MIB]
  assert not _leftovers(s3, bucket)


@pytest.mark.parametrize("parts,merges", [(4, 1), (5, 3), (9, 4)])
def test_compose_rounds_and_where_their_objects_wait(gcs, gs_root, parts,
                                                     merges, monkeypatch):
  # At most _COMPOSE_MAX objects a request: exactly that many need one
  # request; the intermediate objects wait beside the parts, never in the
  # object's directory.
  monkeypatch.setattr(bucket_upload, "UPLOAD_BLOCK", 256 * _KIB)
  monkeypatch.setattr(bucket_upload, "_COMPOSE_MAX", 4)
  url = f"{gs_root}/sub/blob"
  fs = storage.filesystem(url)
  real = fs.fs.merge
  calls = []

  def merge(path, paths, *args, **kwargs):
    calls.append((path, list(paths)))
    return real(path, paths, *args, **kwargs)
  monkeypatch.setattr(fs.fs, "merge", merge)
  data = os.urandom(parts * 256 * _KIB)
  with storage.atomic_writer(url) as write:
    write(data)
  assert _read(gcs, url) == data
  assert len(calls) == merges
  assert calls[-1][0] == url.split("://", 1)[1]
  parts_dir = f"{_bucket(url)}/{bucket_upload.PARTS_PREFIX}/"
  for path, sources in calls:
    assert len(sources) <= 4
    assert all(s.startswith(parts_dir) for s in sources)
  for path, _ in calls[:-1]:
    assert path.startswith(parts_dir)
  assert not _leftovers(gcs, _bucket(url))


def _slowed_parts(fs, monkeypatch, seconds):
  """Makes each GCS part take `seconds`; returns (started, finished) events."""
  real = fs.fs.pipe_file
  started, finished = threading.Event(), threading.Event()

  def slow(path, value, *args, **kwargs):
    if f"/{bucket_upload.PARTS_PREFIX}/" not in path:
      return real(path, value, *args, **kwargs)
    started.set()
    try:
      time.sleep(seconds)
      return real(path, value, *args, **kwargs)
    finally:
      finished.set()
  monkeypatch.setattr(fs.fs, "pipe_file", slow)
  return started, finished


def test_abort_waits_for_a_part_in_flight_before_removing_the_parts(
    gcs, gs_root, monkeypatch):
  # A part still being sent when abort removes the parts would appear
  # after the removal and stay: abort waits for it first.
  monkeypatch.setattr(bucket_upload, "UPLOAD_BLOCK", 256 * _KIB)
  url = f"{gs_root}/in-flight"
  fs = storage.filesystem(url)
  fs.makedirs(url)
  started, finished = _slowed_parts(fs, monkeypatch, 0.5)
  upload = bucket_upload.PartsUpload(fs, url)
  upload.write(os.urandom(256 * _KIB))  # one full part: sent at once
  assert started.wait(10)
  upload.abort()
  assert finished.wait(10)
  assert not storage.exists(url)
  assert not _leftovers(gcs, _bucket(url))


def test_write_waits_while_upload_streams_parts_are_in_flight(
    gcs, gs_root, monkeypatch):
  # Bounded memory: at most upload_streams() parts are held for sending;
  # the next write waits for one of them to finish.
  monkeypatch.setattr(bucket_upload, "UPLOAD_BLOCK", 256 * _KIB)
  monkeypatch.setenv("CLU_CKPT_BUCKET_UPLOAD_STREAMS", "2")
  url = f"{gs_root}/bounded"
  fs = storage.filesystem(url)
  fs.makedirs(url)
  real = fs.fs.pipe_file
  go = threading.Event()
  entered = []

  def held(path, value, *args, **kwargs):
    if f"/{bucket_upload.PARTS_PREFIX}/" in path:
      entered.append(threading.current_thread().name)
      go.wait(20)
    return real(path, value, *args, **kwargs)
  monkeypatch.setattr(fs.fs, "pipe_file", held)
  upload = bucket_upload.PartsUpload(fs, url)
  data = os.urandom(5 * 256 * _KIB)
  writer = threading.Thread(target=upload.write, args=(data,))
  writer.start()
  try:
    deadline = time.monotonic() + 10
    while len(entered) < 2 and time.monotonic() < deadline:
      time.sleep(0.01)
    time.sleep(0.3)  # room for a write that would not wait
    assert len(entered) == 2
    assert writer.is_alive()  # the third part waits for a slot
    # Named for what they do (thread dumps of a hung upload say whose).
    assert all(n.startswith("clu_ckpt-upload") for n in entered), entered
  finally:
    go.set()
    writer.join(20)
  upload.commit()
  assert _read(gcs, url) == data
  assert not _leftovers(gcs, _bucket(url))


def test_parts_that_cannot_be_removed_leave_the_object_whole(
    gcs, gs_root, monkeypatch):
  # Removing the parts is tidying: a store refusing it fails neither the
  # commit (the object is there) nor an abort (its own error is the one
  # raised).
  monkeypatch.setattr(bucket_upload, "UPLOAD_BLOCK", 256 * _KIB)
  url = f"{gs_root}/kept-parts"
  fs = storage.filesystem(url)
  fs.makedirs(url)
  real_rm = fs.fs.rm

  def rm_refused(*args, **kwargs):
    del args, kwargs
    raise _HttpError(503)
  monkeypatch.setattr(fs.fs, "rm", rm_refused)
  upload = bucket_upload.PartsUpload(fs, url)
  data = os.urandom(600 * _KIB)
  upload.write(data)
  upload.commit()
  assert _read(gcs, url) == data
  left = _leftovers(gcs, _bucket(url))
  assert len(left) == 3  # the three parts, left by the refusal

  url = f"{gs_root}/kept-parts-aborted"
  upload = bucket_upload.PartsUpload(fs, url)
  upload.write(os.urandom(600 * _KIB))
  upload.abort()  # does not raise
  assert not storage.exists(url)
  monkeypatch.setattr(fs.fs, "rm", real_rm)
  real_rm(_leftovers(gcs, _bucket(url)))


def test_an_abort_the_store_refuses_is_quiet(s3, monkeypatch):
  # abort runs while another error is on its way up: its own failures are
  # swallowed so that error is the one raised.
  monkeypatch.setattr(bucket_upload, "UPLOAD_BLOCK", 5 * _MIB)
  bucket = s3.bucket()
  url = f"s3://{bucket}/run/refused-abort"
  fs = storage.filesystem(url)
  fs.makedirs(url)
  real = fs.fs.call_s3

  def no_abort(method, *args, **kwargs):
    if method == "abort_multipart_upload":
      raise _HttpError(503)
    return real(method, *args, **kwargs)
  upload = bucket_upload.PartsUpload(fs, url)
  upload.write(os.urandom(5 * _MIB + 1))
  monkeypatch.setattr(fs.fs, "call_s3", no_abort)
  upload.abort()  # does not raise
  assert not storage.exists(url)
  monkeypatch.setattr(fs.fs, "call_s3", real)
  (open_upload,) = _leftovers(s3, bucket)
  fs.fs.call_s3("abort_multipart_upload", Bucket=bucket,
                Key=open_upload["Key"], UploadId=open_upload["UploadId"])


def test_a_multipart_upload_the_store_refuses_to_open_names_the_url(
    s3, monkeypatch):
  monkeypatch.setattr(bucket_upload, "UPLOAD_BLOCK", 5 * _MIB)
  bucket = s3.bucket()
  url = f"s3://{bucket}/run/never-opened"
  fs = storage.filesystem(url)
  real = fs.fs.call_s3

  def no_create(method, *args, **kwargs):
    if method == "create_multipart_upload":
      raise _HttpError(503)
    return real(method, *args, **kwargs)
  monkeypatch.setattr(fs.fs, "call_s3", no_create)
  with pytest.raises(OSError) as raised:
    with storage.atomic_writer(url) as write:
      write(os.urandom(5 * _MIB + 1))
  assert raised.value.filename == url
  assert "Service Unavailable" in raised.value.strerror
  assert not storage.exists(url)
  assert not _leftovers(s3, bucket)
