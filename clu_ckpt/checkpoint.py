"""Drop-in replacement for `clu.checkpoint`: same API, same files, much faster.

Change one import and nothing else::

  from clu_ckpt import checkpoint       # was: from clu import checkpoint
  import flax

  @flax.struct.dataclass
  class TrainState:
    params: Any
    opt_state: Any
    step: int

  ds_iter = iter(load_tf_dataset())
  ckpt = checkpoint.MultihostCheckpoint(base_directory, dict(ds_iter=ds_iter))
  state = ckpt.restore_or_initialize(TrainState(params, opt_state, step=0))
  for step in range(int(state.step) + 1, steps + 1):
    state = update_step(state, next(ds_iter))
    ckpt.save(state)                   # also saves the position of ds_iter

Loading a state dict, e.g. in a Colab, needs neither TensorFlow nor JAX::

  from clu_ckpt import checkpoint
  state_dict = checkpoint.load_state_dict(base_directory)
  params = checkpoint.load_state_dict(base_directory, subtree="params")

Directories in buckets (`gs://`, `s3://`) work the same way, through
`clu_ckpt.storage` (fsspec: gcsfs, s3fs; emulators through
`STORAGE_EMULATOR_HOST`, `AWS_ENDPOINT_URL`). TensorFlow never opens a
bucket: a restore hands it a temporary local copy of the checkpoint's
`.index`/`.data-*` (`storage.local_prefix`), and a save has it serialize the
`tf_state` into a local temporary directory, whose files are uploaded, then
committed by uploading the `checkpoint` state file
(`tf_manager.ObjectStoreManager`: the commit order for stores without
rename). Reading the Flax state of a bucket needs no TensorFlow either.

Differences from `clu.checkpoint` that callers can observe are deliberate.
Among them: the `.flax` file is streamed to a temporary name, fsynced and
renamed (CLU writes it in place), it is read through a memory map (arrays are
read-only views of the file, as Flax's were read-only views of the bytes read),
TensorFlow is imported only when the `tf_state`, a save, or the `tf_checkpoint`
attributes need it, and `MultihostCheckpoint` only considers directories named
`<multihost_base_directory>-<integer>`. The whole list, with the others
(checkpoints newer than a restored one unlisted before their files go, a
failed save undone and killed saves' debris swept, the fallback to the newest
complete checkpoint, `CheckpointInfo.from_path` raising `ValueError`,
`file://` directories, ...), is in CHANGELOG.md, "Deliberate differences from
`clu.checkpoint` 0.0.12".
"""

from __future__ import annotations

import collections
import operator
import re
import time
from typing import Any, Dict, Optional, Sequence, TypeVar, Union

from absl import logging

from clu_ckpt import flax_format
from clu_ckpt import errors
from clu_ckpt import layout
from clu_ckpt import orbax_layout
from clu_ckpt import save_protocol
from clu_ckpt import storage
from clu_ckpt import tf_manager

T = TypeVar("T")

def safe_normpath(path: str) -> str:
  """Normalizes a path, keeping a URL scheme (`gs://`) intact.

  `os.path.normpath("gs://bucket/x")` would collapse the double slash; this
  normalizes only the part after the scheme (see `layout.normpath`).

  Args:
    path: A local path or URL.

  Returns:
    The normalized path.
  """
  return layout.normpath(path)


host_directories = layout.host_directories


