"""`clu_ckpt.bucket_client`: URLs, settings, errors, the clients' classes.

Most of the module is pure (URL splitting, settings, the translation of the
clients' errors into the seam's, modification times) and is tested here
without a store. The clients themselves are made for real (gcsfs, s3fs) and
pointed at nothing but 127.0.0.1; the stores' behaviour is tested against the
emulators in test_fsspec_fs.py and test_fsspec_unreachable.py.
"""

import datetime
import errno
import json
import os
import sys

import pytest

import emulators
from clu_ckpt import bucket_client
from clu_ckpt import errors


@pytest.fixture
def local_only(monkeypatch):
  """The clients' variables pointing at 127.0.0.1 (a port nobody answers)."""
  for name, value in emulators.ENV.items():
    monkeypatch.setenv(name, value)
  for name in ("STORAGE_EMULATOR_HOST", "AWS_ENDPOINT_URL",
               "AWS_ENDPOINT_URL_S3", "TENSORSTORE_GCS_HTTP_URL"):
    monkeypatch.setenv(name, "http://127.0.0.1:1")
  for name in ("AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS"):
    monkeypatch.delenv(name, raising=False)


# -- URLs ----------------------------------------------------------------------


def test_split_url_takes_scheme_bucket_and_key():
  split = bucket_client.split_url
  assert split("gs://b/runs/a/") == ("gs", "b", "runs/a")
  assert split("GS://Bucket/Key/") == ("gs", "Bucket", "Key")
  assert split("s3://b") == ("s3", "b", "")
  assert split("s3://b/") == ("s3", "b", "")
  assert split("s3://b//k//") == ("s3", "b", "k")
  assert split("gcs://b/a/b/c") == ("gcs", "b", "a/b/c")
  assert split("s3a+x.y-z://b/k") == ("s3a+x.y-z", "b", "k")
  assert split("gs://b/X/aX") == ("gs", "b", "X/aX")  # only "/" stripped


@pytest.mark.parametrize("path", ["/local/path", "gs:/b/k", "x://b/k",
                                  "1s://b/k", " gs://b/k", "relative/gs://b"])
def test_split_url_refuses_what_is_not_a_bucket_url(path):
  with pytest.raises(ValueError) as raised:
    bucket_client.split_url(path)
  assert str(raised.value) == (
      f"{path}: not a bucket URL (scheme://bucket/...)")


# -- settings ------------------------------------------------------------------


def test_positive_int_setting(monkeypatch):
  name = "CLU_CKPT_TEST_SETTING"
  monkeypatch.delenv(name, raising=False)
  assert bucket_client.positive_int_setting(name, 4) == 4
  assert bucket_client.positive_int_setting(name, 0) == 1
  assert bucket_client.positive_int_setting(name, -3) == 1
  for value, expected in (("1", 1), (" 7 ", 7), ("12", 12)):
    monkeypatch.setenv(name, value)
    assert bucket_client.positive_int_setting(name, 4) == expected
  monkeypatch.setenv(name, "  ")
  assert bucket_client.positive_int_setting(name, 5) == 5
  for value in ("0", "-2", "x", "1.5"):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as raised:
      bucket_client.positive_int_setting(name, 4)
    assert str(raised.value) == f"{name}={value!r}: not a positive integer"


def test_configure_environment_sets_only_what_the_user_did_not(monkeypatch):
  for name in ("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "EPATH_USE_TF",
               "TENSORSTORE_GCS_HTTP_URL", "STORAGE_EMULATOR_HOST"):
    monkeypatch.delenv(name, raising=False)
  bucket_client.configure_environment()
  assert os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] == "false"
  assert os.environ["EPATH_USE_TF"] == "false"
  assert "TENSORSTORE_GCS_HTTP_URL" not in os.environ

  monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "true")
  monkeypatch.setenv("EPATH_USE_TF", "true")
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:9")
  bucket_client.configure_environment()
  assert os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] == "true"
  assert os.environ["EPATH_USE_TF"] == "true"
  assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == "http://127.0.0.1:9"

  for given in ("http://127.0.0.1:9", "https://127.0.0.1:9"):
    monkeypatch.delenv("TENSORSTORE_GCS_HTTP_URL")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", given)
    bucket_client.configure_environment()
    assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == given

  monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", "http://127.0.0.1:8")
  bucket_client.configure_environment()
  assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == "http://127.0.0.1:8"


