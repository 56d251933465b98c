"""Stand-ins for the leaves Orbax cannot hold as they are, and back.

`encode_state` turns a Flax state dict into a tree Orbax stores and restores
exactly, and describes what Orbax loses in `encodings` (kept in the
`metadata` item as `encoded`): the stand-ins it stored, and the order of
every dict's keys (Orbax returns them sorted). `decode_state` undoes both,
returning exactly what `flax.serialization.msgpack_restore` returns for the
source. Dtypes are named with the package's one codec,
`flax_format.dtype_name` / `flax_format.dtype_from_name`.

The encodings (version 2) are JSON::

  {"version": 2,
   "records": {record_key(keys): record, ...},
   "order": node}

- `record_key(keys)` is `json.dumps` of the leaf's keys (dict keys are
  strings, list indices ints): a key holding "/" or "." is not confused with
  nesting, nor "0" with a list index.
- A record is {"kind": "complex" | "bytes" | "npscalar" | "ndarray",
  "dtype": name, "shape": [...], "stored_as": "none" | "raw_bytes"}
  (`dtype` and `shape` for arrays; `stored_as` only for stand-ins).
- `order` is the skeleton of the containers, one node each (leaves have
  none): a dict's node is {"keys": [its keys, in order], "sub": {key: node
  of each container child}}; a list's is {"list": length, "sub": {"<index>":
  node}}; "sub" is left out when empty. Its size is O(number of keys).

Steps migrated by earlier releases hold version 1: a flat dict of records
keyed by "/"-joined paths; `decode_state` still reads them as it did.

Synopsis::

  from clu_ckpt.migration import codec

  stored, encodings = codec.encode_state(state)
  assert same(codec.decode_state(stored, encodings), state)
"""

from __future__ import annotations

import json
from typing import Any, Iterator, Mapping, Optional, Sequence

import numpy as np

from clu_ckpt import errors
from clu_ckpt import flax_format

MigrationError = errors.MigrationError

VERSION = 2


def record_key(keys: Sequence[Any]) -> str:
  """The key of a leaf's record in `encodings["records"]`.

  Args:
    keys: The leaf's keys from the root (str for dict keys, int for list
      indices).

  Returns:
    `json.dumps(list(keys))`, e.g. '["params", "a/b"]'.
  """
  return json.dumps(list(keys))


# --------------------------------------------------------------------------
# Encoding.
# --------------------------------------------------------------------------


def encode_state(state: Any) -> tuple[Any, dict[str, Any]]:
  """Turns a Flax state dict into a tree Orbax stores and restores exactly.

  Orbax keeps dicts (keys sorted), lists, None, bool, int, float, str and
  arrays of the dtypes TensorStore knows. Other leaves are stored as
  stand-ins, recorded in the returned encodings (kept in the `metadata`
  item) and undone by `decode_state`:

  - complex -> 0-d complex128 array; numpy scalar -> 0-d array;
  - bytes -> uint8 array;
  - array of a dtype TensorStore lacks (unicode, uint4, datetime, ...) or of
    non-native byte order -> its raw bytes as a uint8 array;
  - zero-size array (Orbax refuses them) -> None; dtype and shape are
    recorded.

  No array is copied: stored arrays are views of the state's.

  Args:
    state: A Flax state dict (as `flax_format.load_file` returns it).

  Returns:
    (tree to store, encodings): the encodings are JSON-serializable (see the
    module docstring).

  Raises:
    MigrationError: A key is not a string, a leaf has an unsupported type, or
      two leaves would share one name in Orbax (which joins keys with ".",
      and in which TensorStore ends every name with "/").
  """
  records: dict[str, dict[str, Any]] = {}
  stored, order = _encode(state, (), records)
  _check_param_names(stored)
  return stored, {"version": VERSION, "records": records, "order": order}


def _encode(value: Any, keys: tuple, records: dict) -> tuple[Any, Any]:
  """(stored value, skeleton node or None) of one value."""
  if isinstance(value, dict):
    out, sub = {}, {}
    for key, item in value.items():
      if not isinstance(key, str):
        raise MigrationError(f"{describe_path(keys)}: key {key!r} is a "
                             f"{type(key).__name__}; Orbax needs str keys")
      out[key], node = _encode(item, keys + (key,), records)
      if node is not None:
        sub[key] = node
    return out, _node({"keys": list(value)}, sub)
  if isinstance(value, (list, tuple)):
    out, sub = [], {}
    for i, item in enumerate(value):
      stored, node = _encode(item, keys + (i,), records)
      out.append(stored)
      if node is not None:
        sub[str(i)] = node
    return out, _node({"list": len(value)}, sub)
  return _encode_leaf(value, keys, records), None


def _node(node: dict, sub: dict) -> dict:
  if sub:
    node["sub"] = sub
  return node


