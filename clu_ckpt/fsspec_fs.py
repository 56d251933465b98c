"""The object-store back end of `filesystem.FileSystem`: `gs://` and `s3://`.

Built on fsspec (`gcsfs` for `gs://`, `s3fs` for `s3://`; the extras
`[gcs]` and `[s3]` of a checkout install them). TensorFlow is never
imported here: a Colab reads a bucket's checkpoint with these two packages.

How the store's semantics map onto the seam:

- **Reads are ranged, and fetch what they use.** `read_bytes(path, offset,
  length)` fetches those bytes only. `spool(path)` is a `SparseSpool`: a
  sparse local copy of the object in the temporary directory (`$TMPDIR`),
  memory-mapped, filled by ranged reads only where asked (each byte at most
  once); `flax_ranges` reads a `.flax`'s headers into one. `map` fills a
  spool whole, `streams()` ranges (8, `CLU_CKPT_BUCKET_STREAMS`) always in
  flight: the process never holds the object in anonymous memory, the kernel
  pages the copy in and out like any local file, and the copy disappears
  when the last view of it is dropped. An object that changes size while it
  is read raises an OSError naming it.
- **Writes commit by upload.** `atomic_writer` sends up to `UPLOAD_BLOCK`
  bytes as one upload when the block ends; larger objects go up as parts,
  `upload_streams()` at a time, that the store joins when the block ends
  (GCS: temporary objects under `PARTS_PREFIX`, composed, then removed; S3:
  a multipart upload). If the block raises, the parts are removed or the
  upload aborted, and no object appears.
- **No rename**: object stores have none that is atomic; `rename` raises
  NotImplementedError and callers commit by upload instead.
- **Exclusive create**: `create_exclusive` writes an object only if none
  exists (GCS `ifGenerationMatch=0`, S3 `If-None-Match: *`), the primitive
  the destination lock is built on.
- **Directories are prefixes**: `makedirs` creates nothing, but checks the
  bucket exists, so a misspelt bucket fails at once, by name.
- **No caching between operations**: listings and metadata are kept only
  inside a `metadata_cache()` block (one load or inspection), and forgotten
  at any write through this module; so a second process' writes are seen
  at the next operation.
- **An unreachable store fails fast.** Until the store has answered once in
  this process, a request gets no retries and at most `FIRST_CONTACT_SECONDS`
  (10 s) to answer: a wrong endpoint, a store that refuses connections, no
  network or an unreachable credentials server end in seconds with one
  error naming the path, not after the clients' minute of retries. Once the
  store has answered, gcsfs' and s3fs' own retries and timeouts apply
  (transient 5xx, throttling, dropped connections). On S3, botocore's
  "standard" retry mode is used unless `AWS_RETRY_MODE` or
  `AWS_MAX_ATTEMPTS` says otherwise.

Configuration is the conventional one only: `STORAGE_EMULATOR_HOST` for GCS
(also handed to TensorStore as `TENSORSTORE_GCS_HTTP_URL` when that is not
set), `AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`... for S3; credentials are
found as gcsfs and s3fs find them. Before importing gcsfs this module sets
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

import concurrent.futures
import contextlib
import contextvars
import datetime
import errno
import inspect
import mmap
import os
import re
import sys
import tempfile
import threading
import uuid
from typing import Any, Callable, Iterator, Optional

from clu_ckpt import errors
from clu_ckpt import filesystem

# `map` reads an object in ranges of this many bytes, SPOOL_READS of them in
# flight at all times (a new one starts as each ends). The client holds each
# range about twice while it arrives: 8 MiB x 8 peaks at ~110 MiB of
# anonymous memory. The environment variable CLU_CKPT_BUCKET_STREAMS, when
# set, overrides SPOOL_READS (see `streams`).
SPOOL_CHUNK = 8 * 2**20
SPOOL_READS = 8
_MIN_CHUNK = 2**20
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

# Which package serves a scheme, and which extra installs it.
_PACKAGES = {"gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs"),
             "s3": ("s3fs", "s3")}
_SCHEME_RE = re.compile(r"^(?P<scheme>[a-z][a-z0-9.+-]+)://", re.I)

# Until a store has answered once, a request may wait this long for its
# answer (and its connection half as long), with no retries.
FIRST_CONTACT_SECONDS = 10.0
# S3 calls carrying a body: a slow link may take longer than the above to
# send them, so they are never timed as a first contact.
_S3_UPLOADS = ("put_object", "upload_part")

MissingBackendError = errors.MissingBackendError
StoreAccessError = errors.StoreAccessError

# Metadata answers kept while a `metadata_cache()` block runs (None: none).
_METADATA: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar(
    "clu_ckpt_bucket_metadata", default=None)


@contextlib.contextmanager
def metadata_cache() -> Iterator[None]:
  """Within the block, each listing and object's metadata is asked for once.

  One read-only operation (a load, an inspection) asks the same questions
  many times (does the directory exist, what does it hold, how large is
  each file); on a bucket each is a round trip. Inside this block (in this
  thread or task) the answers are kept and reused; any write, removal or
  exclusive create through this module forgets them. Blocks nest. Outside
  them nothing is cached, so other processes' writes are seen at once.

  Example::

    with fsspec_fs.metadata_cache():
      state = checkpoint.load_state_dict("gs://b/run")
  """
  if _METADATA.get() is not None:
    yield
    return
  token = _METADATA.set({})
  try:
    yield
  finally:
    _METADATA.reset(token)


def _forget_metadata() -> None:
  cache = _METADATA.get()
  if cache is not None:
    cache.clear()


def _cached(method: Callable) -> Callable:
  """Keeps `method(self, path)`'s answer (or error) in the active cache."""

  def wrapper(self: "FsspecFileSystem", path: str) -> Any:
    cache = _METADATA.get()
    if cache is None:
      return method(self, path)
    key = (self._scheme, method.__name__, path.rstrip("/"))
    if key not in cache:
      try:
        cache[key] = (True, method(self, path))
      except (FileNotFoundError, errors.NotRegularFileError) as e:
        cache[key] = (False, e)
    ok, value = cache[key]
    if not ok:
      raise value
    return list(value) if isinstance(value, list) else value

  wrapper.__name__ = method.__name__
  wrapper.__doc__ = method.__doc__
  return wrapper


