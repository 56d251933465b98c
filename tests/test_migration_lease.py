"""Tests for clu_ckpt.migration.lease: a holder whose token was replaced.

The lock object is rewritten by the holder's refresher only while it still
holds the holder's token: a lock taken over (a new token) is never written
again by the old holder, whose `ensure_held` then names the new one. The
races between real processes are in test_migration_destination_buckets.py;
here the refresher is driven directly (and by its own thread) on a local
root and on the GCS emulator.
"""

import contextlib
import datetime
import hashlib
import json
import logging
import os
import re
import socket
import threading
import time

import pytest

from clu_ckpt import errors
from clu_ckpt import storage
from clu_ckpt.migration import lease as lease_lib


@pytest.fixture(params=["local", "gcs"])
def lock_root(request, tmp_path):
  if request.param == "local":
    return str(tmp_path / "root")
  request.getfixturevalue("gcs")
  return f"gs://{request.getfixturevalue('gcs').bucket()}/root"


def _thief(token="stolen"):
  return json.dumps({"host": "thief-host", "pid": 4242, "since": "now",
                     "token": token, "refreshed": "now", "lease_seconds": 60,
                     "seq": 0}).encode("utf-8")


def _steal(path):
  with storage.atomic_writer(path) as write:
    write(_thief())


def test_the_refresher_rewrites_its_own_lock(lock_root, monkeypatch):
  monkeypatch.setenv(lease_lib.LEASE_ENV, "60")
  storage.makedirs(lock_root)
  path = storage.join(lock_root, ".clu_ckpt.lock")
  held = lease_lib.Lease.acquire(lock_root, path)
  try:
    before = json.loads(storage.read_bytes(path))
    held._refresh()  # pylint: disable=protected-access
    after = json.loads(storage.read_bytes(path))
    assert after["token"] == before["token"]
    assert after["seq"] == before["seq"] + 1
    lease_lib.ensure_held(lock_root)
  finally:
    held.release()
  assert not storage.exists(path)


def test_the_refresher_never_rewrites_a_stolen_lock(lock_root, monkeypatch):
  monkeypatch.setenv(lease_lib.LEASE_ENV, "60")
  storage.makedirs(lock_root)
  path = storage.join(lock_root, ".clu_ckpt.lock")
  held = lease_lib.Lease.acquire(lock_root, path)
  try:
    _steal(path)
    held._refresh()  # pylint: disable=protected-access
    assert storage.read_bytes(path) == _thief()
    with pytest.raises(errors.MigrationError, match="thief-host pid 4242"):
      held.check()
    held._refresh()  # pylint: disable=protected-access
    assert storage.read_bytes(path) == _thief()
  finally:
    held.release()
  assert storage.read_bytes(path) == _thief()  # left to the new holder


def test_the_refresh_thread_leaves_a_stolen_lock_alone(tmp_path, monkeypatch):
  monkeypatch.setenv(lease_lib.LEASE_ENV, "1.5")  # refreshed every 0.5 s
  root = str(tmp_path)
  path = storage.join(root, ".clu_ckpt.lock")
  held = lease_lib.Lease.acquire(root, path)
  try:
    deadline = time.monotonic() + 10
    while json.loads(storage.read_bytes(path))["seq"] < 1:  # refreshing
      assert time.monotonic() < deadline, "never refreshed"
      time.sleep(0.05)
    _steal(path)
    time.sleep(1.2)  # two refresh periods
    assert storage.read_bytes(path) == _thief()
    with pytest.raises(errors.MigrationError, match="lost the lock on .* to "
                       "thief-host pid 4242"):
      lease_lib.ensure_held(root)
  finally:
    held.release()
  assert storage.read_bytes(path) == _thief()


def _held(tmp_path, monkeypatch, seconds="60"):
  monkeypatch.setenv(lease_lib.LEASE_ENV, seconds)
  root = str(tmp_path)
  path = storage.join(root, ".clu_ckpt.lock")
  return root, path, lease_lib.Lease.acquire(root, path)