def test_configure_environment_forgets_etils_choice_of_tensorflow():
  from etils.epath import gpath  # pylint: disable=g-import-not-at-top
  decided = gpath._is_tf_installed  # pylint: disable=protected-access
  decided()
  assert decided.cache_info().currsize == 1
  bucket_client.configure_environment()
  assert decided.cache_info().currsize == 0


# -- the clients ---------------------------------------------------------------


def test_make_client_gcs(local_only, monkeypatch, tmp_path):
  del local_only
  # Credentials a user may have: an emulator must not make gcsfs use them
  # (it would ask Google's token endpoint); without one they are used.
  credentials = tmp_path / "credentials.json"
  credentials.write_text(json.dumps({
      "type": "authorized_user", "client_id": "x.apps.googleusercontent.com",
      "client_secret": "s", "refresh_token": "r"}))
  monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(credentials))
  fs = bucket_client.make_client("gs")
  assert type(fs).__name__ == "FirstContactGCSFileSystem"
  assert bucket_client.package_of(fs) == "gcsfs"
  assert fs.credentials.method == "anon"
  assert fs is not bucket_client.make_client("gcs")  # no instance cache
  assert fs.dircache.use_listings_cache is False
  monkeypatch.delenv("STORAGE_EMULATOR_HOST")
  assert bucket_client.make_client("gs").credentials.method == (
      "google_default")


def test_make_client_s3(local_only, monkeypatch):
  del local_only
  fs = bucket_client.make_client("s3")
  assert type(fs).__name__ == "FirstContactS3FileSystem"
  assert bucket_client.package_of(fs) == "s3fs"
  assert fs.config_kwargs == {"retries": {"mode": "standard"}}
  assert fs is not bucket_client.make_client("s3")
  assert fs.dircache.use_listings_cache is False
  for name in ("AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS"):
    monkeypatch.setenv(name, "legacy" if name == "AWS_RETRY_MODE" else "2")
    assert bucket_client.make_client("s3").config_kwargs == {}
    monkeypatch.delenv(name)


@pytest.mark.parametrize("scheme,package,extra", [("gs", "gcsfs", "gcs"),
                                                  ("s3", "s3fs", "s3")])
def test_a_missing_package_names_the_extra(scheme, package, extra,
                                           monkeypatch, local_only):
  del local_only
  monkeypatch.setitem(sys.modules, package, None)  # as if not installed
  monkeypatch.setattr(bucket_client, "_first_contact_gcs", None)
  monkeypatch.setattr(bucket_client, "_first_contact_s3", None)
  with pytest.raises(errors.MissingBackendError) as raised:
    bucket_client.make_client(scheme)
  assert str(raised.value) == (
      f"{scheme}:// paths need the `{package}` package: install it with "
      f"`pip install {package}` (or `pip install -e '.[{extra}]'` in a "
      "clu_ckpt checkout)")
  assert isinstance(raised.value.__cause__, ImportError)


def test_the_first_contact_classes_are_the_modules_attributes():
  gcs = bucket_client.FirstContactGCSFileSystem
  s3 = bucket_client.FirstContactS3FileSystem
  import gcsfs  # pylint: disable=g-import-not-at-top
  import s3fs  # pylint: disable=g-import-not-at-top
  assert issubclass(gcs, gcsfs.GCSFileSystem)
  assert issubclass(s3, s3fs.S3FileSystem)
  for cls in (gcs, s3):
    assert cls.__module__ == "clu_ckpt.bucket_client"
    assert cls.__qualname__ == cls.__name__
    assert cls._answered is False  # pylint: disable=protected-access
  assert bucket_client.FirstContactGCSFileSystem is gcs  # made once
  assert bucket_client.FirstContactS3FileSystem is s3
  assert bucket_client._CLASSES == {"gcs": gcs, "s3": s3}  # pylint: disable=protected-access
  with pytest.raises(AttributeError) as raised:
    bucket_client.NoSuchThing  # pylint: disable=pointless-statement
  assert str(raised.value) == (
      "module 'clu_ckpt.bucket_client' has no attribute 'NoSuchThing'")


