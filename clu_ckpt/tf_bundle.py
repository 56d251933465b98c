"""TensorFlow's checkpoint files (a tensor bundle), read without TensorFlow.

A TensorFlow checkpoint `<prefix>` is `<prefix>.index`, a LevelDB-format
table (data blocks of prefix-compressed keys, an index block of block
handles, a 48-byte footer) whose values are `BundleEntryProto`s (under the
empty key, the `BundleHeaderProto`), and `<prefix>.data-NNNNN-of-MMMMM`
shards holding the values. This module reads the index with ranged reads
through `clu_ckpt.storage` (local files and buckets alike), so that the
variable names, and the bounds and checksums of the fixed-size values, are
known without importing TensorFlow, and the values checked as TensorFlow's
reader checks them, strings and variants (a tf.data iterator's state)
included. Block and value checksums are verified when `google_crc32c` is
installed. An index
with compressed blocks raises `NeedsTensorFlow`.

Synopsis::

  from clu_ckpt import tf_bundle

  shards, entries = tf_bundle.index_entries("gs://b/run/ckpt-3")
  tf_bundle.check_data("gs://b/run/ckpt-3", shards, entries)
  tf_bundle.index_variable_names("/ckpts/ckpt-3")
  # ["_CHECKPOINTABLE_OBJECT_GRAPH", "ds_iter/.ATTRIBUTES/ITERATOR_STATE", ...]
"""

from __future__ import annotations

import struct
from typing import Any, Mapping

from clu_ckpt import errors
from clu_ckpt import storage

# TensorFlow's tensor bundle index is a LevelDB-format table: data blocks of
# prefix-compressed keys, an index block of block handles, a 48-byte footer.
# Values are BundleEntryProtos (the header, under the empty key, a
# BundleHeaderProto).
_TABLE_MAGIC = 0xdb4775248b80fb57
_FOOTER_BYTES = 48
_BLOCK_TRAILER = 5  # compression type (1 byte) + masked crc32c (4 bytes)
_MAX_INDEX_BYTES = 1 << 30


class NeedsTensorFlow(errors.CluCkptError):
  """The index uses a feature only TensorFlow reads (compressed blocks)."""


def index_variable_names(prefix: str) -> list[str]:
  """The variable names of a TensorFlow checkpoint, from its `.index` only.

  Example::

    index_variable_names("gs://b/run/ckpt-3")
    # ["_CHECKPOINTABLE_OBJECT_GRAPH", "ds_iter/.ATTRIBUTES/ITERATOR_STATE",
    #  "save_counter/.ATTRIBUTES/VARIABLE_VALUE"]

  Raises:
    InvalidCheckpointError: See `index_entries`; also for compressed blocks.
  """
  try:
    return sorted(index_entries(prefix)[1])
  except NeedsTensorFlow as e:
    raise errors.InvalidCheckpointError(str(e)) from None


