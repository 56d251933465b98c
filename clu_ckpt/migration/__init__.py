"""Migrates CLU checkpoint directories into Orbax CheckpointManager layouts.

Every kept CLU checkpoint (`ckpt-N.flax` plus TensorFlow's `ckpt-N.index` and
`ckpt-N.data-*`) becomes one Orbax step directory that stock
`orbax.checkpoint.CheckpointManager` reads, with three items:

- `state`: the Flax state dict, arrays in TensorStore (OCDBT, zstd by
  default), written by Orbax's `PyTreeCheckpointHandler`; with
  `migrate(..., template=train_state)`, the train state's own structure,
  as `ocp.args.StandardSave(train_state)` writes it (see `template`).
- `dataset`: every host's TensorFlow checkpoint bytes (the tf.data iterator);
  see `clu_ckpt.orbax_items`. Absent when the checkpoint has no `tf_state`.
- `metadata`: JSON: source, CLU checkpoint number, hosts, clu_ckpt version,
  step mapping and a summary of every leaf.

Synopsis::

  from clu_ckpt import migration

  summary = migration.migrate("/runs/a/checkpoints", "/runs/a/orbax")
  for step in summary.steps:
    print(step.number, "->", step.step, step.status)

  import orbax.checkpoint as ocp
  mngr = ocp.CheckpointManager("/runs/a/orbax")
  restored = mngr.restore(mngr.latest_step())        # stock Orbax, no args
  state = migration.restore_state("/runs/a/orbax")   # exact Flax state dict

Arrays are fed to Orbax as views of the memory-mapped `.flax` file and
written a bounded number of bytes at a time, so memory stays small whatever
the checkpoint size. Each step is written under a temporary name and renamed
when complete (Orbax's own atomic save), so an interrupted migration leaves
no partial step, and re-running it skips the steps already there.

Buckets: sources may be `gs://` or `s3://` URLs, destinations `gs://` ones
(`s3://` destinations are refused: stock Orbax 0.12 cannot restore from
them), in any mix with local paths. Source files are read by ranged reads
(a `.flax` is spooled to an unlinked temporary file and memory-mapped);
TensorStore writes the arrays to the bucket itself, with a smaller in-flight
window (`orbax_target.REMOTE_INFLIGHT_BYTES`). On GCS Orbax does not rename:
it writes a step under its final name and commits it by writing
`commit_success.txt` last; a step without it is unfinished, is not listed,
and the next run removes and rewrites it. A step that fails verification
loses its `commit_success.txt` first (unlisted at once), then its objects.
TensorFlow is not needed: the iterator's files are copied byte for byte and
their index is read without it (`orbax_items.tf_state_names`).

The package's modules, each owning one part:

- `plan`: the source (discover, select, state_step, name_steps, dataset).
- `codec`: stand-ins for leaves Orbax cannot hold (encode/decode_state).
- `orbax_target`: the destination seam (`Target`, which
  `migrate(..., target=...)` accepts) and `OrbaxTarget`, its one
  implementation (the default); the only user of a private Orbax API;
  `list_steps`.
- `memory`: the byte budget, read-ahead, aligned staging and heap trimming
  of the writer.
- `template`: the state in a train state's structure (`from_template`).
- `staging`: a `gs://` step written locally first, then uploaded many
  files at once, its commit file last.
- `destination`: the destination's lock and manifest (a fleet's safety),
  over `lease` (the lock on a bucket: a lease refreshed, taken over when
  stale).
- `verify`: comparing a step with its source, and hosts with each other.
- `run`: `migrate`, `restore_state`; `results` (what `migrate` reports:
  step results, the summary, `Progress` events), `interrupt` (Ctrl-C and
  SIGTERM: the step being written abandoned cleanly), `options` (the
  command's options, shared with the fleet).
- `fleet` (the command of `migration/migrate_runs.py`), over
  `fleet_discovery` (which runs), `fleet_assignment` (destinations,
  shards), `fleet_workers` (worker processes) and `fleet_report`
  (progress, reports): many runs at once.

The names below are imported from their modules when first used, so that
importing the package (or one of its modules, such as the fleet's) costs
nothing until the migration itself is needed.
"""

import importlib
from typing import TYPE_CHECKING, Any