def test_package_of_looks_past_this_package():
  import gcsfs  # pylint: disable=g-import-not-at-top
  fs = gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True)
  assert bucket_client.package_of(fs) == "gcsfs"
  assert bucket_client.package_of(
      bucket_client.FirstContactGCSFileSystem.__new__(
          bucket_client.FirstContactGCSFileSystem)) == "gcsfs"

  class Ours:  # a class of this package's only
    pass
  Ours.__module__ = "clu_ckpt.somewhere"
  assert bucket_client.package_of(Ours()) == "builtins"
  assert bucket_client.package_of(object()) == "builtins"


def test_has_exclusive_create(monkeypatch):
  import botocore  # pylint: disable=g-import-not-at-top
  import gcsfs  # pylint: disable=g-import-not-at-top
  import s3fs  # pylint: disable=g-import-not-at-top
  gcs = gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True)
  s3 = s3fs.S3FileSystem(anon=True, skip_instance_cache=True)
  assert bucket_client.has_exclusive_create(gcs)
  monkeypatch.setattr(botocore, "__version__", "1.35.21")
  assert bucket_client.has_exclusive_create(s3)
  for old in ("1.35.20", "1.34.99", "0.99.0", "1.35", "garbage"):
    monkeypatch.setattr(botocore, "__version__", old)
    assert not bucket_client.has_exclusive_create(s3), old
  for new in ("1.36.0", "1.35.21.dev1"):
    monkeypatch.setattr(botocore, "__version__", new)
    assert bucket_client.has_exclusive_create(s3), new

  class SyncClient:  # no coroutine: its pipe_file decides
    def pipe_file(self, path, value, mode="overwrite", **kwargs):
      del path, value, mode, kwargs
  assert bucket_client.has_exclusive_create(SyncClient())

  class OldClient:  # a release whose pipe_file takes no `mode`
    def pipe_file(self, path, value, **kwargs):
      del path, value, kwargs
  assert not bucket_client.has_exclusive_create(OldClient())

  class OldAsyncClient(OldClient):
    async def _pipe_file(self, path, data, chunksize=50 * 2**20, **kwargs):
      del path, data, chunksize, kwargs

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
      del path, value, mode, kwargs
  # The coroutine decides, as fsspec's sync wrapper calls it.
  assert not bucket_client.has_exclusive_create(OldAsyncClient())

  class NoSignature:
    pipe_file = min  # a builtin inspect finds no signature of (ValueError)
  assert not bucket_client.has_exclusive_create(NoSignature())

  class NotCallable:
    pipe_file = 5  # TypeError
  assert not bucket_client.has_exclusive_create(NotCallable())

  class NoPipeFile:  # no such method at all: no, not an AttributeError
    pass
  assert not bucket_client.has_exclusive_create(NoPipeFile())


# -- errors ----------------------------------------------------------------------


class _StoreError(Exception):
  """An exception of a client package, carrying an HTTP status like theirs."""

  def __init__(self, message, **attrs):
    super().__init__(message)
    for name, value in attrs.items():
      setattr(self, name, value)


def _from(module, cls=_StoreError):
  """A subclass of `cls` that claims to come from `module`."""
  return type(cls.__name__, (cls,), {"__module__": module})


@pytest.mark.parametrize("attr", ["code", "status", "status_code"])
def test_status_of_reads_the_clients_attributes(attr):
  assert bucket_client.status_of(_StoreError("x", **{attr: 503})) == 503
  assert bucket_client.status_of(_StoreError("x", **{attr: 100})) == 100
  assert bucket_client.status_of(_StoreError("x", **{attr: 599})) == 599
  assert bucket_client.status_of(_StoreError("x", **{attr: 99})) is None
  assert bucket_client.status_of(_StoreError("x", **{attr: 600})) is None
  assert bucket_client.status_of(_StoreError("x", **{attr: "503"})) is None


