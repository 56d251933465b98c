"""Stand-ins for the leaves Orbax cannot hold as they are, and back.

`encode_state` turns a Flax state dict into a tree Orbax stores and restores
exactly, recording each stand-in (kept in the `metadata` item's `encoded`
records); `decode_state` undoes them. Dtypes are named with the package's
one codec, `flax_format.dtype_name` / `flax_format.dtype_from_name`.

Synopsis::

  from clu_ckpt.migration import codec

  stored, encodings = codec.encode_state(state)
  assert same(codec.decode_state(stored, encodings), state)
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from clu_ckpt import errors
from clu_ckpt import flax_format

MigrationError = errors.MigrationError


def encode_state(state: Any) -> tuple[Any, dict[str, dict[str, Any]]]:
  """Turns a Flax state dict into a tree Orbax stores and restores exactly.

  Orbax keeps dicts, lists, None, bool, int, float, str and arrays of the
  dtypes TensorStore knows. Other leaves are stored as stand-ins, recorded
  in the returned encodings (kept in the `metadata` item) and undone by
  `decode_state`:

  - complex -> 0-d complex128 array; numpy scalar -> 0-d array;
  - bytes -> uint8 array;
  - array of a dtype TensorStore lacks (unicode, uint4, ...) -> its raw bytes
    as a uint8 array;
  - zero-size array (Orbax refuses them) -> None; dtype and shape are
    recorded.

  Args:
    state: A Flax state dict (as `flax_format.load_file` returns it).

  Returns:
    (tree to store, {leaf path: encoding}).

  Raises:
    MigrationError: A key is not a string, a leaf has an unsupported type, or
      two leaves would share one name in Orbax (which joins keys with ".").
  """
  encodings = {}
  stored = _encode(state, "", encodings)
  _check_param_names(stored)
  return stored, encodings


def _encode(value: Any, path: str, encodings: dict) -> Any:
  if isinstance(value, dict):
    out = {}
    for key, item in value.items():
      if not isinstance(key, str):
        raise MigrationError(f"{path or '/'}: key {key!r} is a "
                             f"{type(key).__name__}; Orbax needs str keys")
      out[key] = _encode(item, f"{path}/{key}", encodings)
    return out
  if isinstance(value, (list, tuple)):
    return [_encode(v, f"{path}/{i}", encodings) for i, v in enumerate(value)]
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, complex):
    encodings[path] = {"kind": "complex"}
    return np.asarray(value, np.complex128)
  if isinstance(value, bytes):
    return _encode_array(np.frombuffer(value, np.uint8), path, encodings,
                         "bytes")
  if isinstance(value, np.generic):
    return _encode_array(np.asarray(value), path, encodings, "npscalar")
  if isinstance(value, np.ndarray):
    return _encode_array(value, path, encodings, "ndarray")
  raise MigrationError(f"{path}: leaf of type {type(value).__name__} cannot "
                       "be stored in Orbax")


def _encode_array(arr: np.ndarray, path: str, encodings: dict,
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
    encodings[path] = record
  return stored


_TS_DTYPES: dict[str, bool] = {}


def _tensorstore_dtype(dtype: np.dtype) -> bool:
  # ml_dtypes types (bfloat16, float8_*, int4, ...) have kind "V" too.
  if dtype.kind not in "biufcV" or dtype.fields is not None:
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
  """Refuses trees in which two leaves get the same Orbax parameter name."""
  seen = {}
  for keys in _terminal_paths(tree, ()):
    name = ".".join(str(k) for k in keys)
    path = "/" + "/".join(str(k) for k in keys)
    if name in seen:
      raise MigrationError(
          f"leaves {seen[name]} and {path} would both be stored under the "
          f"Orbax name {name!r} (Orbax joins keys with '.'); rename one of "
          "them before migrating")
    seen[name] = path


def _terminal_paths(tree: Any, keys: tuple) -> Iterator[tuple]:
  if isinstance(tree, dict) and tree:
    for key, item in tree.items():
      yield from _terminal_paths(item, keys + (key,))
  elif isinstance(tree, list) and tree:
    for i, item in enumerate(tree):
      yield from _terminal_paths(item, keys + (i,))
  else:
    yield keys


def decode_state(stored: Any, encodings: Mapping[str, Mapping[str, Any]],
                 leaf_paths: Sequence[str] = ()) -> Any:
  """Undoes `encode_state`: returns the Flax state dict that was migrated.

  Args:
    stored: The `state` item as Orbax restores it.
    encodings: `metadata["encoded"]` of the same step.
    leaf_paths: The source's leaf paths in file order (`metadata["leaves"]`);
      dict keys are put back in that order (Orbax returns them sorted).

  Returns:
    The state dict, equal leaf for leaf (type, dtype, shape, bytes) to what
    `flax_format.load_file` returns for the source.
  """
  order: dict = {}
  for path in leaf_paths:
    node = order
    for key in path.split("/")[1:]:
      node = node.setdefault(key, {})
  return _reorder(decode(stored, "", encodings), order)


def _reorder(tree: Any, order: Mapping[str, Any]) -> Any:
  if not isinstance(tree, dict):
    return tree
  keys = [k for k in order if k in tree] + [k for k in tree if k not in order]
  return {k: _reorder(tree[k], order.get(k, {})) for k in keys}


def decode(value: Any, path: str, encodings: Mapping) -> Any:
  """Undoes the stand-ins of the subtree at `path` (keys keep Orbax's order)."""
  record = encodings.get(path)
  if record is not None:
    return _decode_leaf(value, record)
  if isinstance(value, dict):
    return {k: decode(v, f"{path}/{k}", encodings) for k, v in value.items()}
  if isinstance(value, list):
    return [decode(v, f"{path}/{i}", encodings) for i, v in enumerate(value)]
  return value


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
