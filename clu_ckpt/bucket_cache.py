"""What one bucket operation keeps: metadata answers, and small objects read once.

On a bucket every question is a round trip. One read-only operation (a load,
an inspection) asks the same ones many times (does the directory exist, what
does it hold, how large is each file); a migration reads each checkpoint's
iterator files (`.index`, `.data-*`) at several stages. Two blocks keep the
answers for the length of one operation, in this thread or task only:

- `metadata_cache()`: each listing and object's metadata is asked for once;
  any write, removal or exclusive create through `fsspec_fs` forgets all of
  them (so a write's effect is seen by the next question).
- `object_cache()`: a `metadata_cache()`, and besides, each small object
  (up to `SMALL_OBJECT_BYTES`) read by `read_bytes` is downloaded whole
  once and every later read of it is served from memory, with its metadata
  (at most `OBJECT_CACHE_BYTES` in all, least recently used dropped first);
  a write or removal of that object forgets it.

Outside these blocks nothing is cached, so other processes' writes are seen
at once. Blocks nest (the outermost one counts).

Synopsis::

  from clu_ckpt import bucket_cache

  with bucket_cache.metadata_cache():
    state = checkpoint.load_state_dict("gs://b/run")
  with bucket_cache.object_cache():
    summary = migration.migrate("gs://b/run", "gs://b/orbax")
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
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
def object_cache() -> Iterator[None]:
  """Within the block, each small object is downloaded at most once.

  Also a `metadata_cache()`. For an operation that reads objects it does not
  write (a migration's source) and reads small ones several times.

  Example::

    with bucket_cache.object_cache():
      summary = migration.migrate("gs://b/run", "gs://b/orbax")
  """
  if _OBJECTS.get() is not None:
    with metadata_cache():
      yield
    return
  token = _OBJECTS.set(_Objects(OBJECT_CACHE_BYTES))
  try:
    with metadata_cache():
      yield
  finally:
    _OBJECTS.reset(token)


class _Objects:
  """Whole small objects and their metadata, least recently used dropped."""

  def __init__(self, limit: int):
    self.limit = limit
    self.held = 0
    self._items: "collections.OrderedDict[str, tuple[dict, bytes]]" = (
        collections.OrderedDict())

  def get(self, key: str) -> Optional[tuple[dict, bytes]]:
    item = self._items.get(key)
    if item is not None:
      self._items.move_to_end(key)
    return item

  def put(self, key: str, info: dict, data: bytes) -> None:
    self.forget(key)
    if len(data) > self.limit:
      return
    self._items[key] = (info, data)
    self.held += len(data)
    while self.held > self.limit:
      _, (_, old) = self._items.popitem(last=False)
      self.held -= len(old)

  def forget(self, key: str, *, tree: bool = False) -> None:
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
  if objects is not None and len(data) <= SMALL_OBJECT_BYTES:
    objects.put(key, info, data)


def caching_objects() -> bool:
  """Whether an `object_cache` block runs (in this thread or task)."""
  return _OBJECTS.get() is not None


def forget(key: str = "", *, tree: bool = False) -> None:
  """Forgets all metadata, and the object `key` (or all under it: `tree`)."""
  cache = _METADATA.get()
  if cache is not None:
    cache.clear()
  objects = _OBJECTS.get()
  if objects is not None and key:
    objects.forget(key, tree=tree)


def cached(method: Callable) -> Callable:
  """Keeps `method(self, path)`'s answer (or error) in the active cache.

  A decorator of `FsspecFileSystem` methods taking one path.
  """

  def wrapper(self: Any, path: str) -> Any:
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