def test_status_of_reads_botocores_response():
  e = _StoreError("x", response={"ResponseMetadata": {"HTTPStatusCode": 412}})
  assert bucket_client.status_of(e) == 412
  e = _StoreError("x", code=404,
                  response={"ResponseMetadata": {"HTTPStatusCode": 412}})
  assert bucket_client.status_of(e) == 404  # the attribute first
  assert bucket_client.status_of(_StoreError("x", response={})) is None
  assert bucket_client.status_of(_StoreError("x", response={
      "ResponseMetadata": {"HTTPStatusCode": "412"}})) is None
  assert bucket_client.status_of(_StoreError("x", response="412")) is None
  assert bucket_client.status_of(ValueError("x")) is None


_PATH = "gs://b/run/ckpt-1.flax"


def test_translate_keeps_the_packages_own_errors():
  e = errors.NotRegularFileError(_PATH, "a directory (a prefix)")
  assert bucket_client.translate(e, "gs://elsewhere") is e
  plain = ValueError("not the store's")
  assert bucket_client.translate(plain, _PATH) is plain
  local = OSError(errno.EIO, "a local error")  # no status, not a client's
  assert bucket_client.translate(local, _PATH) is local


def test_translate_names_the_path_of_an_unreachable_store():
  e = bucket_client.StoreUnreachableError(errno.ETIMEDOUT, "no answer",
                                          "gs://other")
  out = bucket_client.translate(e, _PATH)
  assert isinstance(out, bucket_client.StoreUnreachableError)
  assert (out.errno, out.strerror, out.filename) == (
      errno.ETIMEDOUT, "no answer", _PATH)


@pytest.mark.parametrize("cls", [FileNotFoundError, FileExistsError])
def test_translate_names_the_path_of_a_missing_or_existing_object(cls):
  named = cls(2, "gone", _PATH)
  assert bucket_client.translate(named, _PATH) is named
  out = bucket_client.translate(cls("b/run/ckpt-1.flax"), _PATH)
  assert type(out) is cls
  assert (out.errno, out.filename) == (2, _PATH)
  assert out.strerror == "b/run/ckpt-1.flax"
  out = bucket_client.translate(cls(17, "exists", "b/key"), _PATH)
  assert (out.errno, out.filename) == (17, _PATH)


@pytest.mark.parametrize("name", ["NoCredentialsError",
                                  "PartialCredentialsError",
                                  "DefaultCredentialsError", "RefreshError",
                                  "TransportError"])
def test_translate_credential_errors(name):
  e = type(name, (Exception,), {})("could not find any")
  out = bucket_client.translate(e, _PATH)
  assert isinstance(out, errors.StoreAccessError)
  assert isinstance(out, PermissionError)
  assert str(out) == (
      f"{_PATH}: no usable credentials for this store ({name}: could not "
      "find any); see how gcsfs / s3fs find credentials, or set the usual "
      "variables (GOOGLE_APPLICATION_CREDENTIALS, AWS_ACCESS_KEY_ID...)")


def test_translate_statuses():
  out = bucket_client.translate(_from("gcsfs.retry")("Unauthorized", code=401),
                                _PATH)
  assert isinstance(out, errors.StoreAccessError)
  assert str(out).startswith(f"{_PATH}: no usable credentials for this store "
                             "(_StoreError: Unauthorized)")
  for e in (_StoreError("Forbidden", code=403), PermissionError("denied")):
    out = bucket_client.translate(e, _PATH)
    assert isinstance(out, errors.StoreAccessError)
    assert str(out) == f"{_PATH}: access refused by the store ({e})"
  out = bucket_client.translate(_StoreError("No such key", code=404), _PATH)
  assert type(out) is FileNotFoundError
  assert (out.errno, out.strerror, out.filename) == (
      2, "not found (No such key)", _PATH)
  for status in (400, 412, 429, 500, 503):
    out = bucket_client.translate(_StoreError("busy", code=status), _PATH)
    assert type(out) is OSError
    assert (out.errno, out.strerror, out.filename) == (
        errno.EIO, "_StoreError: busy", _PATH)
  kept = _StoreError("odd", code=399)  # not an error status, not a client's
  assert bucket_client.translate(kept, _PATH) is kept