@pytest.mark.parametrize("clock", ["monotonic", "wall"])
def test_a_lapsed_lease_is_lost_and_its_lock_left_alone(tmp_path, monkeypatch,
                                                        clock):
  """Not rewritten for longer than the lease by either clock (a paused
  holder, a store out of reach): lost; on release the lock is left, since
  another process may have taken it over by now."""
  root, path, held = _held(tmp_path, monkeypatch)
  mine = storage.read_bytes(path)
  try:
    mono, wall = held._ok  # pylint: disable=protected-access
    held._ok = ((mono - 100, wall) if clock == "monotonic" else  # pylint: disable=protected-access
                (mono, wall - 100))
    with pytest.raises(errors.MigrationError, match="not refreshed for 1"):
      held.check()
    with pytest.raises(errors.MigrationError, match="not refreshed"):
      lease_lib.ensure_held(root)
  finally:
    held.release()
  assert storage.read_bytes(path) == mine


def test_release_stops_the_refresher_and_forgets_the_root(tmp_path,
                                                          monkeypatch):
  root, path, held = _held(tmp_path, monkeypatch, "0.6")
  held.release()
  assert not held._thread.is_alive()  # pylint: disable=protected-access
  assert not storage.exists(path)
  _steal(path)  # somebody else's now: this process holds nothing to lose
  lease_lib.ensure_held(root)
  time.sleep(0.4)  # a refresher left running would rewrite it
  assert storage.read_bytes(path) == _thief()


def test_a_lease_lapsed_unnoticed_leaves_its_lock_on_release(tmp_path,
                                                             monkeypatch):
  _, path, held = _held(tmp_path, monkeypatch)
  mine = storage.read_bytes(path)
  mono, wall = held._ok  # pylint: disable=protected-access
  held._ok = (mono - 100, wall - 100)  # pylint: disable=protected-access
  held.release()  # nobody called check(): the age alone decides
  assert storage.read_bytes(path) == mine


def _lost_records(caplog):
  return [r.getMessage() for r in caplog.records
          if r.levelno == logging.ERROR and "lost the lock" in r.getMessage()]


@pytest.mark.parametrize("replacement", ["thief", "bare", "garbage",
                                         "not_a_record", "removed"])
def test_a_lost_lease_names_the_new_holder_as_far_as_known(
    tmp_path, monkeypatch, caplog, replacement):
  """The error (and the one log line) says who holds the lock now: host,
  pid and since of a full record, `?` for what a record lacks, and that the
  lock object was replaced or removed when it names nobody."""
  root, path, held = _held(tmp_path, monkeypatch)
  rest = "; this migration writes nothing more there"
  expected = {
      "thief": f"lost the lock on {root} to thief-host pid 4242 (since now)",
      "bare": f"lost the lock on {root} to ? pid ? (since ?)",
      "garbage": f"lost the lock on {root}: its lock object {path} was "
                 "replaced or removed",
      "not_a_record": f"lost the lock on {root}: its lock object {path} "
                      "was replaced or removed",
      "removed": f"lost the lock on {root}: its lock object {path} was "
                 "replaced or removed",
  }[replacement] + rest
  try:
    if replacement == "removed":
      storage.remove(path)
    else:
      with storage.atomic_writer(path) as write:
        write({"thief": _thief(),
               "bare": json.dumps({"token": "other"}).encode("utf-8"),
               "garbage": b"\xff not a lock",
               "not_a_record": b'["not", "a", "record"]'}[replacement])
    with caplog.at_level(logging.ERROR):
      for _ in range(2):  # lost once, logged once, raised every time
        with pytest.raises(errors.MigrationError) as raised:
          lease_lib.ensure_held(root)
        assert str(raised.value) == expected
    assert _lost_records(caplog) == [expected]
  finally:
    held.release()
  assert storage.exists(path) is (replacement != "removed")


def test_a_lapsed_lease_whose_lock_was_taken_names_the_taker(tmp_path,
                                                             monkeypatch):
  root, path, held = _held(tmp_path, monkeypatch)
  try:
    _steal(path)
    mono, wall = held._ok  # pylint: disable=protected-access
    held._ok = (mono - 100, wall - 100)  # pylint: disable=protected-access
    with pytest.raises(errors.MigrationError) as raised:
      held.check()
    assert str(raised.value) == (
        f"lost the lock on {root} to thief-host pid 4242 (since now); this "
        "migration writes nothing more there")
  finally:
    held.release()
  assert storage.read_bytes(path) == _thief()


