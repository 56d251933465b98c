"""The object-store back end (`clu_ckpt.fsspec_fs`) against real emulators.

Every test runs on fake-gcs-server and on moto's S3 server (`bucket_store`),
both on 127.0.0.1 (tests/emulators.py), through `clu_ckpt.storage` as the
package uses it.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from clu_ckpt import bucket_spool
from clu_ckpt import bucket_upload
from clu_ckpt import errors
from clu_ckpt import fsspec_fs
from clu_ckpt import storage


@pytest.fixture
def root(bucket_store):
  return f"{bucket_store.scheme}://{bucket_store.bucket()}/run"


def test_chooses_fsspec_for_buckets():
  assert isinstance(storage.filesystem("gs://b/x"), fsspec_fs.FsspecFileSystem)
  assert isinstance(storage.filesystem("s3://b/x"), fsspec_fs.FsspecFileSystem)
  assert not isinstance(storage.filesystem("/x"), fsspec_fs.FsspecFileSystem)


def test_a_scheme_without_a_back_end_is_refused_by_name():
  for scheme in ("ftp", "file", "s3a", ""):
    with pytest.raises(ValueError) as raised:
      fsspec_fs.FsspecFileSystem(scheme)
    assert str(raised.value) == f"no fsspec back end for {scheme}://"
  for scheme in ("GS", "gcs", "S3"):  # any case, both names of GCS
    assert fsspec_fs.FsspecFileSystem(scheme)._scheme == scheme.lower()  # pylint: disable=protected-access


def test_split_url():
  assert fsspec_fs.split_url("gs://b/runs/a/") == ("gs", "b", "runs/a")
  assert fsspec_fs.split_url("S3://b") == ("s3", "b", "")
  with pytest.raises(ValueError, match="not a bucket URL"):
    fsspec_fs.split_url("/local/path")


def test_write_list_stat_read(root):
  data = bytes(range(256)) * 1000
  with storage.atomic_writer(f"{root}/ckpt-1.flax") as write:
    write(data[:1000])
    write(memoryview(data)[1000:])
  storage.atomic_writer  # pylint: disable=pointless-statement
  with storage.atomic_writer(f"{root}/sub/checkpoint") as write:
    write(b"x")
  assert storage.exists(f"{root}/ckpt-1.flax")
  assert storage.isdir(f"{root}/sub")
  assert not storage.isdir(f"{root}/ckpt-1.flax")
  assert storage.listdir(root) == ["ckpt-1.flax", "sub"]
  assert storage.glob(f"{root}/ckpt-*.flax") == [f"{root}/ckpt-1.flax"]
  size, mtime = storage.stat(f"{root}/ckpt-1.flax")
  assert size == len(data) and mtime > 1.7e9
  fs = storage.filesystem(root)
  assert fs.read_bytes(f"{root}/ckpt-1.flax", 1000, 24) == data[1000:1024]
  assert fs.read_bytes(f"{root}/ckpt-1.flax", len(data) - 3) == data[-3:]
  assert storage.read_bytes(f"{root}/ckpt-1.flax") == data


def test_map_spools_by_ranges(root, monkeypatch):
  monkeypatch.setattr(bucket_spool, "SPOOL_CHUNK", 4096)
  data = os.urandom(4096 * 5 + 123)
  with storage.atomic_writer(f"{root}/big") as write:
    write(data)
  buf = storage.map_file(f"{root}/big")
  assert bytes(buf) == data
  assert storage.map_file(f"{root}/big", populate=False)[:10] == data[:10]


def test_failed_write_leaves_no_object(root):
  with pytest.raises(KeyError):
    with storage.atomic_writer(f"{root}/torn.flax") as write:
      write(b"a" * (bucket_upload.UPLOAD_BLOCK + 10))  # one part sent already
      raise KeyError("killed")
  assert not storage.exists(f"{root}/torn.flax")
  with storage.atomic_writer(f"{root}/whole") as write:
    write(b"old")
  with pytest.raises(KeyError):
    with storage.atomic_writer(f"{root}/whole") as write:
      write(b"new")
      raise KeyError("killed")
  assert storage.read_bytes(f"{root}/whole") == b"old"


def test_remove_tree_keeps_siblings_with_the_same_prefix(root):
  for name in ("1/a", "1/b/c", "10/a", "1x"):
    with storage.atomic_writer(f"{root}/{name}") as write:
      write(b"x")
  storage.remove_tree(f"{root}/1")
  assert storage.listdir(root) == ["10", "1x"]
  storage.remove_tree(f"{root}/missing")  # not an error
  storage.remove(f"{root}/missing")  # not an error
  storage.remove(f"{root}/1x")
  assert storage.listdir(root) == ["10"]


def test_create_exclusive(root):
  storage.create_exclusive(f"{root}/.lock", b"first")
  with pytest.raises(FileExistsError) as info:
    storage.create_exclusive(f"{root}/.lock", b"second")
  assert f"{root}/.lock" in str(info.value)
  assert storage.read_bytes(f"{root}/.lock") == b"first"


def test_create_exclusive_local(tmp_path):
  path = str(tmp_path / "lock")
  storage.create_exclusive(path, b"first")
  with pytest.raises(FileExistsError):
    storage.create_exclusive(path, b"second")
  assert open(path, "rb").read() == b"first"
  assert os.listdir(tmp_path) == ["lock"]


def test_rename_is_refused(root):
  with pytest.raises(NotImplementedError):
    storage.rename(f"{root}/a", f"{root}/b")


def test_missing_things_are_named(bucket_store, root):
  with pytest.raises(FileNotFoundError, match="missing.flax"):
    storage.stat(f"{root}/missing.flax")
  with pytest.raises(FileNotFoundError, match="missing.flax"):
    storage.map_file(f"{root}/missing.flax")
  with pytest.raises(FileNotFoundError, match="no-such-bucket-x1.*does not exist"):
    storage.makedirs(f"{bucket_store.scheme}://no-such-bucket-x1/run")
  with pytest.raises(FileNotFoundError, match="no-such-bucket-x1"):
    with storage.atomic_writer(
        f"{bucket_store.scheme}://no-such-bucket-x1/run/a") as write:
      write(b"x")


def test_a_prefix_is_not_a_regular_file(root):
  with storage.atomic_writer(f"{root}/d/x") as write:
    write(b"x")
  with pytest.raises(errors.NotRegularFileError, match="prefix"):
    storage.check_regular_file(f"{root}/d")


def test_missing_package_names_the_extra(tmp_path):
  code = textwrap.dedent("""
      import sys
      sys.modules["gcsfs"] = None     # as if not installed
      from clu_ckpt import storage
      try:
        storage.exists("gs://b/x")
      except ImportError as e:
        print(e)
  """)
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=60, check=True).stdout
  assert "pip install gcsfs" in out and ".[gcs]" in out and "gs://" in out


def test_refused_credentials_are_named(s3):
  env = s3.child_env(AWS_ACCESS_KEY_ID="", AWS_SECRET_ACCESS_KEY="")
  code = textwrap.dedent("""
      import json, sys
      from clu_ckpt import storage
      try:
        storage.listdir("s3://somebucket/run")
      except Exception as e:
        print(json.dumps([type(e).__name__, isinstance(e, PermissionError),
                          str(e)]))
  """)
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=60, env=env)
  name, is_permission, message = json.loads(out.stdout.strip().splitlines()[-1])
  assert is_permission, (name, message)
  assert "s3://somebucket/run" in message and "credentials" in message


def test_reads_without_tensorflow(gcs):
  url = gcs.upload(_tiny_tree(gcs), "t")
  code = textwrap.dedent(f"""
      import sys
      sys.modules["tensorflow"] = None  # any import of it fails
      from clu_ckpt import storage
      print(storage.listdir("{url}"), storage.read_bytes("{url}/a"))
  """)
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=60, env=gcs.child_env())
  assert out.returncode == 0, out.stderr
  assert "['a'] b'hello'" in out.stdout


def test_an_earlier_epath_choice_of_tensorflow_is_made_again(gcs):
  """etils caches "gs:// goes through TensorFlow" at its first gs:// path.

  A path made before clu_ckpt sets `EPATH_USE_TF=false` (the user's code,
  or Orbax's) must not keep Orbax on TensorFlow's gs://, which never sees
  the emulator (nor TENSORSTORE settings): this child would ask DNS for
  www.googleapis.com.
  """
  url = gcs.upload(_tiny_tree(gcs), "epath")
  env = gcs.child_env()
  del env["EPATH_USE_TF"]
  code = textwrap.dedent(f"""
      from etils import epath
      before = type(epath.Path("{url}")._backend).__name__
      from clu_ckpt import fsspec_fs
      fsspec_fs.configure_environment()
      after = type(epath.Path("{url}")._backend).__name__
      print(before, after, (epath.Path("{url}") / "a").read_bytes())
  """)
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=120, env=env)
  assert out.returncode == 0, out.stderr
  before, after, data = out.stdout.split()
  assert before == "_TfBackend", out.stdout  # what the user's path chose
  assert after != "_TfBackend" and data == "b'hello'", out.stdout


def _tiny_tree(emulator):
  root = emulator.root / "tiny"
  root.mkdir(exist_ok=True)
  (root / "a").write_bytes(b"hello")
  return root


def test_local_prefix_copies_a_checkpoints_files(root, tmp_path):
  for name, data in (("ckpt-3.index", b"i" * 10),
                     ("ckpt-3.data-00000-of-00001", b"d" * 70000),
                     ("ckpt-30.index", b"other"), ("ckpt-3.flax", b"f")):
    with storage.atomic_writer(f"{root}/{name}") as write:
      write(data)
  with storage.local_prefix(f"{root}/ckpt-3") as prefix:
    local = os.path.dirname(prefix)
    assert os.path.basename(prefix) == "ckpt-3"
    assert sorted(os.listdir(local)) == [
        "ckpt-3.data-00000-of-00001", "ckpt-3.index"]
    assert open(prefix + ".data-00000-of-00001", "rb").read() == b"d" * 70000
  assert not os.path.exists(local)
  with storage.local_prefix(str(tmp_path / "ckpt-1")) as prefix:
    assert prefix == str(tmp_path / "ckpt-1")


def test_a_missing_bucket_is_named_by_every_operation(bucket_store):
  url = f"{bucket_store.scheme}://no-such-bucket-y2/run"
  for call in (lambda: storage.glob(f"{url}/ckpt-*"),
               lambda: storage.stat(f"{url}/checkpoint"),
               lambda: storage.read_bytes(f"{url}/checkpoint"),
               lambda: storage.listdir(url),
               lambda: storage.makedirs(url)):
    with pytest.raises(FileNotFoundError,
                       match="bucket 'no-such-bucket-y2' does not exist"):
      call()


def test_a_full_temporary_directory_fails_at_once_naming_both(
    root, tmp_path, monkeypatch):
  import shutil  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  small = tmp_path / "small"
  small.mkdir()
  if os.geteuid() != 0 or shutil.which("mount") is None or subprocess.run(
      ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)],
      capture_output=True).returncode != 0:
    pytest.skip("cannot mount a small tmpfs here (needs root)")
  try:
    with storage.atomic_writer(f"{root}/big.flax") as write:
      write(b"x" * (3 * 2**20))
    monkeypatch.setattr(tempfile, "tempdir", str(small))
    with pytest.raises(OSError) as info:
      storage.map_file(f"{root}/big.flax")
    assert info.value.errno == 28  # ENOSPC
    assert f"{root}/big.flax" in str(info.value) and str(small) in str(
        info.value) and "TMPDIR" in str(info.value)
    assert os.listdir(small) == []  # the spool is unlinked
  finally:
    subprocess.run(["umount", "-l", str(small)], capture_output=True)


def test_store_errors_become_oserrors_naming_the_path():
  class HttpError(Exception):  # what gcsfs raises for a 5xx after retries
    def __init__(self, code):
      super().__init__("Service Unavailable")
      self.code = code
  HttpError.__module__ = "gcsfs.retry"
  e = fsspec_fs._translate(HttpError(503), "gs://b/x")  # pylint: disable=protected-access
  assert isinstance(e, OSError) and "gs://b/x" in str(e) and "503" not in (
      type(e).__name__)
  assert isinstance(fsspec_fs._translate(HttpError(403), "gs://b/x"),  # pylint: disable=protected-access
                    PermissionError)
  plain = ValueError("not the store's")
  assert fsspec_fs._translate(plain, "gs://b/x") is plain  # pylint: disable=protected-access


def test_modification_times_parse_on_every_python():
  assert fsspec_fs._mtime(  # pylint: disable=protected-access
      {"updated": "2026-11-23T16:39:41.123456789Z"}) == pytest.approx(
          1795451981.123456)
  assert fsspec_fs._mtime({"mtime": 5.0}) == 5.0  # pylint: disable=protected-access


def test_exclusive_create_needs_a_conditional_write(root, monkeypatch):
  monkeypatch.setattr(fsspec_fs, "_has_exclusive_create", lambda fs: False)
  with pytest.raises(NotImplementedError, match="only if absent"):
    storage.create_exclusive(f"{root}/.lock", b"x")
  assert not storage.exists(f"{root}/.lock")


# -- containment, forgetting, exclusive create: the safety contract ------------


def _put(url, data=b"x"):
  with storage.atomic_writer(url) as write:
    write(data)


def _objects(bucket_store, root):
  """Every object under `root`, by the emulator's own client (no caches)."""
  prefix = root.split("://", 1)[1]
  return sorted(o[len(prefix) + 1:] for o in bucket_store.fs().find(prefix))


def test_remove_tree_never_leaves_its_directory(bucket_store, root):
  # Siblings whose names begin with the directory's, or equal it but for
  # what a careless strip would take away (a trailing "X", a trailing space).
  names = ["d/a", "d/b/c", "dX/a", "d /a", "dd/a", "d.flax", "e"]
  if bucket_store.scheme == "s3":
    # An object named like the prefix (fake-gcs-server's file system
    # back end cannot hold one beside the prefix; GCS can).
    names.append("d")
  for name in names:
    _put(f"{root}/{name}")
  storage.remove_tree(f"{root}/dX")
  names.remove("dX/a")
  assert _objects(bucket_store, root) == sorted(names)
  storage.remove_tree(f"{root}/d ")
  names.remove("d /a")
  assert _objects(bucket_store, root) == sorted(names)
  storage.remove_tree(f"{root}/d/")  # the placeholder object `d` too
  assert _objects(bucket_store, root) == ["d.flax", "dd/a", "e"]
  # Nothing there, or no such bucket: nothing to do, not an error.
  storage.remove_tree(f"{root}/d")
  storage.remove_tree(f"{bucket_store.scheme}://no-such-bucket-r7/run")
  storage.remove(f"{bucket_store.scheme}://no-such-bucket-r7/run/a")
  assert _objects(bucket_store, root) == ["d.flax", "dd/a", "e"]


def test_removals_and_writes_forget_what_a_cache_holds(bucket_store, root):
  from clu_ckpt import bucket_cache  # pylint: disable=g-import-not-at-top
  for name in ("d/a", "d/b/c", "f", "lock", "g"):
    _put(f"{root}/{name}", name.encode())
  fs = storage.filesystem(root)
  with bucket_cache.metadata_cache(), bucket_cache.object_cache(root):
    for name in ("d/a", "d/b/c", "f", "lock", "g"):
      assert fs.read_bytes(f"{root}/{name}") == name.encode()  # kept whole
      assert bucket_cache.cached_object(f"{root}/{name}") is not None
    assert storage.listdir(root) == ["d", "f", "g", "lock"]
    storage.remove_tree(f"{root}/d")
    for name in ("d/a", "d/b/c"):
      with pytest.raises(FileNotFoundError, match=name):
        fs.read_bytes(f"{root}/{name}")
    storage.remove(f"{root}/f")
    with pytest.raises(FileNotFoundError, match=f"{root}/f"):
      fs.read_bytes(f"{root}/f")
    assert storage.listdir(root) == ["g", "lock"]
    # Another process removes the lock; ours is created again, with new bytes.
    bucket_store.fs().rm_file(f"{root}/lock".split("://", 1)[1])
    storage.create_exclusive(f"{root}/lock", b"mine")
    assert fs.read_bytes(f"{root}/lock") == b"mine"
    _put(f"{root}/g", b"new")
    assert fs.read_bytes(f"{root}/g") == b"new"


def test_create_exclusive_refusals_are_named(root, monkeypatch):
  path = f"{root}/.lock"
  storage.create_exclusive(path, b"first")
  with pytest.raises(FileExistsError) as raised:
    storage.create_exclusive(path, b"second")
  assert (raised.value.errno, raised.value.strerror, raised.value.filename) == (
      17, "already exists", path)
  assert raised.value.__cause__ is None
  # Clients that report the failed precondition by its status instead.
  client = storage.filesystem(root).fs

  class HttpError(Exception):
    def __init__(self, code):
      super().__init__(f"status {code}")
      self.code = code
  HttpError.__module__ = "gcsfs.retry"
  for status in (409, 412, 503):
    def refuse(*args, code=status, **kwargs):
      del args, kwargs
      raise HttpError(code)
    monkeypatch.setattr(client, "pipe_file", refuse)
    with pytest.raises(OSError) as raised:
      storage.create_exclusive(f"{root}/other", b"x")
    if status == 503:  # not a refusal: an I/O error naming the object
      assert type(raised.value) is OSError
      assert raised.value.filename == f"{root}/other"
      assert "status 503" in raised.value.strerror
    else:
      assert type(raised.value) is FileExistsError
      assert (raised.value.errno, raised.value.strerror,
              raised.value.filename) == (17, "already exists",
                                         f"{root}/other")
  assert storage.read_bytes(path) == b"first"


def test_exclusive_create_without_a_conditional_write_names_the_package(
    bucket_store, root, monkeypatch):
  monkeypatch.setattr(fsspec_fs, "_has_exclusive_create", lambda fs: False)
  package = "gcsfs" if bucket_store.scheme == "gs" else "s3fs"
  with pytest.raises(NotImplementedError) as raised:
    storage.create_exclusive(f"{root}/.lock", b"x")
  assert str(raised.value) == (
      f"{root}/.lock: the installed {package} cannot create an object only "
      "if absent (upgrade it, and botocore for s3://)")


def test_missing_objects_and_buckets_are_told_apart(bucket_store, root,
                                                    monkeypatch):
  path = f"{root}/missing.flax"
  for _ in range(2):  # the bucket unknown, then known to exist
    with pytest.raises(FileNotFoundError) as raised:
      storage.stat(path)
    assert (raised.value.errno, raised.value.strerror,
            raised.value.filename) == (2, os.strerror(2), path)
  gone = f"{bucket_store.scheme}://no-such-bucket-m3/run/x"
  for call in (storage.stat, storage.makedirs, storage.stat):
    with pytest.raises(FileNotFoundError) as raised:
      call(gone)
    assert (raised.value.errno, raised.value.strerror,
            raised.value.filename) == (
                2, "bucket 'no-such-bucket-m3' does not exist (or is not "
                "visible with these credentials)", gone)
  with pytest.raises(ValueError) as raised:
    storage.makedirs(f"{bucket_store.scheme}:///run")
  assert str(raised.value) == f"{bucket_store.scheme}:///run: no bucket named"
  # When the store cannot say whether the bucket exists, the path is named.
  fs = fsspec_fs.FsspecFileSystem(bucket_store.scheme)
  monkeypatch.setattr(fs.fs, "exists", _raiser(OSError(5, "I/O error")))
  with pytest.raises(FileNotFoundError) as raised:
    fs.stat(gone)
  assert (raised.value.strerror, raised.value.filename) == (
      os.strerror(2), gone)
  # A client that reports a missing bucket by raising.
  fs = fsspec_fs.FsspecFileSystem(bucket_store.scheme)
  monkeypatch.setattr(fs.fs, "exists", _raiser(FileNotFoundError("b")))
  with pytest.raises(FileNotFoundError) as raised:
    fs.makedirs(gone)
  assert raised.value.filename == gone


def _raiser(e):
  def call(*args, **kwargs):
    del args, kwargs
    raise e
  return call


def test_a_known_bucket_is_not_asked_about_again(bucket_store, root,
                                                 monkeypatch):
  import link_proxy  # pylint: disable=g-import-not-at-top
  with link_proxy.LinkProxy(bucket_store.port) as proxy:
    if bucket_store.scheme == "gs":
      monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
    else:
      monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
      monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
    fs = fsspec_fs.FsspecFileSystem(bucket_store.scheme)
    fs.makedirs(root)
    assert proxy.requests > 0
    proxy.reset()
    fs.makedirs(f"{root}/other")
    assert proxy.requests == 0
    other = fsspec_fs.FsspecFileSystem(bucket_store.scheme)
    counts = []
    for _ in range(3):
      proxy.reset()
      with pytest.raises(FileNotFoundError):
        other.stat(f"{root}/missing")
      counts.append(proxy.requests)
    assert counts[2] < counts[0], counts  # the bucket asked about once


def test_sizes_times_and_ranges(bucket_store, root, monkeypatch):
  data = bytes(range(256)) * 8
  _put(f"{root}/a", data)
  _put(f"{root}/empty", b"")
  _put(f"{root}/one", b"z")
  fs = storage.filesystem(root)
  assert fs.stat(f"{root}/empty")[0] == 0
  assert fs.stat(f"{root}/one")[0] == 1
  size, mtime = fs.stat(f"{root}/a")
  assert size == len(data) and mtime > 1.7e9
  assert fs.read_bytes(f"{root}/a") == data
  assert fs.read_bytes(f"{root}/a", 5) == data[5:]
  assert fs.read_bytes(f"{root}/a", 5, 1) == data[5:6]
  assert fs.read_bytes(f"{root}/a", 5, 0) == b""
  assert fs.read_bytes(f"{root}/a", 0, 3) == data[:3]
  assert fs.map(f"{root}/empty") == b""
  assert bytes(fs.map(f"{root}/one")) == b"z"
  assert bytes(fs.map(f"{root}/a")) == data
  # An object whose metadata carries no time: asked for separately, never 0.
  monkeypatch.setattr(fsspec_fs, "_mtime", lambda info: 0.0)
  assert fs.stat(f"{root}/a") == (size, pytest.approx(mtime, abs=2))
  from clu_ckpt import bucket_cache  # pylint: disable=g-import-not-at-top
  monkeypatch.undo()
  with bucket_cache.object_cache(root):
    assert fs.read_bytes(f"{root}/a", 3, 4) == data[3:7]  # kept whole
    assert bucket_cache.cached_object(f"{root}/a") is not None
    assert fs.read_bytes(f"{root}/a", 3, 4) == data[3:7]  # from memory
    assert fs.read_bytes(f"{root}/a", 2040) == data[2040:]


def test_glob_names_objects_and_prefixes_as_urls(root):
  for name in ("d/a", "dX/a", "d /a", "d.flax", "e"):
    _put(f"{root}/{name}")
  assert storage.glob(f"{root}/d*") == [
      f"{root}/d", f"{root}/d ", f"{root}/d.flax", f"{root}/dX"]
  assert storage.glob(f"{root}/d*/a") == [
      f"{root}/d /a", f"{root}/d/a", f"{root}/dX/a"]


def test_a_spool_names_the_objects_version(bucket_store, root, monkeypatch):
  path = f"{root}/a"
  _put(path, b"first")
  fs = fsspec_fs.FsspecFileSystem(bucket_store.scheme)
  info = fs._object_info(path)  # pylint: disable=protected-access
  field = "generation" if bucket_store.scheme == "gs" else "ETag"
  first = fs.spool(path).identity
  assert first == (path, 5, fsspec_fs._mtime(info), str(info[field]))  # pylint: disable=protected-access
  _put(path, b"again")  # the same size, maybe the same second
  assert fs.spool(path).identity[-1] != first[-1]
  # Each client's name for the version, in this order; none: "".
  for given, version in (({"generation": 7, "ETag": "e"}, "7"),
                         ({"ETag": "e", "etag": "f"}, "e"),
                         ({"etag": "f", "VersionId": "v"}, "f"),
                         ({"VersionId": "v", "md5Hash": "m"}, "v"),
                         ({"md5Hash": "m"}, "m"),
                         ({"generation": None, "md5Hash": "m"}, "m"),
                         ({}, "")):
    monkeypatch.setattr(fs, "_object_info",
                        lambda p, given=given: {"size": 0, **given})
    assert fs.spool(path).identity == (path, 0, 0.0, version)


@pytest.mark.parametrize("size", [1, 100])
def test_a_small_object_held_whole_is_not_downloaded_again(root, size,
                                                           monkeypatch):
  from clu_ckpt import bucket_cache  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(bucket_cache, "SMALL_OBJECT_BYTES", 100)
  data = os.urandom(size)
  _put(f"{root}/a", data)
  _put(f"{root}/big", os.urandom(101))
  fs = storage.filesystem(root)
  with bucket_cache.object_cache(root):
    spool = fs.spool(f"{root}/a")
    assert spool.size == size and spool.has(0, size)  # adopted, no request
    assert spool.requests == 0 and bytes(spool.map) == data
    big = fs.spool(f"{root}/big")
    assert not big.has(0, 1)  # too large to be held
    assert bucket_cache.cached_object(f"{root}/big") is None
    big.fill()
    assert big.requests > 0


def test_an_object_that_changed_while_read_is_not_kept(bucket_store, root):
  from clu_ckpt import bucket_cache  # pylint: disable=g-import-not-at-top
  path = f"{root}/a"
  _put(path, b"short")
  fs = storage.filesystem(root)
  with bucket_cache.metadata_cache(), bucket_cache.object_cache(root):
    assert fs.stat(path)[0] == 5  # the metadata kept: 5 bytes
    bucket_store.fs().pipe_file(path.split("://", 1)[1], b"longer now")
    assert fs.read_bytes(path) == b"longer now"
    assert bucket_cache.cached_object(path) is None  # not kept: changed
    spool = fs.spool(path)
    assert spool.size == 5 and not spool.has(0, 5)  # nothing adopted


def test_fetch_into_copies_ranges_from_the_store_or_memory(bucket_store, root,
                                                           monkeypatch,
                                                           tmp_path):
  from clu_ckpt import bucket_cache  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(bucket_cache, "SMALL_OBJECT_BYTES", 3000)  # at most
  small, large = os.urandom(3000), os.urandom(5000)
  _put(f"{root}/small", small)
  _put(f"{root}/large", large)
  fs = storage.filesystem(root)
  ranges = [(0, 10), (1000, 1500), (2990, 3000)]

  def fetched(path, size, data):
    with open(tmp_path / "copy", "w+b") as f:
      f.truncate(size)
      requests = fs.fetch_into(path, f.fileno(), ranges, size, width=2,
                               chunk=300)
      f.seek(0)
      copy = f.read()
    for s, e in ranges:
      assert copy[s:e] == data[s:e], (path, s, e)
    return requests

  assert fetched(f"{root}/small", 3000, small) == 4  # ranged reads of 300
  assert fetched(f"{root}/large", 5000, large) == 4
  with bucket_cache.object_cache(root):
    assert fetched(f"{root}/small", 3000, small) == 1  # whole, kept
    assert fetched(f"{root}/small", 3000, small) == 0  # from memory
    assert fetched(f"{root}/large", 5000, large) == 4  # too large to keep
    assert bucket_cache.cached_object(f"{root}/large") is None
  # An object that changed size since its size was taken: named, refused.
  ranges = [(2900, 3100)]
  with pytest.raises(OSError, match=f"{root}/small: the object changed"):
    fetched(f"{root}/small", 3100, small)


def test_an_interrupted_write_leaves_nothing(bucket_store, root, monkeypatch):
  # Ctrl-C (KeyboardInterrupt) or SystemExit inside the block: no object,
  # no parts, no open multipart upload.
  monkeypatch.setattr(bucket_upload, "UPLOAD_BLOCK", 5 * 2**20)
  bucket = root.split("://", 1)[1].split("/", 1)[0]
  for interrupt in (KeyboardInterrupt, SystemExit):
    with pytest.raises(interrupt):
      with storage.atomic_writer(f"{root}/torn") as write:
        write(b"a" * (5 * 2**20 + 1))  # one part sent
        raise interrupt()
    assert not storage.exists(f"{root}/torn")
    fs = bucket_store.fs()
    if bucket_store.scheme == "gs":
      assert not fs.find(f"{bucket}/{bucket_upload.PARTS_PREFIX}")
    else:
      assert not fs.call_s3("list_multipart_uploads", Bucket=bucket).get(
          "Uploads")


def test_prefixes_exist_and_a_listing_leaves_out_the_directory(bucket_store,
                                                               root):
  _put(f"{root}/d/a")
  assert storage.exists(f"{root}/d") and storage.isdir(f"{root}/d")
  assert not storage.exists(f"{root}/nothing")
  if bucket_store.scheme == "s3":
    # A "folder" marker object (`d/`, as consoles make): not an entry of d.
    bucket, key = f"{root}/d/".split("://", 1)[1].split("/", 1)
    bucket_store.fs().call_s3("put_object", Bucket=bucket, Key=key, Body=b"")
  assert storage.listdir(f"{root}/d") == ["a"]
  assert storage.listdir(root) == ["d"]


def test_a_listing_kept_answers_as_the_store_does(root):
  # Inside a metadata block a listing answers for the names it lists; an
  # object and a prefix of one name stay the object, as the store says.
  for name in ("7/a", "9", "obj"):
    with storage.atomic_writer(f"{root}/{name}") as write:
      write(b"x")
  try:
    with storage.atomic_writer(f"{root}/9/a") as write:
      write(b"x")
  except OSError:
    pass  # fake-gcs-server's file store cannot hold both (moto can)
  outside = {n: (storage.exists(f"{root}/{n}"), storage.isdir(f"{root}/{n}"))
             for n in ("7", "9", "obj", "none")}
  assert outside == {"7": (True, True), "9": (True, False),
                     "obj": (True, False), "none": (False, False)}
  with storage.metadata_cache():
    assert storage.listdir(root) == ["7", "9", "obj"]
    inside = {n: (storage.exists(f"{root}/{n}"),
                  storage.isdir(f"{root}/{n}"))
              for n in ("7", "9", "obj", "none")}
    assert storage.stat(f"{root}/9")[0] == 1
  assert inside == outside
