"""Writing the `state` item in the structure of the user's train state.

`migrate(..., template=train_state)` writes a step's `state` item as
`ocp.args.StandardSave(train_state)` would: the template's tree structure
(flax struct dataclasses, namedtuples, tuples and lists as sequences, optax
states), the values of the `.flax` file. A new Orbax loop then restores it
with `ocp.args.StandardRestore(abstract_train_state)`.

- `from_template` puts the source's leaves (views of the memory-mapped
  `.flax`: nothing is copied) into the template's structure, through Flax's
  own `flax.serialization.from_state_dict` (the inverse of the
  `to_state_dict` CLU saved with). A leaf the template lacks or adds, or
  whose shape differs, is refused with a `MigrationError` naming its path;
  leaves that only a stand-in could hold (bytes, complex, strings, zero-size
  arrays, dtypes TensorStore lacks) too. The file's dtype is written, even
  where the template's differs: `StandardRestore(abstract)` casts to the
  abstract leaf's dtype when it restores.
- `standard_state_handler` is the handler the item is written with: Orbax's
  `PyTreeCheckpointHandler` with the bounded numpy type handlers of
  `orbax_target`, recorded in the step's `_CHECKPOINT_METADATA` under the
  name of `StandardCheckpointHandler`. In orbax-checkpoint 0.12.8
  `StandardCheckpointHandler` takes no type handler registry; it checks its
  leaves, then saves through a `PyTreeCheckpointHandler` with the standard
  type handlers, so the files are the same. The name matters where a stock
  `CheckpointManager` picks a handler from it: `restore(step)` with no args
  (it restores with `StandardRestore()`) and `item_metadata(step)`.
- `state_dict_form` turns the item as `PyTreeRestore()` returns it (dicts,
  lists for sequences) back into the dict-only form of the Flax state dict,
  for `codec.decode_state`; `stored_units` pairs each leaf's Flax keys with
  its stored keys (for `verify`).

Synopsis::

  from clu_ckpt.migration import template as template_lib

  stored, encodings = codec.encode_state(handle.tree)
  tree = template_lib.from_template(train_state, stored, encodings)
  target.write_step(7, {"state": tree, "metadata": meta}, on_bytes,
                    standard_state=True)
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Optional

import numpy as np

from clu_ckpt import errors
from clu_ckpt.migration import codec

MigrationError = errors.MigrationError

# `metadata["structure"]` of a step whose state was written with a template.
STRUCTURE = "template"


def written_with_template(meta: Mapping[str, Any]) -> bool:
  """True when a step's `metadata` item says its state has a template's
  structure.

  Args:
    meta: The step's metadata item.

  Returns:
    Whether `meta["structure"]` is `STRUCTURE`.
  """
  return meta.get("structure") == STRUCTURE


def type_name(template: Any) -> str:
  """The template's type as `module.QualifiedName` (for the metadata)."""
  cls = type(template)
  return f"{cls.__module__}.{cls.__qualname__}"


# --------------------------------------------------------------------------
# Writing.
# --------------------------------------------------------------------------