class StoreUnreachableError(OSError):
  """The store has not answered: connection refused or no answer in time."""


def configure_environment() -> None:
  """Sets the variables the object-store stack needs, unless the user did.

  Called before gcsfs is imported (and by the migration before Orbax is):
  `GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`, `EPATH_USE_TF=false`, and
  `TENSORSTORE_GCS_HTTP_URL` from `STORAGE_EMULATOR_HOST` when only the
  latter is set; etils' cached choice of TensorFlow for `gs://` paths is
  forgotten, so it is made again under these settings. Safe to call any
  number of times.
  """
  os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
  os.environ.setdefault("EPATH_USE_TF", "false")
  # etils decides once per process whether its gs:// paths go through
  # TensorFlow, caching the answer at the first such path: a path made
  # before this call (by the user's code, or Orbax's) would keep Orbax on
  # TensorFlow's gs://, which ignores the emulator and TENSORSTORE settings.
  gpath = sys.modules.get("etils.epath.gpath")
  decided = getattr(gpath, "_is_tf_installed", None)
  if hasattr(decided, "cache_clear"):
    decided.cache_clear()
  emulator = os.environ.get("STORAGE_EMULATOR_HOST")
  if emulator and "TENSORSTORE_GCS_HTTP_URL" not in os.environ:
    if not emulator.startswith(("http://", "https://")):
      emulator = "http://" + emulator
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = emulator