def test_a_lapsed_lease_whose_lock_cannot_be_read_says_why(tmp_path,
                                                           monkeypatch):
  """By its own clock the holder knows it lapsed, even when the lock cannot
  be read (here it is a directory now: an OSError)."""
  root, path, held = _held(tmp_path, monkeypatch)
  try:
    storage.remove(path)
    os.mkdir(path)
    # Last written 100 s ago by both clocks (to the millisecond).
    held._ok = (time.monotonic() - 100, time.time() - 100)  # pylint: disable=protected-access
    with pytest.raises(errors.MigrationError) as raised:
      held.check()
    assert str(raised.value) == (
        f"lost the lock on {root}: not refreshed for 100 s, longer than its "
        "60 s lease (paused, or the store unreachable), so another migration "
        "may take it over; this migration writes nothing more there")
  finally:
    held.release()
  assert os.path.isdir(path)


def test_a_lock_that_cannot_be_read_is_left_to_the_lease_clock(
    tmp_path, monkeypatch, caplog):
  """`ensure_held` reads the lock before a write; a read that fails (here
  the lock is a directory now) is logged naming the lock, and the lease's
  own clock decides: still within it, the holder goes on."""
  root, path, held = _held(tmp_path, monkeypatch)
  try:
    storage.remove(path)
    os.mkdir(path)
    with caplog.at_level(logging.WARNING):
      lease_lib.ensure_held(root)
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"{root}: could not read the lock {path} (")
    assert path in warnings[0][len(f"{root}: could not read the lock {path} ("):]
  finally:
    held.release()


def test_each_refresh_records_when(tmp_path, monkeypatch):
  _, path, held = _held(tmp_path, monkeypatch)
  try:
    before = json.loads(storage.read_bytes(path))
    held.record["refreshed"] = "2000-01-01T00:00:00+00:00"
    held._refresh()  # pylint: disable=protected-access
    after = json.loads(storage.read_bytes(path))
  finally:
    held.release()
  assert set(after) == set(before)
  assert after["refreshed"] >= before["refreshed"]  # ISO 8601, UTC
  assert {k: v for k, v in after.items() if k not in ("refreshed", "seq")} == (
      {k: v for k, v in before.items() if k not in ("refreshed", "seq")})


def test_a_refresh_after_the_lease_lapsed_loses_it(tmp_path, monkeypatch):
  root, path, held = _held(tmp_path, monkeypatch)
  mine = storage.read_bytes(path)
  try:
    held._ok = (time.monotonic() - 100, time.time() - 100)  # pylint: disable=protected-access
    held._refresh()  # pylint: disable=protected-access
    assert storage.read_bytes(path) == mine  # not rewritten
    with pytest.raises(errors.MigrationError) as raised:
      held.check()
    assert str(raised.value).startswith(
        f"lost the lock on {root}: not refreshed for 100 s, longer than its "
        "60 s lease")
  finally:
    held.release()
  assert storage.read_bytes(path) == mine


# Taking over a stale lock, on a local root (the same code as on a bucket,
# where test_migration_destination_buckets.py races real processes): the
# lock's modification time is set back instead of waiting for it to age.


def _stale_thief(tmp_path, age=200.0):
  root = str(tmp_path)
  path = storage.join(root, ".clu_ckpt.lock")
  _steal(path)
  old = time.time() - age
  os.utime(path, (old, old))
  marker = path + lease_lib.TAKEOVER_INFIX + hashlib.sha256(
      _thief()).hexdigest()[:16]
  return root, path, marker


def _claim(host, pid):
  return json.dumps({"host": host, "pid": pid, "since": "then",
                     "token": "claim"}).encode("utf-8")


def test_a_stale_lock_is_taken_over_under_a_marker_of_its_bytes(
    tmp_path, monkeypatch, caplog):
  monkeypatch.setenv(lease_lib.LEASE_ENV, "60")
  root, path, marker = _stale_thief(tmp_path)
  claims = []  # what the marker held when it was claimed
  _on_claim(monkeypatch, path,
            lambda: claims.append(json.loads(storage.read_bytes(marker))))
  with caplog.at_level(logging.INFO):
    held = lease_lib.Lease.acquire(root, path)
  taking = [r.getMessage() for r in caplog.records
            if "taking over" in r.getMessage()]
  assert len(taking) == 1 and re.fullmatch(
      f"{re.escape(root)}: taking over the lock last held by host "
      r"thief-host, pid 4242 \(since now\), not refreshed for 2\d\d s",
      taking[0]), taking
  try:
    record = json.loads(storage.read_bytes(path))
    assert record == held.record
    assert not storage.exists(marker)  # removed once the lock was ours
    assert claims == [{k: held.record[k] for k in
                       ("host", "pid", "since", "token")}]
    lease_lib.ensure_held(root)
  finally:
    held.release()
  assert not storage.exists(path)
  assert not storage.exists(marker)  # removed once the lock was ours