def from_template(template: Any, stored: Any,
                  encodings: Mapping[str, Any]) -> Any:
  """The source's leaves in the template's tree structure.

  Example::

    stored, encodings = codec.encode_state(flax_format.load_file(path))
    abstract = jax.eval_shape(create_train_state, jax.random.key(0))
    tree = from_template(abstract, stored, encodings)   # a TrainState

  Args:
    template: The train state, concrete or abstract (`jax.ShapeDtypeStruct`
      leaves); only its structure and shapes are used.
    stored: The source state as `codec.encode_state` stores it.
    encodings: Its encodings (which leaves are stand-ins).

  Returns:
    An object of the template's type whose leaves are `stored`'s (numpy
    arrays are not copied; Python scalars stay scalars).

  Raises:
    MigrationError: A leaf is missing, extra, of another shape, or needs a
      stand-in; or the template holds a type `flax.serialization` cannot
      rebuild.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from flax import serialization  # pylint: disable=g-import-not-at-top
  _refuse_stand_ins(encodings)
  try:
    wanted = serialization.to_state_dict(template)
  except Exception as e:  # pylint: disable=broad-except
    raise MigrationError(f"template of type {type_name(template)}: "
                         f"flax.serialization.to_state_dict fails ({e})") from e
  _compare(wanted, stored, ())
  try:
    tree = serialization.from_state_dict(template, stored)
  except Exception as e:  # pylint: disable=broad-except
    raise MigrationError(f"template of type {type_name(template)}: "
                         "flax.serialization.from_state_dict cannot rebuild "
                         f"it from the source ({e})") from e
  if jax.tree.structure(tree) != jax.tree.structure(template):
    raise MigrationError(
        f"template of type {type_name(template)}: rebuilt from the source, "
        "its tree structure differs (a node type flax.serialization does not "
        "know? register it with flax.serialization."
        "register_serialization_state)")
  return tree


def _refuse_stand_ins(encodings: Mapping[str, Any]) -> None:
  """Refuses leaves that Orbax holds only as `codec` stand-ins."""
  for key, record in (encodings.get("records") or {}).items():
    what = _stand_in(record)
    if what is not None:
      path = codec.describe_path(_keys(key))
      raise MigrationError(
          f"{path}: {what}, which StandardSave cannot hold; migrate without "
          "a template (restore with clu_ckpt.migration.restore_state), or "
          "drop the leaf from the state")


def _stand_in(record: Mapping[str, Any]) -> Optional[str]:
  kind, stored_as = record.get("kind"), record.get("stored_as")
  if kind in ("complex", "bytes"):
    return f"a {kind} leaf"
  if stored_as == "none":
    return f"a zero-size array (shape {record.get('shape')})"
  if stored_as is not None:
    return f"an array of dtype {record.get('dtype')}"
  return None


def _keys(record_key: str) -> list:
  import json  # pylint: disable=g-import-not-at-top
  return json.loads(record_key)


def _compare(wanted: Any, got: Any, keys: tuple) -> None:
  """Refuses a source whose leaves differ from the template's (path named)."""
  if isinstance(wanted, dict):
    if not isinstance(got, dict):
      raise MigrationError(
          f"{_where(keys)}: the template has a subtree here, the source a "
          f"leaf ({_describe(got)})")
    for key in wanted:
      if key not in got:
        raise MigrationError(f"{_where(keys + (key,))}: in the template, "
                             "not in the source")
    for key in got:
      if key not in wanted:
        raise MigrationError(f"{_where(keys + (key,))}: in the source, "
                             "not in the template")
      _compare(wanted[key], got[key], keys + (key,))
    return
  if isinstance(got, dict) and got:
    raise MigrationError(f"{_where(keys)}: the template has a leaf here "
                         f"({_describe(wanted)}), the source a subtree")
  if wanted is None or got is None or isinstance(got, dict):
    if wanted is None and got is None:
      return
    raise MigrationError(f"{_where(keys)}: {_describe(wanted)} in the "
                         f"template, {_describe(got)} in the source")
  if isinstance(got, (str, list)):
    raise MigrationError(f"{_where(keys)}: a {type(got).__name__} leaf, "
                         "which StandardSave cannot hold")
  want_shape, got_shape = _shape(wanted), tuple(np.shape(got))
  if want_shape != got_shape:
    raise MigrationError(f"{_where(keys)}: shape {got_shape} in the source, "
                         f"{want_shape} in the template")


def _shape(leaf: Any) -> tuple:
  shape = getattr(leaf, "shape", None)
  return tuple(shape) if shape is not None else tuple(np.shape(leaf))


def _describe(leaf: Any) -> str:
  if leaf is None:
    return "None"
  if isinstance(leaf, dict):
    return "an empty subtree" if not leaf else "a subtree"
  dtype = getattr(leaf, "dtype", None)
  if dtype is not None:
    return f"{np.dtype(dtype).name}{list(_shape(leaf))}"
  return type(leaf).__name__


def _where(keys: tuple) -> str:
  return codec.describe_path(keys) if keys else "/"


# --------------------------------------------------------------------------
# The handler.
# --------------------------------------------------------------------------


