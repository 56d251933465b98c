"""File-system access for checkpoints, behind one small `FileSystem` seam.

Every file operation of the package goes through the module-level functions
below (`exists`, `glob`, `map_file`, `atomic_writer`, ...), which hand the
path to the back end that `filesystem(path)` picks by URL scheme, the only
place where back ends are chosen:

- plain paths and `file://` URLs: `local_fs.LocalFileSystem` (the os module,
  memory maps with read-ahead advice, O_DIRECT staged writes + fsync +
  rename, regular-file checks that never block on a FIFO);
- `gs://` and `s3://`: `fsspec_fs.FsspecFileSystem` (gcsfs, s3fs; ranged
  reads, commit by upload, no TensorFlow);
- any other `scheme://` (`hdfs://...`): `gfile_fs.GFileFileSystem`
  (`tf.io.gfile`, TensorFlow imported only then), unless a back end was
  registered for that scheme with `register_filesystem`.

Local reads open only regular files (a symlink to one is fine): a named pipe,
device, socket or directory where a file is expected raises
`NotRegularFileError` (an OSError naming the file) at once. Call
`check_regular_file` before handing a path to a library that opens it itself
(TensorFlow).

TensorFlow's `checkpoint` state file is parsed in `clu_ckpt.state_file`; its
names (`read_checkpoint_state`, `CheckpointState`, `STATE_FILENAME`, ...) are
re-exported here.

Synopsis::

  from clu_ckpt import storage

  with storage.atomic_writer("/ckpts/ckpt-3.flax") as write:
    write(b"...")
  buf = storage.map_file("/ckpts/ckpt-3.flax")
  storage.check_regular_file("/ckpts/ckpt-3.index")  # or NotRegularFileError
  storage.filesystem("gs://bucket/x")  # the FsspecFileSystem (gcsfs)
  storage.register_filesystem("s3", MyS3FileSystem)  # a new back end
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import threading
from typing import Any, Callable, ContextManager, Iterator

from clu_ckpt import errors
from clu_ckpt.filesystem import FileSystem
from clu_ckpt.filesystem import TF_INSTALL_HINT  # re-exported

_SCHEME_RE = re.compile(r"^(?P<scheme>[a-z][a-z0-9.+-]+)://", re.I)


NotRegularFileError = errors.NotRegularFileError
CheckpointStateError = errors.CheckpointStateError


# --------------------------------------------------------------------------
# Choosing the back end: the one place that looks at the scheme.
# --------------------------------------------------------------------------

_DEFAULT = "*"  # schemes without a back end of their own


def _local_fs() -> FileSystem:
  from clu_ckpt import local_fs  # pylint: disable=g-import-not-at-top
  return local_fs.LocalFileSystem()


def _fsspec_fs(scheme: str) -> Callable[[], FileSystem]:
  def factory() -> FileSystem:
    from clu_ckpt import fsspec_fs  # pylint: disable=g-import-not-at-top
    return fsspec_fs.FsspecFileSystem(scheme)
  return factory


def _gfile_fs() -> FileSystem:
  from clu_ckpt import gfile_fs  # pylint: disable=g-import-not-at-top
  return gfile_fs.GFileFileSystem()


_FACTORIES: dict[str, Callable[[], FileSystem]] = {
    "": _local_fs, "file": _local_fs, "gs": _fsspec_fs("gs"),
    "s3": _fsspec_fs("s3"), _DEFAULT: _gfile_fs}
_INSTANCES: dict[str, FileSystem] = {}
_LOCK = threading.Lock()


def register_filesystem(scheme: str,
                        factory: Callable[[], FileSystem]) -> None:
  """Makes `factory()` the back end of `scheme://` URLs from now on.

  Example::

    storage.register_filesystem("s3", FsspecFileSystem)
    storage.exists("s3://bucket/ckpts/checkpoint")  # through it

  Args:
    scheme: A URL scheme without `://` (case-insensitive); `""` is plain
      paths, `"*"` every scheme without its own back end.
    factory: Called once, on first use, to build the back end (a class is
      fine), so that its imports wait until a path needs it.
  """
  with _LOCK:
    _FACTORIES[scheme.lower()] = factory
    _INSTANCES.pop(scheme.lower(), None)


def _scheme(path: str) -> str:
  m = _SCHEME_RE.match(path)
  return m.group("scheme").lower() if m else ""


def filesystem(path: str) -> FileSystem:
  """The back end for `path`, chosen by its URL scheme.

  Example::

    storage.filesystem("/ckpts")          # a local_fs.LocalFileSystem
    storage.filesystem("gs://b/ckpts")    # a fsspec_fs.FsspecFileSystem
    storage.filesystem("hdfs://n/ckpts")  # a gfile_fs.GFileFileSystem

  Args:
    path: A path or URL.

  Returns:
    The (shared) `FileSystem` registered for its scheme.
  """
  scheme = _scheme(path)
  key = scheme if scheme in _FACTORIES else _DEFAULT
  fs = _INSTANCES.get(key)
  if fs is None:
    with _LOCK:
      fs = _INSTANCES.get(key)
      if fs is None:
        fs = _INSTANCES[key] = _FACTORIES[key]()
  return fs


def is_local(path: str) -> bool:
  """True for plain paths and `file://` URLs."""
  return _scheme(path) in ("", "file")


def gfile():
  """`tf.io.gfile`, imported on first use; a clear ImportError without TF."""
  from clu_ckpt import gfile_fs  # pylint: disable=g-import-not-at-top
  return gfile_fs.gfile()


# --------------------------------------------------------------------------
# The package's file operations: thin delegations to the chosen back end.
# --------------------------------------------------------------------------


def exists(path: str) -> bool:
  return filesystem(path).exists(path)


def isdir(path: str) -> bool:
  return filesystem(path).isdir(path)


def glob(pattern: str) -> list[str]:
  """Paths matching `pattern` (`*`, `?`, `[...]`), sorted.

  A `file://` pattern gives `file://` paths, so that callers can slice them
  by the prefix they globbed for.
  """
  return filesystem(pattern).glob(pattern)


def glob_escape(path: str) -> str:
  """`path` with its glob characters (`*`, `?`, `[`) matching literally."""
  return re.sub(r"([*?\[])", r"[\1]", path)


def listdir(path: str) -> list[str]:
  return filesystem(path).listdir(path)


def makedirs(path: str) -> None:
  filesystem(path).makedirs(path)


def remove(path: str) -> None:
  """Removes a file; a file that is already gone is not an error."""
  filesystem(path).remove(path)


def remove_tree(path: str) -> None:
  """Removes a directory and its content; a missing one is not an error.

  A symlink (to a directory or anything else) is removed itself: what it
  points to is never touched, nor are the targets of symlinks inside.
  """
  filesystem(path).remove_tree(path)


def rename(src: str, dst: str) -> None:
  """Moves `src` over `dst` (atomically on local disks).

  Raises:
    NotImplementedError: The store has no rename (object stores).
  """
  filesystem(src).rename(src, dst)


def stat(path: str) -> tuple[int, float]:
  """(size in bytes, modification time) of a file."""
  return filesystem(path).stat(path)


def check_regular_file(path: str) -> None:
  """Raises unless `path` is a regular file, without opening it.

  For paths that another library (TensorFlow) will open: a named pipe there
  would block it forever. Symlinks are followed (only the target counts).
  Remote paths (`gs://...`) are not checked.

  Example::

    storage.check_regular_file(prefix + ".index")
    tf_checkpoint.restore(prefix)

  Args:
    path: A file path or URL.

  Raises:
    NotRegularFileError: `path` is a named pipe, device, socket, directory...
    FileNotFoundError: `path` does not exist (or is a dangling symlink).
    OSError: It cannot be examined (ELOOP for a symlink loop, EACCES...),
      with `filename` set.
  """
  filesystem(path).check_regular_file(path)


def read_bytes(path: str) -> bytes:
  """The whole content of a file.

  Args:
    path: The file (path or URL).

  Returns:
    Its bytes.

  Raises:
    NotRegularFileError: A local `path` is not a regular file.
    OSError: It cannot be read (FileNotFoundError if missing).
  """
  return filesystem(path).read_bytes(path)


def read_json_object(path: str) -> "dict | None":
  """The JSON object a small metadata file holds, or None.

  For files a reader may find missing, damaged or of another shape (Orbax's
  and the migration's metadata): each of those is None, not an error.

  Example::

    meta = read_json_object(f"{step_dir}/_CHECKPOINT_METADATA") or {}

  Args:
    path: The file (path or URL).

  Returns:
    The decoded object, or None when the file is missing, unreadable, not
    JSON or not a JSON object.
  """
  try:
    value = json.loads(read_bytes(path))
  except (OSError, ValueError):
    return None
  return value if isinstance(value, dict) else None


def metadata_cache() -> ContextManager[None]:
  """A block (or decorator) in which bucket metadata is asked for once.

  Read-only operations on `gs://` / `s3://` paths (a load, an inspection)
  ask the same listings and sizes many times; inside this block each is one
  round trip (see `fsspec_fs.metadata_cache`). Local paths are unaffected.

  Example::

    with storage.metadata_cache():
      names = storage.listdir("gs://b/run")   # one listing for the block
  """
  from clu_ckpt import fsspec_fs  # pylint: disable=g-import-not-at-top
  return fsspec_fs.metadata_cache()


def caching_source_objects(source: str, destination: str) -> Callable:
  """A decorator: small bucket objects under the call's `source` read once.

  The decorated function's arguments named `source` and `destination`
  (strings) give the prefixes: within the call, small objects in a bucket
  under `source` and not under `destination` are downloaded whole once and
  kept (see `bucket_cache.object_cache`); a migration reads each
  checkpoint's iterator files at several stages. Only for functions that
  never see their source written meanwhile. Local paths are unaffected.

  Example::

    @storage.caching_source_objects("source", "destination")
    def migrate(source, destination): ...

  Args:
    source: The name of the decorated function's parameter holding the
      source (objects whose URL starts with it are kept: a multi-host
      run's `<base>-<host>` directories too).
    destination: The name of the parameter holding the destination
      (objects under it are never kept).

  Returns:
    The decorator.
  """
  import functools  # pylint: disable=g-import-not-at-top
  import inspect  # pylint: disable=g-import-not-at-top

  def decorate(function: Callable) -> Callable:
    signature = inspect.signature(function)

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
      bound = signature.bind(*args, **kwargs).arguments
      under, but_not = bound.get(source), bound.get(destination)
      if not isinstance(under, str) or is_local(under):
        return function(*args, **kwargs)
      from clu_ckpt import bucket_cache  # pylint: disable=g-import-not-at-top
      with bucket_cache.object_cache(
          under, but_not if isinstance(but_not, str) else ""):
        return function(*args, **kwargs)

    return wrapper

  return decorate


def map_file(path: str, *, populate: bool = True) -> Any:
  """The content of a file as a read-only buffer, memory-mapped when local.

  Local maps are advised for sequential reading (see `local_fs`), so that a
  cold first pass streams from the disk instead of faulting page by page, and
  with `populate` (files up to a quarter of RAM) read in whole when mapped.

  Example::

    buffer = map_file("/ckpts/ckpt-7.flax")                  # read it all
    headers = map_file("/ckpts/ckpt-7.flax", populate=False)  # touch a part

  Args:
    path: The file.
    populate: Whether most of the file will be read: False for inspection or
      one small subtree, so that only the pages touched are read from disk.

  Returns:
    An `mmap.mmap` (local, non-empty files), else `bytes`.

  Raises:
    FileNotFoundError: `path` does not exist.
    NotRegularFileError: A local `path` is not a regular file.
    OSError: It cannot be read.
  """
  return filesystem(path).map(path, populate=populate)


@contextlib.contextmanager
def atomic_writer(path: str) -> Iterator[Callable[[Any], None]]:
  """Yields a `write(bytes_like)` function whose output appears at `path` whole.

  Locally the data goes to `<path>.tmp-<unique>` in the same directory, is
  flushed to disk (fsync), and is renamed over `path`; the directory is then
  fsynced so the rename itself survives a power cut. If the block raises, the
  temporary file is removed and `path` is untouched. Objects in
  buckets (`gs://`, `s3://`) are streamed into an upload that completes when
  the block ends and is discarded if it raises.

  Local data is staged through two reused 16 MiB buffers (one filling while
  a helper thread writes the other) and written with `O_DIRECT` where the
  file system allows it: a multi-GiB checkpoint then
  goes to disk at disk speed without first filling (and evicting) gigabytes
  of page cache. File systems without `O_DIRECT` (tmpfs) get ordinary writes.

  Example::

    with atomic_writer("/ckpts/ckpt-3.flax") as write:
      write(header)
      write(memoryview(array))

  Args:
    path: Final destination.

  Yields:
    The write function.
  """
  with filesystem(path).atomic_writer(path) as write:
    yield write


def create_exclusive(path: str, data: bytes) -> None:
  """Writes `data` at `path` only if nothing is there, atomically.

  Locally `O_CREAT | O_EXCL` (the file appears whole: written under a
  temporary name, then hard-linked into place); on GCS and S3 a conditional
  upload. The primitive the migration's lock on object stores is built on.

  Example::

    try:
      storage.create_exclusive("gs://b/orbax/.clu_ckpt.lock", b"{...}")
    except FileExistsError:
      ...  # somebody holds it

  Raises:
    FileExistsError: Something is already at `path`.
    NotImplementedError: The back end cannot do it atomically (gfile).
  """
  filesystem(path).create_exclusive(path, data)


# `local_prefix` copies remote files in ranges of this many bytes.
_COPY_CHUNK = 16 * 2**20


@contextlib.contextmanager
def local_prefix(prefix: str) -> Iterator[str]:
  """A local path under which a library that opens files itself finds them.

  For TensorFlow, which reads a checkpoint `<prefix>.index` /
  `<prefix>.data-*` through its own file systems (that know neither s3:// nor
  an emulator's gs://): files in a bucket are streamed, in ranged reads, into
  a temporary directory that is removed when the block ends. Local prefixes,
  and those of back ends TensorFlow reads itself (`gfile_fs`), are yielded
  as they are.

  Example::

    with storage.local_prefix("gs://b/run/ckpt-3") as prefix:
      tf.train.Checkpoint(ds=it).read(prefix)

  Args:
    prefix: A checkpoint prefix (path or URL, without `.index`).

  Yields:
    A prefix TensorFlow can open: `prefix` itself, or `<tmp>/<basename>`.

  Raises:
    OSError: A file cannot be read (names it).
  """
  fs = filesystem(prefix)
  if is_local(prefix) or _scheme(prefix) not in ("gs", "s3"):
    yield prefix
    return
  base = prefix.rstrip("/").rsplit("/", 1)[-1]
  with tempfile.TemporaryDirectory(prefix="clu_ckpt-tf-") as tmp:
    for path in glob(f"{glob_escape(prefix)}.*"):
      suffix = path[len(prefix) + 1:]
      if suffix != "index" and not suffix.startswith("data-"):
        continue  # the `.flax` (or anything else) is not TensorFlow's
      size, _ = fs.stat(path)
      target = os.path.join(tmp, path.rsplit("/", 1)[-1])
      with open(target, "wb") as f:
        for start in range(0, size, _COPY_CHUNK):
          f.write(fs.read_bytes(path, start, min(_COPY_CHUNK, size - start)))
    yield os.path.join(tmp, base)


def sync(path: str) -> None:
  """Makes a local file written by someone else (TensorFlow) durable.

  Flushes the file and its directory (the rename that put it there); a no-op
  for remote paths, which are durable once written.
  """
  filesystem(path).sync(path)


def fsync_directory(directory: str) -> None:
  """Makes renames and deletions in a local directory durable (best effort)."""
  from clu_ckpt import local_fs  # pylint: disable=g-import-not-at-top
  local_fs.fsync_directory(directory)


def join(directory: str, *names: str) -> str:
  return os.path.join(directory, *names)
