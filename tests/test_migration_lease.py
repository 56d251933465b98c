"""Tests for clu_ckpt.migration.lease: a holder whose token was replaced.

The lock object is rewritten by the holder's refresher only while it still
holds the holder's token: a lock taken over (a new token) is never written
again by the old holder, whose `ensure_held` then names the new one. The
races between real processes are in test_migration_destination_buckets.py;
here the refresher is driven directly (and by its own thread) on a local
root and on the GCS emulator.
"""

import json
import logging
import os
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
                                         "removed"])
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
               "garbage": b"\xff not a lock"}[replacement])
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
    mono, wall = held._ok  # pylint: disable=protected-access
    held._ok = (mono - 100, wall - 100)  # pylint: disable=protected-access
    with pytest.raises(errors.MigrationError) as raised:
      held.check()
    assert str(raised.value) == (
        f"lost the lock on {root}: not refreshed for 100 s, longer than its "
        "60 s lease (paused, or the store unreachable), so another migration "
        "may take it over; this migration writes nothing more there")
  finally:
    held.release()
  assert os.path.isdir(path)