def standard_state_handler(*, use_compression: bool,
                           type_handler_registry: Any):
  """A `PyTreeCheckpointHandler` that Orbax records as a StandardSave's.

  Args:
    use_compression: zstd or none for the arrays.
    type_handler_registry: The type handlers (`orbax_target`'s bounded
      ones).

  Returns:
    The handler: it writes the files `StandardCheckpointHandler` writes
    (which saves through a `PyTreeCheckpointHandler` with the standard type
    handlers), and its `typestr()` is `StandardCheckpointHandler`'s, so the
    step's `_CHECKPOINT_METADATA` lists the item as a StandardSave item.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  standard = ocp.handlers.StandardCheckpointHandler.typestr()

  class StandardStateHandler(ocp.handlers.PyTreeCheckpointHandler):

    @classmethod
    def typestr(cls) -> str:
      return standard

  return StandardStateHandler(use_compression=use_compression,
                              type_handler_registry=type_handler_registry)


# --------------------------------------------------------------------------
# Reading back.
# --------------------------------------------------------------------------


def state_dict_form(stored: Any, order: Optional[Mapping[str, Any]]) -> Any:
  """The `state` item of a template step in the dict-only form of the Flax
  state dict (what `codec.decode_state` takes).

  Example::

    stored, meta = target.restore(7)
    state = codec.decode_state(
        state_dict_form(stored, meta["encoded"]["order"]), meta["encoded"])

  Args:
    stored: The item as `PyTreeRestore()` returns it: dicts, and lists where
      the template had sequences.
    order: The skeleton `encodings["order"]` of the source (`codec`).

  Returns:
    The tree with each list the skeleton records as a dict turned into a
    dict keyed "0", "1", ... (as `flax.serialization.to_state_dict` does).
  """
  if order is None:
    return stored
  sub = order.get("sub", {})
  if isinstance(stored, (list, tuple)) and "keys" in order:
    stored = {str(i): item for i, item in enumerate(stored)}
  if isinstance(stored, dict):
    return {k: state_dict_form(v, sub.get(k)) for k, v in stored.items()}
  if isinstance(stored, list):
    return [state_dict_form(v, sub.get(str(i))) for i, v in enumerate(stored)]
  return stored


def stored_units(tree: Any, keys: tuple = (),
                 stored: tuple = ()) -> Iterator[tuple[tuple, tuple]]:
  """(Flax keys, stored keys) of each leaf of a template step's layout.

  Args:
    tree: The item's layout (`Target.state_layout`): dicts and lists.
    keys: The Flax keys of `tree` (all str).
    stored: The keys of `tree` in the item (ints for list positions).

  Yields:
    One pair per leaf or empty container, in the layout's order.
  """
  if isinstance(tree, dict) and tree:
    for key, item in tree.items():
      yield from stored_units(item, keys + (key,), stored + (key,))
  elif isinstance(tree, (list, tuple)) and tree:
    for i, item in enumerate(tree):
      yield from stored_units(item, keys + (str(i),), stored + (i,))
  else:
    yield keys, stored


def sequence_subtree(tree: Any, paths: list[tuple],
                     placeholder: Callable[[], Any]) -> Any:
  """The part of a layout that `paths` cover, for a partial restore.

  Orbax's partial restore lets dicts leave keys out, but wants every
  position of a list: positions no path covers hold a minimal stand-in
  (one `placeholder()` per leaf on a single branch).

  Args:
    tree: The layout.
    paths: Stored keys of the leaves wanted.
    placeholder: Makes Orbax's "skip this leaf" value (`ocp.PLACEHOLDER`).

  Returns:
    The subtree.
  """
  if any(not p for p in paths):
    return tree
  groups: dict[Any, list[tuple]] = {}
  for p in paths:
    groups.setdefault(p[0], []).append(p[1:])
  if isinstance(tree, (list, tuple)):
    return [sequence_subtree(item, groups[i], placeholder) if i in groups
            else _skeleton(item, placeholder) for i, item in enumerate(tree)]
  return {k: sequence_subtree(tree[k], rest, placeholder)
          for k, rest in groups.items()}


def _skeleton(tree: Any, placeholder: Callable[[], Any]) -> Any:
  if isinstance(tree, dict) and tree:
    key = next(iter(tree))
    return {key: _skeleton(tree[key], placeholder)}
  if isinstance(tree, (list, tuple)) and tree:
    return [_skeleton(item, placeholder) for item in tree]
  return placeholder()
