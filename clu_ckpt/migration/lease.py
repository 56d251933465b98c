"""A lease on an object in a bucket: the migration's lock on object stores.

Object stores have no `flock`; what they have is a conditional create
(`storage.create_exclusive`: GCS `ifGenerationMatch=0`, S3
`If-None-Match: *`). `destination.lock` holds a `Lease` on the lock object
of a `gs://` or `s3://` root for the whole of a migration:

- The lock object, JSON `{host, pid, since, token, refreshed,
  lease_seconds, seq}`, is created only if none exists. A thread of the
  holder re-reads it every third of the lease, checks the token is still its
  own, and rewrites it (`seq` + 1). The lease is `LEASE_SECONDS` (60 s), or
  `$CLU_CKPT_LOCK_LEASE_SECONDS`.
- A lock whose object was last written more than `stale_after(lease)` ago
  (1.5 leases + 1 s: 91 s by default), by the store's modification time
  against this host's clock, is stale: its holder died, or was paused. The
  margin absorbs a host clock up to half a lease off the store's (and S3's
  whole-second times); a host whose clock is further off must not migrate
  into a shared destination (NTP keeps them within milliseconds).
- A stale lock is taken over by whoever first creates (exclusively) the
  marker `<lock>.takeover-<sha256(stale bytes)[:16]>`: only that process,
  after checking the lock still holds those bytes, rewrites it; the others
  report it held (by the marker's writer). The winner removes its marker
  once the lock holds its own bytes (and has been read back): a contender
  that read the stale lock before it was replaced may then claim the marker
  again, but it checks the lock still holds those stale bytes before
  writing, finds it changed, and stops. A marker whose own claimant died
  before rewriting the lock is stepped over once it is itself stale (to a
  marker named from the hash of both, which every contender derives
  alike); such markers are removed by a later holder once older than
  `MARKER_KEEP_LEASES` stale periods.
- The holder whose lease lapses (no successful rewrite for a whole lease, by
  its own clock: before anyone may judge it stale) or whose token was
  replaced has lost the lock: `ensure_held` (called by the manifest before
  each write, and by the migration before each step; it re-reads the lock
  object, so a new holder is seen at once, not at the next refresh) raises
  `MigrationError` ("lost the lock on ROOT to HOST pid PID"), and on exit it
  leaves the lock alone; otherwise it deletes the lock on exit.

What a lease cannot exclude: a holder paused between its last check and the
end of a write for longer than the margin.

Synopsis::

  from clu_ckpt.migration import lease

  held = lease.Lease.acquire("gs://b/orbax", "gs://b/orbax/.clu_ckpt.lock")
  try:
    lease.ensure_held("gs://b/orbax")   # before each write; raises once lost
  finally:
    held.release()
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import secrets
import socket
import threading
import time
from typing import Any, Mapping, Optional

from absl import logging

from clu_ckpt import errors
from clu_ckpt import storage

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


def now() -> str:
  """The time now, UTC, ISO 8601 to the second (what holders record)."""
  return datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds")


def locked_error(root: str, path: str,
                  holder: Mapping[str, Any]) -> DestinationLockedError:
  """The error naming `holder`, the same for every store."""
  who = (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, "
         f"since {holder.get('since', '?')}") if holder else "a process "
  return DestinationLockedError(
      f"{root}: another migration is writing here ({who.strip()}; lock "
      f"{path}); wait for it, or stop it", dict(holder))


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
    lease.confirm()


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
_HELD: dict[str, "Lease"] = {}
_HELD_LOCK = threading.Lock()


class Lease:
  """This process' lease on an object-store root (see the module doc)."""

  def __init__(self, root: str, path: str, lease: float):
    self.root = root
    self.path = path
    self.lease = lease
    self.record = {"host": socket.gethostname(), "pid": os.getpid(),
                   "since": now(), "token": secrets.token_hex(16),
                   "refreshed": now(), "lease_seconds": lease, "seq": 0}
    # When the last write of the lock that succeeded began (monotonic, wall).
    self._ok = _clock()
    self._lost: Optional[str] = None
    self._mutex = threading.Lock()
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None

  @classmethod
  def acquire(cls, root: str, path: str) -> "Lease":
    """Takes the lock of `root` (a fresh one, or a stale one taken over).

    Args:
      root: The root the lock guards (named in errors, checked by
        `ensure_held`).
      path: The lock object.

    Returns:
      The lease, refreshed by a thread until `release`.

    Raises:
      DestinationLockedError: Somebody holds it, or is taking it over.
      NotImplementedError: The store has no exclusive create (gfile).
    """
    lease = cls(root, path, lease_seconds())
    lease._take()  # pylint: disable=protected-access
    with _HELD_LOCK:
      _HELD[_root_key(root)] = lease
    lease._thread = threading.Thread(  # pylint: disable=protected-access
        target=lease._refresh_loop, name=f"clu_ckpt-lease {root}",  # pylint: disable=protected-access
        daemon=True)
    try:
      lease._thread.start()  # pylint: disable=protected-access
      lease._clean_markers()  # pylint: disable=protected-access
    except BaseException:
      lease.release()  # no refresher left running, no lock left held
      raise
    return lease

  def _encode(self) -> bytes:
    return json.dumps(self.record, sort_keys=True).encode("utf-8")

  def _locked(self, holder: Mapping[str, Any]) -> DestinationLockedError:
    return locked_error(self.root, self.path, holder)

  # -- taking it ------------------------------------------------------------

  def _take(self) -> None:
    for _ in range(_ATTEMPTS):
      started = _clock()
      try:
        storage.create_exclusive(self.path, self._encode())
        self._ok = started
        return
      except FileExistsError:
        # A client that retries a create whose first attempt landed (the
        # reply lost) is refused by its own object: that lock is ours.
        if self._is_ours(_read_or_none(self.path)):
          self._ok = started
          return
      stale = self._stale_instance()
      if stale is not None and self._take_over(stale):
        return
    # The lock kept appearing and vanishing under us: somebody is busy.
    raise self._locked(_parse_holder(_read_or_none(self.path)))

  def _is_ours(self, data: Optional[bytes]) -> bool:
    return _parse_holder(data).get("token") == self.record["token"]

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
    self._drop_claim(marker)
    return True

  def _drop_claim(self, marker: str) -> None:
    """Removes our takeover marker once the lock holds our bytes.

    The lock never holds the stale bytes again, and a claimant checks that
    it does after claiming (`_take_over`): a late contender that claims the
    marker anew finds the lock changed and stops. So the marker is of no
    more use: it goes now, not `MARKER_KEEP_LEASES` stale periods later.
    """
    try:
      storage.remove(marker)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("%s: could not remove the takeover marker %s (%s); "
                      "the next holder removes it later", self.root, marker,
                      e)

  def _clean_markers(self) -> None:
    """Removes takeover markers older than `MARKER_KEEP_LEASES` leases."""
    pattern = storage.glob_escape(self.path + TAKEOVER_INFIX) + "*"
    try:
      for marker in storage.glob(pattern):
        _, mtime = storage.stat(marker)
        if time.time() - mtime > MARKER_KEEP_LEASES * stale_after(self.lease):
          storage.remove(marker)
    except Exception as e:  # pylint: disable=broad-except
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

  def confirm(self) -> None:
    """Reads the lock object now; raises MigrationError if not ours.

    The refresher notices a new holder within a third of a lease; this closes
    that gap before a write, for the price of one small read. A read that
    fails is left to the refresher and the lease's own clock.
    """
    try:
      holder = _parse_holder(_read_or_none(self.path))
    except OSError as e:
      logging.warning("%s: could not read the lock %s (%s)", self.root,
                      self.path, e)
      return
    if holder.get("token") != self.record["token"]:
      self._lose_to(holder)
    self.check()

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
    self.record["refreshed"] = now()
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
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("%s: could not remove the lock %s (%s); it lapses "
                      "after %.0f s", self.root, self.path, e,
                      stale_after(self.lease))