@storage.metadata_cache()  # one operation: each listing asked once
def load_state_dict(base_directory: str, *,
                    subtree: Union[None, str, Sequence[str]] = None,
                    checkpoint: Union[None, str, int] = None,
                    step: Optional[int] = None,
                    prefix: Optional[str] = None) -> Dict[str, Any]:
  """Returns the state of the latest checkpoint in `base_directory` as a dict.

  Works without TensorFlow and without JAX, for every layout: a CLU
  `Checkpoint` directory or `MultihostCheckpoint` base, the Orbax root
  `clu-ckpt migrate` made of one (the same dict as before the migration),
  `flax.training.checkpoints` files (`checkpoint_<step>`), or a single file.
  Lists in the saved state come back as dicts keyed "0", "1", ..., exactly
  as in Flax state dicts. See `clu_ckpt.reader.load_state_dict`, which this
  calls.

  Example::

    state_dict = load_state_dict("/work/ckpts")
    params = load_state_dict("/work/ckpts", subtree="params")
    state_dict = load_state_dict("/work/checkpoints")  # a multihost base
    state_dict = load_state_dict("/work/orbax")        # after migration
    state_dict = load_state_dict("/work/orbax", step=500)
    state_dict = load_state_dict("/work/flax_run")     # checkpoint_<step>

  Args:
    base_directory: Directory with the checkpoints (see `Checkpoint`), a
      `MultihostCheckpoint` base (then the newest number every host has is
      read from host 0's directory, and logged), a migrated Orbax root, a
      directory of Flax's `checkpoint_<step>` files, or a file.
    subtree: Only return this subtree ("params" or "params/Dense_0", or a
      sequence of keys); the rest is not decoded (not read, for a migrated
      root).
    checkpoint: A checkpoint path (`<base_directory>/ckpt-N`, or
      `<base>-<host>/ckpt-N`) instead of the latest, read as given; for a
      migrated root also the CLU name ("ckpt-5") or a step; for Flax's
      layout `checkpoint_<step>`.
    step: A step of a migrated root or of Flax's layout.
    prefix: The prefix of Flax's files (default "checkpoint_").

  Returns:
    The deserialized state (or subtree) as a dictionary.

  Raises:
    FileNotFoundError: No checkpoint to restore (or none common to all
      hosts); the message names the layouts looked for, or the absolute
      path of a `checkpoint` that does not exist.
    flax_format.FlaxFormatError: The `.flax` file is corrupt, or has no such
      subtree (the message lists the keys there are).
  """
  from clu_ckpt import reader  # pylint: disable=g-import-not-at-top
  return reader.load_state_dict(base_directory, subtree=subtree,
                                checkpoint=checkpoint, step=step,
                                prefix=prefix)


class CheckpointInfo(
    collections.namedtuple("CheckpointInfo", ("prefix", "number"))):
  """A checkpoint path split into its prefix and number (`<prefix>-<number>`).

  Example::

    info = CheckpointInfo.from_path("/ckpts/ckpt-7")   # ("/ckpts/ckpt", 7)
    str(info.increment())                            # "/ckpts/ckpt-8"
  """

  CHECKPOINT_REGEX = r"^(?P<prefix>.*)-(?P<number>\d+)"

  @classmethod
  def initialize(cls, base_directory: str,
                 checkpoint_name: str) -> "CheckpointInfo":
    """The first checkpoint (number 1) of `base_directory`."""
    return cls(f"{base_directory}/{checkpoint_name}", 1)

  @classmethod
  def from_path(cls, checkpoint: str) -> "CheckpointInfo":
    """Parses a checkpoint path such as `latest_checkpoint`.

    The number is read from the base name only: `/runs/exp-3/model.ckpt` has
    none (clu 0.0.12 would take the `3` of the parent directory).

    Args:
      checkpoint: A checkpoint prefix (`<base>/<name>-<number>`).

    Returns:
      The parsed `CheckpointInfo`.

    Raises:
      ValueError: The base name of `checkpoint` does not end in `-<number>`.
    """
    parts = layout.split_checkpoint(checkpoint)
    if parts is None:
      raise errors.InvalidCheckpointError(
          f"Invalid checkpoint format: {checkpoint}")
    digits = re.search(r"\d+$", checkpoint)
    return cls(checkpoint[:digits.start() - 1], parts[1])

  def increment(self) -> "CheckpointInfo":
    """The next checkpoint: the same prefix, `number + 1`."""
    return CheckpointInfo(self.prefix, self.number + 1)

  def __str__(self) -> str:
    return f"{self.prefix}-{self.number}"