def index_entries(prefix: str) -> tuple[int, dict[str, dict[str, int]]]:
  """The entries of a TensorFlow checkpoint's `.index`, without TensorFlow.

  Reads the index table (LevelDB format) with ranged reads: the keys are
  what TensorFlow's `CheckpointReader.get_variable_to_shape_map()` lists.
  Block checksums are verified when `google_crc32c` is installed.

  Args:
    prefix: A checkpoint prefix (path or URL).

  Returns:
    (number of data shards, variable name -> {"shard", "offset", "size",
    "crc32c" (masked, as stored), "dtype" (TensorFlow's DataType number),
    "sliced" (1 for partitioned variables, whose values are in other
    entries), "elements" (the number of elements its shape holds; -1 for
    an unknown rank)}).

  Raises:
    InvalidCheckpointError: The index is not a table TensorFlow wrote
      (bad magic, bounds, checksum or entry).
    OSError: It cannot be read (FileNotFoundError when missing).
  """
  path = f"{prefix}.index"
  fs = storage.filesystem(path)
  size, _ = fs.stat(path)

  def bad(problem: str) -> errors.InvalidCheckpointError:
    return errors.InvalidCheckpointError(
        f"{path}: unreadable TensorFlow checkpoint index: {problem}")

  if size < _FOOTER_BYTES or size > _MAX_INDEX_BYTES:
    raise bad(f"{size} bytes")
  footer = fs.read_bytes(path, size - _FOOTER_BYTES, _FOOTER_BYTES)
  if struct.unpack("<Q", footer[-8:])[0] != _TABLE_MAGIC:
    raise bad("not a TensorFlow table (bad magic number)")
  try:
    pos = _varint(footer, 0)[1]
    pos = _varint(footer, pos)[1]  # skip the metaindex handle
    index_offset, pos = _varint(footer, pos)
    index_size, _ = _varint(footer, pos)
  except IndexError:
    raise bad("malformed footer") from None

  def block(offset: int, length: int) -> bytes:
    if offset + length + _BLOCK_TRAILER > size - _FOOTER_BYTES:
      raise bad(f"block at {offset} ({length} bytes) beyond the file")
    raw = fs.read_bytes(path, offset, length + _BLOCK_TRAILER)
    if len(raw) != length + _BLOCK_TRAILER:
      raise bad(f"short read at {offset}")
    _check_block_crc(raw, length, lambda: bad(f"checksum of the block at "
                                              f"{offset}"))
    if raw[length] != 0:
      raise NeedsTensorFlow(
          f"{path}: block at {offset} is compressed (type {raw[length]}); "
          "only TensorFlow reads it")
    return raw[:length]

  shards, entries = 1, {}
  try:
    for _, handle in _block_entries(block(index_offset, index_size)):
      offset, pos = _varint(handle, 0)
      length, _ = _varint(handle, pos)
      for key, value in _block_entries(block(offset, length)):
        fields = _proto_fields(value)
        if not key:  # BundleHeaderProto: num_shards = 1
          shards = fields.get(1, 1)
        else:
          entries[key.decode("utf-8")] = {
              "shard": fields.get(3, 0), "offset": fields.get(4, 0),
              "size": fields.get(5, 0), "crc32c": fields.get(6, 0),
              "dtype": fields.get(1, 0),
              "sliced": int(7 in fields),
              "elements": _elements(value)}
  except (IndexError, UnicodeDecodeError, struct.error) as e:
    raise bad(f"malformed block ({e})") from None
  if not 1 <= shards <= 99999:
    raise bad(f"{shards} data shards")
  return shards, dict(sorted(entries.items()))


def check_data(prefix: str, shards: int,
               entries: Mapping[str, Mapping[str, int]]) -> bool:
  """Checks the data shards against the index, without TensorFlow.

  Every value must lie inside its shard (a truncated shard fails), and each
  value must match the crc32c the index records, as TensorFlow's reader
  checks it (with `google_crc32c`): the bytes of fixed-size types; for
  strings and variants (a tf.data iterator's state), their framing too
  (element lengths, per-element checksums, then the bytes; see
  `_framed_crc`). Reads each value checked (ranged), up to
  `_CRC_READ_LIMIT` bytes (`_FRAMED_READ_LIMIT` for strings and variants).

  Returns:
    Whether every value was checked as TensorFlow's reader would check it
    (False without `google_crc32c`, or with a value over the limits).

  Raises:
    InvalidCheckpointError: A value is out of its shard's bounds or its
      checksum differs (names the shard and variable).
    OSError: A shard cannot be read (FileNotFoundError when missing).
  """
  crc32c = _crc32c()
  complete = crc32c is not None
  sizes: dict[int, int] = {}
  for name, entry in entries.items():
    if entry["sliced"]:
      continue
    path = f"{prefix}.data-{entry['shard']:05d}-of-{shards:05d}"
    if entry["shard"] not in sizes:
      sizes[entry["shard"]] = storage.stat(path)[0]
    start, end = entry["offset"], entry["offset"] + entry["size"]
    if end > sizes[entry["shard"]]:
      raise errors.InvalidCheckpointError(
          f"{path}: corrupt TensorFlow checkpoint data ({name}): bytes "
          f"{start}..{end} beyond the file's {sizes[entry['shard']]}")
    framed = entry["dtype"] in _FRAMED_DTYPES
    if crc32c is None:
      continue
    if entry["size"] > (_FRAMED_READ_LIMIT if framed else _CRC_READ_LIMIT) or (
        framed and entry.get("elements", -1) < 0):
      complete = False
      continue
    value = storage.filesystem(path).read_bytes(path, start, entry["size"])
    try:
      crc = (_framed_crc(crc32c, value, entry["dtype"], entry["elements"])
             if framed else int(crc32c.value(value)))
    except (IndexError, ValueError) as e:
      raise errors.InvalidCheckpointError(
          f"{path}: corrupt TensorFlow checkpoint data ({name}): {e}"
      ) from None
    if _mask(crc) != entry["crc32c"]:
      raise errors.InvalidCheckpointError(
          f"{path}: corrupt TensorFlow checkpoint data ({name}): checksum "
          "mismatch")
  return complete