def test_a_lock_fresh_by_its_modification_time_is_not_taken_over(
    tmp_path, monkeypatch):
  monkeypatch.setenv(lease_lib.LEASE_ENV, "60")
  root, path, marker = _stale_thief(tmp_path, age=60.0)  # < 1.5 leases + 1
  with pytest.raises(errors.DestinationLockedError) as raised:
    lease_lib.Lease.acquire(root, path)
  assert str(raised.value) == (
      f"{root}: another migration is writing here (host thief-host, pid 4242,"
      f" since now; lock {path}); wait for it, or stop it")
  assert storage.read_bytes(path) == _thief()
  assert not storage.exists(marker)


def test_a_stale_lock_claimed_by_another_is_left_to_it(tmp_path,
                                                      monkeypatch):
  monkeypatch.setenv(lease_lib.LEASE_ENV, "60")
  root, path, marker = _stale_thief(tmp_path)
  storage.create_exclusive(marker, _claim("claimer", 7))
  with pytest.raises(errors.DestinationLockedError) as raised:
    lease_lib.Lease.acquire(root, path)
  assert str(raised.value) == (
      f"{root}: another migration is writing here (host claimer, pid 7, "
      f"since then; lock {path}); wait for it, or stop it")
  assert storage.read_bytes(path) == _thief()
  assert storage.read_bytes(marker) == _claim("claimer", 7)


def test_a_dead_claimant_is_stepped_over_to_a_marker_all_derive(
    tmp_path, monkeypatch):
  monkeypatch.setenv(lease_lib.LEASE_ENV, "60")
  root, path, marker = _stale_thief(tmp_path)
  storage.create_exclusive(marker, _claim("dead", 9))
  old = time.time() - 200
  os.utime(marker, (old, old))  # its claimant never wrote the lock
  key = marker.rsplit("-", 1)[1]
  second = path + lease_lib.TAKEOVER_INFIX + hashlib.sha256(
      key.encode("ascii") + _claim("dead", 9)).hexdigest()[:16]
  claimed = []  # (marker, its token) as each was claimed
  _on_claim(monkeypatch, path, lambda: claimed.append(
      (second, json.loads(storage.read_bytes(second))["token"])))
  held = lease_lib.Lease.acquire(root, path)
  try:
    assert json.loads(storage.read_bytes(path))["token"] == (
        held.record["token"])
    assert claimed == [(second, held.record["token"])]
    assert not storage.exists(second)  # ours, removed once the lock was
    assert storage.read_bytes(marker) == _claim("dead", 9)
  finally:
    held.release()


def _on_claim(monkeypatch, path, then):
  """Calls `then()` right after this process claims a takeover marker."""
  create_exclusive = storage.create_exclusive

  def create(p, data):
    create_exclusive(p, data)
    if lease_lib.TAKEOVER_INFIX in p:
      then()

  monkeypatch.setattr(storage, "create_exclusive", create)


def test_a_lock_changed_while_claimed_is_left_to_its_new_holder(
    tmp_path, monkeypatch):
  monkeypatch.setenv(lease_lib.LEASE_ENV, "60")
  root, path, marker = _stale_thief(tmp_path)
  other = json.dumps({"host": "other-host", "pid": 77, "since": "later",
                      "token": "other"}).encode("utf-8")

  def rewritten():
    with storage.atomic_writer(path) as write:
      write(other)

  _on_claim(monkeypatch, path, rewritten)
  with pytest.raises(errors.DestinationLockedError) as raised:
    lease_lib.Lease.acquire(root, path)
  assert str(raised.value) == (
      f"{root}: another migration is writing here (host other-host, pid 77, "
      f"since later; lock {path}); wait for it, or stop it")
  assert storage.read_bytes(path) == other


def test_a_lock_gone_while_claimed_is_taken_afresh(tmp_path, monkeypatch):
  monkeypatch.setenv(lease_lib.LEASE_ENV, "60")
  root, path, marker = _stale_thief(tmp_path)
  _on_claim(monkeypatch, path, lambda: storage.remove(path))
  held = lease_lib.Lease.acquire(root, path)
  try:
    assert json.loads(storage.read_bytes(path)) == held.record
    assert storage.exists(marker)
  finally:
    held.release()


