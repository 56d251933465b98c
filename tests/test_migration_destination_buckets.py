"""The destination lock (a lease) and manifest on object stores.

Against the emulators of tests/emulators.py (fake-gcs-server and moto's S3
server on 127.0.0.1), with a lease of 2 s (`CLU_CKPT_LOCK_LEASE_SECONDS`), so
that a lock goes stale in `destination.stale_after(2)` = 4 s. Real child
processes where a test needs a kill, a pause (SIGSTOP) or a race. The S3
variants, and the longer races, kills and pauses, run with `--thorough`; the
stores' own exclusive create is in test_fsspec_fs.py's quick run.
"""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from clu_ckpt import errors
from clu_ckpt import filesystem
from clu_ckpt import local_fs
from clu_ckpt import storage
from clu_ckpt.migration import destination
from clu_ckpt.migration import lease

pytestmark = pytest.mark.thorough("s3")

LEASE = 2.0
STALE = destination.stale_after(LEASE)


@pytest.fixture(autouse=True)
def short_lease(monkeypatch):
  monkeypatch.setenv(destination.LEASE_ENV, str(LEASE))


@pytest.fixture
def root(bucket_store):
  return f"{bucket_store.scheme}://{bucket_store.bucket()}/orbax"


def _lock_path(root):
  return f"{root}/{destination.LOCK_NAME}"


def _names(root):
  """What the root holds (nothing: an empty prefix does not exist)."""
  try:
    return storage.listdir(root)
  except FileNotFoundError:
    return []


def _read_lock(root):
  return json.loads(storage.read_bytes(_lock_path(root)))


def _write_stale_lock(root, pid=4242):
  """A lock written by hand, as a holder that died long ago left it."""
  holder = {"host": "gone-host", "pid": pid, "since": "2020-01-01T00:00:00",
            "token": "0" * 32, "refreshed": "2020-01-01T00:00:00",
            "lease_seconds": LEASE, "seq": 7}
  data = json.dumps(holder).encode()
  storage.create_exclusive(_lock_path(root), data)
  return data


# What a child runs: commands on stdin, answers on stdout, one line each.
#   try ROOT   -> "won" (holding it) or "locked <message>"
#   record     -> "recorded" or "<ErrorType> <message>" (in the lock held)
#   release    -> "released"
_CHILD = textwrap.dedent("""
    import contextlib, sys
    from clu_ckpt import errors
    from clu_ckpt.migration import destination
    stack = contextlib.ExitStack()
    root = None
    print("ready", flush=True)
    for line in sys.stdin:
      command, _, arg = line.strip().partition(" ")
      if command == "try":
        root = arg
        try:
          stack.enter_context(destination.lock(root))
          print("won", flush=True)
        except errors.DestinationLockedError as e:
          print("locked", str(e).replace("\\n", " "), flush=True)
      elif command == "record":
        try:
          destination.read_manifest(root).record("/src", 1, "ckpt-1", 1)
          print("recorded", flush=True)
        except Exception as e:
          print(type(e).__name__, str(e).replace("\\n", " "), flush=True)
      elif command == "release":
        stack.close()
        print("released", flush=True)
""")


class _Child:
  """A Python child taking and releasing locks when told (see `_CHILD`)."""

  def __init__(self, store):
    self.proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True,
        env=store.child_env(**{destination.LEASE_ENV: str(LEASE)}))

  def ready(self):
    assert self.read() == "ready"
    return self

  def send(self, command):
    self.proc.stdin.write(command + "\n")
    self.proc.stdin.flush()

  def read(self):
    return self.proc.stdout.readline().strip()

  def ask(self, command):
    self.send(command)
    return self.read()

  def close(self):
    if self.proc.poll() is None:
      self.proc.kill()
    self.proc.wait()


def test_lock_is_taken_refreshed_and_released(root):
  with destination.lock(root) as holder:
    on_store = _read_lock(root)
    assert on_store["token"] == holder["token"]
    assert on_store["pid"] == os.getpid() and on_store["lease_seconds"] == LEASE
    # At least two refreshes (one every LEASE / 3), however loaded the host.
    deadline = time.monotonic() + 10 * LEASE
    while (refreshed := _read_lock(root))["seq"] < 2:
      assert time.monotonic() < deadline, refreshed
      time.sleep(0.05)
    assert refreshed["token"] == holder["token"]
    destination.ensure_held(root)
  assert not storage.exists(_lock_path(root))
  with pytest.raises(RuntimeError):
    with destination.lock(root):
      raise RuntimeError("boom")
  assert not storage.exists(_lock_path(root))
  assert _names(root) == []


