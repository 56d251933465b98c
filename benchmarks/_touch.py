"""Reads every byte of a restored checkpoint tree: the benchmark's "touch".

Synopsis::

  from _touch import touch, tree_leaves
  digest = touch(tree_leaves(load_state_dict(workdir)))

Both libraries' results go through this same function, so a lazily mapped
result pays for its page faults here and an eagerly copied one does not get
charged twice. The digest (XOR of all 8-byte words, then of the leftover bytes)
lets the benchmark check that both libraries read the same bytes.

Only numpy is imported, so the end-to-end measurement can use this module in a
process without TensorFlow or JAX.
"""

from typing import Any, Iterable, Iterator

import numpy as np


def tree_leaves(tree: Any) -> Iterator[Any]:
  """Yields the leaves of nested dicts, lists and tuples (as restored)."""
  if isinstance(tree, dict):
    for value in tree.values():
      yield from tree_leaves(value)
  elif isinstance(tree, (list, tuple)):
    for value in tree:
      yield from tree_leaves(value)
  else:
    yield tree


def touch(leaves: Iterable[Any]) -> int:
  """Reads every byte of every array-like leaf.

  Args:
    leaves: arrays (numpy, JAX or anything `np.asarray` accepts) and scalars.
      Leaves without a fixed-size binary form (None, objects) are skipped.

  Returns:
    The XOR of all 8-byte words of all leaves, each leaf's trailing bytes
    folded in byte by byte.
  """
  digest = 0
  for leaf in leaves:
    data = np.asarray(leaf)
    if data.dtype == object:
      continue
    octets = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    whole = octets.size // 8 * 8
    if whole:
      digest ^= int(np.bitwise_xor.reduce(octets[:whole].view(np.uint64)))
    if whole < octets.size:
      digest ^= int(np.bitwise_xor.reduce(octets[whole:]))
  return digest
