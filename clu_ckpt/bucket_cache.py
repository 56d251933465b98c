"""What one bucket operation keeps: metadata answers, and small objects read once.

On a bucket every question is a round trip. One read-only operation (a load,
an inspection) asks the same ones many times (does the directory exist, what
does it hold, how large is each file); a migration reads each checkpoint's
iterator files (`.index`, `.data-*`) at several stages. Two blocks keep the
answers for the length of one operation, in this thread or task only:

- `metadata_cache()`: each listing and object's metadata is asked for once;
  any write, removal or exclusive create through `fsspec_fs` forgets all of
  them (so a write's effect is seen by the next question).
- `object_cache(under, but_not)`: each small object (up to
  `SMALL_OBJECT_BYTES`) under the prefix `under` (and not under `but_not`)
  read by `read_bytes` or spooled is downloaded whole once and every later
  read of it is served from memory, with its metadata (at most
  `OBJECT_CACHE_BYTES` in all, least recently used dropped first); a write
  or removal of that object through `fsspec_fs` forgets it. The listings
  and metadata of everything under `under` (not under `but_not`) are kept
  for the whole block too, whatever is written elsewhere meanwhile (a
  listing also answers for the metadata of the objects it lists); a write
  under `under` through `fsspec_fs` forgets them. For objects nobody writes
  while the block runs (a migration's source), never for objects others
  write (a lock, a destination).

Outside these blocks nothing is cached, so other processes' writes are seen
at once. Blocks nest: the outermost one keeps the objects, and an inner
block's `but_not` applies too while it runs.

Synopsis::

  from clu_ckpt import bucket_cache

  with bucket_cache.metadata_cache():
    state = checkpoint.load_state_dict("gs://b/run")
  with bucket_cache.object_cache("gs://b/run", but_not="gs://b/orbax"):
    summary = migration.migrate("gs://b/run", "gs://b/orbax")
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import re
import threading
from typing import Any, Callable, Iterator, Optional

from clu_ckpt import errors

# An object this small is downloaded whole at its first read in an
# `object_cache()` block (one request), and kept for the block.
SMALL_OBJECT_BYTES = 16 * 2**20
# What an `object_cache()` block keeps at most, in all.
OBJECT_CACHE_BYTES = 64 * 2**20

# Metadata answers kept while a `metadata_cache()` block runs (None: none).
_METADATA: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar(
    "clu_ckpt_bucket_metadata", default=None)


_OBJECTS: contextvars.ContextVar[Optional["_Objects"]] = (
    contextvars.ContextVar("clu_ckpt_bucket_objects", default=None))


@contextlib.contextmanager
def metadata_cache() -> Iterator[None]:
  """Within the block, each listing and object's metadata is asked for once.

  One read-only operation (a load, an inspection) asks the same questions
  many times (does the directory exist, what does it hold, how large is
  each file); on a bucket each is a round trip. Inside this block (in this
  thread or task) the answers are kept and reused; any write, removal or
  exclusive create through `fsspec_fs` forgets them. Blocks nest. Outside
  them nothing is cached, so other processes' writes are seen at once.

  Example::

    with bucket_cache.metadata_cache():
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



@contextlib.contextmanager
def object_cache(under: str, but_not: str = "") -> Iterator[None]:
  """Within the block, each small object under `under` is downloaded once.

  For an operation that reads objects nobody writes meanwhile (a
  migration's source) several times. Objects under `but_not` (a
  destination inside the source) are never kept.

  Example::

    with bucket_cache.object_cache("gs://b/run", but_not="gs://b/run/orbax"):
      summary = migration.migrate("gs://b/run", "gs://b/run/orbax")
  """
  outer = _OBJECTS.get()
  if outer is not None:
    # The outermost block's objects are kept; this block's exclusion
    # applies too while it runs (what it excludes may be written now).
    with outer.excluding(but_not):
      yield
    return
  token = _OBJECTS.set(_Objects(OBJECT_CACHE_BYTES, under, but_not))
  try:
    yield
  finally:
    _OBJECTS.reset(token)


_PASSING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "clu_ckpt_bucket_passing", default=False)


@contextlib.contextmanager
def passing_through() -> Iterator[None]:
  """Within the block, reads are not turned into whole-object downloads.

  For a read of an object's first bytes long before its whole is needed
  (a migration's planning peeks at every `.flax` before writing any): kept
  whole then, a small `.flax` could be dropped by the cache's limit before
  its turn and downloaded twice. Objects already kept are still served.

  Example::

    with bucket_cache.passing_through():
      head = fs.read_bytes("gs://b/run/ckpt-7.flax", 0, 2**20)
  """
  token = _PASSING.set(True)
  try:
    yield
  finally:
    _PASSING.reset(token)