def test_second_taker_is_refused_naming_the_holder(root, bucket_store):
  child = _Child(bucket_store).ready()
  try:
    assert child.ask(f"try {root}") == "won"
    with pytest.raises(errors.DestinationLockedError) as e:
      with destination.lock(root):
        pass
    # The same message as the local lock's.
    assert re.fullmatch(
        re.escape(f"{root}: another migration is writing here (host ") +
        r"[^,]+, pid " + str(child.proc.pid) + r", since 20[-0-9T:+]+; lock " +
        re.escape(f"{_lock_path(root)}); wait for it, or stop it"),
        str(e.value)), str(e.value)
    assert e.value.holder["pid"] == child.proc.pid
    assert isinstance(e.value, errors.MigrationError)
    assert child.ask("release") == "released"
    with destination.lock(root):
      pass
  finally:
    child.close()


@pytest.mark.thorough
def test_stale_lock_is_taken_over_a_live_one_is_not(root):
  stale = _write_stale_lock(root)
  with pytest.raises(errors.DestinationLockedError, match="pid 4242"):
    with destination.lock(root):
      pass
  time.sleep(STALE + 0.5)
  with destination.lock(root) as holder:
    assert _read_lock(root)["token"] == holder["token"]
    key = hashlib.sha256(stale).hexdigest()[:16]
    marker = f"{_lock_path(root)}.takeover-{key}"
    assert json.loads(storage.read_bytes(marker))["pid"] == os.getpid()
  # The marker stays (see the module doc); the lock is gone.
  assert _names(root) == [os.path.basename(marker)]


def test_old_takeover_markers_are_cleaned(root, monkeypatch):
  storage.create_exclusive(f"{_lock_path(root)}.takeover-0123456789abcdef",
                           b"{}")
  with destination.lock(root):
    pass
  assert len(_names(root)) == 1   # younger than the keep period
  monkeypatch.setattr(lease, "MARKER_KEEP_LEASES", 0)
  with destination.lock(root):
    pass
  assert _names(root) == []


@pytest.mark.thorough
def test_dead_takeover_claimant_is_stepped_over(root):
  stale = _write_stale_lock(root)
  key = hashlib.sha256(stale).hexdigest()[:16]
  # A contender claimed the takeover, then died before rewriting the lock.
  storage.create_exclusive(f"{_lock_path(root)}.takeover-{key}",
                           b'{"host": "h", "pid": 99, "since": "x"}')
  with pytest.raises(errors.DestinationLockedError):
    with destination.lock(root):
      pass
  time.sleep(STALE + 0.5)
  with destination.lock(root) as holder:
    assert _read_lock(root)["token"] == holder["token"]


@pytest.mark.thorough
def test_two_processes_race_for_a_stale_lock_one_wins(bucket_store):
  bucket = bucket_store.bucket()
  rounds = [f"{bucket_store.scheme}://{bucket}/r{i}" for i in range(4)]
  written = time.monotonic()
  for root in rounds:
    _write_stale_lock(root)
  children = [_Child(bucket_store), _Child(bucket_store)]
  try:
    for child in children:
      child.ready()
    time.sleep(max(0.0, written + STALE + 0.5 - time.monotonic()))
    for root in rounds:
      for child in children:  # as close together as two pipes allow
        child.send(f"try {root}")
      answers = [child.read() for child in children]
      assert sorted(a.split()[0] for a in answers) == ["locked", "won"], (
          answers)
      winner = children[answers.index("won")]
      loser = answers[1 - answers.index("won")]
      assert f"pid {winner.proc.pid}" in loser, answers
      assert _read_lock(root)["pid"] == winner.proc.pid
      assert winner.ask("release") == "released"
  finally:
    for child in children:
      child.close()


@pytest.mark.thorough
def test_killed_holder_is_taken_over_after_the_lease(root, bucket_store):
  child = _Child(bucket_store).ready()
  try:
    assert child.ask(f"try {root}") == "won"
    os.kill(child.proc.pid, signal.SIGKILL)
    child.proc.wait()
    killed = time.monotonic()
    with pytest.raises(errors.DestinationLockedError,
                       match=f"pid {child.proc.pid}"):
      with destination.lock(root):
        pass
    while True:
      try:
        with destination.lock(root) as holder:
          assert _read_lock(root)["token"] == holder["token"]
        break
      except errors.DestinationLockedError:
        assert time.monotonic() - killed < STALE + 3
        time.sleep(0.25)
    assert time.monotonic() - killed > LEASE
  finally:
    child.close()