def split_url(path: str) -> tuple[str, str, str]:
  """(scheme, bucket, key) of `scheme://bucket/key`; key without edge `/`.

  Example::

    split_url("gs://b/runs/a/")   # ("gs", "b", "runs/a")
  """
  m = _SCHEME_RE.match(path)
  if not m:
    raise ValueError(f"{path}: not a bucket URL (scheme://bucket/...)")
  rest = path[m.end():]
  bucket, _, key = rest.partition("/")
  return m.group("scheme").lower(), bucket, key.strip("/")


def _status(e: BaseException) -> Optional[int]:
  """The HTTP status an fsspec/botocore/google exception carries, if any."""
  for attr in ("code", "status", "status_code"):
    value = getattr(e, attr, None)
    if isinstance(value, int) and 100 <= value < 600:
      return value
  response = getattr(e, "response", None)
  if isinstance(response, dict):
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if isinstance(status, int):
      return status
  return None


# Packages whose own exceptions (not OSErrors) mean a failed store operation.
_STORE_MODULES = ("gcsfs", "s3fs", "aiohttp", "botocore", "aiobotocore",
                  "google", "requests", "urllib3")

_CREDENTIAL_ERRORS = ("NoCredentialsError", "PartialCredentialsError",
                      "DefaultCredentialsError", "RefreshError",
                      "TransportError")