# Imported when first used (PEP 562), not with the package: a process that
# needs one module of it (the fleet's parent process, which plans and
# reports but never migrates) does not pay for NumPy, Flax's format and the
# destination's modules. Name -> the module that defines it.
_EXPORTS = {
    "decode_state": "codec",
    "encode_state": "codec",
    "DestinationLockedError": "destination",
    "lock": "destination",
    "Manifest": "destination",
    "read_manifest": "destination",
    "DATASET_ITEM": "orbax_target",
    "DEFAULT_INFLIGHT_BYTES": "orbax_target",
    "item_handlers": "orbax_target",
    "list_steps": "orbax_target",
    "METADATA_ITEM": "orbax_target",
    "OrbaxTarget": "orbax_target",
    "read_metadata": "orbax_target",
    "REMOTE_INFLIGHT_BYTES": "orbax_target",
    "STATE_ITEM": "orbax_target",
    "Target": "orbax_target",
    "discover": "plan",
    "name_steps": "plan",
    "Selection": "plan",
    "select": "plan",
    "Source": "plan",
    "SourceCheckpoint": "plan",
    "state_step": "plan",
    "STEP_NAMINGS": "plan",
    "COMPRESSIONS": "run",
    "describe_error": "run",
    "FORMAT": "run",
    "migrate": "run",
    "MigrationError": "run",
    "MigrationInterrupted": "run",
    "MigrationSummary": "run",
    "Progress": "run",
    "ProgressFn": "run",
    "restore_state": "run",
    "StepResult": "run",
    "same_leaf": "verify",
    "VerificationError": "verify",
    "verify_step": "verify",
}

if TYPE_CHECKING:  # what a type checker and an IDE see
  from clu_ckpt.migration.codec import decode_state
  from clu_ckpt.migration.codec import encode_state
  from clu_ckpt.migration.destination import DestinationLockedError
  from clu_ckpt.migration.destination import lock
  from clu_ckpt.migration.destination import Manifest
  from clu_ckpt.migration.destination import read_manifest
  from clu_ckpt.migration.orbax_target import DATASET_ITEM
  from clu_ckpt.migration.orbax_target import DEFAULT_INFLIGHT_BYTES
  from clu_ckpt.migration.orbax_target import item_handlers
  from clu_ckpt.migration.orbax_target import list_steps
  from clu_ckpt.migration.orbax_target import METADATA_ITEM
  from clu_ckpt.migration.orbax_target import OrbaxTarget
  from clu_ckpt.migration.orbax_target import read_metadata
  from clu_ckpt.migration.orbax_target import REMOTE_INFLIGHT_BYTES
  from clu_ckpt.migration.orbax_target import STATE_ITEM
  from clu_ckpt.migration.orbax_target import Target
  from clu_ckpt.migration.plan import discover
  from clu_ckpt.migration.plan import name_steps
  from clu_ckpt.migration.plan import Selection
  from clu_ckpt.migration.plan import select
  from clu_ckpt.migration.plan import Source
  from clu_ckpt.migration.plan import SourceCheckpoint
  from clu_ckpt.migration.plan import state_step
  from clu_ckpt.migration.plan import STEP_NAMINGS
  from clu_ckpt.migration.run import COMPRESSIONS
  from clu_ckpt.migration.run import describe_error
  from clu_ckpt.migration.run import FORMAT
  from clu_ckpt.migration.run import migrate
  from clu_ckpt.migration.run import MigrationError
  from clu_ckpt.migration.run import MigrationInterrupted
  from clu_ckpt.migration.run import MigrationSummary
  from clu_ckpt.migration.run import Progress
  from clu_ckpt.migration.run import ProgressFn
  from clu_ckpt.migration.run import restore_state
  from clu_ckpt.migration.run import StepResult
  from clu_ckpt.migration.verify import same_leaf
  from clu_ckpt.migration.verify import VerificationError
  from clu_ckpt.migration.verify import verify_step


def __getattr__(name: str) -> Any:
  """A public name (or a submodule), imported on first use."""
  module = _EXPORTS.get(name)
  if module is None:
    try:
      return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
      if e.name != f"{__name__}.{name}":
        raise
      raise AttributeError(
          f"module {__name__!r} has no attribute {name!r}") from None
  value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "COMPRESSIONS", "DATASET_ITEM", "DEFAULT_INFLIGHT_BYTES",
    "DestinationLockedError", "FORMAT", "METADATA_ITEM", "Manifest",
    "MigrationError", "MigrationInterrupted", "VerificationError", "lock", "read_manifest", "MigrationSummary", "OrbaxTarget",
    "Progress", "ProgressFn", "REMOTE_INFLIGHT_BYTES", "STATE_ITEM", "STEP_NAMINGS", "Selection",
    "Source", "SourceCheckpoint", "StepResult", "Target", "decode_state",
    "describe_error", "discover", "encode_state", "item_handlers",
    "list_steps", "migrate",
    "name_steps", "read_metadata", "restore_state", "same_leaf", "select",
    "state_step", "verify_step",
]