# DT_STRING and DT_VARIANT: stored with framing (lengths, checksums).
_DT_STRING, _DT_VARIANT = 7, 21
_FRAMED_DTYPES = (_DT_STRING, _DT_VARIANT)
# Fixed-size values up to this size are read to check their checksum.
_CRC_READ_LIMIT = 1 << 20
# Strings and variants (an iterator's state, read whole by TensorFlow too)
# up to this size.
_FRAMED_READ_LIMIT = 1 << 28


def _framed_crc(crc32c: Any, data: bytes, dtype: int, elements: int) -> int:
  """The crc32c TensorFlow's bundle writer computes for a string or variant
  tensor's bytes (before masking), checking the framing on the way.

  Strings: the lengths (varint64 each), the masked crc32c of the lengths
  (each hashed as a little-endian uint32, or uint64 above 2**32 - 1), then
  the bytes of every element. Variants, per element: the length (varint64,
  hashed as uint64), the serialized `VariantTensorDataProto`, then the
  masked crc32c of everything hashed so far. The tensor's crc32c covers the
  hashed lengths, the stored checksums and the bytes, in that order.

  Raises:
    ValueError: A stored checksum differs or the framing does not fill the
      value exactly.
    IndexError: The framing runs past the value.
  """
  crc, pos = 0, 0
  if dtype == _DT_STRING:
    lengths = []
    for _ in range(elements):
      length, pos = _varint(data, pos)
      lengths.append(length)
      crc = crc32c.extend(crc, struct.pack(
          "<I" if length <= 0xffffffff else "<Q", length))
    stored = data[pos:pos + 4]
    if len(stored) != 4:
      raise IndexError("string lengths run past the value")
    if struct.unpack("<I", stored)[0] != _mask(crc):
      raise ValueError("checksum of the string lengths mismatch")
    crc = crc32c.extend(crc, stored)
    pos += 4
    end = pos + sum(lengths)
    if end > len(data):
      raise IndexError("strings run past the value")
    crc = crc32c.extend(crc, data[pos:end])
    pos = end
  else:
    for _ in range(elements):
      length, pos = _varint(data, pos)
      crc = crc32c.extend(crc, struct.pack("<Q", length))
      end = pos + length
      stored = data[end:end + 4]
      if len(stored) != 4:
        raise IndexError("variant runs past the value")
      crc = crc32c.extend(crc, data[pos:end])
      if struct.unpack("<I", stored)[0] != _mask(crc):
        raise ValueError("checksum of a variant element mismatch")
      crc = crc32c.extend(crc, stored)
      pos = end + 4
  if pos != len(data):
    raise ValueError(f"{len(data) - pos} bytes after the last element")
  return int(crc)


def _elements(entry: bytes) -> int:
  """The element count of a BundleEntryProto's shape (field 2, a
  TensorShapeProto: dims (field 2, each with size = field 1), unknown_rank
  (field 3)); -1 for an unknown rank."""
  shape = _length_delimited(entry).get(2, b"")
  if _proto_fields(shape).get(3):
    return -1
  count = 1
  for dim in _length_delimited(shape, repeated=2):
    count *= _proto_fields(dim).get(1, 0)
  return count


