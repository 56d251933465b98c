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
  - Object stores (`gs://`, `s3://`): a lease. The lock object, JSON
    `{host, pid, since, token, refreshed, lease_seconds, seq}`, is created
    only if none exists (`storage.create_exclusive`: GCS
    `ifGenerationMatch=0`, S3 `If-None-Match: *`). A thread of the holder
    re-reads it every third of the lease, checks the token is still its
    own, and rewrites it (`seq` + 1). The lease is `LEASE_SECONDS` (60 s),
    or `$CLU_CKPT_LOCK_LEASE_SECONDS`. A lock whose object was last written
    more than `stale_after(lease)` ago (1.5 leases + 1 s: 91 s by default),
    by the store's modification time against this host's clock, is stale:
    its holder died, or was paused. The margin absorbs a host clock up to
    half a lease off the store's (and S3's whole-second times); a host
    whose clock is further off must not migrate into a shared destination
    (NTP keeps them within milliseconds). A stale lock is taken
    over by whoever first creates (exclusively) the marker
    `.clu_ckpt.lock.takeover-<sha256(stale bytes)[:16]>`: only that
    process, after checking the lock still holds those bytes, rewrites it;
    the others report it held (by the marker's writer). The holder whose
    lease lapses (no successful rewrite for a whole lease, by its own
    clock: before anyone may judge it stale) or whose token was replaced
    has lost the lock: `Manifest.record`, `forget`, `save` and
    `ensure_held` then raise `MigrationError` ("lost the lock on ROOT to
    HOST pid PID") instead of writing, and on exit it leaves the lock
    alone; otherwise it deletes the lock on exit. Markers are kept for
    `MARKER_KEEP_LEASES` stale periods, then removed by the next holder:
    removed at once, a contender that read the stale lock just before it
    was replaced could create the marker again and overwrite the new
    holder. A marker whose own claimant died before rewriting the lock is
    stepped over once it is itself stale (to a marker named from the hash
    of both, which every contender derives alike). What a lease cannot
    exclude: a holder paused between its last check and the end of a
    write for longer than the margin; the check is made right before each
    manifest write, and `ensure_held` is there to call before each step.
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
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import json
import os
import secrets
import socket
import stat
import threading
import time
from typing import Any, Iterator, Mapping, Optional

from absl import logging

from clu_ckpt import errors
from clu_ckpt import storage

LOCK_NAME = ".clu_ckpt.lock"
MANIFEST_NAME = "clu_ckpt_manifest.json"
MANIFEST_FORMAT = "clu_ckpt.manifest/1"
# A manifest names a few hundred bytes per checkpoint; anything larger than
# this is not one of ours.
MAX_MANIFEST_BYTES = 64 * 2**20
# What a holder writes into the lock file (JSON) is at most this long.
_MAX_HOLDER_BYTES = 4096

# The lease on object stores (see the module doc). Its length in seconds;
# `$CLU_CKPT_LOCK_LEASE_SECONDS` overrides it (tests use 2-3 s). The holder
# rewrites the lock every third of it.
LEASE_SECONDS = 60.0
LEASE_ENV = "CLU_CKPT_LOCK_LEASE_SECONDS"
# A lock not rewritten for lease * (1 + SKEW_FRACTION) + SKEW_SECONDS (by the
# store's modification time against this host's clock) is stale: the margin
# absorbs a clock up to half a lease off the store's, and S3's whole-second
# modification times.
SKEW_FRACTION = 0.5
SKEW_SECONDS = 1.0
# `<lock>.takeover-<hash>`: the claim to take over one stale instance.
TAKEOVER_INFIX = ".takeover-"
# Takeover markers are removed once older than this many stale periods.
MARKER_KEEP_LEASES = 10
# How many times a contender starts over when the lock vanishes under it.
_ATTEMPTS = 4

MigrationError = errors.MigrationError
DestinationLockedError = errors.DestinationLockedError


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds")


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
      lease = _Lease.acquire(root)
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
              "since": _now()}
    _write_holder(fd, holder)
    try:
      yield holder
    finally:
      with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
  finally:
    os.close(fd)  # releases the flock


def ensure_held(root: str) -> None:
  """Raises if this process held the lease on `root` and has lost it.

  A no-op for local roots (a `flock` is never lost) and for roots this
  process does not lock. Call it before anything that must not be written
  over a new holder's work (each step's commit).

  Example::

    with lock("gs://b/orbax"):
      for step in steps:
        ensure_held("gs://b/orbax")
        ...  # write the step

  Args:
    root: The Orbax root given to `lock`.

  Raises:
    MigrationError: "lost the lock on ROOT to HOST pid PID" (or why the
      lease lapsed when nobody has taken it yet).
  """
  with _HELD_LOCK:
    lease = _HELD.get(_root_key(root))
  if lease is not None:
    lease.check()


def _locked_error(root: str, path: str,
                  holder: Mapping[str, Any]) -> DestinationLockedError:
  """The error naming `holder`, the same for every store."""
  who = (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, "
         f"since {holder.get('since', '?')}") if holder else "a process "
  return DestinationLockedError(
      f"{root}: another migration is writing here ({who.strip()}; lock "
      f"{path}); wait for it, or stop it", dict(holder))


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
    raise _locked_error(root, path, _read_holder(fd)) from None


def _read_holder(fd: int) -> dict:
  try:
    data = os.pread(fd, _MAX_HOLDER_BYTES, 0)
    holder = json.loads(data.decode("utf-8")) if data.strip() else {}
  except (OSError, ValueError):
    return {}
  return holder if isinstance(holder, dict) else {}


def _write_holder(fd: int, holder: Mapping[str, Any]) -> None:
  data = json.dumps(holder).encode("utf-8")
  os.ftruncate(fd, 0)
  os.pwrite(fd, data, 0)
  with contextlib.suppress(OSError):
    os.fsync(fd)


# --------------------------------------------------------------------------
# The lease on object stores.
# --------------------------------------------------------------------------


def lease_seconds() -> float:
  """The lease length: `$CLU_CKPT_LOCK_LEASE_SECONDS`, else `LEASE_SECONDS`.

  Example::

    os.environ["CLU_CKPT_LOCK_LEASE_SECONDS"] = "3"   # tests
    lease_seconds()   # 3.0

  Raises:
    MigrationError: The variable is set but not a positive number.
  """
  text = os.environ.get(LEASE_ENV, "").strip()
  if not text:
    return LEASE_SECONDS
  try:
    value = float(text)
  except ValueError:
    value = float("nan")
  if not 0 < value < float("inf"):
    raise MigrationError(f"{LEASE_ENV}={text!r}: expected a positive number "
                         "of seconds")
  return value


def stale_after(lease: float) -> float:
  """Seconds since its last write after which a lock of `lease` is stale.

  The lease, plus the clock-skew margin: half the lease, plus a second for
  stores that keep modification times to the second (S3).

  Example::

    stale_after(60)   # 91.0
  """
  return lease * (1 + SKEW_FRACTION) + SKEW_SECONDS


def _root_key(root: str) -> str:
  return root.rstrip("/")


def _parse_holder(data: Optional[bytes]) -> dict:
  try:
    holder = json.loads(data.decode("utf-8")) if data else {}
  except (UnicodeDecodeError, ValueError):
    return {}
  return holder if isinstance(holder, dict) else {}


def _read_or_none(path: str) -> Optional[bytes]:
  try:
    return storage.read_bytes(path)
  except FileNotFoundError:
    return None


def _clock() -> tuple[float, float]:
  return time.monotonic(), time.time()


# Leases this process holds, by root: what `ensure_held` and the manifest
# check before writing.
_HELD: dict[str, "_Lease"] = {}
_HELD_LOCK = threading.Lock()


class _Lease:
  """This process' lease on an object-store root (see the module doc)."""

  def __init__(self, root: str, lease: float):
    self.root = root
    self.path = storage.join(root, LOCK_NAME)
    self.lease = lease
    self.record = {"host": socket.gethostname(), "pid": os.getpid(),
                   "since": _now(), "token": secrets.token_hex(16),
                   "refreshed": _now(), "lease_seconds": lease, "seq": 0}
    # When the last write of the lock that succeeded began (monotonic, wall).
    self._ok = _clock()
    self._lost: Optional[str] = None
    self._mutex = threading.Lock()
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None

  @classmethod
  def acquire(cls, root: str) -> "_Lease":
    """Takes the lock of `root` (a fresh one, or a stale one taken over).

    Raises:
      DestinationLockedError: Somebody holds it, or is taking it over.
      NotImplementedError: The store has no exclusive create (gfile).
    """
    lease = cls(root, lease_seconds())
    lease._take()  # pylint: disable=protected-access
    with _HELD_LOCK:
      _HELD[_root_key(root)] = lease
    lease._thread = threading.Thread(  # pylint: disable=protected-access
        target=lease._refresh_loop, name=f"clu_ckpt-lease {root}",  # pylint: disable=protected-access
        daemon=True)
    lease._thread.start()  # pylint: disable=protected-access
    lease._clean_markers()  # pylint: disable=protected-access
    return lease

  def _encode(self) -> bytes:
    return json.dumps(self.record, sort_keys=True).encode("utf-8")

  def _locked(self, holder: Mapping[str, Any]) -> DestinationLockedError:
    return _locked_error(self.root, self.path, holder)

  # -- taking it ------------------------------------------------------------

  def _take(self) -> None:
    for _ in range(_ATTEMPTS):
      started = _clock()
      try:
        storage.create_exclusive(self.path, self._encode())
        self._ok = started
        return
      except FileExistsError:
        pass
      stale = self._stale_instance()
      if stale is not None and self._take_over(stale):
        return
    # The lock kept appearing and vanishing under us: somebody is busy.
    raise self._locked(_parse_holder(_read_or_none(self.path)))

  def _stale_instance(self) -> Optional[bytes]:
    """The lock's bytes if it is stale; None if it vanished; else raises."""
    try:
      first = storage.read_bytes(self.path)
      _, mtime = storage.stat(self.path)
      again = storage.read_bytes(self.path)
    except FileNotFoundError:
      return None
    holder = _parse_holder(again)
    if first != again:  # refreshed (or taken) while we looked: alive
      raise self._locked(holder)
    # Judged by the holder's lease when it is longer than ours.
    theirs = holder.get("lease_seconds")
    lease = self.lease
    if isinstance(theirs, (int, float)) and 0 < theirs < float("inf"):
      lease = max(lease, float(theirs))
    age = time.time() - mtime
    if age <= stale_after(lease):
      raise self._locked(holder)
    logging.info("%s: taking over the lock last held by host %s, pid %s "
                 "(since %s), not refreshed for %.0f s", self.root,
                 holder.get("host"), holder.get("pid"), holder.get("since"),
                 age)
    return first

  def _take_over(self, stale: bytes) -> bool:
    """Replaces the stale lock `stale` if this process wins its takeover.

    Returns:
      True if the lock is now ours; False if it vanished meanwhile (try
      again from the start).

    Raises:
      DestinationLockedError: Another process won the takeover, or the lock
        changed meanwhile.
    """
    claim = json.dumps({k: self.record[k] for k in
                        ("host", "pid", "since", "token")}).encode("utf-8")
    key = hashlib.sha256(stale).hexdigest()[:16]
    started = _clock()
    for _ in range(_ATTEMPTS):
      marker = self.path + TAKEOVER_INFIX + key
      try:
        storage.create_exclusive(marker, claim)
        break
      except FileExistsError:
        pass
      try:
        seen = storage.read_bytes(marker)
        _, mtime = storage.stat(marker)
      except FileNotFoundError:
        return False  # cleaned up: that stale instance is long gone
      if time.time() - mtime <= stale_after(self.lease):
        raise self._locked(_parse_holder(seen))  # being taken over
      # Its claimant died between its claim and its write: step over it,
      # to a marker every contender derives the same way.
      key = hashlib.sha256(key.encode("ascii") + seen).hexdigest()[:16]
    else:
      raise self._locked(_parse_holder(stale))
    now = _read_or_none(self.path)
    if now is None:
      return False
    if now != stale:
      raise self._locked(_parse_holder(now))
    if time.monotonic() - started[0] > self.lease:
      raise MigrationError(f"{self.root}: paused for longer than the lease "
                           f"({self.lease:g} s) while taking over the stale "
                           f"lock {self.path}; try again")
    with storage.atomic_writer(self.path) as write:
      write(self._encode())
    self._ok = started
    holder = _parse_holder(_read_or_none(self.path))
    if holder.get("token") != self.record["token"]:
      raise self._locked(holder)
    return True

  def _clean_markers(self) -> None:
    """Removes takeover markers older than `MARKER_KEEP_LEASES` leases."""
    pattern = storage.glob_escape(self.path + TAKEOVER_INFIX) + "*"
    try:
      for marker in storage.glob(pattern):
        _, mtime = storage.stat(marker)
        if time.time() - mtime > MARKER_KEEP_LEASES * stale_after(self.lease):
          storage.remove(marker)
    except OSError as e:
      logging.warning("%s: could not clean old takeover markers: %s",
                      self.root, e)

  # -- keeping it -----------------------------------------------------------

  def _age(self) -> float:
    """Seconds since the last successful write of the lock began."""
    mono, wall = _clock()
    return max(mono - self._ok[0], wall - self._ok[1])

  def _lose(self, why: str) -> None:
    with self._mutex:
      if self._lost is None:
        self._lost = f"lost the lock on {self.root}{why}"
        logging.error("%s", self._lost)

  def _lose_to(self, holder: Mapping[str, Any]) -> None:
    if holder:
      self._lose(f" to {holder.get('host', '?')} pid {holder.get('pid', '?')}"
                 f" (since {holder.get('since', '?')}); this migration "
                 "writes nothing more there")
    else:
      self._lose(f": its lock object {self.path} was replaced or removed; "
                 "this migration writes nothing more there")

  def _lose_by_age(self, age: float) -> None:
    holder = {}
    with contextlib.suppress(OSError):
      holder = _parse_holder(_read_or_none(self.path))
    if holder and holder.get("token") != self.record["token"]:
      self._lose_to(holder)
    else:
      self._lose(f": not refreshed for {age:.0f} s, longer than its "
                 f"{self.lease:g} s lease (paused, or the store unreachable), "
                 "so another migration may take it over; this migration "
                 "writes nothing more there")

  def check(self) -> None:
    """Raises MigrationError if the lease is lost (or has lapsed)."""
    age = self._age()
    if self._lost is None and age > self.lease:
      self._lose_by_age(age)
    if self._lost is not None:
      raise MigrationError(self._lost)

  def _refresh_loop(self) -> None:
    interval = self.lease / 3
    while not self._stop.wait(interval):
      if self._lost is not None:
        return
      try:
        self._refresh()
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("%s: could not refresh the lock %s (%s); retrying",
                        self.root, self.path, e)
        interval = self.lease / 6
      else:
        interval = self.lease / 3

  def _refresh(self) -> None:
    started = _clock()
    data = _read_or_none(self.path)
    holder = _parse_holder(data)
    if holder.get("token") != self.record["token"]:
      self._lose_to(holder)
      return
    age = self._age()
    if age > self.lease:
      self._lose_by_age(age)
      return
    if self._stop.is_set():
      return
    self.record["seq"] += 1
    self.record["refreshed"] = _now()
    with storage.atomic_writer(self.path) as write:
      write(self._encode())
    self._ok = started

  def release(self) -> None:
    """Stops refreshing; deletes the lock if it is still ours."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    with _HELD_LOCK:
      if _HELD.get(_root_key(self.root)) is self:
        del _HELD[_root_key(self.root)]
    if self._lost is not None or self._age() > self.lease:
      return  # somebody else may hold it now: leave it to them (or to lapse)
    try:
      holder = _parse_holder(_read_or_none(self.path))
      if holder.get("token") == self.record["token"]:
        storage.remove(self.path)
    except OSError as e:
      logging.warning("%s: could not remove the lock %s (%s); it lapses "
                      "after %.0f s", self.root, self.path, e,
                      stale_after(self.lease))


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
             kind: str = "", verified: bool = False) -> None:
    """Records a migrated checkpoint and writes the manifest atomically.

    Raises:
      MigrationError: This process lost the root's lease (nothing written).
      OSError: The manifest could not be written (names it).
    """
    ensure_held(self.root)
    entry = self._source(source)
    if entry is None:
      entry = {"path": source, "kind": kind, "checkpoints": []}
      self.data["sources"].append(entry)
    entry["checkpoints"] = [c for c in entry["checkpoints"]
                            if c["number"] != number]
    entry["checkpoints"].append({"number": number, "name": name,
                                 "step": step, "migrated_at": _now(),
                                 "verified": verified})
    entry["checkpoints"].sort(key=lambda c: c["number"])
    self.save()

  def forget(self, source: str, number: int) -> None:
    """Drops a checkpoint's record (its step failed verification).

    Raises:
      MigrationError: This process lost the root's lease (nothing written).
      OSError: The manifest could not be written (names it).
    """
    ensure_held(self.root)
    entry = self._source(source)
    if entry is None:
      return
    kept = [c for c in entry["checkpoints"] if c["number"] != number]
    if len(kept) != len(entry["checkpoints"]):
      entry["checkpoints"] = kept
      self.save()

  def save(self) -> None:
    """Replaces the manifest file atomically.

    Locally a temporary file renamed over it; in a bucket an upload that
    completes whole (or not at all).

    Raises:
      MigrationError: This process held the root's lease and lost it (the
        manifest is not written: it may be another migration's now).
      OSError: The manifest could not be written (names it).
    """
    ensure_held(self.root)
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