def _encode_leaf(value: Any, keys: tuple, records: dict) -> Any:
  # numpy scalars first: np.float64 is a float, np.complex128 a complex,
  # np.str_ a str and np.bytes_ bytes, but Orbax would not give them back.
  if isinstance(value, np.generic):
    return _encode_array(np.asarray(value), keys, records, "npscalar")
  if isinstance(value, np.ndarray):
    return _encode_array(value, keys, records, "ndarray")
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, complex):
    records[record_key(keys)] = {"kind": "complex"}
    return np.asarray(value, np.complex128)
  if isinstance(value, bytes):
    return _encode_array(np.frombuffer(value, np.uint8), keys, records,
                         "bytes")
  raise MigrationError(f"{describe_path(keys)}: leaf of type "
                       f"{type(value).__name__} cannot be stored in Orbax")


def _encode_array(arr: np.ndarray, keys: tuple, records: dict,
                  kind: str) -> Any:
  record = {"kind": kind, "dtype": flax_format.dtype_name(arr.dtype),
            "shape": list(arr.shape)}
  stored: Any = arr
  if arr.size == 0:
    record["stored_as"], stored = "none", None
  elif not _tensorstore_dtype(arr.dtype):
    record["stored_as"] = "raw_bytes"
    stored = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
  if kind != "ndarray" or "stored_as" in record:
    records[record_key(keys)] = record
  return stored


_TS_DTYPES: dict[str, bool] = {}


def _tensorstore_dtype(dtype: np.dtype) -> bool:
  """True when TensorStore holds `dtype` and Orbax gives it back as it is."""
  # ml_dtypes types (bfloat16, float8_*, int4, ...) have kind "V" too.
  # Orbax restores big-endian arrays as native ones: their bytes are kept.
  if (dtype.kind not in "biufcV" or dtype.fields is not None or
      not dtype.isnative):
    return False
  if dtype.name not in _TS_DTYPES:
    import tensorstore as ts  # pylint: disable=g-import-not-at-top
    try:
      ts.dtype(dtype.name)
      _TS_DTYPES[dtype.name] = True
    except (ValueError, TypeError):
      _TS_DTYPES[dtype.name] = False
  return _TS_DTYPES[dtype.name]


def _check_param_names(tree: Any) -> None:
  """Refuses trees in which two leaves get the same Orbax parameter name.

  Orbax names a leaf by joining its keys with "."; TensorStore stores it
  under that name with a "/" appended unless it ends with one already: the
  names "x/" and "x" are one array (measured with orbax-checkpoint 0.12.8:
  the second write fails or silently overwrites the first).
  """
  seen: dict[str, tuple[str, str]] = {}
  for keys in _terminal_paths(tree, ()):
    name = ".".join(str(k) for k in keys)
    stored_as = name if name.endswith("/") else name + "/"
    path = describe_path(keys)
    if stored_as in seen:
      other_path, other_name = seen[stored_as]
      names = (f"the Orbax name {name!r}" if name == other_name else
               f"the Orbax names {other_name!r} and {name!r}, which "
               "TensorStore stores as one array")
      raise MigrationError(
          f"leaves {other_path} and {path} would both be stored under "
          f"{names} (Orbax joins keys with '.', TensorStore ends names with "
          "'/'); rename one of them before migrating")
    seen[stored_as] = (path, name)


def _terminal_paths(tree: Any, keys: tuple) -> Iterator[tuple]:
  if isinstance(tree, dict) and tree:
    for key, item in tree.items():
      yield from _terminal_paths(item, keys + (key,))
  elif isinstance(tree, list) and tree:
    for i, item in enumerate(tree):
      yield from _terminal_paths(item, keys + (i,))
  else:
    yield keys


def describe_path(keys: Sequence[Any]) -> str:
  """A leaf's path for messages: "/a/b", or its JSON keys if one holds "/".

  Args:
    keys: The leaf's keys from the root.

  Returns:
    "/"-joined keys when that is unambiguous, else `record_key(keys)`.
  """
  if any("/" in str(k) for k in keys):
    return record_key(keys)
  return "/" + "/".join(str(k) for k in keys)


# --------------------------------------------------------------------------
# Decoding.
# --------------------------------------------------------------------------


