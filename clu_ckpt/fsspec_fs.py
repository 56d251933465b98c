"""The object-store back end of `filesystem.FileSystem`: `gs://` and `s3://`.

Built on fsspec (`gcsfs` for `gs://`, `s3fs` for `s3://`; the extras
`[gcs]` and `[s3]` of a checkout install them). TensorFlow is never
imported here: a Colab reads a bucket's checkpoint with these two packages.

How the store's semantics map onto the seam:

- **Reads are ranged, and fetch what they use.** `read_bytes(path, offset,
  length)` fetches those bytes only. `spool(path)` is a
  `bucket_spool.SparseSpool`: a sparse local copy of the object, filled by
  ranged reads only where asked, many in flight; `map` fills one whole.
- **Writes commit by upload.** `atomic_writer` streams into a
  `bucket_upload.PartsUpload`: one request for a small object, parallel
  parts joined by the store for a large one (GCS compose, S3 multipart); if
  the block raises, no object appears.
- **No rename**: object stores have none that is atomic; `rename` raises
  NotImplementedError and callers commit by upload instead.
- **Exclusive create**: `create_exclusive` writes an object only if none
  exists (GCS `ifGenerationMatch=0`, S3 `If-None-Match: *`), the primitive
  the destination lock is built on.
- **Directories are prefixes**: `makedirs` creates nothing, but checks the
  bucket exists, so a misspelt bucket fails at once, by name.
- **No caching between operations**: listings and metadata are kept only
  inside a `bucket_cache.metadata_cache()` block (one load or inspection),
  a migration's small source objects inside a `bucket_cache.object_cache()`
  block, and forgotten at any write through this module; so a second
  process' writes are seen at the next operation.
- **An unreachable store fails fast** (`bucket_client`): until the store has
  answered once in this process, a request gets no retries and at most
  `bucket_client.FIRST_CONTACT_SECONDS` (10 s) to answer.

Configuration is the conventional one only: `STORAGE_EMULATOR_HOST` for GCS
(also handed to TensorStore as `TENSORSTORE_GCS_HTTP_URL` when that is not
set), `AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`... for S3; credentials are
found as gcsfs and s3fs find them. Before importing gcsfs `bucket_client` sets
`GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false` unless the caller set it (gcsfs
2026 otherwise makes a storage-control call per bucket that emulators never
answer), and `EPATH_USE_TF=false` unless set, so that Orbax's paths to a
bucket go through fsspec too, not TensorFlow.

Errors name the path: a missing package is an ImportError saying which extra
to install (`MissingBackendError`); missing or refused credentials a
`StoreAccessError` (a PermissionError); a missing bucket or object a
FileNotFoundError.

Synopsis::

  from clu_ckpt import fsspec_fs

  fs = fsspec_fs.FsspecFileSystem("gs")
  with fs.atomic_writer("gs://bucket/ckpts/ckpt-3.flax") as write:
    write(b"...")                       # the object appears when this ends
  fs.read_bytes("gs://bucket/ckpts/ckpt-3.flax", offset=8, length=16)
  buf = fs.map("gs://bucket/ckpts/ckpt-3.flax")   # a spooled memory map
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from typing import Any, Callable, Iterator, Optional

from clu_ckpt import bucket_cache
from clu_ckpt import bucket_client
from clu_ckpt import bucket_spool
from clu_ckpt import bucket_upload
from clu_ckpt import errors
from clu_ckpt import filesystem

# Names other modules and tests know this module by (they live in the
# modules named).
configure_environment = bucket_client.configure_environment
split_url = bucket_client.split_url
StoreUnreachableError = bucket_client.StoreUnreachableError
MissingBackendError = errors.MissingBackendError
StoreAccessError = errors.StoreAccessError
metadata_cache = bucket_cache.metadata_cache
SparseSpool = bucket_spool.SparseSpool
streams = bucket_spool.streams
upload_streams = bucket_upload.upload_streams
PARTS_PREFIX = bucket_upload.PARTS_PREFIX
_translate = bucket_client.translate
_mtime = bucket_client.mtime
_has_exclusive_create = bucket_client.has_exclusive_create
_cached = bucket_cache.cached


def _forget_metadata(path: str = "", *, tree: bool = False) -> None:
  """Forgets kept metadata, and the kept object at `path` (or under it)."""
  bucket_cache.forget(_normal(path) if path else "", tree=tree)


def _normal(path: str) -> str:
  """The key an object is kept under: its URL without a trailing `/`."""
  return path.rstrip("/")


class FsspecFileSystem(filesystem.FileSystem):
  """`gs://` or `s3://` URLs, through fsspec; one instance per scheme.

  Example::

    fs = FsspecFileSystem("s3")
    fs.listdir("s3://bucket/ckpts")   # ["checkpoint", "ckpt-1.flax", ...]

  Args:
    scheme: `"gs"` (or `"gcs"`) or `"s3"`.
  """

  def __init__(self, scheme: str):
    scheme = scheme.lower()
    if scheme not in bucket_client._PACKAGES:  # pylint: disable=protected-access
      raise ValueError(f"no fsspec back end for {scheme}://")
    self._scheme = scheme
    self._lock = threading.Lock()
    self._fs: Any = None
    self._pid = -1
    self._buckets: set[str] = set()

  # -- the fsspec file system, made on first use and again after a fork ------

  @property
  def fs(self) -> Any:
    """The underlying fsspec file system (gcsfs / s3fs)."""
    if self._fs is None or self._pid != os.getpid():
      with self._lock:
        if self._fs is None or self._pid != os.getpid():
          self._fs, self._pid = self._make(), os.getpid()
          self._buckets = set()
    return self._fs

  def _make(self) -> Any:
    return bucket_client.make_client(self._scheme)

  def _key(self, path: str) -> str:
    """`bucket/key` as fsspec wants it."""
    _, bucket, key = split_url(path)
    return f"{bucket}/{key}" if key else bucket

  def _url(self, key: str) -> str:
    return f"{self._scheme}://{key.rstrip('/')}"

  @contextlib.contextmanager
  def _naming(self, path: str) -> Iterator[None]:
    try:
      yield
    except (NotImplementedError, errors.NotRegularFileError):
      raise
    except Exception as e:  # pylint: disable=broad-except
      translated = _translate(e, path)
      if isinstance(translated, FileNotFoundError):
        translated = self._not_found(path)
      if translated is e:
        raise
      raise translated from e

  def _not_found(self, path: str) -> FileNotFoundError:
    """What is missing at `path`: the bucket itself, or the object."""
    _, bucket, _ = split_url(path)
    if bucket in self._buckets:  # known to exist: a missing object, no request
      return FileNotFoundError(2, os.strerror(2), path)
    try:
      bucket_exists = bool(bucket) and self.fs.exists(bucket)
    except Exception:  # pylint: disable=broad-except
      bucket_exists = True  # cannot tell: report the path
    if bucket_exists and bucket:
      self._buckets.add(bucket)
    if not bucket_exists:
      return FileNotFoundError(
          2, f"bucket {bucket!r} does not exist (or is not visible with these "
          "credentials)", path)
    return FileNotFoundError(2, os.strerror(2), path)

  # -- the seam ---------------------------------------------------------------

  @_cached
  def exists(self, path: str) -> bool:
    if not split_url(path)[2]:  # a bucket
      with self._naming(path):
        return bool(self.fs.exists(self._key(path)))
    try:
      self._object_info(path)  # the one request `stat`, `isdir` reuse
    except errors.NotRegularFileError:
      return True  # a prefix
    except FileNotFoundError:
      return False
    return True

  @_cached
  def isdir(self, path: str) -> bool:
    if not split_url(path)[2]:
      with self._naming(path):
        return bool(self.fs.isdir(self._key(path)))
    try:
      self._object_info(path)
    except errors.NotRegularFileError:
      return True
    except FileNotFoundError:
      return False
    return False

  @_cached
  def listdir(self, path: str) -> list[str]:
    """The names in the directory `path`; inside a cache block the listing
    also answers for the metadata of the objects it lists."""
    key = self._key(path).rstrip("/")
    with self._naming(path):
      entries = self.fs.ls(key, detail=True)
    names, files, prefixes = set(), set(), set()
    for entry in entries:
      name = str(entry.get("name", "")).strip("/")
      if name == key.strip("/") or not name:
        continue
      base = name.rsplit("/", 1)[-1]
      names.add(base)
      if entry.get("type") == "file":
        files.add(base)
        bucket_cache.remember(self._scheme, "_asked_info",
                              f"{path.rstrip('/')}/{base}", dict(entry))
      elif entry.get("type") == "directory":
        prefixes.add(base)
    for base in prefixes - files:  # a prefix, and no object of that name
      url = f"{path.rstrip('/')}/{base}"
      bucket_cache.remember(
          self._scheme, "_asked_info", url,
          errors.NotRegularFileError(url, "a directory (a prefix)"), ok=False)
    return sorted(n for n in names if n)

  @_cached
  def glob(self, pattern: str) -> list[str]:
    """The objects and prefixes matching `pattern`, sorted.

    A pattern with wildcards in its last component only, in a directory
    whose listing a cache block keeps, is answered from that listing.

    Raises:
      FileNotFoundError: The bucket does not exist; it names the directory
        searched (the pattern up to its first wildcard's component), not
        the pattern, which is the caller's, not the user's.
    """
    directory, _, last = pattern.rstrip("/").rpartition("/")
    if directory and not re.search(r"[*?\[]", directory):
      listed = bucket_cache.recalled(self._scheme, "listdir", directory)
      if listed is not None and listed[0]:
        import fnmatch  # pylint: disable=g-import-not-at-top
        return sorted(f"{directory}/{n}" for n in listed[1]
                      if fnmatch.fnmatchcase(n, last))
    with self._naming(_searched(pattern)):
      found = self.fs.glob(self._key(pattern))
    return sorted(self._url(p) for p in found)

  def makedirs(self, path: str) -> None:
    """Object stores have no directories; checks the bucket exists."""
    _, bucket, _ = split_url(path)
    if not bucket:
      raise ValueError(f"{path}: no bucket named")
    if bucket in self._buckets:
      return
    with self._naming(path):
      try:
        found = self.fs.exists(bucket)
      except FileNotFoundError:
        found = False
    if not found:
      raise self._not_found(path)
    self._buckets.add(bucket)

  def remove(self, path: str) -> None:
    _forget_metadata(path)
    with self._naming(path):
      try:
        self.fs.rm_file(self._key(path))
      except FileNotFoundError:
        pass

  def remove_tree(self, path: str) -> None:
    """Removes every object under `path/` (not `path10/`), and `path`."""
    _forget_metadata(path, tree=True)
    key = self._key(path).rstrip("/")
    with self._naming(path):
      try:
        objects = self.fs.find(key + "/")
      except FileNotFoundError:
        objects = []
      objects = [o for o in objects if o.startswith(key + "/")]
      if objects:
        self.fs.rm(objects)
      if self.fs.isfile(key):  # a placeholder object named like the prefix
        self.fs.rm_file(key)

  def stat(self, path: str) -> tuple[int, float]:
    info = self._object_info(path)
    mtime = _mtime(info)
    if not mtime:
      # The lease judges staleness by it: never take a missing time as 0.
      with self._naming(path):
        mtime = self.fs.modified(self._key(path)).timestamp()
    return int(info.get("size") or 0), mtime

  def _object_info(self, path: str) -> dict:
    """The store's metadata of the object at `path` (kept, or one request).

    Raises:
      FileNotFoundError: No object there.
      NotRegularFileError: Only a prefix is there.
    """
    held = bucket_cache.cached_object(_normal(path))
    if held is not None:
      return held[0]
    return self._asked_info(path)

  @_cached
  def _asked_info(self, path: str) -> dict:
    """The store's metadata of the object at `path`: one request.

    (gcsfs' `info` also lists the name as a prefix, in parallel.)

    Raises:
      FileNotFoundError: No object there.
      NotRegularFileError: Only a prefix is there.
    """
    key = self._key(path)
    listed = bucket_cache.parent_listing(self._scheme, path)
    if (listed is not None and split_url(path)[2] and
        path.rstrip("/").rpartition("/")[2] not in listed):
      # Its directory's listing is kept and does not name it.
      raise FileNotFoundError(2, os.strerror(2), path)
    get_object = getattr(self.fs, "_get_object", None)
    with self._naming(path):
      if get_object is not None and getattr(self.fs, "loop", None):
        import fsspec.asyn  # pylint: disable=g-import-not-at-top
        try:
          info = fsspec.asyn.sync(self.fs.loop, get_object, key)
        except FileNotFoundError:
          own = bucket_cache.recalled(self._scheme, "listdir", path)
          if own is not None:
            # Its own listing is kept: a prefix if it lists anything
            # (found nothing: `own` holds the FileNotFoundError).
            if own[0] and own[1]:
              raise errors.NotRegularFileError(
                  path, "a directory (a prefix)") from None
            raise
          info = self.fs.info(key)  # a prefix, or nothing: say which
      else:
        info = self.fs.info(key)
    if info.get("type") == "directory":
      raise errors.NotRegularFileError(path, "a directory (a prefix)")
    return info

  def check_regular_file(self, path: str) -> None:
    self.stat(path)

  def read_bytes(self, path: str, offset: int = 0,
                 length: Optional[int] = None) -> bytes:
    """Bytes of the object: all, or `length` from `offset` (one request).

    Inside a `bucket_cache.object_cache()` block an object of at most
    `bucket_cache.SMALL_OBJECT_BYTES` is downloaded whole at its first read
    and served from memory afterwards.
    """
    end = None if length is None else offset + length
    if length == 0:
      return b""
    whole = self._small_object(path)
    if whole is not None:
      return whole[offset:end]
    with self._naming(path):
      return self.fs.cat_file(self._key(path), start=offset or None, end=end)

  def map(self, path: str, *, populate: bool = True) -> Any:
    """The object, spooled by ranged reads into an unlinked temporary file.

    `populate` is ignored: the whole object is fetched, `streams()` ranges
    always in flight (only the ranges of `read_bytes`, or a `SparseSpool`
    filled on demand, are cheaper).

    Raises:
      FileNotFoundError: No object at `path`.
      OSError: The object changed size while it was read.
    """
    del populate
    spool = self.spool(path)
    if spool.size == 0:
      return b""
    spool.fill()
    return spool.map

  def spool(self, path: str) -> "SparseSpool":
    """An empty `SparseSpool` of the object at `path` (one metadata request).

    Raises:
      FileNotFoundError: No object at `path`.
    """
    info = self._object_info(path)
    size = int(info.get("size") or 0)
    version = next((str(info[f]) for f in ("generation", "ETag", "etag",
                                             "VersionId", "md5Hash")
                    if info.get(f)), "")
    spool = bucket_spool.SparseSpool(self, path, size)
    spool.identity = (path, size, _mtime(info), version)
    if 0 < size <= bucket_cache.SMALL_OBJECT_BYTES:
      # A small object an `object_cache()` block keeps: the copy is made
      # whole now (one request, or none), so that ranges asked for later
      # from other threads (Orbax's writer), where the block does not
      # apply, are not downloaded again.
      whole = self._small_object(path)
      if whole is not None and len(whole) == size:
        spool.adopt([(0, whole)])
    return spool

  def _small_object(self, path: str) -> Optional[bytes]:
    """The whole object, if small and an `object_cache()` block runs."""
    if not bucket_cache.caching_objects(_normal(path)):
      return None
    held = bucket_cache.cached_object(_normal(path))
    if held is not None:
      return held[1]
    info = self._object_info(path)
    if int(info.get("size") or 0) > bucket_cache.SMALL_OBJECT_BYTES:
      return None
    with self._naming(path):
      data = self.fs.cat_file(self._key(path))
    if len(data) == int(info.get("size") or 0):  # else it changed: not kept
      bucket_cache.keep_object(_normal(path), info, data)
    return data

  def fetch_into(self, path: str, fd: int, ranges: list[tuple[int, int]],
                 size: int, width: Optional[int] = None,
                 chunk: Optional[int] = None) -> int:
    """Copies byte ranges of the object into file `fd`: see `bucket_spool.fetch_ranges`.

    An object an `object_cache()` block holds is copied from memory.

    Returns:
      The number of requests made.
    """
    key = self._key(path)
    held = bucket_cache.cached_object(_normal(path))
    data = held[1] if held is not None else (
        self._small_object(path) if size <= bucket_cache.SMALL_OBJECT_BYTES
        else None)
    if data is not None and len(data) == size:
      bucket_spool.fetch_ranges(lambda s, e: data[s:e], path, fd, ranges,
                                size)
      return 0 if held is not None else 1

    def read(start: int, end: int) -> bytes:
      with self._naming(path):
        return self.fs.cat_file(key, start=start or None, end=end)

    return bucket_spool.fetch_ranges(read, path, fd, ranges, size, width,
                                     chunk)

  @contextlib.contextmanager
  def atomic_writer(self, path: str) -> Iterator[Callable[[Any], None]]:
    """Streams into an upload that completes only if the block succeeds.

    Up to `UPLOAD_BLOCK` bytes: one request when the block ends. Larger
    objects go up in parts of `UPLOAD_BLOCK` bytes, `upload_streams()` at a
    time,
    which the store joins when the block ends (GCS: temporary objects under
    `PARTS_PREFIX`, composed into the object, then removed; S3: a multipart
    upload, completed). If the block raises (or an upload fails), the parts
    are removed or the multipart upload aborted: no object appears.
    """
    _forget_metadata(path)
    self.makedirs(path)
    upload = bucket_upload.PartsUpload(self, path)
    try:
      yield upload.write
      with self._naming(path):
        upload.commit()
    except BaseException:
      upload.abort()
      raise
    finally:
      _forget_metadata(path)

  def create_exclusive(self, path: str, data: bytes) -> None:
    """Writes `data` at `path` only if no object is there, atomically.

    Raises:
      FileExistsError: An object is already at `path`.
    """
    _forget_metadata(path)
    self.makedirs(path)
    if not _has_exclusive_create(self.fs):
      raise NotImplementedError(
          f"{path}: the installed {bucket_client.package_of(self.fs)} "
          "cannot create an object only if absent (upgrade it, and botocore "
          "for s3://)")
    with self._naming(path):
      try:
        self.fs.pipe_file(self._key(path), data, mode="create")
      except FileExistsError:
        raise FileExistsError(17, "already exists", path) from None
      except Exception as e:  # pylint: disable=broad-except
        if bucket_client.status_of(e) in (409, 412):
          raise FileExistsError(17, "already exists", path) from None
        raise


def _searched(pattern: str) -> str:
  """The directory a glob searches: `pattern` before its first wildcard.

  Example::

    _searched("gs://b/run1/checkpoints-*")   # "gs://b/run1"
  """
  m = re.search(r"[*?\[]", pattern)
  head = pattern[:pattern.rfind("/", 0, m.start())] if m else pattern
  return head if bucket_client.SCHEME_RE.match(head) and split_url(head)[1] else pattern

