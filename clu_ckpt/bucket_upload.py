"""Uploads to a bucket: one request, or parts sent in parallel and joined by the store.

`PartsUpload` takes an object's bytes as they are written. Up to
`UPLOAD_BLOCK` bytes go up as one request at `commit`. A larger object goes
up as parts of `UPLOAD_BLOCK` bytes, `upload_streams()` at a time (4,
`CLU_CKPT_BUCKET_UPLOAD_STREAMS`), which the store joins at `commit`:

- GCS: a parallel composite upload, as `gcloud storage` makes: the parts are
  temporary objects under `PARTS_PREFIX`, composed into the object (in
  rounds of 32), then removed;
- S3: a multipart upload, completed.

The object appears whole or not at all: `abort` (and a failed part) removes
the parts or aborts the multipart upload, and no object appears.

Synopsis::

  from clu_ckpt import bucket_upload

  upload = bucket_upload.PartsUpload(fs, "gs://b/run/ckpt-3.flax")
  try:
    upload.write(data)                  # parts go up as they fill
    upload.commit()                     # the object appears
  except BaseException:
    upload.abort()                      # nothing is left behind
    raise
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import uuid
from typing import Any, Optional

from clu_ckpt import bucket_client

# Uploads are sent in parts of this many bytes (GCS wants multiples of 256
# KiB, S3 parts of at least 5 MiB), UPLOAD_STREAMS parts at a time (the
# environment variable CLU_CKPT_BUCKET_UPLOAD_STREAMS overrides it): an
# object larger than one part goes up as parts the store joins into the
# object (GCS: a parallel composite upload, `compose`; S3: a multipart
# upload). The clients hold each part about 3 times while it is sent: 4 x 8
# MiB parts in flight peak at ~100 MiB of anonymous memory (8 at ~190 MiB).
UPLOAD_BLOCK = 8 * 2**20
UPLOAD_STREAMS = 4
# GCS composes at most this many objects in one request.
_COMPOSE_MAX = 32
# Where GCS parts wait to be composed: beside the bucket's objects, under
# this prefix (removed when the upload ends, well or not).
PARTS_PREFIX = ".clu_ckpt-parts"


def upload_streams() -> int:
  """How many parts an upload sends at once.

  `CLU_CKPT_BUCKET_UPLOAD_STREAMS` when set (a positive integer), else
  `UPLOAD_STREAMS`; read at each call.

  Raises:
    ValueError: The variable is set to anything but a positive integer.
  """
  return bucket_client.positive_int_setting(
      "CLU_CKPT_BUCKET_UPLOAD_STREAMS", UPLOAD_STREAMS)



class PartsUpload:
  """One object's upload: a single request, or parts sent in parallel.

  Args:
    owner: The `fsspec_fs.FsspecFileSystem` (its client, its errors).
    path: The object's URL.
  """

  def __init__(self, owner: Any, path: str):
    self._owner, self._path = owner, path
    self._fs = owner.fs
    self._key = owner._key(path)  # pylint: disable=protected-access
    self._s3 = bucket_client.package_of(self._fs) == "s3fs"
    self._buf = bytearray()
    self._parts: dict[int, Any] = {}  # number -> GCS part name / S3 ETag
    self._futures: list[concurrent.futures.Future] = []
    self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
    self._slots: Optional[threading.BoundedSemaphore] = None
    self._upload_id: Optional[str] = None
    self._tmp = f"{PARTS_PREFIX}/{uuid.uuid4().hex}"
    self._done = False

  def write(self, data: Any) -> None:
    """Takes the next bytes of the object; sends each full part."""
    view = memoryview(data).cast("B")
    while view:
      take = min(UPLOAD_BLOCK - len(self._buf), len(view))
      self._buf += view[:take]
      view = view[take:]
      if len(self._buf) >= UPLOAD_BLOCK:
        self._send()

  def _send(self) -> None:
    """Sends the buffered bytes as the next part."""
    if self._pool is None:
      width = upload_streams()
      self._pool = concurrent.futures.ThreadPoolExecutor(
          width, thread_name_prefix="clu_ckpt-upload")
      self._slots = threading.BoundedSemaphore(width)
      if self._s3:
        bucket, key = self._key.split("/", 1)
        with self._owner._naming(self._path):  # pylint: disable=protected-access
          self._upload_id = self._fs.call_s3(
              "create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    self._check()
    self._slots.acquire()  # at most upload_streams() parts in flight
    number = len(self._futures) + 1
    data = bytes(self._buf)  # the buffer is dropped: one copy in flight
    self._buf = bytearray()
    try:
      future = self._pool.submit(self._put, number, data)
    except BaseException:
      self._slots.release()
      raise
    future.add_done_callback(lambda _: self._slots.release())
    self._futures.append(future)

  def _put(self, number: int, part: bytes) -> None:
    bucket, key = self._key.split("/", 1)
    with self._owner._naming(self._path):  # pylint: disable=protected-access
      if self._s3:
        out = self._fs.call_s3(
            "upload_part", Bucket=bucket, Key=key, UploadId=self._upload_id,
            PartNumber=number, Body=part)
        self._parts[number] = out["ETag"]
      else:
        name = f"{bucket}/{self._tmp}/{number:06d}"
        self._parts[number] = name  # to remove, even if the upload fails
        self._fs.pipe_file(name, part)

  def _check(self) -> None:
    """Raises the first failure of a part sent so far."""
    for future in self._futures:
      if future.done() and future.exception() is not None:
        raise future.exception()

  def commit(self) -> None:
    """Sends what is left and makes the object appear (joins the parts)."""
    if self._pool is None:  # small: one request
      self._fs.pipe_file(self._key, bytes(self._buf))
      self._done = True
      return
    if self._buf or not self._futures:
      self._send()
    for future in self._futures:
      future.result()
    self._join()
    self._done = True
    self._pool.shutdown()

  def _join(self) -> None:
    """The store joins the parts sent into the object (and forgets them)."""
    bucket, key = self._key.split("/", 1)
    if self._s3:
      self._fs.call_s3(
          "complete_multipart_upload", Bucket=bucket, Key=key,
          UploadId=self._upload_id, MultipartUpload={"Parts": [
              {"PartNumber": n, "ETag": self._parts[n]}
              for n in sorted(self._parts)]})
    else:
      self._compose([self._parts[n] for n in sorted(self._parts)])
      self._remove_parts()

  def _compose(self, names: list[str]) -> None:
    """Joins `names` into the object (in rounds of at most 32 each)."""
    level = 0
    while len(names) > _COMPOSE_MAX:
      level += 1
      bucket = self._key.split("/", 1)[0]
      joined = []
      for i in range(0, len(names), _COMPOSE_MAX):
        name = f"{bucket}/{self._tmp}/c{level}-{i:06d}"
        self._parts[f"c{level}-{i}"] = name
        self._fs.merge(name, names[i:i + _COMPOSE_MAX])
        joined.append(name)
      names = joined
    self._fs.merge(self._key, names)

  def _remove_parts(self) -> None:
    names = [v for v in self._parts.values() if isinstance(v, str) and
             "/" + PARTS_PREFIX + "/" in "/" + v]
    if names:
      with contextlib.suppress(Exception):
        self._fs.rm(names)

  def abort(self) -> None:
    """Stops the upload and removes what it sent; nothing appears."""
    if self._done:
      return
    if self._pool is not None:
      for future in self._futures:
        future.cancel()
      self._pool.shutdown(wait=True)
      if self._s3 and self._upload_id:
        bucket, key = self._key.split("/", 1)
        with contextlib.suppress(Exception):
          self._fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key,
                           UploadId=self._upload_id)
      if not self._s3:
        self._remove_parts()
    self._done = True