@pytest.mark.thorough
def test_paused_holder_loses_the_lock_and_records_nothing(root, bucket_store):
  child = _Child(bucket_store).ready()
  try:
    assert child.ask(f"try {root}") == "won"
    assert child.ask("record") == "recorded"
    os.kill(child.proc.pid, signal.SIGSTOP)
    time.sleep(STALE + 0.5)
    with destination.lock(root) as holder:
      manifest = destination.read_manifest(root)
      manifest.record("/src", 2, "ckpt-2", 2)
      os.kill(child.proc.pid, signal.SIGCONT)
      answer = child.ask("record")
      assert answer.startswith("MigrationError "), answer
      assert f"lost the lock on {root} to " in answer
      assert f"pid {os.getpid()}" in answer
      # It wrote nothing over us, and leaves our lock alone on exit.
      assert child.ask("release") == "released"
      assert sorted(destination.read_manifest(root).recorded("/src")) == [1, 2]
      assert _read_lock(root)["token"] == holder["token"]
      destination.ensure_held(root)
  finally:
    os.kill(child.proc.pid, signal.SIGCONT)
    child.close()


def _steal(root):
  with storage.atomic_writer(_lock_path(root)) as write:
    write(json.dumps({"host": "thief", "pid": 77, "since": "now",
                      "token": "t"}).encode())


def test_replaced_lock_makes_record_raise_at_once(root, monkeypatch):
  with destination.lock(root):
    manifest = destination.read_manifest(root)
    manifest.record("/src", 1, "ckpt-1", 1)
    # No refresh at all: a rewrite racing the theft could put ours back, and
    # the check before a write must not wait for the refresher anyway.
    monkeypatch.setattr(lease.Lease, "_refresh", lambda self: None)
    _steal(root)
    with pytest.raises(errors.MigrationError,
                       match=f"lost the lock on {re.escape(root)} to thief "
                       "pid 77"):
      manifest.record("/src", 2, "ckpt-2", 2)
    with pytest.raises(errors.MigrationError, match="lost the lock"):
      destination.ensure_held(root)
  assert sorted(destination.read_manifest(root).recorded("/src")) == [1]
  assert _read_lock(root)["host"] == "thief"   # not deleted: not ours


@pytest.mark.thorough
def test_refresher_finds_a_replaced_lock(root, monkeypatch):
  with destination.lock(root):
    # Only the refresher may notice here.
    monkeypatch.setattr(lease.Lease, "confirm", lambda self: None)
    seq = _read_lock(root)["seq"]
    deadline = time.monotonic() + 10 * LEASE
    while _read_lock(root)["seq"] == seq:  # just after a refresh: the next
      assert time.monotonic() < deadline   # one is a third of a lease away
      time.sleep(0.02)
    _steal(root)
    time.sleep(LEASE / 3 + 0.7)
    with pytest.raises(errors.MigrationError,
                       match=f"lost the lock on {re.escape(root)} to thief"):
      destination.ensure_held(root)
  assert _read_lock(root)["host"] == "thief"


@pytest.mark.thorough
def test_lapsed_lease_makes_record_raise(root, monkeypatch):
  with destination.lock(root):
    manifest = destination.read_manifest(root)
    # As if every refresh failed (the store unreachable) for a whole lease.
    monkeypatch.setattr(lease.Lease, "_refresh",  # pylint: disable=protected-access
                        lambda self: (_ for _ in ()).throw(OSError("down")))
    time.sleep(LEASE + 0.3)
    with pytest.raises(errors.MigrationError, match="not refreshed for"):
      manifest.record("/src", 1, "ckpt-1", 1)
  assert not storage.exists(f"{root}/{destination.MANIFEST_NAME}")


def test_bad_lease_variable_is_refused(root, monkeypatch):
  monkeypatch.setenv(destination.LEASE_ENV, "soon")
  with pytest.raises(errors.MigrationError, match=destination.LEASE_ENV):
    with destination.lock(root):
      pass


def test_manifest_round_trip_on_a_bucket(root):
  manifest = destination.read_manifest(root)
  assert manifest.sources == []
  manifest.record("/runs/a", 3, "ckpt-3", 300, kind="Checkpoint")
  manifest.record("/runs/a", 1, "ckpt-1", 100, verified=True)
  manifest.forget("/runs/a", 3)
  again = destination.read_manifest(root)
  assert again.sources == ["/runs/a"]
  assert sorted(again.recorded("/runs/a")) == [1]
  assert again.recorded("/runs/a")[1]["verified"] is True
  assert _names(root) == [destination.MANIFEST_NAME]
  # A failed write leaves the previous manifest whole.
  with pytest.raises(RuntimeError):
    with storage.atomic_writer(again.path) as write:
      write(b"{half")
      raise RuntimeError("killed")
  assert sorted(destination.read_manifest(root).recorded("/runs/a")) == [1]


class _NoExclusiveCreate(local_fs.LocalFileSystem):
  """A store like gfile's: no exclusive create."""

  def makedirs(self, path):
    pass

  def create_exclusive(self, path, data):
    filesystem.FileSystem.create_exclusive(self, path, data)