def test_a_lock_overwritten_right_after_our_takeover_is_theirs(
    tmp_path, monkeypatch):
  monkeypatch.setenv(lease_lib.LEASE_ENV, "60")
  root, path, marker = _stale_thief(tmp_path)
  other = json.dumps({"host": "other-host", "pid": 77, "since": "later",
                      "token": "other"}).encode("utf-8")
  atomic_writer, done = storage.atomic_writer, []

  @contextlib.contextmanager
  def overwritten(p):
    with atomic_writer(p) as write:
      yield write
    if p == path and not done:  # another writer's upload lands after ours
      done.append(p)
      with atomic_writer(p) as write:
        write(other)

  monkeypatch.setattr(storage, "atomic_writer", overwritten)
  with pytest.raises(errors.DestinationLockedError) as raised:
    lease_lib.Lease.acquire(root, path)
  assert str(raised.value) == (
      f"{root}: another migration is writing here (host other-host, pid 77, "
      f"since later; lock {path}); wait for it, or stop it")
  assert done and storage.read_bytes(path) == other


def test_a_marker_gone_while_looked_at_starts_over(tmp_path, monkeypatch):
  """A claim cleaned up between our failed create and our read of it."""
  monkeypatch.setenv(lease_lib.LEASE_ENV, "60")
  root, path, marker = _stale_thief(tmp_path)
  storage.create_exclusive(marker, _claim("claimer", 7))
  read_bytes = storage.read_bytes

  def cleaned(p, *args, **kwargs):
    if p == marker and storage.exists(marker):
      storage.remove(marker)
    return read_bytes(p, *args, **kwargs)

  monkeypatch.setattr(storage, "read_bytes", cleaned)
  held = lease_lib.Lease.acquire(root, path)
  try:
    assert json.loads(read_bytes(path)) == held.record
    assert not storage.exists(marker)  # ours, removed once the lock was
  finally:
    held.release()


def test_claimants_dead_at_every_step_leave_the_lock_alone(tmp_path,
                                                           monkeypatch):
  monkeypatch.setenv(lease_lib.LEASE_ENV, "60")
  root, path, marker = _stale_thief(tmp_path)
  old = time.time() - 200
  for n in range(lease_lib._ATTEMPTS):  # pylint: disable=protected-access
    storage.create_exclusive(marker, _claim("dead", n))
    os.utime(marker, (old, old))
    key = marker.rsplit("-", 1)[1]
    marker = path + lease_lib.TAKEOVER_INFIX + hashlib.sha256(
        key.encode("ascii") + _claim("dead", n)).hexdigest()[:16]
  with pytest.raises(errors.DestinationLockedError) as raised:
    lease_lib.Lease.acquire(root, path)
  assert str(raised.value) == (
      f"{root}: another migration is writing here (host thief-host, pid 4242,"
      f" since now; lock {path}); wait for it, or stop it")
  assert storage.read_bytes(path) == _thief()
  assert not storage.exists(marker)  # a fifth step was never taken


def test_a_takeover_paused_longer_than_the_lease_writes_nothing(
    tmp_path, monkeypatch):
  monkeypatch.setenv(lease_lib.LEASE_ENV, "0.05")
  root, path, marker = _stale_thief(tmp_path)  # the thief's 60 s lease: stale
  _on_claim(monkeypatch, path, lambda: time.sleep(0.2))  # a pause
  with pytest.raises(errors.MigrationError) as raised:
    lease_lib.Lease.acquire(root, path)
  assert not isinstance(raised.value, errors.DestinationLockedError)
  assert str(raised.value) == (
      f"{root}: paused for longer than the lease (0.05 s) while taking over "
      f"the stale lock {path}; try again")
  assert storage.read_bytes(path) == _thief()


def test_the_locked_error_names_the_holder_as_far_as_known():
  message = "r: another migration is writing here ({}; lock r/l); wait for " \
            "it, or stop it"
  for holder, who in (
      ({"host": "h", "pid": 1, "since": "s"}, "host h, pid 1, since s"),
      ({"token": "t"}, "host ?, pid ?, since ?"),
      ({}, "a process")):
    error = lease_lib.locked_error("r", "r/l", holder)
    assert str(error) == message.format(who)
    assert isinstance(error, errors.DestinationLockedError)


