"""A comparable digest of a state tree, for tests and their child processes.

Imports only numpy and hashlib, so a child with TensorFlow blocked can use it
(`sys.path.insert(0, <tests dir>)`, then `import digests`).
"""

import hashlib
from typing import Any

import numpy as np


def digest(tree: Any) -> dict[str, list]:
  """Path -> [kind, dtype, shape, type, sha256 of the bytes] or [type, repr].

  `tree` is a state dict (nested dicts; an empty dict is a leaf).
  """
  out = {}

  def walk(node, path):
    if isinstance(node, dict) and node:
      for key, value in node.items():
        walk(value, f"{path}/{key}")
    elif isinstance(node, (np.ndarray, np.generic)):
      a = np.asarray(node)
      out[path] = ["array", str(a.dtype), list(a.shape), type(node).__name__,
                   hashlib.sha256(a.tobytes()).hexdigest()]
    else:
      out[path] = [type(node).__name__, repr(node)]

  walk(tree, "")
  return out
