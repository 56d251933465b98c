"""Bucket clients: gcsfs / s3fs made, configured, and failing fast until the store answers.

The one place that knows which package serves a scheme (`gs://`: gcsfs,
`s3://`: s3fs), how they are configured (the conventional variables only:
`STORAGE_EMULATOR_HOST`, `AWS_ENDPOINT_URL`, credentials as the clients find
them), and how their errors become the seam's (`translate`: errors name the
path; a missing package is `MissingBackendError`, refused credentials a
`StoreAccessError`, a missing object a FileNotFoundError).

An unreachable store fails fast: until the store has answered once in this
process, a request gets no retries and at most `FIRST_CONTACT_SECONDS` (10 s)
to answer (`FirstContactGCSFileSystem`, `FirstContactS3FileSystem`); a wrong
endpoint, a refused connection or no network end in seconds with one error
naming the path, not after the clients' minute of retries. Once the store
has answered, gcsfs' and s3fs' own retries and timeouts apply. On S3,
botocore's "standard" retry mode is used unless `AWS_RETRY_MODE` or
`AWS_MAX_ATTEMPTS` says otherwise.

Synopsis::

  from clu_ckpt import bucket_client

  bucket_client.configure_environment()      # before gcsfs or Orbax import
  fs = bucket_client.make_client("gs")       # a gcsfs file system
  bucket_client.split_url("gs://b/runs/a/")   # ("gs", "b", "runs/a")
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import inspect
import os
import re
import sys
from typing import Any, Optional

from clu_ckpt import errors

# Which package serves a scheme, and which extra installs it.
_PACKAGES = {"gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs"),
             "s3": ("s3fs", "s3")}
SCHEME_RE = re.compile(r"^(?P<scheme>[a-z][a-z0-9.+-]+)://", re.I)

# Until a store has answered once, a request may wait this long for its
# answer (and its connection half as long), with no retries.
FIRST_CONTACT_SECONDS = 10.0
# S3 calls carrying a body: a slow link may take longer than the above to
# send them, so they are never timed as a first contact.
_S3_UPLOADS = ("put_object", "upload_part")

MissingBackendError = errors.MissingBackendError
StoreAccessError = errors.StoreAccessError


def make_client(scheme: str) -> Any:
  """A fresh gcsfs / s3fs file system for `scheme`, failing fast at first.

  No instance or listings cache (other processes' writes are seen at once).

  Raises:
    MissingBackendError: The package serving `scheme` is not installed.
  """
  package, extra = _PACKAGES[scheme]
  configure_environment()
  try:
    module = __import__(package)
  except ImportError as e:
    raise MissingBackendError(
        f"{scheme}:// paths need the `{package}` package: install "
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


def positive_int_setting(name: str, default: int) -> int:
  """The positive integer in environment variable `name`, else `default`.

  Raises:
    ValueError: The variable is set to anything but a positive integer.
  """
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
  m = SCHEME_RE.match(path)
  if not m:
    raise ValueError(f"{path}: not a bucket URL (scheme://bucket/...)")
  rest = path[m.end():]
  bucket, _, key = rest.partition("/")
  return m.group("scheme").lower(), bucket, key.strip("/")


def status_of(e: BaseException) -> Optional[int]:
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


def translate(e: BaseException, path: str) -> BaseException:
  """`e` as the error the seam promises, naming `path`."""
  if isinstance(e, errors.CluCkptError):
    return e
  if isinstance(e, StoreUnreachableError):
    return StoreUnreachableError(e.errno, e.strerror, path)
  if isinstance(e, (FileNotFoundError, FileExistsError)):
    return e if path in str(e) else type(e)(e.errno or 2, str(e), path)
  name = type(e).__name__
  status = status_of(e)
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


def _timeouts() -> tuple[type[BaseException], ...]:
  """The exceptions of a coroutine that timed out.

  asyncio's TimeoutError (aiohttp's socket timeouts, `wait_for`) is the
  builtin one from Python 3.11 on, a class of its own before.
  """
  import asyncio  # pylint: disable=g-import-not-at-top
  return (TimeoutError, asyncio.TimeoutError)


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
  timeouts = _timeouts()
  # No response at all (a status comes as ClientError, which s3fs turns
  # into FileNotFoundError, PermissionError...).
  unanswered = (botocore.exceptions.BotoCoreError, ConnectionError)

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


def package_of(fs: Any) -> str:
  """The package of `fs`' class ("gcsfs", "s3fs"), past this module's own."""
  for cls in type(fs).__mro__:
    package = cls.__module__.split(".")[0]
    if package != "clu_ckpt":
      return package
  return "clu_ckpt"


def has_exclusive_create(fs: Any) -> bool:
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
  if package_of(fs) == "s3fs":
    try:
      import botocore  # pylint: disable=g-import-not-at-top
      version = tuple(int(p) for p in botocore.__version__.split(".")[:3])
    except (ImportError, ValueError):
      return False
    return version >= (1, 35, 21)
  return True



def mtime(info: dict) -> float:
  """Seconds since the epoch of an fsspec `info` dict (gcsfs or s3fs)."""
  for field in ("mtime", "LastModified", "updated", "last_modified"):
    value = info.get(field)
    if isinstance(value, (int, float)):
      return float(value)
    if isinstance(value, datetime.datetime):
      return value.timestamp()
    if isinstance(value, str) and value:
      # Python 3.10's fromisoformat takes neither "Z" nor a fraction of
      # other than 3 or 6 digits: 6 digits, padded or cut.
      text = re.sub(r"\.(\d+)", lambda m: "." + (m.group(1) + "00000")[:6],
                    value.replace("Z", "+00:00"), count=1)
      with contextlib.suppress(ValueError):
        return datetime.datetime.fromisoformat(text).timestamp()
  return 0.0