@pytest.mark.parametrize("module", ["gcsfs.retry", "s3fs", "aiohttp.client",
                                    "botocore.exceptions", "aiobotocore",
                                    "google.auth", "requests", "urllib3.x"])
def test_translate_a_clients_failure_into_an_io_error(module):
  out = bucket_client.translate(_from(module)("connection reset"), _PATH)
  assert type(out) is OSError
  assert (out.errno, out.strerror, out.filename) == (
      errno.EIO, "_StoreError: connection reset", _PATH)
  # The package's own OSErrors (no status) are left to the caller.
  own = _from(module, ConnectionResetError)("reset")
  assert bucket_client.translate(own, _PATH) is own


def test_translate_leaves_other_packages_errors():
  for module in ("numpy", "gcsfsx", "mygoogle", "tests"):
    e = _from(module)("theirs")
    assert bucket_client.translate(e, _PATH) is e


def test_no_answer_names_the_endpoint_and_the_deadline(monkeypatch):
  e = bucket_client._no_answer("http://127.0.0.1:5")  # pylint: disable=protected-access
  assert isinstance(e, bucket_client.StoreUnreachableError)
  assert isinstance(e, OSError)
  assert e.errno == errno.ETIMEDOUT
  assert e.strerror == ("no answer from the store at http://127.0.0.1:5 "
                        "within 10 s (network, endpoint or firewall?)")
  monkeypatch.setattr(bucket_client, "FIRST_CONTACT_SECONDS", 2.5)
  assert "within 2.5 s" in str(bucket_client._no_answer("x"))  # pylint: disable=protected-access


def test_timeouts_are_the_builtin_and_asyncios():
  import asyncio  # pylint: disable=g-import-not-at-top
  caught = bucket_client._timeouts()  # pylint: disable=protected-access
  assert TimeoutError in caught and asyncio.TimeoutError in caught


# -- modification times ---------------------------------------------------------


def test_mtime_of_every_clients_field():
  when = datetime.datetime(2026, 11, 23, 16, 39, 41, 123456,
                           tzinfo=datetime.timezone.utc)
  stamp = when.timestamp()
  assert bucket_client.mtime({"mtime": 5}) == 5.0
  assert isinstance(bucket_client.mtime({"mtime": 5}), float)
  assert bucket_client.mtime({"mtime": 5.5}) == 5.5
  assert bucket_client.mtime({"LastModified": when}) == stamp
  assert bucket_client.mtime({"updated": "2026-11-23T16:39:41.123456789Z"}
                             ) == pytest.approx(stamp, abs=1e-6)
  assert bucket_client.mtime({"last_modified": "2026-11-23T16:39:41Z"}
                             ) == int(stamp)
  assert bucket_client.mtime({"updated": "2026-11-23T17:39:41.1+01:00"}
                             ) == pytest.approx(int(stamp) + 0.1)
  # The first field present wins, in the clients' order.
  assert bucket_client.mtime({"mtime": 1.0, "LastModified": when}) == 1.0
  assert bucket_client.mtime({"LastModified": when, "updated": "x"}) == stamp
  assert bucket_client.mtime({"updated": when, "last_modified": 3}) == stamp


def test_mtime_without_a_usable_time_is_zero():
  assert bucket_client.mtime({}) == 0.0
  assert bucket_client.mtime({"updated": ""}) == 0.0
  assert bucket_client.mtime({"updated": "yesterday"}) == 0.0
  assert bucket_client.mtime({"mtime": None, "size": 5}) == 0.0
  # An unparsable field is skipped for the next one.
  assert bucket_client.mtime({"updated": "yesterday", "last_modified": 7}
                             ) == 7.0
  assert bucket_client.mtime({"mtime": "", "LastModified": 8.0}) == 8.0
  assert bucket_client.mtime({"updated": object(), "last_modified": 9}) == 9.0
