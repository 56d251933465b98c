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

Differences from `clu.checkpoint` that callers can observe are deliberate and
few: the `.flax` file is streamed to a temporary name, fsynced and renamed (CLU
writes it in place), it is read through a memory map (arrays are read-only
views of the file, as Flax's were read-only views of the bytes read), TensorFlow
is imported only when the `tf_state`, a save, or the `tf_checkpoint`
attributes need it, and `MultihostCheckpoint` only considers directories named
`<multihost_base_directory>-<integer>`.
"""

from __future__ import annotations

import collections
import operator
import os
import re
import time
from typing import Any, Dict, Optional, Sequence, TypeVar, Union

from absl import logging

from clu_ckpt import flax_format
from clu_ckpt import storage

T = TypeVar("T")

_SCHEME_RE = re.compile(r"^(?P<scheme>[a-z][a-z0-9.+-]+://)?(?P<path>.*)",
                        re.I | re.S)


def safe_normpath(path: str) -> str:
  """Normalizes a path, keeping a URL scheme (`gs://`) intact.

  `os.path.normpath("gs://bucket/x")` would collapse the double slash; this
  normalizes only the part after the scheme.

  Example::

    safe_normpath("gs://bucket//run/./ckpt/")   # "gs://bucket/run/ckpt"

  Args:
    path: A local path or URL.

  Returns:
    The normalized path.
  """
  m = _SCHEME_RE.match(path)
  return (m.group("scheme") or "") + os.path.normpath(m.group("path"))


def load_state_dict(base_directory: str, *,
                    subtree: Union[None, str, Sequence[str]] = None,
                    checkpoint: Optional[str] = None) -> Dict[str, Any]:
  """Returns the state of the latest checkpoint in `base_directory` as a dict.

  Works without TensorFlow and without JAX. Lists in the saved state come back
  as dicts keyed "0", "1", ..., exactly as in Flax state dicts. Arrays are
  read-only numpy views of the memory-mapped file.

  Example::

    state_dict = load_state_dict("/work/ckpts")
    params = load_state_dict("/work/ckpts", subtree="params")

  Args:
    base_directory: Directory with the checkpoints (see `Checkpoint`).
    subtree: Only return this subtree ("params" or "params/Dense_0", or a
      sequence of keys); the rest of the file is not decoded.
    checkpoint: A specific checkpoint (`<base_directory>/ckpt-N`) instead of
      the latest.

  Returns:
    The deserialized state (or subtree) as a dictionary.

  Raises:
    FileNotFoundError: There is no checkpoint to restore.
    flax_format.FlaxFormatError: The `.flax` file is corrupt, or has no such
      subtree.
  """
  ckpt = Checkpoint(base_directory)
  return ckpt._read_flax(ckpt._checkpoint_or_latest(checkpoint), checkpoint,
                         subtree)  # pylint: disable=protected-access


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

    Args:
      checkpoint: A checkpoint prefix (`<base>/<name>-<number>`).

    Returns:
      The parsed `CheckpointInfo`.

    Raises:
      ValueError: `checkpoint` does not end in `-<number>`.
    """
    m = re.match(cls.CHECKPOINT_REGEX, checkpoint, re.S)
    if m is None:
      raise ValueError(f"Invalid checkpoint format: {checkpoint}")
    return cls(m.group("prefix"), int(m.group("number")))

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
  by rewriting `checkpoint`: a `.flax` without that commit (a crash in
  between) is not a checkpoint; it is ignored and later overwritten. Only the
  newest `max_to_keep` checkpoints are kept; the `.flax` of a pruned one is
  removed with its TensorFlow files. These are the files `clu.checkpoint`
  writes, byte for byte, and each library restores the other's.

  Attributes:
    base_directory: The normalized directory.
    max_to_keep: How many checkpoints are kept.
    checkpoint_name: Prefix of the checkpoint files.
    restored_from: The checkpoint last restored, or None.
  """

  def __init__(self,
               base_directory: str,
               tf_state: Optional[Dict[str, Any]] = None,
               *,
               max_to_keep: int = 5,
               checkpoint_name: str = "ckpt"):
    """Initializes a Checkpoint with a dictionary of TensorFlow Trackables.

    Args:
      base_directory: Directory under which the checkpoints are stored; use a
        different one in every task.
      tf_state: A dictionary of TensorFlow `Trackable`s to save with every
        checkpoint, for example a dataset iterator.
      max_to_keep: Number of checkpoints to keep; older ones are removed.
      checkpoint_name: Prefix of the checkpoint files (before `-{number}`).

    Raises:
      ImportError: `tf_state` is given and TensorFlow is not installed.
    """
    self.base_directory = safe_normpath(base_directory)
    self.max_to_keep = max_to_keep
    self.checkpoint_name = checkpoint_name
    self.restored_from = None
    self._tf_state = dict(tf_state or {})
    self._tf_checkpoint = None
    self._tf_checkpoint_manager = None
    # Mirrors `tf_checkpoint.save_counter` until TensorFlow is loaded.
    self._save_counter = 0
    if self._tf_state:
      self._load_tf()

  # -- TensorFlow, loaded only when needed ------------------------------------

  @property
  def tf_checkpoint(self):
    """The `tf.train.Checkpoint` holding `tf_state` (imports TensorFlow)."""
    self._load_tf()
    return self._tf_checkpoint

  @property
  def tf_checkpoint_manager(self):
    """The `tf.train.CheckpointManager` writing the TF files (imports TF)."""
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
          "with `pip install tensorflow-cpu` (or `pip install clu_ckpt[tf]`); "
          "reading the Flax state alone (load_state_dict, load_state, "
          "restore_dict) works without it.") from e
    tf_checkpoint = tf.train.Checkpoint(**self._tf_state)
    if self._save_counter:
      tf_checkpoint.save_counter.assign(self._save_counter)
    self._tf_checkpoint_manager = tf.train.CheckpointManager(
        tf_checkpoint,
        self.base_directory,
        max_to_keep=self.max_to_keep,
        checkpoint_name=self.checkpoint_name)
    self._tf_checkpoint = tf_checkpoint

  def _current_number(self) -> int:
    if self._tf_checkpoint is not None:
      return int(self._tf_checkpoint.save_counter.numpy())
    return self._save_counter

  # -- paths ------------------------------------------------------------------

  def get_latest_checkpoint_to_restore_from(self) -> Optional[str]:
    """Returns the checkpoint `restore()` uses by default.

    Here simply `latest_checkpoint`; `MultihostCheckpoint` overrides it to
    pick the newest checkpoint that every host has.

    Returns:
      A checkpoint path (`<base_directory>/ckpt-N`), or None.
    """
    return self.latest_checkpoint

  @property
  def latest_checkpoint(self) -> Optional[str]:
    """The newest committed checkpoint, e.g. `<base_directory>/ckpt-7`, or None.

    The path is the prefix of the checkpoint's files (`.flax`, `.index`, ...).
    It is read from TensorFlow's `checkpoint` file, without TensorFlow until
    it is loaded.
    """
    if self._tf_checkpoint_manager is not None:
      return self._tf_checkpoint_manager.latest_checkpoint
    state = storage.read_checkpoint_state(self.base_directory)
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
    latest = self.latest_checkpoint
    if latest is None:
      return None
    info = CheckpointInfo.from_path(latest)
    return str(info._replace(number=self._current_number()))

  def _flax_path(self, checkpoint: str) -> str:
    return f"{checkpoint}.flax"

  def _next_checkpoint(self, checkpoint: Optional[str]) -> str:
    if checkpoint is None:
      return str(
          CheckpointInfo.initialize(self.base_directory, self.checkpoint_name))
    return str(CheckpointInfo.from_path(checkpoint).increment())

  def _checkpoint_or_latest(self, checkpoint: Optional[str] = None) -> str:
    if checkpoint is None:
      checkpoint = self.get_latest_checkpoint_to_restore_from()
      if checkpoint is None:
        raise FileNotFoundError(f"No checkpoint found at {self.base_directory}")
    return checkpoint

  # -- saving -------------------------------------------------------------------

  def _delete_future_checkpoints(self) -> None:
    """Removes the files of every checkpoint after the current one.

    They exist after restoring an older checkpoint than the newest (a host
    that re-joins its peers after a preemption), or as a torn write.
    """
    checkpoint = self.current_checkpoint
    while True:
      checkpoint = self._next_checkpoint(checkpoint)
      paths = storage.glob(f"{_glob_escape(checkpoint)}.*")
      if not paths:
        break
      for path in paths:
        logging.info("Cleaning up future checkpoint file '%s'", path)
        storage.remove(path)

  def save(self, state: Any) -> str:
    """Saves `state` (and `tf_state`) as a new checkpoint.

    If this object restored a checkpoint older than the newest, the save
    overwrites the next number and deletes every newer checkpoint: with
    checkpoints 1, 2, 3, restoring 1 and saving writes a new 2 and deletes 3.
    This is how a preempted `MultihostCheckpoint` host re-joins its peers.

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
      OSError: The files could not be written; earlier checkpoints are intact.
    """
    start = time.time()
    manager = self.tf_checkpoint_manager
    self._delete_future_checkpoints()
    next_checkpoint = self._next_checkpoint(self.current_checkpoint)
    logging.info("Storing next checkpoint '%s'", next_checkpoint)
    storage.makedirs(self.base_directory)
    nbytes = flax_format.save_file(state, self._flax_path(next_checkpoint))
    before = set(manager.checkpoints)
    # TensorFlow writes last: its `checkpoint` file is the commit.
    manager.save()
    for stale in before - set(manager.checkpoints):
      for path in [self._flax_path(stale)] + storage.glob(
          f"{_glob_escape(self._flax_path(stale))}.tmp-*"):
        storage.remove(path)
    current = self.current_checkpoint
    if current != next_checkpoint:
      raise RuntimeError(
          f"Saved {current} but expected {next_checkpoint}: another process "
          f"may be writing to {self.base_directory}")
    logging.info("Checkpoint.save() wrote %s (%d bytes of Flax state) in "
                 "%.2fs", current, nbytes, time.time() - start)
    return current

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
    state_dict = self._read_flax(resolved, checkpoint)
    if state is None:
      return state_dict
    from flax import serialization  # pylint: disable=g-import-not-at-top
    try:
      return serialization.from_state_dict(state, state_dict)
    except ValueError as e:
      raise ValueError(
          f"{e} (restoring {self._flax_path(resolved)} into a "
          f"{type(state).__name__} template)") from e

  def _read_flax(self, checkpoint: str, requested: Optional[str],
                 subtree: Any = None) -> Any:
    flax_path = self._flax_path(checkpoint)
    if not storage.exists(flax_path):
      raise FileNotFoundError(f"Checkpoint {requested} does not exist "
                              f"({flax_path} not found)")
    return flax_format.load_file(flax_path, subtree=subtree)

  def restore(self, state: Optional[T], checkpoint: Optional[str] = None) -> T:
    """Restores a checkpoint: the Flax state, returned, and `tf_state`.

    Like `restore_or_initialize()`, but raises when there is no checkpoint.

    Args:
      state: Template for the returned state, or None for a dict.
      checkpoint: The checkpoint (`<base_directory>/ckpt-N`); default latest
        (for `MultihostCheckpoint`, the newest that every host has).

    Returns:
      The restored state. The TensorFlow objects in `tf_state` are restored
      in place.

    Raises:
      FileNotFoundError: `checkpoint` does not exist, or there is none.
      ValueError: The saved state does not match `state`.
      ImportError: `tf_state` needs TensorFlow and it is missing.
    """
    checkpoint = self._checkpoint_or_latest(checkpoint)
    logging.info("Restoring checkpoint: %s", checkpoint)
    state = self.load_state(state, checkpoint)
    if self._tf_checkpoint is not None:
      self._tf_checkpoint.restore(checkpoint)
    else:
      # Nothing but the save counter to restore: no need to load TensorFlow.
      self._save_counter = CheckpointInfo.from_path(checkpoint).number
    logging.info("Restored save_counter=%d restored_checkpoint=%s",
                 self._current_number(), checkpoint)
    self.restored_from = checkpoint
    return state


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
  """

  def __init__(self,
               multihost_base_directory: str,
               tf_state: Optional[Dict[str, Any]] = None,
               *,
               host_id: Optional[int] = None,
               max_to_keep: int = 5,
               checkpoint_name: str = "ckpt"):
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

    Raises:
      ValueError: `max_to_keep < 2`.
      TypeError: `host_id` is not an integer.
    """
    if max_to_keep < 2:
      raise ValueError("Requires multiple checkpoints (max_to_keep>=2).")
    multihost_base_directory = multihost_base_directory.rstrip("/")
    self.multihost_base_directory = multihost_base_directory
    if host_id is None:
      import jax  # pylint: disable=g-import-not-at-top
      host_id = jax.process_index()
    host_id = operator.index(host_id)
    super().__init__(
        f"{multihost_base_directory}-{host_id}",
        tf_state,
        max_to_keep=max_to_keep,
        checkpoint_name=checkpoint_name)

  def host_directories(self) -> Dict[int, str]:
    """Host id -> directory, for every `{multihost_base_directory}-{int}`."""
    return host_directories(self.multihost_base_directory)

  def get_latest_checkpoint_to_restore_from(self) -> Optional[str]:
    """Returns the newest checkpoint that every host directory holds.

    Returns:
      This host's path of that checkpoint, or None when this host has no
      directory yet or the hosts have no checkpoint number in common.
    """
    directories = self.host_directories()
    if self.base_directory not in directories.values():
      logging.info("%s not in %s", self.base_directory,
                   list(directories.values()))
      return None
    common = None
    own = {}
    exclusive = set()
    for directory in directories.values():
      state = storage.read_checkpoint_state(directory)
      paths = state.managed_checkpoints() if state else []
      numbers = {CheckpointInfo.from_path(p).number: p for p in paths}
      if directory == self.base_directory:
        own = numbers
      exclusive |= set(numbers)
      common = set(numbers) if common is None else common & set(numbers)
    logging.info("Checked checkpoint directories %s: common numbers %s, "
                 "exclusive numbers %s", list(directories.values()), common,
                 exclusive - (common or set()))
    if not common:
      return None
    return own[max(common)]


def host_directories(multihost_base_directory: str) -> Dict[int, str]:
  """The host directories of a `MultihostCheckpoint` base.

  Example::

    host_directories("/work/checkpoints")
    # {0: "/work/checkpoints-0", 1: "/work/checkpoints-1"}

  Args:
    multihost_base_directory: The shared prefix passed to
      `MultihostCheckpoint`.

  Returns:
    Host id -> normalized directory, for every existing directory named
    `{multihost_base_directory}-{integer}`, sorted by host id.
  """
  prefix = f"{safe_normpath(multihost_base_directory.rstrip('/'))}-"
  found = {}
  for path in storage.glob(f"{_glob_escape(prefix)}*"):
    suffix = path[len(prefix):]
    if suffix.isdigit() and storage.isdir(path):
      found[int(suffix)] = safe_normpath(path)
  return dict(sorted(found.items()))


def _glob_escape(path: str) -> str:
  return re.sub(r"([*?\[])", r"[\1]", path)
