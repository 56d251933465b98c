"""Reading a migrated step's Flax state with TensorStore alone.

`clu-ckpt migrate` writes each CLU checkpoint as an Orbax step whose `state`
item holds the arrays in TensorStore (zarr in an OCDBT key-value store),
strings in `_strings.json`, the tree in `_METADATA`, and whose `metadata`
item records how to give back exactly the source's state dict (key order,
stand-ins: `clu_ckpt.migration.codec`). This module reads those files
directly: JSON with `storage`, arrays with TensorStore. Neither Orbax, JAX
nor TensorFlow is imported, and with `subtree` only that subtree's arrays
are read. All arrays are read concurrently (one TensorStore future each).

Synopsis::

  from clu_ckpt import orbax_read

  state = orbax_read.read_state("/runs/a/orbax/500")
  params = orbax_read.read_state("/runs/a/orbax/500", subtree="params")
  meta = orbax_read.migration_metadata("/runs/a/orbax/500")  # or None

The files read (what Orbax 0.12's `PyTreeCheckpointHandler` writes)::

  <step>/metadata/metadata        the migration's JSON (`format`, `encoded`)
  <step>/state/_METADATA          tree: per leaf its keys and value type
  <step>/state/_strings.json      string leaves, by parameter name
  <step>/state/manifest.ocdbt ... arrays, key `<keys joined by ".">/`
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import numpy as np

from clu_ckpt import errors
from clu_ckpt import layout
from clu_ckpt import storage

_read_json = storage.read_json_object

STATE_ITEM = "state"
METADATA_ITEM = "metadata"
# The `format` the migration records in its metadata item (its prefix).
MIGRATION_FORMAT = "clu_ckpt.migration/"
# Orbax's key types in `_METADATA` (`tree_metadata` ... `key_type`).
_SEQUENCE_KEY = 1
# Value types stored as TensorStore arrays, and restored as Python scalars.
_ARRAY_TYPES = ("np.ndarray", "jax.Array")
_SCALAR_TYPE = "scalar"
_STRING_TYPE = "string"

Subtree = Union[None, str, Sequence[str]]
# Read coalescing for buckets (the settings Orbax 0.12 uses there).
_COALESCING = {
    "experimental_read_coalescing_threshold_bytes": 1000000,
    "experimental_read_coalescing_merged_bytes": 500000000000,
    "experimental_read_coalescing_interval": "1ms",
}


def migration_metadata(step_dir: str) -> Optional[dict[str, Any]]:
  """The migration's `metadata` item of a step, or None if it has none.

  Args:
    step_dir: The step directory (`<root>/<step>`).

  Returns:
    The JSON dict when it records a clu_ckpt migration `format`, else None.
  """
  meta = _read_json(storage.join(step_dir, METADATA_ITEM, METADATA_ITEM))
  if meta is None or not str(meta.get("format", "")).startswith(
      MIGRATION_FORMAT):
    return None
  return meta


def subtree_keys(subtree: Subtree) -> tuple[str, ...]:
  """("params", "Dense_0") for "params/Dense_0", a sequence, or None."""
  if subtree is None:
    return ()
  if isinstance(subtree, str):
    return tuple(k for k in subtree.split("/") if k)
  return tuple(str(k) for k in subtree)


def read_state(step_dir: str, subtree: Subtree = None) -> Any:
  """The Flax state dict (or a subtree) a migrated step was written from.

  Equal to `flax_format.load_file` of the source `.flax` (and to
  `migration.restore_state`): same keys in the same order, same types,
  dtypes, shapes and bytes. Steps written with a template (`migrate(...,
  template=...)`) are turned back into the state dict form too.

  Args:
    step_dir: The step directory (`<root>/<step>`, local or a URL).
    subtree: Only this subtree ("params/Dense_0" or a sequence of keys);
      only its arrays are read.

  Returns:
    The state dict or the subtree.

  Raises:
    CheckpointNotFoundError: `step_dir` holds no migrated state.
    SubtreeNotFoundError: No such subtree (a `FlaxFormatError`, as for a
      `.flax` file; the message names the keys available at the level
      where the path stops).
    InvalidCheckpointError: The step's files cannot be read.
  """
  from clu_ckpt.migration import codec  # pylint: disable=g-import-not-at-top
  from clu_ckpt.migration import template  # pylint: disable=g-import-not-at-top
  meta = migration_metadata(step_dir)
  if meta is None:
    raise errors.CheckpointNotFoundError(
        f"{step_dir}: not a step migrated by clu_ckpt (no `metadata` item "
        "with a clu_ckpt.migration format)")
  item = storage.join(step_dir, STATE_ITEM)
  tree_meta = _read_json(storage.join(item, "_METADATA"))
  if tree_meta is None or not isinstance(tree_meta.get("tree_metadata"),
                                         dict):
    raise errors.InvalidCheckpointError(
        f"{storage.join(item, '_METADATA')}: missing or not Orbax's tree "
        "metadata")
  encodings = meta.get("encoded") or {}
  keys = subtree_keys(subtree)
  with_template = template.written_with_template(meta)
  order = encodings.get("order") if encodings.get("version") == 2 else None
  if keys:
    _check_subtree(keys, order, tree_meta["tree_metadata"], step_dir)
  # A template's structure differs from the state dict's: read it whole.
  wanted = () if with_template else keys
  stored = _read_tree(item, tree_meta, wanted)
  if with_template:
    stored = template.state_dict_form(stored, order)
    state = codec.decode_state(stored, encodings)
    for key in keys:
      state = state[key]
    return state
  if not keys:
    return codec.decode_state(
        stored, encodings, [l["path"] for l in meta.get("leaves", [])])
  value = stored
  for key in keys:
    value = value.get(key) if isinstance(value, dict) else None
  return codec.decode_subtree(value, _typed_keys(keys, order), encodings)


def _typed_keys(keys: tuple, order: Optional[dict]) -> tuple:
  """The keys with list indices as ints, as `codec` records them."""
  out, node = [], order
  for key in keys:
    if node is not None and "list" in node:
      out.append(int(key))
      node = node.get("sub", {}).get(key)
    else:
      out.append(key)
      node = None if node is None else node.get("sub", {}).get(key)
  return tuple(out)


def _check_subtree(keys: tuple, order: Optional[dict], tree_meta: dict,
                   step_dir: str) -> None:
  """Raises KeyError naming the keys available where `keys` stops.

  The source's keys, in order, come from the skeleton the migration
  recorded (`order`); for steps without one, from Orbax's tree metadata.
  """
  if order is not None:
    node = order
    for depth, key in enumerate(keys):
      available = (node.get("keys") if "keys" in node else
                   [str(i) for i in range(node.get("list", 0))]) if (
                       node is not None) else None
      if available is None or key not in available:
        _no_subtree(keys, depth, available, step_dir)
      node = node.get("sub", {}).get(key)
    return
  paths = [tuple(str(k.get("key")) for k in entry.get("key_metadata") or [])
           for entry in tree_meta.values()]
  for depth, key in enumerate(keys):
    level = [p for p in paths if p[:depth] == keys[:depth] and len(p) > depth]
    available = list(dict.fromkeys(p[depth] for p in level))
    if key not in available:
      _no_subtree(keys, depth, available or None, step_dir)


def _no_subtree(keys: tuple, depth: int, available: Optional[list],
                step_dir: str) -> None:
  where = "/" + "/".join(keys[:depth])
  if available is None:
    detail = f"{where} is a leaf, not a map"
  else:
    detail = (f"{where} has no key {keys[depth]!r}; its keys: "
              f"{describe_keys(available)}")
  raise errors.SubtreeNotFoundError(
      f"no subtree {'/'.join(keys)!r}: {detail}", step_dir)


def describe_keys(keys: Sequence[Any], limit: int = 20) -> str:
  """Keys for a message: "'a', 'b', 'c'" (the first `limit`, then a count)."""
  shown = ", ".join(repr(k) for k in list(keys)[:limit])
  more = len(keys) - limit
  return (shown or "none") + (f" and {more} more" if more > 0 else "")


def _read_tree(item: str, tree_meta: dict, keys: tuple) -> Any:
  """The item's tree as Orbax's `PyTreeRestore()` gives it, `keys` only.

  Dicts for dict keys, lists for sequence keys; arrays as numpy arrays,
  scalars as Python scalars, strings, None and empty containers.
  """
  entries = []
  for entry in tree_meta["tree_metadata"].values():
    key_meta = entry.get("key_metadata") or []
    path = tuple(str(k.get("key")) for k in key_meta)
    if path[:len(keys)] != keys:
      continue
    kinds = tuple(k.get("key_type") == _SEQUENCE_KEY for k in key_meta)
    entries.append((path, kinds, entry.get("value_metadata") or {}))
  ts_meta = dict(use_ocdbt=tree_meta.get("use_ocdbt", True),
                 use_zarr3=tree_meta.get("use_zarr3", False))
  values = _read_values(item, entries, ts_meta)
  root: Any = {}
  for (path, kinds, _), value in zip(entries, values):
    _insert(root, path, kinds, value)
  return _lists(root)


def _read_values(item: str, entries: list, ts_meta: dict) -> list:
  """Each entry's value: arrays read concurrently with TensorStore."""
  strings = None
  values: list[Any] = [None] * len(entries)
  pending = []
  for i, (path, _, value_meta) in enumerate(entries):
    kind = value_meta.get("value_type")
    name = ".".join(path)
    if kind in _ARRAY_TYPES or kind == _SCALAR_TYPE:
      pending.append((i, kind, name))
    elif kind == _STRING_TYPE:
      if strings is None:
        strings = _read_json(storage.join(item, "_strings.json")) or {}
      if name not in strings:
        raise errors.InvalidCheckpointError(
            f"{storage.join(item, '_strings.json')}: no string {name!r}")
      values[i] = strings[name]
    elif kind in ("Dict", "dict"):
      values[i] = {}
    elif kind in ("List", "list"):
      values[i] = []
    else:  # "None", and what Orbax does not restore
      values[i] = None
  if pending:
    arrays = read_arrays(item, [name for _, _, name in pending], **ts_meta)
    for (i, kind, _), array in zip(pending, arrays):
      values[i] = array.item() if kind == _SCALAR_TYPE else array
  return values


