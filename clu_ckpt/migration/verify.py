"""Checking a migration: a step against its source, hosts against each other.

`verify_step` restores a migrated step through its `Target` in bounded
batches of leaves and compares each, bit-exactly (`same_leaf`), with the
source state (an open `FlaxFile`'s tree: no second parse); every host's
TensorFlow files with the `dataset` item. `compare_hosts` checks that hosts
hold the same `.flax` bytes (or, failing that, the same state).

Synopsis::

  from clu_ckpt.migration import verify

  verify.verify_step("/runs/a/orbax", 7, ckpt, host=0)   # MigrationError
  assert verify.same_leaf(np.float32(1), np.float32(1))
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from clu_ckpt import errors
from clu_ckpt import flax_format
from clu_ckpt import library_logs
from clu_ckpt import storage
from clu_ckpt.migration import codec
from clu_ckpt.migration import orbax_target
from clu_ckpt.migration import plan
from clu_ckpt.migration import template as template_lib

MigrationError = errors.MigrationError
VerificationError = errors.VerificationError

# Bytes of leaves restored at once by `verify`.
_VERIFY_BATCH_BYTES = 256 * 2**20
_COMPARE_BLOCK = 64 * 2**20


def verify_step(destination: Any, step: int, ckpt: plan.SourceCheckpoint,
                host: int,
                source: Optional[flax_format.FlaxFile] = None) -> None:
  """Compares a migrated step with its source, leaf by leaf, bit-exactly.

  The state is restored through stock Orbax in batches of leaves (bounded
  memory) and compared with the memory-mapped source; every host's
  TensorFlow files with the `dataset` item. A step written with a template
  (`template`) is compared leaf by leaf too, each of its leaves matched
  with the source's by its Flax keys (a sequence's positions are "0", "1",
  ...).

  Args:
    destination: The Orbax root directory, or a `Target`.
    step: The step.
    ckpt: Its source checkpoint.
    host: The host whose `.flax` the state came from.
    source: That `.flax` file, open (else it is opened and parsed here).

  Raises:
    VerificationError: Something differs, is missing, or cannot be read
      back from the step (a `MigrationError`).
    MigrationError, OSError: The source cannot be read.
  """
  target = (destination if isinstance(destination, orbax_target.Target) else
            orbax_target.OrbaxTarget(destination))
  if source is None:
    with flax_format.FlaxFile(ckpt.flax_path(host)) as handle:
      return verify_step(target, step, ckpt, host, handle)
  if step not in target.steps():
    raise VerificationError(f"verify: Orbax does not list step {step} in "
                         f"{target.root}")
  meta = _read_back(step, target.read_metadata, step)
  encodings = meta.get("encoded", {})
  state = source.tree
  tree = _read_back(step, target.state_layout, step)
  expected = list(_verify_units(codec.encode_state(state)[0], ()))
  if template_lib.written_with_template(meta):
    # Flax keys -> keys in the item (list positions are ints there).
    stored = dict(template_lib.stored_units(tree))
    subtree = lambda paths: template_lib.sequence_subtree(
        tree, paths, _placeholder)
  else:
    stored = {keys: keys for keys in _verify_units(tree, ())}
    subtree = lambda paths: _subtree(tree, paths)
  missing = [k for k in expected if k not in stored]
  if missing or len(stored) != len(expected):
    where = _path(missing[0]) if missing else "(extra leaves)"
    raise VerificationError(f"verify: step {step} does not hold the same leaves "
                         f"as {ckpt.flax_path(host)}: {where}")
  flax_keys = {stored_keys: keys for keys, stored_keys in stored.items()}
  for batch in _batches([stored[k] for k in expected], tree,
                        _VERIFY_BATCH_BYTES):
    restored = _read_back(step, target.restore_leaves, step, subtree(batch))
    for stored_keys in batch:
      keys = flax_keys[stored_keys]
      got = codec.decode_subtree(_get(restored, stored_keys), keys, encodings)
      if not same_leaf(got, _get(state, keys)):
        raise VerificationError(f"verify: step {step} leaf {_path(keys)} differs "
                             f"from {ckpt.flax_path(host)}")
  _verify_dataset(target, step, ckpt)
  return None


def _read_back(step: int, read: Callable[..., Any], *args: Any) -> Any:
  """`read(*args)` of the step; a step Orbax cannot read back fails it."""
  try:
    return read(*args)
  except errors.CluCkptError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    # TensorStore's reads still in flight will find Orbax's loop closed.
    library_logs.drop_closed_loop_callbacks()
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise VerificationError(f"verify: step {step} cannot be read back: "
                            f"{first}") from e


def _placeholder() -> Any:
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  return ocp.PLACEHOLDER


def _verify_dataset(target: orbax_target.Target, step: int,
                    ckpt: plan.SourceCheckpoint) -> None:
  try:
    expected, _ = plan.dataset_tree(ckpt)
    missing = ""
  except MigrationError as e:  # the source lost its TensorFlow files
    expected, missing = None, str(e)
  stored = _read_back(step, target.restore_dataset, step)
  if expected is None:
    if stored is not None:
      raise VerificationError(
          f"verify: step {step} has an unexpected dataset" + (
              f" ({missing})" if missing else ""))
    if missing:
      raise VerificationError(f"verify: step {step}: {missing}")
    return
  stored = stored or {}
  for key, files in expected.items():
    got = stored.get(key, {})
    if set(got) != set(files) or not all(
        np.array_equal(np.asarray(got[s]), files[s]) for s in files):
      raise VerificationError(f"verify: step {step} dataset/{key} differs from "
                           f"the TensorFlow files of {ckpt.prefixes}")


def compare_hosts(ckpt: plan.SourceCheckpoint, host: int, other: int,
                  source: Optional[flax_format.FlaxFile] = None) -> None:
  """Raises unless two hosts' `.flax` files hold the same state.

  The files are compared byte for byte; only if they differ are they
  decoded (`host`'s through `source`, when given: no second parse).
  """
  a, b = ckpt.flax_path(host), ckpt.flax_path(other)
  if _same_bytes(a, b):
    return
  mine = source.tree if source is not None else flax_format.load_file(a)
  difference = _first_difference(mine, flax_format.load_file(b), "")
  if difference is not None:
    raise MigrationError(
        f"{ckpt.name}: hosts {host} and {other} hold different states "
        f"(first difference at {difference or '/'}: {a} vs {b}); pass "
        "--state-host to take the state from one host")


def _same_bytes(a: str, b: str) -> bool:
  if storage.stat(a)[0] != storage.stat(b)[0]:
    return False
  x = np.frombuffer(storage.map_file(a), np.uint8)
  y = np.frombuffer(storage.map_file(b), np.uint8)
  for i in range(0, x.size, _COMPARE_BLOCK):
    if not np.array_equal(x[i:i + _COMPARE_BLOCK], y[i:i + _COMPARE_BLOCK]):
      return False
  return True


def _first_difference(x: Any, y: Any, path: str) -> Optional[str]:
  """Path of the first leaf where two state dicts differ, or None."""
  if isinstance(x, dict) or isinstance(y, dict):
    if not (isinstance(x, dict) and isinstance(y, dict)) or set(x) != set(y):
      return path
    for key in x:
      found = _first_difference(x[key], y[key], f"{path}/{key}")
      if found is not None:
        return found
    return None
  return None if same_leaf(x, y) else path


def same_leaf(x: Any, y: Any) -> bool:
  """Bit-exact equality of two leaves: type, dtype, shape and bytes."""
  if type(x) is not type(y):
    return False
  if isinstance(x, (np.ndarray, np.generic)):
    x, y = np.asarray(x), np.asarray(y)
    return (x.dtype == y.dtype and x.shape == y.shape and
            np.array_equal(_bytes_view(x), _bytes_view(y)))
  if isinstance(x, float):
    return np.float64(x).tobytes() == np.float64(y).tobytes()
  if isinstance(x, complex):
    return np.complex128(x).tobytes() == np.complex128(y).tobytes()
  if isinstance(x, (list, tuple)):
    return len(x) == len(y) and all(same_leaf(a, b) for a, b in zip(x, y))
  if isinstance(x, dict):
    return list(x) == list(y) and all(same_leaf(x[k], y[k]) for k in x)
  return x == y


def _bytes_view(arr: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)



def _verify_units(tree: Any, keys: tuple) -> Iterator[tuple]:
  """Leaf paths, but a list counts as one unit (compared whole)."""
  if isinstance(tree, dict) and tree:
    for key, item in tree.items():
      yield from _verify_units(item, keys + (key,))
  else:
    yield keys


def _batches(units: Sequence[tuple], tree: Any,
             budget: int) -> Iterator[list[tuple]]:
  batch, used = [], 0
  for keys in units:
    size = _stored_nbytes(_get(tree, keys))
    if batch and used + size > budget:
      yield batch
      batch, used = [], 0
    batch.append(keys)
    used += size
  if batch:
    yield batch


def _stored_nbytes(meta: Any) -> int:
  shape, dtype = getattr(meta, "shape", None), getattr(meta, "dtype", None)
  if shape is None or dtype is None:
    return 0
  return int(np.prod(shape)) * np.dtype(dtype).itemsize


def _subtree(tree: Any, paths: Sequence[tuple]) -> Any:
  out: dict = {}
  for keys in paths:
    if not keys:
      return tree
    node = out
    for key in keys[:-1]:
      node = node.setdefault(key, {})
    node[keys[-1]] = _get(tree, keys)
  return out


def _path(keys: Sequence[Any]) -> str:
  return codec.describe_path(keys)


def _get(tree: Any, keys: Sequence[Any]) -> Any:
  for key in keys:
    tree = tree[key]
  return tree