def test_a_stale_lock_is_judged_by_its_holders_longer_lease(tmp_path,
                                                           monkeypatch):
  monkeypatch.setenv(lease_lib.LEASE_ENV, "60")
  root = str(tmp_path)
  path = storage.join(root, ".clu_ckpt.lock")
  record = json.loads(_thief())
  for theirs, taken in ((600, False), ("junk", True), (float("nan"), True)):
    record["lease_seconds"] = theirs
    with storage.atomic_writer(path) as write:
      write(json.dumps(record).encode("utf-8"))
    old = time.time() - 200  # stale by 60 s leases, not by 600 s ones
    os.utime(path, (old, old))
    if not taken:
      with pytest.raises(errors.DestinationLockedError,
                         match="host thief-host, pid 4242"):
        lease_lib.Lease.acquire(root, path)
      continue
    held = lease_lib.Lease.acquire(root, path)
    held.release()
    assert not storage.exists(path), theirs


def test_a_lock_rewritten_while_looked_at_is_alive(tmp_path, monkeypatch):
  monkeypatch.setenv(lease_lib.LEASE_ENV, "60")
  root, path, marker = _stale_thief(tmp_path)
  stat = storage.stat

  def refreshed_meanwhile(p):
    if p == path:  # its holder rewrites it between our two reads
      with storage.atomic_writer(path) as write:
        write(_thief(token="refreshed"))
    return stat(p)

  monkeypatch.setattr(storage, "stat", refreshed_meanwhile)
  with pytest.raises(errors.DestinationLockedError) as raised:
    lease_lib.Lease.acquire(root, path)
  assert str(raised.value) == (
      f"{root}: another migration is writing here (host thief-host, pid 4242,"
      f" since now; lock {path}); wait for it, or stop it")
  assert not storage.exists(marker)


def test_a_lock_that_keeps_vanishing_is_left_to_its_holder(tmp_path,
                                                          monkeypatch):
  """Each attempt finds the lock there to create, gone to look at: after
  `_ATTEMPTS` rounds the error names whoever holds it now."""
  monkeypatch.setenv(lease_lib.LEASE_ENV, "60")
  root, path, marker = _stale_thief(tmp_path)
  creates = []
  create_exclusive, stat = storage.create_exclusive, storage.stat

  def create(p, data):
    creates.append(p)
    return create_exclusive(p, data)

  def vanished(p):
    if p == path:
      raise FileNotFoundError(p)
    return stat(p)

  monkeypatch.setattr(storage, "create_exclusive", create)
  monkeypatch.setattr(storage, "stat", vanished)
  with pytest.raises(errors.DestinationLockedError) as raised:
    lease_lib.Lease.acquire(root, path)
  assert str(raised.value) == (
      f"{root}: another migration is writing here (host thief-host, pid 4242,"
      f" since now; lock {path}); wait for it, or stop it")
  assert creates == [path] * lease_lib._ATTEMPTS  # pylint: disable=protected-access
  assert storage.read_bytes(path) == _thief()
  assert not storage.exists(marker)


def test_a_takeover_won_on_the_last_attempt_holds_the_lock(tmp_path,
                                                         monkeypatch):
  """The lock seems to vanish while looked at in all rounds but the last,
  where the stale lock is taken over: the takeover is the result, not a
  "locked" error naming this very process."""
  monkeypatch.setenv(lease_lib.LEASE_ENV, "60")
  root, path, _ = _stale_thief(tmp_path)
  stat = storage.stat
  vanishings = [None] * (lease_lib._ATTEMPTS - 1)  # pylint: disable=protected-access

  def vanished_at_first(p):
    if p == path and vanishings:
      vanishings.pop()
      raise FileNotFoundError(p)
    return stat(p)

  monkeypatch.setattr(storage, "stat", vanished_at_first)
  held = lease_lib.Lease.acquire(root, path)
  try:
    assert not vanishings
    assert json.loads(storage.read_bytes(path)) == held.record
    lease_lib.ensure_held(root)
  finally:
    held.release()
  assert not storage.exists(path)


def test_markers_that_cannot_be_cleaned_are_only_logged(tmp_path, monkeypatch,
                                                        caplog):
  def failing_glob(pattern):
    raise OSError(5, "Input/output error", pattern)

  monkeypatch.setattr(storage, "glob", failing_glob)
  with caplog.at_level(logging.WARNING):
    root, path, held = _held(tmp_path, monkeypatch)
  try:
    assert [r.getMessage() for r in caplog.records
            if "takeover markers" in r.getMessage()] == [
                f"{root}: could not clean old takeover markers: [Errno 5] "
                f"Input/output error: '{storage.glob_escape(path)}"
                f"{lease_lib.TAKEOVER_INFIX}*'"]
    lease_lib.ensure_held(root)
  finally:
    held.release()