def read_arrays(item: str, names: Sequence[str], *, use_ocdbt: bool = True,
                use_zarr3: bool = False) -> list[np.ndarray]:
  """Reads the named arrays of an Orbax item with TensorStore, concurrently.

  Args:
    item: The item directory (local path or `gs://` URL).
    names: Parameter names (keys joined with ".").
    use_ocdbt: The item's arrays are in one OCDBT store (Orbax's default).
    use_zarr3: zarr v3 instead of v2.

  Returns:
    numpy arrays, in the order of `names`.

  Raises:
    InvalidCheckpointError: An array cannot be opened or read (names it).
  """
  base = _kvstore_url(item)
  if not base.startswith("file://"):
    # TensorStore reads the bucket itself (an emulator through
    # TENSORSTORE_GCS_HTTP_URL): set up before it is imported.
    from clu_ckpt import fsspec_fs  # pylint: disable=g-import-not-at-top
    fsspec_fs.configure_environment()
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  # As Orbax reads: OCDBT's B-tree nodes cached (read once for all arrays),
  # nothing rechecked, a missing chunk an error (Orbax writes every chunk).
  context = ts.Context({"file_io_concurrency": {"limit": 128},
                        "cache_pool#ocdbt": {"total_bytes_limit": 10**8}})
  opened = []
  for name in names:
    if use_ocdbt:
      kvstore = {"driver": "ocdbt", "base": base, "path": f"{name}/",
                 "cache_pool": "cache_pool#ocdbt"}
      if not base.startswith("file://"):
        kvstore.update(_COALESCING)
    else:
      kvstore = f"{base}{name}/"
    spec = {"driver": "zarr3" if use_zarr3 else "zarr", "kvstore": kvstore,
            "recheck_cached_data": False, "recheck_cached_metadata": False,
            "fill_missing_data_reads": False}
    opened.append(ts.open(spec, open=True, read=True, context=context))
  reads = []
  for name, future in zip(names, opened):
    try:
      reads.append(future.result().read())
    except Exception as e:  # pylint: disable=broad-except
      raise errors.InvalidCheckpointError(
          f"{item}: array {name!r} cannot be opened: {_first_line(e)}") from e
  out = []
  for name, future in zip(names, reads):
    try:
      out.append(np.asarray(future.result()))
    except Exception as e:  # pylint: disable=broad-except
      raise errors.InvalidCheckpointError(
          f"{item}: array {name!r} cannot be read: {_first_line(e)}") from e
  return out


def _first_line(e: BaseException) -> str:
  return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _kvstore_url(directory: str) -> str:
  scheme, _ = layout.split_scheme(directory)
  if scheme:
    return directory.rstrip("/") + "/"
  return "file://" + layout.absolute(directory).rstrip("/") + "/"


def _insert(root: dict, path: tuple, kinds: tuple, value: Any) -> None:
  """Puts `value` at `path`; sequence levels are dicts keyed by int here."""
  node = root
  for depth, key in enumerate(path):
    k: Any = int(key) if kinds[depth] else key
    if depth == len(path) - 1:
      node[k] = value
    else:
      node = node.setdefault(k, {})


def _lists(node: Any) -> Any:
  """Turns the int-keyed dicts `_insert` made for sequences into lists."""
  if not isinstance(node, dict):
    return node
  if node and all(isinstance(k, int) for k in node):
    return [_lists(node[k]) for k in sorted(node)]
  return {k: _lists(v) for k, v in node.items()}