class _Objects:
  """Whole small objects and their metadata, least recently used dropped."""

  def __init__(self, limit: int, under: str, but_not: str):
    self.limit = limit
    # `under` itself, and a multi-host run's `<under>-<host>/` directories;
    # not a sibling that merely starts with its name (`<under>2/`).
    self.under = re.compile(re.escape(under.rstrip("/")) + r"(?:-[0-9]+)?/")
    self.but_not = [but_not.rstrip("/") + "/"] if but_not else []
    self.root = under.rstrip("/")
    # `under` and what is below it: the prefixes whose metadata is kept.
    self.tree = re.compile(re.escape(under.rstrip("/")) + r"(?:-[0-9]+)?(?:/|$)")
    # Metadata answers under `under`, kept for the block (see `cached`).
    self.meta: dict = {}
    # A thread given the block's context (a migration's prefetch) may use
    # it beside the caller.
    self._mutex = threading.RLock()
    self.held = 0
    self._items: "collections.OrderedDict[str, tuple[dict, bytes]]" = (
        collections.OrderedDict())

  def excludes(self, key: str) -> bool:
    """Whether `key` is under one of the excluded prefixes (or is one)."""
    return any(key.startswith(prefix) or key == prefix[:-1]
               for prefix in self.but_not)

  def keeps_metadata(self, key: str) -> bool:
    """Whether the metadata of `key` (a URL) is kept for the block."""
    key = key.rstrip("/")
    return self.tree.match(key) is not None and not self.excludes(key)

  @contextlib.contextmanager
  def excluding(self, but_not: str) -> Iterator[None]:
    """Also never keeps objects under `but_not` (and forgets them) while
    the block runs."""
    if not but_not:
      yield
      return
    prefix = but_not.rstrip("/") + "/"
    self.forget(prefix, tree=True)
    self.but_not.append(prefix)
    try:
      yield
    finally:
      self.but_not.remove(prefix)

  def get(self, key: str) -> Optional[tuple[dict, bytes]]:
    with self._mutex:
      item = self._items.get(key)
      if item is not None:
        self._items.move_to_end(key)
      return item

  def put(self, key: str, info: dict, data: bytes) -> None:
    with self._mutex:
      self._drop(key)
      if len(data) > self.limit:
        return
      self._items[key] = (info, data)
      self.held += len(data)
      while self.held > self.limit:
        _, (_, old) = self._items.popitem(last=False)
        self.held -= len(old)

  def forget(self, key: str, *, tree: bool = False) -> None:
    with self._mutex:
      if not key or self.keeps_metadata(key) or tree and (
          self.root.startswith(key.rstrip("/") + "/")):
        self.meta.clear()  # a write under the kept tree (or anywhere: "")
      self._drop(key, tree=tree)

  def _drop(self, key: str, *, tree: bool = False) -> None:
    with self._mutex:
      for k in [k for k in self._items
                if k == key or tree and k.startswith(key.rstrip("/") + "/")]:
        self.held -= len(self._items.pop(k)[1])


def cached_object(key: str) -> Optional[tuple[dict, bytes]]:
  """(metadata, bytes) of the object `key` if an `object_cache` holds it."""
  objects = _OBJECTS.get()
  return None if objects is None else objects.get(key)


def keep_object(key: str, info: dict, data: bytes) -> None:
  """Keeps a small object read whole, if an `object_cache` block runs."""
  objects = _OBJECTS.get()
  if caching_objects(key) and len(data) <= SMALL_OBJECT_BYTES:
    objects.put(key, info, data)


def caching_objects(key: str) -> bool:
  """Whether an `object_cache` block keeps the object `key` (its URL)."""
  objects = _OBJECTS.get()
  return objects is not None and not _PASSING.get() and (
      objects.under.match(key) is not None) and not objects.excludes(key)


def forget(key: str = "", *, tree: bool = False) -> None:
  """Forgets all metadata, and the object `key` (or all under it: `tree`)."""
  cache = _METADATA.get()
  if cache is not None:
    cache.clear()
  objects = _OBJECTS.get()
  if objects is not None:
    objects.forget(key, tree=tree)


def _cache_for(path: str) -> Optional[dict]:
  """The metadata cache that applies to `path`: an `object_cache` block's
  for its source tree, else a `metadata_cache` block's, else None."""
  objects = _OBJECTS.get()
  if objects is not None and objects.keeps_metadata(path):
    return objects.meta
  return _METADATA.get()


def remember(scheme: str, name: str, path: str, value: Any,
             ok: bool = True) -> None:
  """Keeps what `name(path)` answers (or raises: `ok` False), if a cache
  applies to `path`: what a listing tells of the objects it lists."""
  cache = _cache_for(path)
  if cache is not None:
    cache.setdefault((scheme, name, path.rstrip("/")), (ok, value))


def parent_listing(scheme: str, path: str) -> Optional[list[str]]:
  """The names a kept listing of `path`'s directory holds, when the same
  cache applies to `path` (the listing then answers whether it exists);
  else None."""
  parent = path.rstrip("/").rpartition("/")[0]
  cache = _cache_for(path)
  if not parent or cache is None or _cache_for(parent) is not cache:
    return None
  listed = cache.get((scheme, "listdir", parent))
  return listed[1] if listed is not None and listed[0] else None


def recalled(scheme: str, name: str, path: str) -> Optional[tuple]:
  """(ok, answer) kept for `name(path)`, or None."""
  cache = _cache_for(path)
  return None if cache is None else cache.get(
      (scheme, name, path.rstrip("/")))


def cached(method: Callable) -> Callable:
  """Keeps `method(self, path)`'s answer (or error) in the active cache.

  A decorator of `FsspecFileSystem` methods taking one path.
  """

  def wrapper(self: Any, path: str) -> Any:
    cache = _cache_for(path)
    if cache is None:
      return method(self, path)
    key = (self._scheme, method.__name__, path.rstrip("/"))
    if key not in cache:
      try:
        cache[key] = (True, method(self, path))
      except (FileNotFoundError, errors.NotRegularFileError) as e:
        objects = _OBJECTS.get()
        if (isinstance(e, FileNotFoundError) and objects is not None and
            cache is objects.meta):
          # Kept for the whole run: what exists, never what does not (a
          # name may appear meanwhile; only a kept listing says it is not
          # there, and a write under the run forgets it).
          raise
        cache[key] = (False, e)
    ok, value = cache[key]
    if not ok:
      raise value
    return list(value) if isinstance(value, list) else value

  wrapper.__name__ = method.__name__
  wrapper.__doc__ = method.__doc__
  return wrapper