class Checkpoint:
  """Stores and restores a Flax state together with TensorFlow state.

  The Flax state (any `flax.struct.dataclass`, dict or registered type) and
  the `tf_state` (e.g. a `tf.data` iterator) are stored side by side::

    {base_directory}/checkpoint               TF's state file (latest, kept)
    {base_directory}/{name}-{number}.index    TF's checkpoint of tf_state
    {base_directory}/{name}-{number}.data-00000-of-00001
    {base_directory}/{name}-{number}.flax     the Flax state, msgpack

  `number` starts at 1 and grows by one per save. The `.flax` file is written
  first (temporary name, fsync, rename), then TensorFlow commits the checkpoint
  by rewriting `checkpoint`; only the newest `max_to_keep` checkpoints are
  kept, `.flax` included. A process killed at any point leaves every listed
  checkpoint whole (see `clu_ckpt.save_protocol`). These are the files
  `clu.checkpoint` writes, byte for byte, and each library restores the other's.

  In a bucket (`gs://`, `s3://`) every object appears whole (an upload
  completes or nothing appears) and the order is: `.flax`, `.data-*`,
  `.index`, the list of checkpoints to prune, `checkpoint` (the commit), then
  the pruned checkpoints' files (see `tf_manager.ObjectStoreManager`): a
  process killed at any point leaves the previous checkpoint restorable and
  the next save completes what was left.

  The directory's content is not trusted (docs/CONTRACTS.md, "Threat
  model"): a save writes only `{base_directory}/{checkpoint_name}-{number}`
  and deletes only checkpoints directly inside `base_directory`; listed paths
  elsewhere (absolute, `..`) are left alone with a warning, and symlinks where
  the new files go are removed, not written through. Restoring reads
  `latest_checkpoint` (or a `checkpoint` argument) wherever it points, as clu
  does. Files that are not regular (a named pipe, a device) are refused.

  With `layout="orbax"` (or `CLU_CKPT_LAYOUT=orbax`), the API stays and
  each checkpoint is saved as a step of an Orbax `CheckpointManager` root in
  the same base directory, numbered by checkpoint number (see
  `clu_ckpt.orbax_layout`)::

    {base_directory}/{number}/state/, dataset/, metadata/, _CHECKPOINT_METADATA

  Paths keep their CLU names: `latest_checkpoint` is
  `{base_directory}/{checkpoint_name}-{number}` whichever layout holds that
  number (an Orbax step wins over CLU files of the same number), and
  `restore` also accepts a step directory `{base_directory}/{number}`. CLU
  checkpoints already there are restored as before (`restore_or_initialize`
  takes the newest number of either layout, the iterator included); new
  saves go to Orbax. `max_to_keep` counts both layouts; a CLU checkpoint
  outside it is deleted only when an Orbax step of the same number exists
  (its only copy is left for `clu-ckpt migrate`). Checkpoints numbered after
  the current one are removed by a save in both layouts, as in CLU.

  Attributes:
    base_directory: The normalized directory.
    max_to_keep: How many checkpoints are kept.
    checkpoint_name: Prefix of the checkpoint files.
    restored_from: The checkpoint last restored, or None.
    layout: "clu" or "orbax": the layout saves write.
  """

  def __init__(self, base_directory: str,
               tf_state: Optional[Dict[str, Any]] = None, *,
               max_to_keep: int = 5, checkpoint_name: str = "ckpt",
               layout: Optional[str] = None):
    """Initializes a Checkpoint with a dictionary of TensorFlow Trackables.

    Args:
      base_directory: Directory under which the checkpoints are stored; use a
        different one in every task.
      tf_state: A dictionary of TensorFlow `Trackable`s to save with every
        checkpoint, for example a dataset iterator.
      max_to_keep: Number of checkpoints to keep; older ones are removed.
      checkpoint_name: Prefix of the checkpoint files (before `-{number}`).
      layout: "clu" (the files above) or "orbax" (Orbax steps, see the class
        docstring); None: `$CLU_CKPT_LAYOUT`, else "clu".

    Raises:
      ImportError: `tf_state` is given and TensorFlow is not installed.
      UsageError: An unknown layout.
    """
    self.layout = orbax_layout.resolve(layout)
    self.base_directory = safe_normpath(base_directory)
    self.max_to_keep = max_to_keep
    self.checkpoint_name = checkpoint_name
    self.restored_from = None
    self._tf_state = dict(tf_state or {})
    self._tf_checkpoint = None
    self._tf_checkpoint_manager = None
    # Mirrors `tf_checkpoint.save_counter` until TensorFlow is loaded.
    self._save_counter = 0
    self._orbax = None
    if self.layout == orbax_layout.ORBAX:
      self._orbax = self._new_orbax_steps()
      if self._tf_state:
        orbax_layout.check_tensorflow(self.base_directory)
    elif self._tf_state:
      self._load_tf()

  def _new_orbax_steps(self) -> orbax_layout.OrbaxSteps:
    """The Orbax root of `layout="orbax"`: the base directory itself."""
    return orbax_layout.OrbaxSteps(self.base_directory)

  # -- TensorFlow, loaded only when needed ------------------------------------

  @property
  def tf_checkpoint(self):
    """The `tf.train.Checkpoint` holding `tf_state` (imports TensorFlow)."""
    self._load_tf()
    return self._tf_checkpoint

  @property
  def tf_checkpoint_manager(self):
    """The `tf.train.CheckpointManager` writing the TF files (imports TF).

    In a bucket, a `tf_manager.ObjectStoreManager` (the same bookkeeping).
    """
    self._load_tf()
    return self._tf_checkpoint_manager

  def _load_tf(self) -> None:
    if self._tf_checkpoint is not None:
      return
    try:
      import tensorflow as tf  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError(
          f"Checkpoint({self.base_directory!r}): saving, or restoring a "
          "tf_state, needs TensorFlow, which cannot be imported. Install it "
          "with `pip install tensorflow-cpu` (or `pip install -e '.[tf]'` in "
          "a clu_ckpt checkout); "
          "reading the Flax state alone (load_state_dict, load_state, "
          "restore_dict) works without it.") from e
    tf_checkpoint = tf.train.Checkpoint(**self._tf_state)
    if self._save_counter:
      tf_checkpoint.save_counter.assign(self._save_counter)
    self._tf_checkpoint = tf_checkpoint
    self._tf_checkpoint_manager = self._new_manager()

  def _new_manager(self):
    """A `tf.train.CheckpointManager` that reads the directory's state.

    What reaches TensorFlow is contained first (see `tf_manager`).
    """
    return tf_manager.new_manager(
        self._tf_checkpoint, self.base_directory,
        max_to_keep=self.max_to_keep, checkpoint_name=self.checkpoint_name)

  def _reread_manager(self) -> None:
    """Replaces the manager with one read from disk (after a failed save)."""
    self._tf_checkpoint_manager = self._new_manager()

  def _current_number(self) -> int:
    if self._orbax is None and self._tf_checkpoint is not None:
      return int(self._tf_checkpoint.save_counter.numpy())
    return self._save_counter

  # -- paths ------------------------------------------------------------------

  def get_latest_checkpoint_to_restore_from(self) -> Optional[str]:
    """Returns the checkpoint `restore()` uses by default.

    That is `latest_checkpoint`, unless some of its files are missing (a
    directory damaged outside clu_ckpt, e.g. by clu killed while deleting
    newer checkpoints after restoring an older one): then the newest listed
    checkpoint whose files are all there, with a warning. `MultihostCheckpoint`
    overrides this to pick the newest checkpoint that every host has.

    With `layout="orbax"`, the newest of that and the newest Orbax step.

    Returns:
      A checkpoint path (`<base_directory>/ckpt-N`), or None.
    """
    return self._newest_of_both(self._clu_checkpoint_to_restore_from())

  def _clu_checkpoint_to_restore_from(self) -> Optional[str]:
    """`get_latest_checkpoint_to_restore_from` among CLU checkpoints only."""
    return layout.restorable(self._clu_latest_checkpoint(),
                             self._listed_checkpoints)

  def _listed_checkpoints(self) -> list[str]:
    """The checkpoints TensorFlow manages here, oldest first."""
    if self._tf_checkpoint_manager is not None:
      return self._tf_checkpoint_manager.checkpoints
    state = layout.read_checkpoint_state(self.base_directory)
    return state.managed_checkpoints() if state else []

  @property
  def latest_checkpoint(self) -> Optional[str]:
    """The newest committed checkpoint, e.g. `<base_directory>/ckpt-7`, or None.

    The path is the prefix of the checkpoint's files (`.flax`, `.index`, ...).
    It is read from TensorFlow's `checkpoint` file, without TensorFlow until
    it is loaded. With `layout="orbax"`, the newest number of either layout
    (named `<base_directory>/ckpt-N` also when it is Orbax step N).
    """
    return self._newest_of_both(self._clu_latest_checkpoint())

  def _newest_of_both(self, clu: Optional[str]) -> Optional[str]:
    """`clu` (a CLU checkpoint path), or the newest Orbax step if newer.

    An Orbax step wins over a CLU checkpoint of the same number (a save in
    the Orbax layout removes the CLU checkpoints after the current one, so
    the two are the same checkpoint, migrated).
    """
    if self._orbax is None:
      return clu
    steps = self._orbax.steps()
    if not steps:
      return clu
    number = layout.checkpoint_number(clu or "", self.checkpoint_name)
    if clu is not None and number is not None and number > steps[-1]:
      return clu
    return self._numbered(steps[-1])

  def _orbax_number(self, checkpoint: str) -> Optional[int]:
    """The Orbax step `checkpoint` names, or None (a CLU checkpoint).

    `{base_directory}/{checkpoint_name}-{N}` names step N when the step
    exists; so does the step directory (`{root}/{N}`) itself.
    """
    if self._orbax is None:
      return None
    path = layout.absolute(checkpoint)
    parent, name = path.rsplit("/", 1) if "/" in path else ("", path)
    if parent == self._orbax.root and re.fullmatch(r"0|[1-9][0-9]*", name):
      return int(name)
    number = layout.checkpoint_number(checkpoint, self.checkpoint_name)
    if number is None or parent != layout.absolute(self.base_directory):
      return None
    return number if number in self._orbax.steps() else None

  def _clu_latest_checkpoint(self) -> Optional[str]:
    """The newest CLU checkpoint (TensorFlow's `checkpoint` file)."""
    if self._tf_checkpoint_manager is not None:
      return self._tf_checkpoint_manager.latest_checkpoint
    state = layout.read_checkpoint_state(self.base_directory)
    return None if state is None else state.model_checkpoint_path

  @property
  def current_checkpoint(self) -> Optional[str]:
    """The checkpoint this object last saved or restored.

    Right after construction this points to `ckpt-0` (which does not exist)
    when the directory has checkpoints; after a save or `restore_or_initialize`
    to the one written or read. It can differ from `latest_checkpoint` after
    `restore(state, checkpoint)` of an older checkpoint.

    Returns:
      A checkpoint path, or None when the directory has no checkpoint.
    """
    if self.latest_checkpoint is None:
      return None
    return self._numbered(self._current_number())

  def _numbered(self, number: int) -> str:
    """`{base_directory}/{checkpoint_name}-{number}`: where saves write."""
    return str(CheckpointInfo.initialize(
        self.base_directory, self.checkpoint_name)._replace(number=number))

  def _flax_path(self, checkpoint: str) -> str:
    return f"{checkpoint}.flax"

  def _next_checkpoint(self, checkpoint: Optional[str]) -> str:
    if checkpoint is None:
      return self._numbered(1)
    return self._numbered(CheckpointInfo.from_path(checkpoint).number + 1)

  def _checkpoint_or_latest(self, checkpoint: Optional[str] = None) -> str:
    if checkpoint is None:
      checkpoint = self.get_latest_checkpoint_to_restore_from()
      if checkpoint is None:
        raise errors.CheckpointNotFoundError(
            f"No checkpoint found at {self.base_directory}")
    return checkpoint

  # -- saving -------------------------------------------------------------------

  def save(self, state: Any) -> str:
    """Saves `state` (and `tf_state`) as a new checkpoint.

    If this object restored a checkpoint older than the newest, the save
    overwrites the next number and deletes every newer checkpoint: with
    checkpoints 1, 2, 3, restoring 1 and saving writes a new 2 and deletes 3.
    This is how a preempted `MultihostCheckpoint` host re-joins its peers.
    The newer checkpoints are unlisted before their files are deleted, so a
    crash never leaves a listed checkpoint torn. A failed save leaves the
    earlier checkpoints as they were and removes its own partial files; the
    next save reuses the same number. In a bucket, TensorFlow writes the
    `tf_state` to a local temporary directory and clu_ckpt uploads and
    commits it (see the class docstring). With `layout="orbax"` the
    checkpoint is Orbax step `number` instead (see the class docstring and
    `clu_ckpt.orbax_layout`); the path returned keeps its CLU name.

    Example::

      path = ckpt.save(state)   # "/ckpts/ckpt-4"

    Args:
      state: The Flax state to store (anything `flax.serialization.to_bytes`
        accepts).

    Returns:
      The new checkpoint (`{base_directory}/{checkpoint_name}-{number}`).

    Raises:
      ImportError: TensorFlow is not installed.
      TypeError: `state` holds a leaf of an unregistered type (names its path).
      OSError: The files could not be written (a full or read-only disk); the
        error names the file or checkpoint. Earlier checkpoints are intact.
    """
    if self._orbax is not None:
      return self._save_orbax(state)
    start = time.time()
    manager = self.tf_checkpoint_manager
    save_protocol.delete_future_checkpoints(
        manager, self.base_directory, self.checkpoint_name,
        self._current_number())
    next_checkpoint = self._next_checkpoint(self.current_checkpoint)
    logging.info("Storing next checkpoint '%s'", next_checkpoint)
    storage.makedirs(self.base_directory)
    nbytes = flax_format.save_file(state, self._flax_path(next_checkpoint))
    # TensorFlow writes last: its `checkpoint` file is the commit.
    save_protocol.commit(manager, self._tf_checkpoint, self.base_directory,
                         next_checkpoint, reread=self._reread_manager)
    current = self.current_checkpoint
    if current != next_checkpoint:
      raise errors.ConcurrentWriterError(
          f"Saved {current} but expected {next_checkpoint}: another process "
          f"may be writing to {self.base_directory}")
    # Also removes the .flax of checkpoints TensorFlow pruned.
    save_protocol.sweep_debris(manager, self.base_directory,
                               self.checkpoint_name)
    logging.info("Checkpoint.save() wrote %s (%d bytes of Flax state) in "
                 "%.2fs", current, nbytes, time.time() - start)
    return current

  def _save_orbax(self, state: Any) -> str:
    """`save` in the Orbax layout: step `current + 1` of the Orbax root.

    Checkpoints after the current one go first (Orbax steps and CLU
    checkpoints, each unlisted before it is deleted), then the step is
    written (temporary directory, fsync, rename), then `max_to_keep` is
    applied (`_prune_both`) and what killed saves left is removed.
    """
    start = time.time()
    current = self._current_number()
    number = current + 1
    logging.info("Storing next checkpoint '%s' as Orbax step %s",
                 self._numbered(number), self._orbax.step_path(number))
    for step in self._orbax.steps():
      if step > current:
        self._orbax.discard(step)
    self._delete_future_clu_checkpoints(current)
    nbytes = self._orbax.save(number, state, self._tf_state,
                              checkpoint_name=self.checkpoint_name)
    self._save_counter = number
    self._prune_both()
    self._orbax.sweep_partial()
    logging.info("Checkpoint.save() wrote %s (%d bytes of arrays) in %.2fs",
                 self._orbax.step_path(number), nbytes, time.time() - start)
    return self._numbered(number)

  def _clu_numbers(self) -> dict[int, str]:
    """Number -> path of the CLU checkpoints listed in this directory."""
    if self._tf_checkpoint_manager is not None:
      return {n: p for p in self._tf_checkpoint_manager.checkpoints
              if (n := layout.checkpoint_number(p, self.checkpoint_name))
              is not None and layout.is_contained(self.base_directory, p)}
    return layout.listed_numbers(self.base_directory, self.checkpoint_name)

  def _delete_future_clu_checkpoints(self, current: int) -> None:
    """Removes CLU checkpoints numbered after `current` (Orbax layout).

    TensorFlow is loaded only when there are some.
    """
    upcoming = layout.checkpoint_files(self._numbered(current + 1))
    if not upcoming and not any(n > current for n in self._clu_numbers()):
      return
    current_is_clu = current > 0 and bool(
        layout.checkpoint_files(self._numbered(current)))
    save_protocol.delete_future_checkpoints(
        self.tf_checkpoint_manager, self.base_directory, self.checkpoint_name,
        current, keep_current=current_is_clu)

  def _prune_both(self) -> None:
    """`max_to_keep` over both layouts' numbers.

    Orbax steps outside the newest `max_to_keep` numbers are removed; a CLU
    checkpoint outside them only when an Orbax step of its number exists
    (removed first, so that the Orbax step is never the only copy taken).
    """
    if self.max_to_keep is None:
      return
    steps = set(self._orbax.steps())
    clu = self._clu_numbers()
    numbers = sorted(steps | set(clu), reverse=True)
    old = numbers[max(self.max_to_keep, 1):]
    copies = [clu[n] for n in old if n in clu and n in steps]
    if copies:
      save_protocol.delete_checkpoints(
          self.tf_checkpoint_manager, self.base_directory, copies)
    for number in old:
      if number in steps:
        self._orbax.discard(number)

  def restore_or_initialize(self, state: T) -> T:
    """Restores the latest checkpoint, or saves `state` as the first one.

    Args:
      state: The template to restore into (the fields must match the saved
        state, see `flax.serialization.from_state_dict`), which is also what is
        saved when there is no checkpoint yet.

    Returns:
      The restored state, or `state` itself when it was saved as the first
      checkpoint. `tf_state` is restored too.

    Raises:
      ValueError: The checkpoint does not match the template (names the path).
    """
    checkpoint = self.get_latest_checkpoint_to_restore_from()
    if checkpoint is not None:
      return self.restore(state, checkpoint)
    logging.info("Storing initial version.")
    self.save(state)
    return state

  # -- restoring ----------------------------------------------------------------

  def restore_dict(self, checkpoint: Optional[str] = None) -> Dict[str, Any]:
    """Restores a checkpoint and returns its state as a dictionary.

    Same as `restore(None, checkpoint)`.

    Args:
      checkpoint: The checkpoint (`<base_directory>/ckpt-N`); default latest.

    Returns:
      The state dict. `tf_state` is restored too.

    Raises:
      FileNotFoundError: `checkpoint` does not exist, or there is none.
    """
    return self.restore(state=None, checkpoint=checkpoint)

  def load_state(self, state: Optional[T],
                 checkpoint: Optional[str] = None) -> T:
    """Reads the Flax state of a checkpoint, not the TensorFlow state.

    Args:
      state: Template for the returned state (see
        `flax.serialization.from_state_dict`), or None for a dict.
      checkpoint: The checkpoint (`<base_directory>/ckpt-N`); default latest.

    Returns:
      The restored state; array leaves are read-only numpy arrays.

    Raises:
      FileNotFoundError: `checkpoint` does not exist, or there is none.
      ValueError: The saved state does not match `state`; the message names
        the tree path and the file.
      flax_format.FlaxFormatError: The `.flax` file is corrupt.
    """
    resolved = self._checkpoint_or_latest(checkpoint)
    number = self._orbax_number(resolved)
    if number is not None:
      state_dict = self._orbax.load_state_dict(number)
    else:
      state_dict = self._read_flax(resolved, checkpoint)
    if state is None:
      return state_dict
    from flax import serialization  # pylint: disable=g-import-not-at-top
    try:
      return serialization.from_state_dict(state, state_dict)
    except ValueError as e:
      raise errors.InvalidCheckpointError(
          f"{e} (restoring {self._flax_path(resolved)} into a "
          f"{type(state).__name__} template)") from e

  def _read_flax(self, checkpoint: str, requested: Optional[str],
                 subtree: Any = None) -> Any:
    flax_path = self._flax_path(checkpoint)
    if not storage.exists(flax_path):
      raise errors.CheckpointNotFoundError(
          f"Checkpoint {requested} does not exist ({flax_path} not found)")
    return flax_format.load_file(flax_path, subtree=subtree)

  def restore(self, state: Optional[T], checkpoint: Optional[str] = None) -> T:
    """Restores a checkpoint: the Flax state, returned, and `tf_state`.

    Like `restore_or_initialize()`, but raises when there is no checkpoint.

    Args:
      state: Template for the returned state, or None for a dict.
      checkpoint: The checkpoint (`<base_directory>/ckpt-N`); default latest
        (for `MultihostCheckpoint`, the newest that every host has). As in
        clu and TensorFlow, a path is read wherever it points, also when it
        (or the latest in TensorFlow's `checkpoint` file) is an absolute path
        outside `base_directory`; saves still write only inside it. In a
        bucket, `tf_state` is restored from a temporary local copy of the
        TensorFlow files, completely before this returns (`_restore_tf`).

    Returns:
      The restored state. The TensorFlow objects in `tf_state` are restored
      in place.

    Raises:
      FileNotFoundError: `checkpoint` does not exist, or there is none.
      ValueError: The saved state does not match `state`, or (in a bucket)
        `tf_state` holds an object the checkpoint does not.
      ImportError: `tf_state` needs TensorFlow and it is missing.
    """
    checkpoint = self._checkpoint_or_latest(checkpoint)
    logging.info("Restoring checkpoint: %s", checkpoint)
    if self._orbax is not None:
      return self._restore_in_orbax_layout(state, checkpoint)
    state = self.load_state(state, checkpoint)
    if self._tf_checkpoint is not None:
      # TensorFlow would block forever opening a named pipe.
      for path in storage.glob(f"{storage.glob_escape(checkpoint)}.*"):
        if not path.endswith(".flax"):
          storage.check_regular_file(path)
      self._restore_tf(checkpoint)
    else:
      # Nothing but the save counter to restore: no need to load TensorFlow.
      parts = layout.split_checkpoint(checkpoint)
      self._save_counter = parts[1] if parts else 0
    logging.info("Restored save_counter=%d restored_checkpoint=%s",
                 self._current_number(), checkpoint)
    self.restored_from = checkpoint
    return state


  def _restore_in_orbax_layout(self, state: Optional[T], checkpoint: str) -> T:
    """`restore` with `layout="orbax"`: an Orbax step, or a CLU checkpoint.

    Either way the state and `tf_state` come from the same checkpoint, and
    the next save writes the number after it.
    """
    number = self._orbax_number(checkpoint)
    state = self.load_state(state, checkpoint)
    if number is not None:
      if self._tf_state:
        self._orbax.restore_tf_state(number, self._tf_state)
    else:
      parts = layout.split_checkpoint(checkpoint)
      number = parts[1] if parts else 0
      if self._tf_state:
        for path in storage.glob(f"{storage.glob_escape(checkpoint)}.*"):
          if not path.endswith(".flax"):
            storage.check_regular_file(path)
        self._load_tf()
        self._restore_tf(checkpoint)
    self._save_counter = number
    logging.info("Restored save_counter=%d restored_checkpoint=%s",
                 number, checkpoint)
    self.restored_from = checkpoint
    return state

  def _restore_tf(self, checkpoint: str) -> None:
    """Restores `tf_state` from the TensorFlow files of `checkpoint`.

    Files in a bucket are read from a temporary local copy
    (`storage.local_prefix`), removed when this returns. TensorFlow restores
    objects that exist when `restore` is called at once (eagerly), and
    `tf_state`'s objects all exist: the status is asserted before the copy
    goes, so every one of them is restored, or this raises. Objects created
    later, which TensorFlow would restore from the files when they appear
    (deferred restoration), are not restored from a bucket checkpoint.

    Raises:
      InvalidCheckpointError: An object of `tf_state` has no counterpart in
        a bucket checkpoint (names the checkpoint).
    """
    with storage.local_prefix(checkpoint) as prefix:
      status = self._tf_checkpoint.restore(prefix)
      if prefix != checkpoint:
        try:
          status.assert_existing_objects_matched()
        except AssertionError as e:
          raise errors.InvalidCheckpointError(
              f"{checkpoint}: the tf_state does not match the checkpoint's "
              f"TensorFlow objects: {e}") from e


