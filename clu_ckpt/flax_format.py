"""The Flax msgpack checkpoint format (`*.flax`): one module owns it.

`flax.serialization.to_bytes` writes a state as msgpack: the state dict's maps
and scalars as plain msgpack, numpy and jax arrays as ext type 1 holding a
msgpack triple `(shape, dtype name, C-order bytes)`, numpy scalars as ext type 3
(a 0-d array), complex numbers as ext type 2 (`(real, imag)`), and arrays over
`MAX_CHUNK_SIZE` bytes (1 GiB unless changed) split into a
`{"__msgpack_chunked_array__": True, "shape": ..., "chunks": ...}` map. This
module writes exactly those bytes, but streams them: array data goes from the
array's own buffer to the file, so saving costs no copy of the state. It reads
by memory-mapping the file and handing out read-only numpy views of the array
bytes, so loading costs no copy either, and it can decode a single subtree or
only the headers.

Synopsis::

  from clu_ckpt import flax_format

  flax_format.save_file(state, "/tmp/ckpt-1.flax")   # == to_bytes(state)
  state_dict = flax_format.load_file("/tmp/ckpt-1.flax")
  params = flax_format.load_file("/tmp/ckpt-1.flax", subtree="params")
  for leaf in flax_format.inspect_file("/tmp/ckpt-1.flax"):
    print(leaf.path, leaf.dtype, leaf.shape, leaf.nbytes)

  data = flax_format.save(state)                      # bytes, for small states
  state_dict = flax_format.load(data)

  with flax_format.FlaxFile("/tmp/ckpt-1.flax") as f:  # parsed once, on use
    f.tree, f.leaves, f.subtree("params"), f.nbytes

  flax_format.dtype_name(np.dtype(">f4"))             # ">f4": the one codec
  flax_format.dtype_from_name("bfloat16")             # (see flax_dtypes)

This module is the format's public face: the API, and the knobs `CHUNK_BYTES`,
`MEMORY_FACTOR` and `MEMORY_BASE` (read at each call and passed down, so that
setting them here takes effect; while `CHUNK_BYTES` is left at its default, a
loaded Flax's `MAX_CHUNK_SIZE` applies: see `chunk_bytes`). The work is done by
its submodules, of which it re-exports what callers need: `flax_encode` (the
streaming writer), `flax_parse` (the bounded msgpack parser: errors, the limits
`MAX_DEPTH` and `MAX_NDIM`, the memory budget), `flax_decode` (`LeafInfo`,
chunked arrays, the one walk that lists leaves and builds trees) and
`flax_dtypes` (the dtype codec).

Reading needs only numpy, msgpack and ml_dtypes; writing a plain tree of dicts,
lists and arrays needs nothing more either. Flax is imported only to turn other
objects (dataclasses, named tuples, registered types) into state dicts, with
`flax.serialization.to_state_dict`, exactly as `to_bytes` does.

Every problem with the bytes of a file raises `FlaxFormatError`, a `ValueError`
naming the file and the byte offset. The reader never recurses deeper than
`MAX_DEPTH`, parses each byte a bounded number of times (time is linear in the
file's size), and whatever the bytes are, decoding or inspecting an M-byte
file allocates at most `MEMORY_FACTOR * M + MEMORY_BASE` bytes (64 x M + 16
MiB), the file's own bytes included: every Python object it creates (dicts,
lists, strings, numpy views, `LeafInfo`s and their paths) is charged to that
budget at no less than its CPython size, and a file whose objects would need
more is refused with `FlaxFormatError` before they are built. Real states are
far below the bound: array data stays in the file, and even a dict of a
million small python scalars costs about 20 x its msgpack bytes. Hostile ones
(millions of empty maps or nils, one long key repeated in a million paths)
would cost 70 x their size to unboundedly more. Map keys are strings (as Flax
writes them), bytes, ints, bools or None; float and complex keys are refused
(their hashes can be made to collide, which would make building a dict
quadratic).
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence, Union

from clu_ckpt import errors
from clu_ckpt import flax_encode
from clu_ckpt import flax_ranges
from clu_ckpt import storage
# Re-exported: flax_format.X is the public name of each (see the docstring).
from clu_ckpt.flax_decode import _Reader
from clu_ckpt.flax_decode import LeafInfo  # pylint: disable=unused-import
from clu_ckpt.flax_dtypes import _DTYPE_CACHE  # pylint: disable=unused-import
from clu_ckpt.flax_dtypes import _dtype_from_name  # pylint: disable=unused-import
from clu_ckpt.flax_dtypes import dtype_from_name  # pylint: disable=unused-import
from clu_ckpt.flax_dtypes import dtype_name  # pylint: disable=unused-import
# The reader's limits: maps and arrays nested deeper than MAX_DEPTH are
# refused as hostile input; arrays have at most MAX_NDIM dimensions (numpy's).
from clu_ckpt.flax_parse import MAX_DEPTH  # pylint: disable=unused-import
from clu_ckpt.flax_parse import MAX_NDIM  # pylint: disable=unused-import

# Arrays larger than this many bytes are split into chunks (Flax's MAX_CHUNK_SIZE).
# Left at its default, Flax's own `flax.serialization.MAX_CHUNK_SIZE` applies
# when Flax is loaded (see `chunk_bytes`); set here, this value wins.
CHUNK_BYTES = 2**30
_DEFAULT_CHUNK_BYTES = 2**30
# Reading an M-byte input (load, load_file, inspect, inspect_file) allocates at
# most MEMORY_FACTOR * M + MEMORY_BASE bytes, the input included; inputs that
# would need more are refused (once the reader's estimates, which are never
# below CPython's real sizes, reach 15/16 of the bound). Legitimate states are
# charged far less: tiny nested dicts of small scalars, None and empty dicts
# (the worst we know) about 35 x M (their real use: ~20 x M), dicts of short
# keys to python scalars or lists of floats 14-24 x M (real: 10-20 x), tiny
# arrays 10-25 x M, real models' arrays about 1 x. Hostile shapes (a 64-byte
# dict per byte of file, a LeafInfo and its path per 2 bytes, a long key in
# every path) would take 70 x M to unboundedly more.
MEMORY_FACTOR = 64
# On top: recursion frames down to MAX_DEPTH, small files' fixed costs.
MEMORY_BASE = 16 * 2**20

Subtree = Union[None, str, Sequence[str]]


FlaxFormatError = errors.FlaxFormatError


# --------------------------------------------------------------------------
# Writing.
# --------------------------------------------------------------------------


def save(state: Any) -> bytes:
  """Serializes `state` to bytes, exactly as `flax.serialization.to_bytes`.

  Use `save_file` for anything large: it never holds the encoding in memory.

  Example::

    data = save({"params": {"w": np.ones((2, 2), np.float32)}, "step": 3})
    assert load(data)["step"] == 3

  Args:
    state: A Flax state: dicts, lists, tuples, flax dataclasses or any type
      registered with `flax.serialization`, with array and scalar leaves.

  Returns:
    The msgpack encoding.

  Raises:
    TypeError: A leaf is of a type msgpack cannot encode (names its path).
    ValueError: An object or structured dtype array, or dict keys whose
      string forms collide.
    OverflowError: An int outside [-2**63, 2**64 - 1].
  """
  out = bytearray()
  flax_encode.encode(state, out.extend, chunk_bytes=chunk_bytes())
  return bytes(out)


def save_file(state: Any, path: str) -> int:
  """Writes `state` to `path` in Flax's format, streaming, crash-safe.

  The bytes are those of `flax.serialization.to_bytes(state)`. Array data is
  read straight from each array's buffer (jax arrays on the CPU are not
  copied; others cost one device-to-host transfer) and streamed to the file
  through one reused 16 MiB staging buffer (see `storage.atomic_writer`), so
  memory stays flat whatever the state's size. Local files are written under a temporary name in the same
  directory, flushed to disk with fsync and renamed, so `path` either holds the
  previous content or the complete new one; objects in buckets (`gs://`,
  `s3://`) are streamed into an upload and appear only when complete.

  Example::

    n = save_file(state, "/ckpts/ckpt-7.flax")

  Args:
    state: See `save`.
    path: Destination file.

  Returns:
    The number of bytes written.

  Raises:
    TypeError, ValueError, OverflowError: See `save`; nothing is left at `path`.
    OSError: The file could not be written (e.g. the disk is full); `path` is
      left as it was.
  """
  with storage.atomic_writer(path) as write:
    return flax_encode.encode(state, write, chunk_bytes=chunk_bytes())


def chunk_bytes() -> int:
  """The size above which `save` and `save_file` chunk an array, in bytes.

  The writer follows the same rule as `to_bytes`: an array of more than this
  many bytes becomes a chunked map. Precedence, read at each call:

  1. `CHUNK_BYTES`, when it was set to anything but its default (2**30): an
     explicit choice made here wins.
  2. Otherwise `flax.serialization.MAX_CHUNK_SIZE`, when Flax is already
     imported (`"flax.serialization" in sys.modules`), so that a program that
     changed Flax's knob gets the bytes `to_bytes` gives it. Flax is never
     imported for this.
  3. Otherwise the default, 2**30 (Flax's).

  (Setting `CHUNK_BYTES` to 2**30 itself is indistinguishable from leaving it
  alone, so Flax's value then applies.)

  Example::

    flax.serialization.MAX_CHUNK_SIZE = 2**20
    assert flax_format.chunk_bytes() == 2**20
    assert flax_format.save(state) == flax.serialization.to_bytes(state)

  Returns:
    The chunk threshold in bytes (an int, or whatever number Flax's
    attribute holds).
  """
  if CHUNK_BYTES != _DEFAULT_CHUNK_BYTES:
    return CHUNK_BYTES
  serialization = sys.modules.get("flax.serialization")
  return getattr(serialization, "MAX_CHUNK_SIZE", CHUNK_BYTES)


# --------------------------------------------------------------------------
# Reading.
# --------------------------------------------------------------------------


def load(data: Any, *, writable: bool = False, subtree: Subtree = None,
         name: Optional[str] = None) -> Any:
  """Decodes Flax msgpack bytes, like `flax.serialization.msgpack_restore`.

  Decoding M bytes allocates at most `MEMORY_FACTOR * M + MEMORY_BASE` bytes
  (`data` included) and takes time linear in M, whatever the bytes are: a
  state whose Python objects would need more (no real Flax state does, see
  `MEMORY_FACTOR`) is refused before it is built.

  Example::

    state_dict = load(open("ckpt-1.flax", "rb").read())

  Args:
    data: bytes, bytearray, memoryview, mmap or any buffer.
    writable: Return arrays that own writable memory (copies) instead of
      read-only views of `data`.
    subtree: Return only this subtree: a "/"-separated path ("params/Dense_0")
      or a sequence of keys. Other values are skipped without being decoded.
    name: How to name `data` in error messages (e.g. its file).

  Returns:
    The state dict: dicts, lists, python scalars, numpy arrays and scalars.

  Raises:
    FlaxFormatError: The bytes are not a valid encoding, `subtree` is not in
      them, or decoding them would need more memory than the bound above.
  """
  reader = _reader(data, name, writable)
  return reader.root(_subtree_keys(subtree))


def load_file(path: str, *, writable: bool = False,
              subtree: Subtree = None) -> Any:
  """Reads a `.flax` file, memory-mapped: arrays are views of the file.

  Array leaves are read-only numpy views of the mapping (their data is read
  from disk only when touched), except with `writable=True`, and except arrays
  in Flax's chunked form, which are reassembled into new memory. Views may be
  unaligned; numpy handles that, and `jax.device_put` copies them anyway. The
  file is unmapped when the last view is gone. Remote paths are read whole
  through `tf.io.gfile`. Memory and time are bounded as for `load`: at most
  `MEMORY_FACTOR` x the file's size + `MEMORY_BASE` bytes, the mapped pages
  included.

  Example::

    params = load_file("/ckpts/ckpt-7.flax", subtree="params")

  Args:
    path: The `.flax` file.
    writable: See `load`.
    subtree: See `load`.

  Returns:
    See `load`.

  Raises:
    FileNotFoundError: `path` does not exist.
    FlaxFormatError: The file is truncated, corrupt, not a Flax checkpoint, or
      would need more memory than the bound above.
  """
  # A subtree touches only its own pages: the file is not read in whole.
  keys = _subtree_keys(subtree)
  if keys and flax_ranges.is_remote(path):
    # In a bucket: the headers and the subtree's arrays, by ranged reads.
    remote = _open_remote(path, keys)
    remote.fetch_subtree(keys)
    value = load(remote.spool.map, writable=writable, subtree=keys,
                 name=path)
    remote.fetch_views(value)
    return value
  return load(_open(path, populate=not keys), writable=writable,
              subtree=subtree, name=path)


def inspect_file(path: str) -> list[LeafInfo]:
  """Lists the leaves of a `.flax` file from its headers alone.

  No array data is read: only the msgpack headers are parsed, so this is fast
  on files of any size. The list costs memory like a decoded state (a
  `LeafInfo` and its path per leaf); as for `load`, at most `MEMORY_FACTOR` x
  the file's size + `MEMORY_BASE` bytes, in time linear in the file's size.

  Example::

    total = sum(leaf.nbytes for leaf in inspect_file("ckpt-7.flax"))

  Args:
    path: The `.flax` file.

  Returns:
    One `LeafInfo` per leaf, in file order.

  Raises:
    FileNotFoundError: `path` does not exist.
    FlaxFormatError: The file is truncated, corrupt, not a Flax checkpoint
      (chunked arrays included: their shape must match their chunks, as
      `load` requires), or would need more memory than the bound above.
  """
  if flax_ranges.is_remote(path):  # a bucket's: its headers only
    return _reader(_open_remote(path).spool.map, path, False).leaves()
  reader = _reader(_open(path, populate=False), path, False)
  return reader.leaves()


def inspect(data: Any, name: Optional[str] = None) -> list[LeafInfo]:
  """`inspect_file` for bytes already in memory.

  Example::

    leaves = inspect(save({"w": np.ones(3)}))  # [LeafInfo("/w", ...)]

  Args:
    data: bytes, bytearray, memoryview, mmap or any buffer.
    name: How to name `data` in error messages.

  Returns:
    One `LeafInfo` per leaf, in file order.

  Raises:
    FlaxFormatError: As `inspect_file`; memory is bounded by `MEMORY_FACTOR`
      x `len(data)` + `MEMORY_BASE` bytes (`data` included).
  """
  return _reader(data, name, False).leaves()


class FlaxFile:
  """An open `.flax` file: parsed once, its tree and leaves handed out.

  The file is memory-mapped when opened; the first use of `tree`, `leaves`,
  `subtree` or `nbytes` parses it once, in one pass that builds both the
  state dict (as `load_file` returns it: arrays are read-only views of the
  mapping, chunked arrays joined) and its `LeafInfo`s (as `inspect_file`
  lists them). Memory and time are bounded as for `load`. Closing drops the
  handle's references; the mapping is unmapped once no view is left.

  Example::

    with flax_format.FlaxFile("/ckpts/ckpt-7.flax") as f:
      print(f.nbytes, [leaf.path for leaf in f.leaves])
      step = f.subtree("step")
      state = f.tree
    with flax_format.FlaxFile(path, read_data=False) as f:  # headers only
      total = f.nbytes

  Raises (on first use):
    FileNotFoundError: The file does not exist (on opening).
    FlaxFormatError: As `load_file` and `inspect_file`.
  """

  def __init__(self, path: str, *, read_data: bool = True):
    """Maps the file (it is parsed on first use).

    Args:
      path: The `.flax` file.
      read_data: Whether the arrays' data will be read: True (the default)
        reads a local file in whole when it is mapped (see
        `storage.map_file`), the fastest way to then read all of it from a
        cold cache (to restore, migrate or compare the state); pass False
        when only `leaves`, `nbytes` or a small `subtree` will be used (e.g.
        inspection), so that only the pages touched are read.
    """
    self.path = path
    # A bucket's file read for its headers: fetched by ranges, its arrays
    # only when `tree` or `subtree` needs them.
    self._remote: Optional[flax_ranges.RemoteFlax] = None
    if not read_data and flax_ranges.is_remote(path):
      self._remote = _open_remote(path)
      self._buffer: Any = self._remote.spool.map
    else:
      self._buffer = _open(path, populate=read_data)
    self._parsed: Optional[tuple[Any, list[LeafInfo]]] = None
    self._leaves: Optional[list[LeafInfo]] = None

  def __enter__(self) -> "FlaxFile":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def close(self) -> None:
    """Drops the handle's references to the mapping and the parsed tree."""
    self._buffer = None
    self._parsed = None
    self._leaves = None
    self._remote = None

  def _check_open(self) -> None:
    if self._buffer is None:
      raise ValueError(f"{self.path}: FlaxFile is closed")

  def _headers_only(self) -> bool:
    """Whether only a bucket file's headers are here (no parse yet)."""
    return self._parsed is None and self._remote is not None

  def _parse(self, complete: bool = True) -> tuple[Any, list[LeafInfo]]:
    """(tree, leaves), parsed once; `complete`: every byte fetched first."""
    if self._parsed is None:
      self._check_open()
      if self._remote is not None:
        if complete:
          self._remote.fetch_all()  # each byte not here yet, once
        else:
          self._remote.fetch_for_parse()  # all but the arrays' bytes
      reader = _reader(self._buffer, self.path, False)
      self._parsed = reader.tree_and_leaves()
    if complete and self._remote is not None:
      self._remote.fetch_all()  # what a streaming_tree left (or nothing)
    return self._parsed

  @property
  def tree(self) -> Any:
    """The state dict, as `load_file(path)` returns it (shared, read-only)."""
    return self._parse()[0]

  def streaming_tree(self) -> Any:
    """`tree`, whose arrays a bucket's file fetches when told they are needed.

    For a file in a bucket opened with `read_data=False`, the arrays are
    views of bytes not downloaded yet: each is fetched when its range of
    the buffer is advised `madvise(MADV_WILLNEED)` (`migration.memory.
    will_need`, which the migration's writer calls for each array before
    writing it), so that the download of the next arrays overlaps the
    upload of the current one. A consumer must advise each array before
    reading it; everything else (scalars, strings, joined chunks) is here.
    `tree` (and `subtree`) later fetch whatever is left. Otherwise `tree`.
    """
    return self._parse(complete=False)[0]

  @property
  def leaves(self) -> list[LeafInfo]:
    """The leaves, as `inspect_file(path)` lists them."""
    if self._headers_only():
      if self._leaves is None:
        self._check_open()
        self._leaves = _reader(self._buffer, self.path, False).leaves()
      return self._leaves
    return self._parse(complete=False)[1]  # no array bytes needed

  @property
  def nbytes(self) -> int:
    """Bytes of array data in the file (the sum of the leaves' nbytes)."""
    return sum(leaf.nbytes for leaf in self.leaves)

  def subtree(self, keys: Subtree) -> Any:
    """A subtree of `tree`, as `load_file(path, subtree=keys)` returns it.

    Raises:
      FlaxFormatError: There is no such subtree.
    """
    wanted = _subtree_keys(keys)
    if wanted and self._headers_only():
      self._check_open()
      self._remote.fetch_subtree(wanted)
      value = _reader(self._buffer, self.path, False).root(wanted)
      self._remote.fetch_views(value)
      return value
    node = self.tree
    for depth, key in enumerate(wanted):
      where = "/" + "/".join(wanted[:depth])
      if not isinstance(node, dict):
        raise FlaxFormatError(f"no subtree {'/'.join(wanted)!r}: {where} is "
                              "not a map", self.path, 0)
      if key not in node:
        keys = [k for k in node if isinstance(k, str)]
        shown = ", ".join(repr(k) for k in keys[:20]) or "none"
        if len(node) > 20:
          shown += f" ({len(node)} keys in all)"
        raise errors.SubtreeNotFoundError(
            f"no subtree {'/'.join(wanted)!r}: {where} has no key {key!r}; "
            f"its keys: {shown}", self.path, 0)
      node = node[key]
    return node


def open_file(path: str) -> FlaxFile:
  """`FlaxFile(path)`: the file, mapped, to be parsed once on first use."""
  return FlaxFile(path)


def _reader(data: Any, name: Optional[str], writable: bool) -> _Reader:
  """A reader of `data` bounded by this module's MEMORY_FACTOR and _BASE."""
  return _Reader(data, name, writable, memory_factor=MEMORY_FACTOR,
                 memory_base=MEMORY_BASE)


def _open(path: str, *, populate: bool) -> Any:
  buffer = storage.map_file(path, populate=populate)
  if len(buffer) == 0:
    raise FlaxFormatError("empty file", path, 0)
  return buffer


def _open_remote(path: str, keys: tuple = ()) -> "flax_ranges.RemoteFlax":
  remote = flax_ranges.open_remote(path, keys)
  if remote.spool.size == 0:
    raise FlaxFormatError("empty file", path, 0)
  return remote


def _subtree_keys(subtree: Subtree) -> tuple:
  if subtree is None:
    return ()
  if isinstance(subtree, str):
    return tuple(k for k in subtree.split("/") if k)
  return tuple(subtree)