def decode_state(stored: Any, encodings: Mapping[str, Any],
                 leaf_paths: Sequence[str] = ()) -> Any:
  """Undoes `encode_state`: returns the Flax state dict that was migrated.

  Args:
    stored: The `state` item as Orbax restores it.
    encodings: `metadata["encoded"]` of the same step (version 2, or the
      version 1 records of steps migrated by earlier releases).
    leaf_paths: The source's leaf paths in file order (`metadata["leaves"]`);
      used only for version 1 encodings, to put dict keys back in order.

  Returns:
    The state dict, equal to what `flax.serialization.msgpack_restore`
    returns for the source: same keys in the same order, same types, dtypes,
    shapes and bytes (for version 1 encodings, as exactly as that format
    allows).

  Raises:
    MigrationError: The encodings are of a version this release cannot read.
  """
  if _version(encodings) == 1:
    order: dict = {}
    for path in leaf_paths:
      node = order
      for key in path.split("/")[1:]:
        node = node.setdefault(key, {})
    return _reorder(_decode_v1(stored, "", encodings), order)
  return _decode(stored, (), encodings.get("order"),
                 encodings.get("records") or {})


def decode_subtree(value: Any, keys: Sequence[Any],
                   encodings: Mapping[str, Any]) -> Any:
  """Undoes `encode_state` for the subtree at `keys` only.

  Args:
    value: The subtree as Orbax restores it.
    keys: Its keys from the root (str for dict keys, int for list indices).
    encodings: `metadata["encoded"]` of the step.

  Returns:
    The subtree as the source holds it (version 1 encodings: stand-ins
    undone, keys in Orbax's order, as earlier releases did).

  Raises:
    MigrationError: The encodings are of a version this release cannot read.
  """
  if _version(encodings) == 1:
    path = "/" + "/".join(str(k) for k in keys) if keys else ""
    return _decode_v1(value, path, encodings)
  node = encodings.get("order")
  for key in keys:
    node = _child(node, key)
  return _decode(value, tuple(keys), node, encodings.get("records") or {})


def _version(encodings: Mapping[str, Any]) -> int:
  version = encodings.get("version", 1)
  if version not in (1, VERSION):
    raise MigrationError(f"stand-in records of version {version!r}: this "
                         "clu_ckpt reads versions 1 and 2; upgrade clu_ckpt")
  return version


def _child(node: Optional[Mapping[str, Any]], key: Any) -> Any:
  if node is None:
    return None
  return node.get("sub", {}).get(key if "keys" in node else str(key))


def _decode(value: Any, keys: tuple, node: Optional[Mapping[str, Any]],
            records: Mapping[str, Any]) -> Any:
  """Undoes the stand-ins of one value and puts its dicts' keys in order."""
  if node is None:
    record = records.get(record_key(keys)) if records else None
    return value if record is None else _decode_leaf(value, record)
  sub = node.get("sub", {})
  if "list" in node:
    if value is None and not node["list"]:
      return []
    if not isinstance(value, list):
      return value
    return [_decode(v, keys + (i,), sub.get(str(i)), records)
            for i, v in enumerate(value)]
  if value is None and not node["keys"]:
    return {}
  if not isinstance(value, dict):
    return value
  out = {}
  for key in node["keys"]:
    if key in value:
      out[key] = _decode(value[key], keys + (key,), sub.get(key), records)
    elif _empty(sub.get(key)):  # an empty subtree Orbax did not keep
      out[key] = [] if "list" in sub[key] else {}
  for key, item in value.items():  # not in the skeleton: kept as they come
    if key not in out:
      out[key] = _decode(item, keys + (key,), sub.get(key), records)
  return out


def _empty(node: Optional[Mapping[str, Any]]) -> bool:
  return node is not None and not node.get("keys", node.get("list"))


def _decode_leaf(value: Any, record: Mapping[str, Any]) -> Any:
  kind = record["kind"]
  if kind == "complex":
    return complex(np.asarray(value).item())
  dtype = flax_format.dtype_from_name(record["dtype"])
  shape = tuple(record["shape"])
  stored_as = record.get("stored_as")
  if stored_as == "none":
    arr = np.zeros(shape, dtype)
  elif stored_as == "raw_bytes":
    arr = np.frombuffer(np.asarray(value).tobytes(), dtype).reshape(shape)
  else:
    arr = np.asarray(value)
  if kind == "bytes":
    return arr.tobytes()
  if kind == "npscalar":
    return arr.reshape(()).astype(dtype)[()]
  return arr


# Version 1: records keyed by "/"-joined paths, order from the leaf paths.


def _reorder(tree: Any, order: Mapping[str, Any]) -> Any:
  if not isinstance(tree, dict):
    return tree
  keys = [k for k in order if k in tree] + [k for k in tree if k not in order]
  return {k: _reorder(tree[k], order.get(k, {})) for k in keys}


def _decode_v1(value: Any, path: str, encodings: Mapping) -> Any:
  record = encodings.get(path)
  if record is not None:
    return _decode_leaf(value, record)
  if isinstance(value, dict):
    return {k: _decode_v1(v, f"{path}/{k}", encodings)
            for k, v in value.items()}
  if isinstance(value, list):
    return [_decode_v1(v, f"{path}/{i}", encodings)
            for i, v in enumerate(value)]
  return value