def test_store_without_exclusive_create_warns_and_does_not_lock(monkeypatch):
  monkeypatch.setitem(storage._FACTORIES, "noexcl", _NoExclusiveCreate)  # pylint: disable=protected-access
  monkeypatch.delitem(storage._INSTANCES, "noexcl", raising=False)  # pylint: disable=protected-access
  warnings = []
  monkeypatch.setattr(destination.logging, "warning",
                      lambda *args: warnings.append(args[0] % args[1:]))
  try:
    with destination.lock("noexcl://b/orbax") as holder:
      assert holder == {}
  finally:
    storage._INSTANCES.pop("noexcl", None)  # pylint: disable=protected-access
  assert warnings and "has no lock" in warnings[0]


# --------------------------------------------------------------------------
# End to end: two `clu-ckpt migrate` into one gs:// destination at once.
# --------------------------------------------------------------------------


# Each contender imports everything, then waits for `go`; the one that takes
# the lock keeps it until `release` exists, so the other certainly meets a
# held lock (without this, the second could start after the first ended).
_CONTENDER = """
import contextlib, os, sys, time
from clu_ckpt import cli
from clu_ckpt.migration import destination
go, release = sys.argv[1], sys.argv[2]
real_lock = destination.lock

@contextlib.contextmanager
def lock(root, *args, **kwargs):
  with real_lock(root, *args, **kwargs) as holder:
    while not os.path.exists(release):
      time.sleep(0.02)
    yield holder

destination.lock = lock
while not os.path.exists(go):
  time.sleep(0.01)
sys.exit(cli.main(sys.argv[3:]))
"""


@pytest.mark.thorough
def test_two_cli_migrations_into_one_bucket(gcs, golden_copy, tmp_path):
  src = gcs.upload(golden_copy("flax_only"), "run")
  dst = src.rsplit("/", 1)[0] + "/orbax"
  env = gcs.child_env(**{destination.LEASE_ENV: "3"})
  go, release = tmp_path / "go", tmp_path / "release"
  procs = [subprocess.Popen(
      [sys.executable, "-c", _CONTENDER, str(go), str(release), "migrate",
       src, dst],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
           for _ in range(2)]
  go.touch()
  deadline = time.monotonic() + 300
  while all(p.poll() is None for p in procs):  # the loser is refused
    assert time.monotonic() < deadline, "neither contender was refused"
    time.sleep(0.05)
  release.touch()
  outcomes = []
  for p in procs:
    out, err = p.communicate(timeout=300)
    outcomes.append((p.pid, p.returncode, out, err))
  codes = sorted(code for _, code, _, _ in outcomes)
  assert codes == [0, 1], outcomes
  (winner, _, _, _), = [o for o in outcomes if o[1] == 0]
  (_, _, _, err), = [o for o in outcomes if o[1] == 1]
  lines = err.strip().splitlines()
  assert len(lines) == 1, err
  assert "another migration" in lines[0] and f"pid {winner}" in lines[0]
  assert not storage.exists(f"{dst}/{destination.LOCK_NAME}")
  verify = subprocess.run(
      [sys.executable, "-m", "clu_ckpt", "verify", dst, "--source", src],
      capture_output=True, text=True, env=env, timeout=300)
  assert verify.returncode == 0, verify.stdout + verify.stderr


def test_a_failed_acquire_leaves_no_refresher_and_no_lock(root, monkeypatch):
  def broken(self):
    raise RuntimeError("503 from the store")
  monkeypatch.setattr(lease.Lease, "_clean_markers", broken)
  before = set(threading.enumerate())
  with pytest.raises(RuntimeError, match="503"):
    with destination.lock(root):
      pass
  assert not [t for t in set(threading.enumerate()) - before
              if t.name.startswith("clu_ckpt-lease")]
  assert not storage.exists(f"{root}/{destination.LOCK_NAME}")
  monkeypatch.undo()
  monkeypatch.setenv(destination.LEASE_ENV, str(LEASE))
  with destination.lock(root) as holder:  # this process can take it again
    assert holder["pid"] == os.getpid()


def test_a_retried_create_that_had_landed_takes_the_lock(root, monkeypatch):
  """The store created the lock, the reply was lost, the client retried.

  The retry is refused (the object exists): by this process' own lock,
  which must count as taken, not as "another migration is writing here".
  """
  create = storage.create_exclusive

  def landed_then_refused(path, data):
    create(path, data)
    raise FileExistsError(path)

  monkeypatch.setattr(storage, "create_exclusive", landed_then_refused)
  with destination.lock(root) as holder:
    monkeypatch.undo()
    monkeypatch.setenv(destination.LEASE_ENV, str(LEASE))
    assert _read_lock(root)["token"] == holder["token"]
    destination.ensure_held(root)
  assert not storage.exists(_lock_path(root))  # released: it was ours