def _length_delimited(data: bytes, repeated: int = 0) -> Any:
  """The length-delimited fields of a protobuf message: {number: bytes} (the
  last of each), or the list of every field `repeated` when it is given."""
  fields, found, pos = {}, [], 0
  while pos < len(data):
    key, pos = _varint(data, pos)
    number, wire = key >> 3, key & 7
    if wire == 0:
      pos = _varint(data, pos)[1]
    elif wire == 5:
      pos += 4
    elif wire == 1:
      pos += 8
    elif wire == 2:
      length, pos = _varint(data, pos)
      if pos + length > len(data):
        raise IndexError("protobuf field beyond the entry")
      fields[number] = data[pos:pos + length]
      if number == repeated:
        found.append(data[pos:pos + length])
      pos += length
    else:
      raise IndexError(f"protobuf wire type {wire}")
  return found if repeated else fields


def _crc32c() -> Any:
  try:
    import google_crc32c  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return google_crc32c


def _mask(crc: int) -> int:
  """LevelDB's / TensorFlow's masked crc32c."""
  return ((((crc >> 15) | (crc << 17)) & 0xffffffff) + 0xa282ead8) & (
      0xffffffff)


def _proto_fields(data: bytes) -> dict[int, int]:
  """The varint and fixed32 fields of a protobuf message, by number.

  Length-delimited and fixed64 fields are skipped but their presence is
  recorded (as 1): enough for BundleEntryProto's shard_id (3), offset (4),
  size (5), crc32c (6, fixed32) and slices (7), and BundleHeaderProto's
  num_shards (1).
  """
  fields, pos = {}, 0
  while pos < len(data):
    key, pos = _varint(data, pos)
    number, wire = key >> 3, key & 7
    if wire == 0:
      fields[number], pos = _varint(data, pos)
    elif wire == 5:
      fields[number] = struct.unpack("<I", data[pos:pos + 4])[0]
      pos += 4
    elif wire == 1:
      fields[number], pos = 1, pos + 8
    elif wire == 2:
      length, pos = _varint(data, pos)
      fields[number], pos = 1, pos + length
    else:
      raise IndexError(f"protobuf wire type {wire}")
    if pos > len(data):
      raise IndexError("protobuf field beyond the entry")
  return fields


def _check_block_crc(raw: bytes, length: int, error: Any) -> None:
  """Verifies a block's masked crc32c (of data + type) when we can."""
  crc32c = _crc32c()
  if crc32c is None:
    return
  stored = struct.unpack("<I", raw[length + 1:length + 5])[0]
  if _mask(int(crc32c.value(raw[:length + 1]))) != stored:
    raise error()


def _varint(data: bytes, pos: int) -> tuple[int, int]:
  """(value, next position) of the base-128 varint at `pos`."""
  value = shift = 0
  while True:
    byte = data[pos]
    pos += 1
    value |= (byte & 0x7f) << shift
    if byte < 0x80:
      return value, pos
    shift += 7
    if shift > 63:
      raise IndexError("varint too long")


def _block_entries(data: bytes) -> list[tuple[bytes, bytes]]:
  """The (key, value) entries of a table block, keys rebuilt in full."""
  if len(data) < 4:
    raise IndexError("block too short")
  restarts = struct.unpack("<I", data[-4:])[0]
  end = len(data) - 4 - 4 * restarts
  if end < 0:
    raise IndexError("restart array beyond the block")
  entries, key, pos = [], b"", 0
  while pos < end:
    shared, pos = _varint(data, pos)
    unshared, pos = _varint(data, pos)
    length, pos = _varint(data, pos)
    if shared > len(key) or pos + unshared + length > end:
      raise IndexError(f"entry at {pos} beyond the block")
    key = key[:shared] + data[pos:pos + unshared]
    pos += unshared
    entries.append((key, data[pos:pos + length]))
    pos += length
  return entries