class MultihostCheckpoint(Checkpoint):
  """A `Checkpoint` per JAX host that restores where every host can resume.

  A host preempted while saving restarts one checkpoint behind its peers.
  Each host therefore writes its own directory and restores the newest
  checkpoint number present in all of them; the first save after that
  overwrites the newer checkpoints a host may have::

    {multihost_base_directory}-0/ckpt-{number}.flax, .index, .data-*, checkpoint
    {multihost_base_directory}-1/...
    ...

  Only directories named `{multihost_base_directory}-{integer}` count as host
  directories.

  With `layout="orbax"` every host saves into one Orbax root, the multihost
  base itself, in one collective save (all processes call `save`, as they
  do): the state is written once (by process 0), each host's `tf_state` is
  kept under `process_<host_id>` of the `dataset` item, and a step is listed
  only once every process has written its part::

    {multihost_base_directory}/{number}/state/, dataset/, metadata/

  An Orbax step is therefore on every host: the restore takes the newest of
  it and of the newest CLU checkpoint number every host directory holds.
  `host_id` must then be `jax.process_index()`.
  """

  def __init__(self, multihost_base_directory: str,
               tf_state: Optional[Dict[str, Any]] = None, *,
               host_id: Optional[int] = None, max_to_keep: int = 5,
               checkpoint_name: str = "ckpt", layout: Optional[str] = None):
    """Initializes a MultihostCheckpoint with a dict of TensorFlow Trackables.

    Args:
      multihost_base_directory: Shared prefix of the host directories, usually
        `f"{workdir}/checkpoints"`; host `i` writes to
        `f"{multihost_base_directory}-{i}"`.
      tf_state: A dictionary of TensorFlow `Trackable`s, e.g. the host's
        dataset iterator.
      host_id: This host's integer id; default `jax.process_index()`.
      max_to_keep: Number of checkpoints to keep per host (at least 2).
      checkpoint_name: Prefix of the checkpoint files (before `-{number}`).
      layout: "clu" or "orbax" (see the class docstring); None:
        `$CLU_CKPT_LAYOUT`, else "clu".

    Raises:
      ValueError: `max_to_keep < 2`, or with `layout="orbax"` a `host_id`
        other than `jax.process_index()`.
      TypeError: `host_id` is not an integer.
    """
    if max_to_keep < 2:
      raise errors.UsageError("Requires multiple checkpoints (max_to_keep>=2).")
    multihost_base_directory = multihost_base_directory.rstrip("/")
    self.multihost_base_directory = multihost_base_directory
    if host_id is None:
      import jax  # pylint: disable=g-import-not-at-top
      host_id = jax.process_index()
    host_id = operator.index(host_id)
    self.host_id = host_id
    super().__init__(f"{multihost_base_directory}-{host_id}", tf_state,
                     max_to_keep=max_to_keep, checkpoint_name=checkpoint_name,
                     layout=layout)

  def _new_orbax_steps(self) -> orbax_layout.OrbaxSteps:
    """The one Orbax root of all hosts: the multihost base directory."""
    index, count = orbax_layout.process_index_and_count()
    if self.host_id != index:
      raise errors.UsageError(
          f"MultihostCheckpoint({self.multihost_base_directory!r}, "
          f"layout='orbax'): host_id {self.host_id} is not this process's "
          f"jax.process_index() {index}; all hosts save one Orbax step "
          "together, each under its process index")
    return orbax_layout.OrbaxSteps(
        safe_normpath(self.multihost_base_directory),
        kind="MultihostCheckpoint", process_index=index, process_count=count)

  def host_directories(self) -> Dict[int, str]:
    """Host id -> directory, for every `{multihost_base_directory}-{int}`."""
    return host_directories(self.multihost_base_directory)

  def get_latest_checkpoint_to_restore_from(self) -> Optional[str]:
    """Returns the newest checkpoint that every host directory holds.

    Only checkpoints named `{checkpoint_name}-{number}` inside each host's
    directory count; entries of the `checkpoint` files that lead elsewhere
    are ignored. With `layout="orbax"`, the newest Orbax step of the shared
    root counts too (every host has it: it is listed only once all hosts
    wrote it), when its number is higher.

    Returns:
      This host's path of that checkpoint, or None when this host has no
      directory yet or the hosts have no checkpoint number in common.
    """
    directories = self.host_directories()
    if self.base_directory not in directories.values():
      logging.info("%s not in %s", self.base_directory,
                   list(directories.values()))
      return self._newest_of_both(None)
    found = layout.newest_common(directories, self.checkpoint_name)
    return self._newest_of_both(
        None if found is None else found[1][self.base_directory])