def test_a_refresh_that_fails_is_retried_and_logged(tmp_path, monkeypatch,
                                                    caplog):
  root, path, held = _held(tmp_path, monkeypatch, "3")  # every 1 s
  read_bytes = storage.read_bytes

  def failing_read(p, *args, **kwargs):
    if p == path:
      raise OSError(5, "Input/output error", p)
    return read_bytes(p, *args, **kwargs)

  try:
    with caplog.at_level(logging.WARNING):
      monkeypatch.setattr(storage, "read_bytes", failing_read)
      deadline = time.monotonic() + 10
      expected = (f"{root}: could not refresh the lock {path} ([Errno 5] "
                  f"Input/output error: '{path}'); retrying")
      while expected not in [r.getMessage() for r in caplog.records]:
        assert time.monotonic() < deadline, caplog.text
        time.sleep(0.05)
      monkeypatch.setattr(storage, "read_bytes", read_bytes)
    # Retried after a sixth of the lease (0.5 s), well before it lapses.
    deadline = time.monotonic() + 1.5
    while json.loads(storage.read_bytes(path))["seq"] < 1:
      assert time.monotonic() < deadline, "not retried"
      time.sleep(0.05)
    lease_lib.ensure_held(root)
  finally:
    held.release()


class _Waits(threading.Event):
  """The refresher's stop event, recording each wait; set after `rounds`."""

  def __init__(self, rounds, between):
    super().__init__()
    self.timeouts, self._rounds, self._between = [], rounds, between

  def wait(self, timeout=None):
    self.timeouts.append(timeout)
    if len(self.timeouts) > self._rounds:
      self.set()
    else:
      self._between(len(self.timeouts))
    return self.is_set()


def test_the_refresher_waits_a_third_of_the_lease_a_sixth_after_a_failure(
    tmp_path, monkeypatch):
  root, path, held = _held(tmp_path, monkeypatch, "60")
  held._stop.set()  # pylint: disable=protected-access
  held._thread.join()  # pylint: disable=protected-access
  read_bytes = storage.read_bytes

  def failing_read(p, *args, **kwargs):
    if p == path:
      raise OSError(5, "Input/output error", p)
    return read_bytes(p, *args, **kwargs)

  def between(wait):  # refreshes 1 and 3 fail, 2 and 4 succeed
    monkeypatch.setattr(storage, "read_bytes",
                        failing_read if wait % 2 else read_bytes)

  waits = _Waits(4, between)
  held._stop = waits  # pylint: disable=protected-access
  try:
    held._refresh_loop()  # pylint: disable=protected-access
    assert waits.timeouts == [20.0, 10.0, 20.0, 10.0, 20.0]
    assert json.loads(read_bytes(path))["seq"] == 2
  finally:
    monkeypatch.setattr(storage, "read_bytes", read_bytes)
    held.release()
  assert not storage.exists(path)


def test_release_waits_for_a_refresh_in_flight(tmp_path, monkeypatch):
  """No refresh can write the lock after `release` returns."""
  root, path, held = _held(tmp_path, monkeypatch, "3")  # every 1 s
  read_bytes = storage.read_bytes
  entered, proceed = threading.Event(), threading.Event()

  def slow_read(p, *args, **kwargs):
    if p == path and threading.current_thread() is held._thread:  # pylint: disable=protected-access
      entered.set()
      proceed.wait(30)
    return read_bytes(p, *args, **kwargs)

  monkeypatch.setattr(storage, "read_bytes", slow_read)
  releasing = threading.Thread(target=held.release)
  try:
    assert entered.wait(10), "the refresher never refreshed"
    releasing.start()
    releasing.join(1.0)
    assert releasing.is_alive(), "release returned with a refresh in flight"
  finally:
    proceed.set()
    if releasing.ident:
      releasing.join(30)
    else:
      held.release()
  assert not held._thread.is_alive()  # pylint: disable=protected-access
  assert not storage.exists(path)


