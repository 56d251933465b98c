"""The destination of a migration as a fleet shares it: a lock and a manifest.

Two files in the Orbax root, beside the steps, which Orbax does not list (it
lists only names that parse as steps):

- `.clu_ckpt.lock`: held for the whole of a migration. A second migration
  into the same root stops at once with `DestinationLockedError`, naming the
  holder (host, pid, since). How it is held depends on the store:

  - Local disks (and NFS): `flock(2)` on that file. The kernel releases it
    when the holder exits, however it dies (`kill -9` included), so a lock
    left by a killed process is simply taken over; the file only says who
    holds it. On NFS, `flock` is carried by the server's byte-range locks.
  - Object stores (`gs://`, `s3://`): a lease (`clu_ckpt.migration.lease`),
    an object created only if none exists and rewritten by the holder every
    third of the lease (60 s, `$CLU_CKPT_LOCK_LEASE_SECONDS`); one not
    rewritten for 1.5 leases + 1 s is stale and taken over by exactly one
    contender. A holder that lost its lease writes nothing more:
    `Manifest.record`, `forget`, `save` and `ensure_held` raise
    `MigrationError` ("lost the lock on ROOT to HOST pid PID").
  - Other stores (`hdfs://`... through TensorFlow's gfile, which has no
    exclusive create): a warning and no lock; run one migration per
    destination there.
- `clu_ckpt_manifest.json`: which source the root was migrated from, and each
  checkpoint migrated with its step. A root holding another source's steps
  (or steps of no migration at all: an Orbax run's own) is refused before
  anything is written, unless other sources are allowed; a checkpoint
  recorded as migrated is never written again, even when Orbax has since
  pruned its step (`max_to_keep`). It is replaced atomically after each step
  is committed: locally a temporary file, fsync, rename; in a bucket an
  upload that completes whole or not at all (`storage.atomic_writer`). A
  kill in between leaves a finished step the manifest does not name yet,
  which the next run recognises by its metadata and records.

Synopsis::

  from clu_ckpt.migration import destination

  with destination.lock("/runs/a/orbax"):
    manifest = destination.read_manifest("/runs/a/orbax")
    manifest.check_source("/runs/a/checkpoints", allow_other_sources=False)
    if 7 not in manifest.recorded("/runs/a/checkpoints"):
      ...  # write checkpoint 7 as step 7000
      manifest.record("/runs/a/checkpoints", 7, "ckpt-7", 7000)

  with destination.lock("gs://bucket/orbax"):   # a lease, refreshed
    destination.ensure_held("gs://bucket/orbax")  # raises once lost

  # Before deleting a source: what it keeps that the root never got.
  left = destination.checkpoints_not_migrated("/runs/a/orbax",
                                              "/runs/a/checkpoints")
  left.names   # ["ckpt-8"]: saved after the migration, or not selected
  left.entries  # ["6/"]: what the migration does not read (an Orbax step)
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import socket
import stat
from typing import Any, Iterator, Mapping, Optional

from absl import logging

from clu_ckpt import errors
from clu_ckpt import layout
from clu_ckpt import storage
from clu_ckpt.migration import lease as lease_lib
# Re-exported: the lease's knobs and check, as the lock's.
from clu_ckpt.migration.lease import ensure_held  # pylint: disable=unused-import
from clu_ckpt.migration.lease import LEASE_ENV  # pylint: disable=unused-import
from clu_ckpt.migration.lease import LEASE_SECONDS  # pylint: disable=unused-import
from clu_ckpt.migration.lease import lease_seconds  # pylint: disable=unused-import
from clu_ckpt.migration.lease import stale_after  # pylint: disable=unused-import

LOCK_NAME = ".clu_ckpt.lock"
MANIFEST_NAME = "clu_ckpt_manifest.json"
MANIFEST_FORMAT = "clu_ckpt.manifest/1"
# A manifest names a few hundred bytes per checkpoint; anything larger than
# this is not one of ours.
MAX_MANIFEST_BYTES = 64 * 2**20
# What a holder writes into the lock file (JSON) is at most this long.
_MAX_HOLDER_BYTES = 4096

MigrationError = errors.MigrationError
DestinationLockedError = errors.DestinationLockedError


# --------------------------------------------------------------------------
# The lock.
# --------------------------------------------------------------------------


@contextlib.contextmanager
def lock(root: str) -> Iterator[dict]:
  """Holds the destination's lock for the duration of the block.

  Locally a `flock(2)`; on object stores (`gs://`, `s3://`) a lease refreshed
  by a background thread (see the module doc). If a lease is lost while the
  block runs, `Manifest.record` and `ensure_held` raise `MigrationError`.

  Example::

    with lock("/runs/a/orbax") as holder:
      print("migrating as", holder["host"], holder["pid"])

  Args:
    root: The Orbax root (created if missing).

  Yields:
    What this process recorded as the holder: host, pid, since (and, on
    object stores, token, refreshed, lease_seconds, seq).

  Raises:
    DestinationLockedError: Another migration holds it (names the holder).
    MigrationError: The lock file is a symlink or not a regular file; or
      `CLU_CKPT_LOCK_LEASE_SECONDS` is not a positive number.
  """
  storage.makedirs(root)
  if not storage.is_local(root):
    try:
      lease = lease_lib.Lease.acquire(root, storage.join(root, LOCK_NAME))
    except NotImplementedError:
      logging.warning("%s: this store has no lock; make sure no other "
                      "migration writes into it at the same time", root)
      yield {}
      return
    try:
      yield dict(lease.record)
    finally:
      lease.release()
    return
  path = storage.join(root, LOCK_NAME)
  fd = _open_lock_file(path)
  try:
    _flock_or_raise(fd, path, root)
    previous = _read_holder(fd)
    if previous:
      logging.info("%s: taking over the lock last held by host %s, pid %s "
                   "(since %s), which has ended", root, previous.get("host"),
                   previous.get("pid"), previous.get("since"))
    holder = {"host": socket.gethostname(), "pid": os.getpid(),
              "since": lease_lib.now()}
    _write_holder(fd, holder)
    try:
      yield holder
    finally:
      with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
  finally:
    os.close(fd)  # releases the flock


def _open_lock_file(path: str) -> int:
  from clu_ckpt import local_fs  # pylint: disable=g-import-not-at-top
  local = local_fs.local_path(path)
  flags = (os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
           | getattr(os, "O_NOFOLLOW", 0))
  try:
    fd = os.open(local, flags, 0o644)
  except OSError as e:
    if e.errno == errno.ELOOP:
      raise MigrationError(f"{path}: the lock file is a symlink; refused "
                           "(remove it if nothing is migrating)") from e
    if e.errno == errno.EISDIR:
      raise MigrationError(f"{path}: the lock file is a directory; refused "
                           "(remove it if nothing is migrating)") from e
    raise
  st = os.fstat(fd)
  if not stat.S_ISREG(st.st_mode):
    os.close(fd)
    raise MigrationError(f"{path}: the lock file is not a regular file; "
                         "refused (remove it if nothing is migrating)")
  if st.st_nlink != 1:
    # A hard link to a file elsewhere: writing the holder would change it.
    os.close(fd)
    raise MigrationError(f"{path}: the lock file has {st.st_nlink} hard "
                         "links; refused (remove it if nothing is migrating)")
  return fd


def _flock_or_raise(fd: int, path: str, root: str) -> None:
  import fcntl  # pylint: disable=g-import-not-at-top
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
      raise
    raise lease_lib.locked_error(root, path, _read_holder(fd)) from None


def _read_holder(fd: int) -> dict:
  try:
    data = os.pread(fd, _MAX_HOLDER_BYTES, 0)
    holder = json.loads(data.decode("utf-8")) if data.strip() else {}
  except (OSError, ValueError):
    return {}
  return holder if isinstance(holder, dict) else {}


def _write_holder(fd: int, holder: Mapping[str, Any]) -> None:
  # Not fsynced: the flock is the lock (the kernel drops a dead process's),
  # the record only names the holder to whoever finds it locked, who reads
  # it from the page cache. An fsync here waited for the disk (0.9 s seen
  # while other processes wrote) before every migration.
  data = json.dumps(holder).encode("utf-8")
  os.ftruncate(fd, 0)
  os.pwrite(fd, data, 0)


# --------------------------------------------------------------------------
# The manifest.
# --------------------------------------------------------------------------


class Manifest:
  """The record of what was migrated into a root (see the module doc).

  On disk (JSON)::

    {"format": "clu_ckpt.manifest/1",
     "sources": [{"path": "/runs/a/checkpoints", "kind": "Checkpoint",
                  "checkpoints": [{"number": 7, "name": "ckpt-7",
                                   "step": 7000, "migrated_at": "...",
                                   "verified": true}, ...]}]}

  Example::

    manifest = read_manifest("/runs/a/orbax")
    done = manifest.recorded("/runs/a/checkpoints")   # {7: {...}, ...}
  """

  def __init__(self, root: str, data: Optional[dict] = None):
    self.root = root
    self.path = storage.join(root, MANIFEST_NAME)
    self.data = data or {"format": MANIFEST_FORMAT, "sources": []}

  @property
  def sources(self) -> list[str]:
    """The source paths recorded, in the order they were first migrated."""
    return [s["path"] for s in self.data["sources"]]

  def _source(self, source: str) -> Optional[dict]:
    for entry in self.data["sources"]:
      if entry["path"] == source:
        return entry
    return None

  def recorded(self, source: str) -> dict[int, dict]:
    """Checkpoint number -> its record, for the checkpoints of `source`."""
    entry = self._source(source)
    if entry is None:
      return {}
    return {c["number"]: c for c in entry["checkpoints"]}

  def check_source(self, source: str, *, allow_other_sources: bool,
                   foreign_steps: Mapping[int, str] = ()) -> None:
    """Refuses a root that holds another source's steps.

    Args:
      source: The source being migrated (normalized path).
      allow_other_sources: Accept them anyway (steps of two runs in one
        root); clashing step numbers still fail one by one.
      foreign_steps: Steps already in the root that are not this source's,
        with what they hold (from their metadata), for the message.

    Raises:
      MigrationError: The manifest names another source, or `foreign_steps`
        is not empty, and other sources are not allowed.
    """
    if allow_other_sources:
      return
    others = [s for s in self.sources if s != source]
    if others:
      raise MigrationError(
          f"{self.root}: already holds the migration of {others[0]} (see "
          f"{self.path}); choose another destination, or allow other "
          "sources (--allow-other-sources)")
    if foreign_steps:
      step, what = sorted(foreign_steps.items())[0]
      raise MigrationError(
          f"{self.root}: holds {len(foreign_steps)} step(s) that are not "
          f"from {source} (step {step}: {what}); choose another "
          "destination, or allow other sources (--allow-other-sources)")

  def record(self, source: str, number: int, name: str, step: int, *,
             kind: str = "", verified: bool = False,
             saved_at: Optional[float] = None) -> None:
    """Records a migrated checkpoint and writes the manifest atomically.

    `saved_at` (when the checkpoint was saved, from its source) tells it
    from another checkpoint saved later under the same number
    (`same_checkpoint`).

    Raises:
      MigrationError: This process lost the root's lease (nothing written).
      OSError: The manifest could not be written (names it).
    """
    lease_lib.ensure_held(self.root)
    entry = self._source(source)
    if entry is None:
      entry = {"path": source, "kind": kind, "checkpoints": []}
      self.data["sources"].append(entry)
    entry["checkpoints"] = [c for c in entry["checkpoints"]
                            if c["number"] != number]
    record = {"number": number, "name": name, "step": step,
              "migrated_at": lease_lib.now(), "verified": verified}
    if saved_at is not None:
      record["saved_at"] = saved_at
    entry["checkpoints"].append(record)
    entry["checkpoints"].sort(key=lambda c: c["number"])
    self._write()  # the lease was checked above, before anything changed

  def forget(self, source: str, number: int) -> None:
    """Drops a checkpoint's record (its step failed verification).

    Raises:
      MigrationError: This process lost the root's lease (nothing written).
      OSError: The manifest could not be written (names it).
    """
    lease_lib.ensure_held(self.root)
    entry = self._source(source)
    if entry is None:
      return
    kept = [c for c in entry["checkpoints"] if c["number"] != number]
    if len(kept) != len(entry["checkpoints"]):
      entry["checkpoints"] = kept
      self._write()  # the lease was checked above

  def save(self) -> None:
    """Replaces the manifest file atomically.

    Locally a temporary file renamed over it; in a bucket an upload that
    completes whole (or not at all).

    Raises:
      MigrationError: This process held the root's lease and lost it (the
        manifest is not written: it may be another migration's now).
      OSError: The manifest could not be written (names it).
    """
    lease_lib.ensure_held(self.root)
    self._write()

  def _write(self) -> None:
    """Writes the manifest atomically; the caller has just checked the
    lease (one read of the lock per write, not two)."""
    data = json.dumps(self.data, indent=1).encode("utf-8")
    with storage.atomic_writer(self.path) as write:
      write(data)


def read_manifest(root: str) -> Manifest:
  """The root's manifest (an empty one when the root has none yet).

  Example::

    read_manifest("/runs/a/orbax").sources   # ["/runs/a/checkpoints"]

  Args:
    root: The Orbax root.

  Returns:
    The manifest.

  Raises:
    MigrationError: The manifest is not a regular file, too large, not JSON,
      or not a clu_ckpt manifest (names the file and what is wrong).
  """
  manifest = Manifest(root)
  path = manifest.path
  if not storage.exists(path):
    return manifest
  try:
    storage.check_regular_file(path)
    size, _ = storage.stat(path)
    if size > MAX_MANIFEST_BYTES:
      raise MigrationError(f"{path}: {size} bytes, not a clu_ckpt manifest "
                           f"(at most {MAX_MANIFEST_BYTES})")
    data = json.loads(storage.read_bytes(path).decode("utf-8"))
  except (OSError, ValueError) as e:
    raise MigrationError(f"{path}: unreadable manifest: {e}") from e
  problem = _manifest_problem(data)
  if problem:
    raise MigrationError(f"{path}: not a clu_ckpt manifest ({problem}); "
                         "move it away if it is not needed")
  manifest.data = data
  return manifest


def _manifest_problem(data: Any) -> Optional[str]:
  if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
    return f"format is not {MANIFEST_FORMAT!r}"
  sources = data.get("sources")
  if not isinstance(sources, list):
    return "no list of sources"
  for source in sources:
    if not isinstance(source, dict) or not isinstance(source.get("path"), str):
      return "a source without a path"
    checkpoints = source.get("checkpoints")
    if not isinstance(checkpoints, list):
      return f"source {source['path']}: no list of checkpoints"
    for c in checkpoints:
      if not (isinstance(c, dict) and type(c.get("number")) is int and
              type(c.get("step")) is int):
        return f"source {source['path']}: a checkpoint without number/step"
  return None


@dataclasses.dataclass
class NotMigrated:
  """What a source holds that was never migrated into a root.

  Attributes:
    source: The source's path as discovered (absolute).
    names: The checkpoints ("ckpt-8"), oldest first; [] when all were
      migrated. (The checkpoint numbered after the newest one every host of
      a `MultihostCheckpoint` keeps, kept by some hosts only, is a save the
      others never finished: CLU never restores it, and it is not counted;
      later ones some hosts keep are in `entries`.)
    total: How many checkpoints the source keeps.
    entries: Other entries of the source's directories that may hold
      checkpoints the migration does not read, relative to the source:
      subdirectories ("6/": an Orbax step of `Checkpoint(layout="orbax")`;
      "finetune/": a run inside the run) and files named like Flax's
      (`<prefix><number>`: "checkpoint_10", "ema_10"); the entries of a
      `MultihostCheckpoint`'s base directory ("checkpoints/3/": steps its
      `layout="orbax"` saved there); `.flax` files newer than every
      committed checkpoint (a save in progress or a torn one); checkpoints some hosts
      keep past an unfinished save. Deleting the source deletes them.
    removed: Checkpoints the root's manifest records as migrated whose step
      the root no longer holds ("ckpt-5 (step 4000)"): removed since, by a
      `CheckpointManager`'s `max_to_keep` or by hand. The source holds their
      only copy (a re-run of the migration does not write them again: the
      record stands).
  """
  source: str
  names: list[str]
  total: int
  entries: list[str] = dataclasses.field(default_factory=list)
  removed: list[str] = dataclasses.field(default_factory=list)

  @property
  def anything(self) -> bool:
    """Whether deleting the source would lose anything listed here."""
    return bool(self.names or self.entries or self.removed)


# A CLU checkpoint's own files (and TensorFlow's and clu_ckpt's temporary
# ones): what a migration reads, or debris of an interrupted save.
_CLU_FILE = re.compile(
    r".+-\d+(\.flax(\.tmp-.*)?|\.index|\.data-\d+-of-\d+|_temp)", re.S)
# A whole `.flax` file's checkpoint number (a temporary one is no state).
_FLAX_NUMBER = re.compile(r".+-(\d+)\.flax", re.S)
# A file named like Flax's `flax.training.checkpoints` files: `<prefix><n>`.
_FLAX_LIKE = re.compile(r"[^.]*\d", re.S)


def _other_entries(src: Any) -> list[str]:
  """Entries of `src`'s directories a migration of it does not take.

  One listing per directory; a kind of entry is asked for (a round trip
  on a bucket) only when its name is neither a CLU file nor a hidden one.
  """
  taken = {os.path.basename(f) for c in src.checkpoints
           for f in (c.files or {}).values()}
  # Past every number committed on some host: a save in progress (CLU
  # writes the `.flax` before TensorFlow's commit) or a torn one.
  committed = [c.number for c in src.checkpoints] + list(
      getattr(src, "not_on_all_hosts", []))
  newest = max(committed, default=0)
  out = []
  directories = list(src.host_directories.values())
  base = layout.normpath(src.path)
  if base not in {layout.normpath(d) for d in directories}:
    # A MultihostCheckpoint's base path is no host's: a directory there
    # holds what `layout="orbax"` saved (every host's steps) or another
    # run, none of which the migration reads.
    try:
      if storage.isdir(src.path):
        directories.append(src.path)
    except Exception:  # pylint: disable=broad-except
      directories.append(src.path)  # cannot tell: listing it will say
  for directory in directories:
    relative = ("" if layout.normpath(directory) == layout.normpath(
        src.path) and len(directories) == len(src.host_directories)
                else os.path.basename(directory.rstrip("/")) + "/")
    try:
      names = sorted(n.rstrip("/") for n in storage.listdir(directory))
    except Exception as e:  # pylint: disable=broad-except
      # What it holds cannot be seen: not verified, so kept.
      why = (e.strerror if isinstance(e, OSError) else None) or str(e)
      out.append(f"{relative or './'} (not verified: cannot list it: {why})")
      continue
    for name in names:
      if (name in taken or name == layout.STATE_FILENAME or
          name.startswith(f"{layout.STATE_FILENAME}.tmp")):
        continue
      if _CLU_FILE.fullmatch(name):
        number = _FLAX_NUMBER.fullmatch(name)
        if number and int(number.group(1)) not in committed:
          out.append(f"{relative}{name} (" + (
              "not committed: a save in progress, or a torn one"
              if int(number.group(1)) > newest else
              "not a checkpoint the `checkpoint` file lists") + ")")
        continue
      if name.endswith(".flax"):  # a state saved by hand (`best.flax`)
        out.append(f"{relative}{name}")
        continue
      path = storage.join(directory, name)
      try:
        is_dir = storage.isdir(path)
        if not is_dir:  # a file only if known: `os.path.isdir` says False
          storage.stat(path)  # when it cannot tell (no permission)
      except FileNotFoundError:
        is_dir = False  # gone, or a link to nothing: nothing to lose
      except Exception:  # pylint: disable=broad-except
        is_dir = True  # cannot tell: keep it listed
      if is_dir:
        out.append(f"{relative}{name}/")
      elif not name.startswith(".") and _FLAX_LIKE.fullmatch(name):
        out.append(f"{relative}{name}")
  return out


def same_checkpoint(record: Mapping[str, Any],
                    saved_at: Optional[float]) -> bool:
  """Whether a manifest record is of the checkpoint saved at `saved_at`:
  not when both times are known and differ (a run re-launched at the same
  path, or restored to an older checkpoint and trained on, saves another
  checkpoint under a number already migrated)."""
  recorded = record.get("saved_at")
  if recorded is None or saved_at is None:
    return True
  try:
    return abs(float(recorded) - float(saved_at)) < 1e-3
  except (TypeError, ValueError):  # a manifest edited by hand: not the same
    return False


def _on_some_hosts(src: Any) -> list[str]:
  """Checkpoints some hosts of a `MultihostCheckpoint` keep, past the one
  save the others may have left unfinished (the number after the newest
  common one): training went on there (a job resumed on fewer hosts), and
  the migration, which takes what every host keeps, leaves them."""
  newest = max((c.number for c in src.checkpoints), default=0)
  prefix = (src.checkpoints[-1].name.rsplit("-", 1)[0] if src.checkpoints
            else "ckpt")
  return [f"{prefix}-{n} (kept by some hosts only, past an unfinished save: "
          "training went on there; not migrated)"
          for n in sorted(getattr(src, "not_on_all_hosts", []))
          if n > newest + 1]


def checkpoints_not_migrated(root: str, source: str
                             ) -> Optional[NotMigrated]:
  """The checkpoints `source` keeps that were never migrated into `root`.

  The question to answer before a source is deleted: a `--latest` or
  `--number` migration leaves the others behind, and training that went on
  saves more. A checkpoint counts as migrated when the root's manifest
  records it, or, for what the manifest leaves out (a root migrated before
  manifests, a kill before the record), when a step's migration metadata
  names it. A recorded checkpoint whose step the root no longer holds
  (Orbax's `max_to_keep`, a hand) is listed apart (`NotMigrated.removed`):
  the migration will not write it again, and the source holds its only
  copy.
  Entries of the source's directories that a migration does not read (Orbax steps a
  `Checkpoint(layout="orbax")` saved there, a run inside the run, Flax
  files) are listed too (`NotMigrated.entries`): deleting the source
  would lose them.

  Example::

    left = checkpoints_not_migrated("/orbax/a", "/runs/a/checkpoints")
    if left is not None and left.anything:
      print(f"{left.source} keeps {', '.join(left.names + left.entries)}")

  Args:
    root: The Orbax root.
    source: The CLU run (a `Checkpoint` directory or `MultihostCheckpoint`
      base).

  Returns:
    What the source keeps and what of it is not migrated, or None when the
    source cannot be read as a CLU run (the caller says why elsewhere).
  """
  # pylint: disable=g-import-not-at-top
  from clu_ckpt import orbax_root
  from clu_ckpt.migration import plan
  # pylint: enable=g-import-not-at-top
  try:
    src = plan.discover(source)
  except (errors.CluCkptError, OSError, ValueError):
    return None
  try:
    recorded = read_manifest(root).recorded(src.path)
  except MigrationError:
    recorded = {}
  other = [c for c in src.checkpoints if c.number in recorded and
           not same_checkpoint(recorded[c.number], c.saved_at)]
  recorded = {n: r for n, r in recorded.items()
              if n not in {c.number for c in other}}
  done = set(recorded)
  naming, steps, _ = orbax_root.read_steps(root)
  held = set(steps)
  removed = [f"{c.name} (step {recorded[c.number].get('step')})"
             for c in src.checkpoints if c.number in recorded and
             recorded[c.number].get("step") not in held]
  # Steps' metadata only for what the manifest leaves out: on a bucket each
  # read is a round trip.
  unrecorded = [c for c in src.checkpoints
                if c.number not in done and c not in other]
  for number in steps if unrecorded else ():
    try:
      meta = json.loads(storage.read_bytes(storage.join(
          naming.path(root, number), "metadata", "metadata")))
    except (OSError, ValueError):
      continue
    if isinstance(meta, dict) and meta.get("source") == src.path:
      done.add(meta.get("clu_checkpoint_number"))
  reused = {c.number for c in other}
  return NotMigrated(src.path, [c.name for c in src.checkpoints
                                if c.number not in done | reused],
                     len(src.checkpoints),
                     [f"{c.name} (not the checkpoint migrated under its "
                      "number: saved at another time)" for c in other] +
                     _on_some_hosts(src) + _other_entries(src), removed)