def _translate(e: BaseException, path: str) -> BaseException:
  """`e` as the error the seam promises, naming `path`."""
  if isinstance(e, errors.CluCkptError):
    return e
  if isinstance(e, StoreUnreachableError):
    return StoreUnreachableError(e.errno, e.strerror, path)
  if isinstance(e, (FileNotFoundError, FileExistsError)):
    return e if path in str(e) else type(e)(e.errno or 2, str(e), path)
  name = type(e).__name__
  status = _status(e)
  if name in _CREDENTIAL_ERRORS or status == 401:
    return StoreAccessError(
        f"{path}: no usable credentials for this store ({name}: {e}); see "
        "how gcsfs / s3fs find credentials, or set the usual variables "
        "(GOOGLE_APPLICATION_CREDENTIALS, AWS_ACCESS_KEY_ID...)")
  if isinstance(e, PermissionError) or status == 403:
    return StoreAccessError(f"{path}: access refused by the store ({e})")
  if status == 404:
    return FileNotFoundError(2, f"not found ({e})", path)
  if (status is not None and status >= 400) or not isinstance(e, OSError) and (
      type(e).__module__.split(".")[0] in _STORE_MODULES):
    # A server error (503, 429 after the client's retries) or a connection
    # failure: an I/O error like any other, naming the object.
    return OSError(errno.EIO, f"{type(e).__name__}: {e}", path)
  return e


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
    if scheme not in _PACKAGES:
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
    package, extra = _PACKAGES[self._scheme]
    configure_environment()
    try:
      module = __import__(package)
    except ImportError as e:
      raise MissingBackendError(
          f"{self._scheme}:// paths need the `{package}` package: install "
          f"it with `pip install {package}` (or `pip install -e '.[{extra}]'` "
          "in a clu_ckpt checkout)") from e
    options: dict[str, Any] = {"skip_instance_cache": True,
                               "use_listings_cache": False}
    if package == "gcsfs":
      if os.environ.get("STORAGE_EMULATOR_HOST"):
        # An emulator takes no credentials: do not look for any (that would
        # ask a metadata server, or Google's token endpoint).
        options["token"] = "anon"
      return _first_contact_gcs(module)(**options)
    if not {"AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS"} & set(os.environ):
      # botocore's legacy mode retries a refused connection 5 times over
      # ~7 s; "standard" (AWS' recommended mode) 3 times, in ~2 s.
      options["config_kwargs"] = {"retries": {"mode": "standard"}}
    return _first_contact_s3(module)(**options)

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
    key = self._key(path).rstrip("/")
    with self._naming(path):
      entries = self.fs.ls(key, detail=False)
    names = {e.rstrip("/").rsplit("/", 1)[-1] for e in entries
             if e.rstrip("/") != key}
    return sorted(n for n in names if n)

  @_cached
  def glob(self, pattern: str) -> list[str]:
    """The objects and prefixes matching `pattern`, sorted.

    Raises:
      FileNotFoundError: The bucket does not exist; it names the directory
        searched (the pattern up to its first wildcard's component), not
        the pattern, which is the caller's, not the user's.
    """
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
    _forget_metadata()
    with self._naming(path):
      try:
        self.fs.rm_file(self._key(path))
      except FileNotFoundError:
        pass

  def remove_tree(self, path: str) -> None:
    """Removes every object under `path/` (not `path10/`), and `path`."""
    _forget_metadata()
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

  @_cached
  def _object_info(self, path: str) -> dict:
    """The store's metadata of the object at `path`: one request.

    (gcsfs' `info` also lists the name as a prefix, in parallel.)

    Raises:
      FileNotFoundError: No object there.
      NotRegularFileError: Only a prefix is there.
    """
    key = self._key(path)
    get_object = getattr(self.fs, "_get_object", None)
    with self._naming(path):
      if get_object is not None and getattr(self.fs, "loop", None):
        import fsspec.asyn  # pylint: disable=g-import-not-at-top
        try:
          info = fsspec.asyn.sync(self.fs.loop, get_object, key)
        except FileNotFoundError:
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
    end = None if length is None else offset + length
    if length == 0:
      return b""
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
    spool = SparseSpool(self, path, size)
    spool.identity = (path, size, _mtime(info), version)
    return spool

  def fetch_into(self, path: str, fd: int, ranges: list[tuple[int, int]],
                 size: int) -> int:
    """Copies byte ranges of an object into file `fd` at the same offsets.

    Ranges are split into pieces of `SPOOL_CHUNK` bytes (less for objects
    under 10 x that x `streams()`: at least 1 MiB); `streams()` reads are kept
    in flight at all times (a new one starts as soon as one ends, not in
    batches), and each range's bytes are written to `fd` as soon as they
    arrive, so at most `streams()` chunks are held in memory.

    Returns:
      The number of requests made.

    Raises:
      OSError: A read failed, returned fewer bytes than asked (the object
        changed), or the local copy could not be written.
    """
    key = self._key(path)
    width = streams()
    # Ranges of SPOOL_CHUNK, smaller for small objects: what is in flight
    # (held about twice as it arrives) stays near 0.2x the object.
    chunk = min(SPOOL_CHUNK, max(_MIN_CHUNK, size // (10 * width)))
    pieces = [(s, min(s + chunk, end)) for start, end in ranges
              for s in range(start, end, chunk)]
    if not pieces:
      return 0

    def fetch(piece: tuple[int, int]) -> None:
      start, end = piece
      with self._naming(path):
        data = self.fs.cat_file(key, start=start or None, end=end)
      if len(data) != end - start:
        raise OSError(f"{path}: the object changed while it was read "
                      f"({len(data)} bytes at {start}, {end - start} "
                      "expected)")
      view = memoryview(data)
      try:
        while view:
          view = view[os.pwrite(fd, view, start + len(data) - len(view)):]
      except OSError as e:
        raise _spool_error(e, path, size) from e

    if len(pieces) == 1:
      fetch(pieces[0])
      return 1
    width = min(width, len(pieces))
    todo = iter(pieces)
    with concurrent.futures.ThreadPoolExecutor(
        width, thread_name_prefix="clu_ckpt-spool") as pool:
      running = {pool.submit(fetch, p) for p in
                 (next(todo) for _ in range(width))}
      try:
        while running:
          done, running = concurrent.futures.wait(
              running, return_when=concurrent.futures.FIRST_COMPLETED)
          for future in done:
            future.result()  # raises the first failure
            piece = next(todo, None)
            if piece is not None:
              running.add(pool.submit(fetch, piece))
      except BaseException:
        for future in running:
          future.cancel()
        raise
    return len(pieces)

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
    _forget_metadata()
    self.makedirs(path)
    upload = _PartsUpload(self, path)
    try:
      yield upload.write
      with self._naming(path):
        upload.commit()
    except BaseException:
      upload.abort()
      raise
    finally:
      _forget_metadata()

  def create_exclusive(self, path: str, data: bytes) -> None:
    """Writes `data` at `path` only if no object is there, atomically.

    Raises:
      FileExistsError: An object is already at `path`.
    """
    _forget_metadata()
    self.makedirs(path)
    if not _has_exclusive_create(self.fs):
      raise NotImplementedError(
          f"{path}: the installed {_package(self.fs)} "
          "cannot create an object only if absent (upgrade it, and botocore "
          "for s3://)")
    with self._naming(path):
      try:
        self.fs.pipe_file(self._key(path), data, mode="create")
      except FileExistsError:
        raise FileExistsError(17, "already exists", path) from None
      except Exception as e:  # pylint: disable=broad-except
        if _status(e) in (409, 412):
          raise FileExistsError(17, "already exists", path) from None
        raise


class _PartsUpload:
  """One object's upload: a single request, or parts sent in parallel."""

  def __init__(self, owner: "FsspecFileSystem", path: str):
    self._owner, self._path = owner, path
    self._fs = owner.fs
    self._key = owner._key(path)  # pylint: disable=protected-access
    self._s3 = _package(self._fs) == "s3fs"
    self._buf = bytearray()
    self._parts: dict[int, Any] = {}  # number -> GCS part name / S3 ETag
    self._futures: list[concurrent.futures.Future] = []
    self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
    self._slots: Optional[threading.BoundedSemaphore] = None
    self._upload_id: Optional[str] = None
    self._tmp = f"{PARTS_PREFIX}/{uuid.uuid4().hex}"
    self._done = False

  def write(self, data: Any) -> None:
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
    if self._pool is None:  # small: one request
      self._fs.pipe_file(self._key, bytes(self._buf))
      self._done = True
      return
    if self._buf or not self._futures:
      self._send()
    for future in self._futures:
      future.result()
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
    self._done = True
    self._pool.shutdown()

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


def streams() -> int:
  """How many ranged reads a whole-object read keeps in flight.

  `CLU_CKPT_BUCKET_STREAMS` when set (a positive integer), else
  `SPOOL_READS`; read at each call.

  Raises:
    ValueError: The variable is set to anything but a positive integer.
  """
  return _setting("CLU_CKPT_BUCKET_STREAMS", SPOOL_READS)


def upload_streams() -> int:
  """How many parts an upload sends at once.

  `CLU_CKPT_BUCKET_UPLOAD_STREAMS` when set (a positive integer), else
  `UPLOAD_STREAMS`; read at each call.

  Raises:
    ValueError: The variable is set to anything but a positive integer.
  """
  return _setting("CLU_CKPT_BUCKET_UPLOAD_STREAMS", UPLOAD_STREAMS)


def _setting(name: str, default: int) -> int:
  value = os.environ.get(name, "").strip()
  if value:
    try:
      n = int(value)
    except ValueError:
      n = 0
    if n < 1:
      raise ValueError(f"{name}={value!r}: not a positive integer")
    return n
  return max(1, int(default))


class SparseSpool:
  """A local copy of an object, filled by ranged reads only where asked.

  The copy is an unlinked sparse file in `$TMPDIR`, memory-mapped (`map`):
  bytes not fetched yet read as zeros, and every range fetched later shows
  up in the same map (and in every numpy view of it). Each byte of the
  object is downloaded at most once, however many callers ask for it.

  Example::

    spool = fs.spool("gs://b/run/ckpt-3.flax")
    spool.ensure([(0, 4096)])          # one ranged read
    header = spool.map[:16]
    spool.fill()                        # the rest, many reads in flight

  Attributes:
    path: The object's URL.
    size: Its size in bytes.
    map: An `mmap.mmap` of the local copy (`b""` for an empty object).
    requests: Ranged reads made so far.
    fetched: Bytes downloaded so far.
    identity: (path, size, modification time, generation or ETag): what
      names this version of the object, for caches.
  """

  def __init__(self, fs: "FsspecFileSystem", path: str, size: int):
    self.path, self.size = path, size
    self.identity: tuple = (path, size)
    self.requests = self.fetched = 0
    self._fs = fs
    self._lock = threading.Lock()
    self._have: list[tuple[int, int]] = []  # sorted, disjoint, merged
    self._file = tempfile.TemporaryFile(prefix="clu_ckpt-spool-")
    if size:
      try:
        os.ftruncate(self._file.fileno(), size)  # sparse: no blocks yet
      except OSError as e:
        raise _spool_error(e, path, size) from e
      self.map: Any = mmap.mmap(self._file.fileno(), size,
                                access=mmap.ACCESS_READ)
    else:
      self.map = b""

  def missing(self, start: int, end: int) -> list[tuple[int, int]]:
    """The parts of [start, end) not fetched yet."""
    start, end = max(0, start), min(end, self.size)
    out = []
    for s, e in self._have:
      if e <= start:
        continue
      if s >= end:
        break
      if s > start:
        out.append((start, s))
      start = max(start, e)
    if start < end:
      out.append((start, end))
    return out

  def has(self, start: int, end: int) -> bool:
    """Whether [start, end) is all fetched."""
    return not self.missing(start, end)

  def ensure(self, ranges: list[tuple[int, int]]) -> None:
    """Fetches whatever of `ranges` is not here yet, many reads in flight.

    Raises:
      OSError: A read failed or the object changed; the local copy could
        not be written (a full `$TMPDIR`).
    """
    with self._lock:
      todo = []
      for start, end in sorted(ranges):
        for piece in self.missing(start, end):
          if todo and todo[-1][1] >= piece[0]:
            todo[-1] = (todo[-1][0], max(todo[-1][1], piece[1]))
          else:
            todo.append(piece)
      if not todo:
        return
      if sum(e - s for s, e in todo) > self.size // 2:
        self._reserve()
      self.requests += self._fs.fetch_into(self.path, self._file.fileno(),
                                           todo, self.size)
      self.fetched += sum(e - s for s, e in todo)
      self._have = _merge(self._have + todo)

  def fill(self) -> None:
    """Fetches everything not here yet."""
    self.ensure([(0, self.size)])

  def copy_fetched(self, limit: int) -> Optional[list[tuple[int, bytes]]]:
    """(offset, bytes) of what was fetched, if no more than `limit` bytes."""
    with self._lock:
      if sum(e - s for s, e in self._have) > limit:
        return None
      return [(s, bytes(self.map[s:e])) for s, e in self._have]

  def adopt(self, pieces: list[tuple[int, bytes]]) -> None:
    """Takes bytes of the object known from elsewhere (`copy_fetched`)."""
    with self._lock:
      fd = self._file.fileno()
      for start, data in pieces:
        view = memoryview(data)
        try:
          while view:
            view = view[os.pwrite(fd, view, start + len(data) - len(view)):]
        except OSError as e:
          raise _spool_error(e, self.path, self.size) from e
      self._have = _merge(self._have + [(s, s + len(d)) for s, d in pieces])

  def _reserve(self) -> None:
    """Allocates the whole copy's blocks, so that a full disk fails now."""
    if not getattr(self, "_reserved", False):
      _reserve(self._file.fileno(), self.size, self.path)
      self._reserved = True


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
  out: list[tuple[int, int]] = []
  for start, end in sorted(ranges):
    if out and out[-1][1] >= start:
      out[-1] = (out[-1][0], max(out[-1][1], end))
    else:
      out.append((start, end))
  return out


def _searched(pattern: str) -> str:
  """The directory a glob searches: `pattern` before its first wildcard.

  Example::

    _searched("gs://b/run1/checkpoints-*")   # "gs://b/run1"
  """
  m = re.search(r"[*?\[]", pattern)
  head = pattern[:pattern.rfind("/", 0, m.start())] if m else pattern
  return head if _SCHEME_RE.match(head) and split_url(head)[1] else pattern


def _timeouts() -> tuple[type[BaseException], ...]:
  """The exceptions of a coroutine that timed out.

  asyncio's TimeoutError (aiohttp's socket timeouts, `wait_for`) is the
  builtin one from Python 3.11 on, a class of its own before.
  """
  import asyncio  # pylint: disable=g-import-not-at-top
  return (TimeoutError, asyncio.TimeoutError)


def _no_answer(endpoint: str) -> StoreUnreachableError:
  return StoreUnreachableError(
      errno.ETIMEDOUT, f"no answer from the store at {endpoint} within "
      f"{FIRST_CONTACT_SECONDS:g} s (network, endpoint or firewall?)")


_CLASSES: dict[str, Any] = {}


def _publish(kind: str, cls: Any) -> Any:
  """Names `cls` as this module's attribute, so that a copy rebuilt by fsspec (`__reduce__`) finds it."""
  cls.__module__, cls.__qualname__ = __name__, cls.__name__
  _CLASSES[kind] = cls
  return cls


def __getattr__(name: str) -> Any:
  """The first-contact classes, made on first use (PEP 562).

  They subclass gcsfs' and s3fs' classes, which are imported only when a
  bucket is used; a file system rebuilt from `__reduce__` asks for its class by name here.
  """
  if name == "FirstContactGCSFileSystem":
    return _first_contact_gcs(__import__("gcsfs"))
  if name == "FirstContactS3FileSystem":
    return _first_contact_s3(__import__("s3fs"))
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _first_contact_gcs(gcsfs: Any) -> Any:
  """gcsfs' file system class, failing fast until the store first answers.

  gcsfs retries a refused connection 6 times over ~33 s, logging each
  failure's traceback, and waits 5 minutes for a store that accepts the
  connection but never answers. Before the first answer (any HTTP status,
  404 included) a request here is made once, with a connect timeout of
  `FIRST_CONTACT_SECONDS / 2` and a read timeout of `FIRST_CONTACT_SECONDS`;
  afterwards gcsfs' own retrying request is used unchanged.
  """
  if "gcs" in _CLASSES:
    return _CLASSES["gcs"]
  import aiohttp  # pylint: disable=g-import-not-at-top
  import google.auth.exceptions  # pylint: disable=g-import-not-at-top
  base = gcsfs.GCSFileSystem
  once = getattr(base._request, "__wrapped__", None)  # pylint: disable=protected-access
  timeouts = _timeouts()
  unanswered = (aiohttp.ClientConnectionError, *timeouts,
                google.auth.exceptions.GoogleAuthError)

  class FirstContactGCSFileSystem(base):
    """gcsfs, with no retries and short timeouts until the store answers."""

    _answered = False

    async def _request(self, method, path, *args, **kwargs):
      if self._answered or once is None:
        return await super()._request(method, path, *args, **kwargs)
      saved = self.requests_timeout
      self.requests_timeout = aiohttp.ClientTimeout(
          total=None, sock_connect=FIRST_CONTACT_SECONDS / 2,
          sock_read=FIRST_CONTACT_SECONDS)
      try:
        result = await once(self, method, path, *args, **kwargs)
      except timeouts as e:
        raise _no_answer(self._location) from e
      except unanswered:
        raise
      except Exception:
        self._answered = True  # an HTTP error is an answer
        raise
      finally:
        self.requests_timeout = saved
      self._answered = True
      return result

  return _publish("gcs", FirstContactGCSFileSystem)


def _first_contact_s3(s3fs: Any) -> Any:
  """s3fs' file system class, failing fast until the store first answers.

  Until the first answer (any response, an error status included) a call
  other than an upload is tried once by s3fs (botocore still retries a
  refused connection within its mode) and given `FIRST_CONTACT_SECONDS`.
  """
  if "s3" in _CLASSES:
    return _CLASSES["s3"]
  import asyncio  # pylint: disable=g-import-not-at-top
  import botocore.exceptions  # pylint: disable=g-import-not-at-top
  # No response at all (a status comes as ClientError, which s3fs turns
  # into FileNotFoundError, PermissionError...).
  unanswered = (botocore.exceptions.BotoCoreError, ConnectionError)
  timeouts = _timeouts()

  class FirstContactS3FileSystem(s3fs.S3FileSystem):
    """s3fs, with no retries and a deadline until the store answers."""

    _answered = False

    async def _call_s3(self, method, *args, **kwargs):
      if self._answered or method in _S3_UPLOADS:
        return await super()._call_s3(method, *args, **kwargs)
      await self.set_session()  # the client's set-up is not the store's time
      saved, self.retries = self.retries, 1
      try:
        result = await asyncio.wait_for(
            super()._call_s3(method, *args, **kwargs), FIRST_CONTACT_SECONDS)
      except timeouts as e:
        raise _no_answer(self.client_kwargs.get("endpoint_url") or
                         os.environ.get("AWS_ENDPOINT_URL") or "S3") from e
      except unanswered:
        raise
      except Exception:
        self._answered = True  # an error status (s3fs' OSErrors) is an answer
        raise
      finally:
        self.retries = saved
      self._answered = True
      return result

  return _publish("s3", FirstContactS3FileSystem)


def _package(fs: Any) -> str:
  """The package of `fs`' class ("gcsfs", "s3fs"), past this module's own."""
  for cls in type(fs).__mro__:
    package = cls.__module__.split(".")[0]
    if package != "clu_ckpt":
      return package
  return "clu_ckpt"


def _has_exclusive_create(fs: Any) -> bool:
  """Whether `fs.pipe_file(..., mode="create")` is a conditional write.

  Older gcsfs / s3fs releases take no `mode` (s3fs silently drops unknown
  arguments: the write would be unconditional), and S3's `IfNoneMatch`
  needs botocore 1.35.21 or later.
  """
  method = getattr(type(fs), "_pipe_file", None) or getattr(
      type(fs), "pipe_file", None)
  try:
    if "mode" not in inspect.signature(method).parameters:
      return False
  except (TypeError, ValueError):
    return False
  if _package(fs) == "s3fs":
    try:
      import botocore  # pylint: disable=g-import-not-at-top
      version = tuple(int(p) for p in botocore.__version__.split(".")[:3])
    except (ImportError, ValueError):
      return False
    return version >= (1, 35, 21)
  return True


def _spool_error(e: OSError, path: str, size: int) -> OSError:
  """`e` naming the object and where its local copy was going."""
  return OSError(e.errno, f"{path}: its {size}-byte local copy in "
                 f"{tempfile.gettempdir()} failed ({e.strerror}); set TMPDIR "
                 "to a directory with room for it")


def _reserve(fd: int, size: int, path: str) -> None:
  """Allocates the spool file's blocks, so that a full disk fails at once."""
  try:
    os.posix_fallocate(fd, 0, size)
  except OSError as e:
    if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
      os.ftruncate(fd, size)  # a file system without fallocate
    else:
      raise _spool_error(e, path, size) from e


def _mtime(info: dict) -> float:
  """Seconds since the epoch of an fsspec `info` dict (gcsfs or s3fs)."""
  for field in ("mtime", "LastModified", "updated", "last_modified"):
    value = info.get(field)
    if isinstance(value, (int, float)):
      return float(value)
    if isinstance(value, datetime.datetime):
      return value.timestamp()
    if isinstance(value, str) and value:
      # Python 3.10's fromisoformat takes neither "Z" nor 9 fractional digits.
      text = re.sub(r"(\.\d{6})\d+", r"\1", value.replace("Z", "+00:00"))
      with contextlib.suppress(ValueError):
        return datetime.datetime.fromisoformat(text).timestamp()
  return 0.0