def test_a_holders_lease_under_a_second_is_honoured(tmp_path, monkeypatch):
  """A holder's lease longer than ours counts even when under a second."""
  monkeypatch.setenv(lease_lib.LEASE_ENV, "0.001")  # stale after 1.0015 s
  root = str(tmp_path)
  path = storage.join(root, ".clu_ckpt.lock")
  record = json.loads(_thief())
  record["lease_seconds"] = 0.99  # stale only after 2.485 s
  with storage.atomic_writer(path) as write:
    write(json.dumps(record).encode("utf-8"))
  stat = storage.stat

  def aged(p):  # last written 1.75 s ago, as its store says
    size, _ = stat(p)
    return size, time.time() - 1.75

  monkeypatch.setattr(storage, "stat", aged)
  with pytest.raises(errors.DestinationLockedError) as raised:
    lease_lib.Lease.acquire(root, path)
  assert str(raised.value) == (
      f"{root}: another migration is writing here (host thief-host, pid 4242,"
      f" since now; lock {path}); wait for it, or stop it")
  assert json.loads(storage.read_bytes(path)) == record


def test_a_lock_that_cannot_be_removed_on_release_is_left_to_lapse(
    tmp_path, monkeypatch, caplog):
  root, path, held = _held(tmp_path, monkeypatch)
  remove = storage.remove

  def failing_remove(p):
    raise OSError(5, "Input/output error", p)

  monkeypatch.setattr(storage, "remove", failing_remove)
  with caplog.at_level(logging.WARNING):
    held.release()
  monkeypatch.setattr(storage, "remove", remove)
  assert [r.getMessage() for r in caplog.records
          if r.levelno == logging.WARNING] == [
              f"{root}: could not remove the lock {path} ([Errno 5] "
              f"Input/output error: '{path}'); it lapses after 91 s"]
  assert storage.exists(path)


def test_the_lock_record_says_who_since_when_and_for_how_long(tmp_path,
                                                             monkeypatch):
  root, path, held = _held(tmp_path, monkeypatch)
  try:
    record = json.loads(storage.read_bytes(path))
  finally:
    held.release()
  assert sorted(record) == ["host", "lease_seconds", "pid", "refreshed",
                            "seq", "since", "token"]
  assert (record["host"], record["pid"], record["lease_seconds"],
          record["seq"]) == (socket.gethostname(), os.getpid(), 60.0, 0)
  for key in ("since", "refreshed"):
    assert datetime.datetime.fromisoformat(record[key]).utcoffset() == (
        datetime.timedelta(0))
  assert len(record["token"]) == 32


def test_a_root_is_held_however_it_is_spelled(tmp_path, monkeypatch):
  """`ensure_held` finds the lease of `root/` as of `root`; the refresher is
  a named daemon thread (it never keeps a dying process alive)."""
  root, path, held = _held(tmp_path, monkeypatch)
  try:
    assert held._thread.daemon  # pylint: disable=protected-access
    assert held._thread.name == f"clu_ckpt-lease {root}"  # pylint: disable=protected-access
    _steal(path)
    with pytest.raises(errors.MigrationError, match="thief-host pid 4242"):
      lease_lib.ensure_held(root + "/")
  finally:
    held.release()


@pytest.mark.parametrize("text", ["0", "-1", "inf", "nan", "soon"])
def test_a_bad_lease_length_is_refused_naming_the_variable(monkeypatch, text):
  monkeypatch.setenv(lease_lib.LEASE_ENV, f" {text} ")
  with pytest.raises(errors.MigrationError) as raised:
    lease_lib.lease_seconds()
  assert str(raised.value) == (
      f"CLU_CKPT_LOCK_LEASE_SECONDS={text!r}: expected a positive number of "
      "seconds")


def test_a_late_contender_finds_the_taken_over_lock_changed(tmp_path,
                                                           monkeypatch):
  """After a takeover its marker is gone; a contender that read the stale
  lock before it was replaced claims the marker anew, finds the lock
  changed, and leaves it to the new holder."""
  monkeypatch.setenv(lease_lib.LEASE_ENV, "60")
  root, path, marker = _stale_thief(tmp_path)
  stale = storage.read_bytes(path)
  held = lease_lib.Lease.acquire(root, path)
  try:
    assert not storage.exists(marker)
    late = lease_lib.Lease(root, path, 60.0)
    with pytest.raises(errors.DestinationLockedError) as raised:
      late._take_over(stale)  # pylint: disable=protected-access
    assert f"pid {os.getpid()}" in str(raised.value)  # names the holder
    assert json.loads(storage.read_bytes(path)) == held.record
    lease_lib.ensure_held(root)
  finally:
    held.release()
