"""clu_ckpt: legacy CLU/Flax checkpoints, kept alive and moved to Orbax.

Synopsis::

  from clu_ckpt import checkpoint          # was: from clu import checkpoint

  ckpt = checkpoint.Checkpoint(workdir, dict(ds_iter=ds_iter))
  state = ckpt.restore_or_initialize(state)

  from clu_ckpt import load_state_dict     # no TensorFlow needed
  params = load_state_dict(workdir)["params"]

Heavy dependencies (TensorFlow, JAX, Orbax) are imported only by the code
paths that need them; importing this package imports none of them.
"""

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Checkpoint": "clu_ckpt.checkpoint",
    "MultihostCheckpoint": "clu_ckpt.checkpoint",
    "load_state_dict": "clu_ckpt.checkpoint",
    "CheckpointInfo": "clu_ckpt.checkpoint",
    "FlaxFormatError": "clu_ckpt.flax_format",
    "TfStateSave": "clu_ckpt.orbax_items",
    "TfStateRestore": "clu_ckpt.orbax_items",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
  module = _LAZY.get(name)
  if module is None:
    raise AttributeError(f"module 'clu_ckpt' has no attribute {name!r}")
  value = getattr(importlib.import_module(module), name)
  globals()[name] = value
  return value


def __dir__():
  return __all__
