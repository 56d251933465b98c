"""Tests of clu_ckpt.migration.destination: the lock and the manifest."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from clu_ckpt import errors
from clu_ckpt.migration import destination

_HOLD = textwrap.dedent("""
    import sys, time
    from clu_ckpt.migration import destination
    with destination.lock(sys.argv[1]):
      print("held", flush=True)
      time.sleep(float(sys.argv[2]))
    print("released", flush=True)
""")


def _holder(root, seconds=60.0):
  """A child process holding the lock of `root` until it is told to go."""
  child = subprocess.Popen([sys.executable, "-c", _HOLD, str(root),
                            str(seconds)], stdout=subprocess.PIPE, text=True)
  assert child.stdout.readline().strip() == "held"
  return child


def test_second_locker_is_refused_naming_the_holder(tmp_path):
  child = _holder(tmp_path)
  try:
    with pytest.raises(errors.DestinationLockedError) as e:
      with destination.lock(str(tmp_path)):
        pass
    assert f"pid {child.pid}" in str(e.value)
    assert "since 20" in str(e.value)
    assert e.value.holder["pid"] == child.pid
    assert isinstance(e.value, errors.MigrationError)
  finally:
    child.kill()
    child.wait()


def test_lock_of_a_killed_process_is_taken_over(tmp_path):
  child = _holder(tmp_path)
  os.kill(child.pid, signal.SIGKILL)
  child.wait()
  # The file still names the dead holder; the kernel released its flock.
  recorded = json.loads((tmp_path / destination.LOCK_NAME).read_text())
  assert recorded["pid"] == child.pid
  with destination.lock(str(tmp_path)) as holder:
    assert holder["pid"] == os.getpid()
    on_disk = json.loads((tmp_path / destination.LOCK_NAME).read_text())
    assert on_disk["pid"] == os.getpid()


def test_lock_is_released_after_the_block_and_on_error(tmp_path):
  with pytest.raises(RuntimeError):
    with destination.lock(str(tmp_path)):
      raise RuntimeError("boom")
  with destination.lock(str(tmp_path)):
    pass
  child = _holder(tmp_path, seconds=0.0)
  assert child.stdout.readline().strip() == "released"
  assert child.wait() == 0


def test_two_lockers_in_one_process_exclude_each_other(tmp_path):
  with destination.lock(str(tmp_path)):
    with pytest.raises(errors.DestinationLockedError):
      with destination.lock(str(tmp_path)):
        pass


def test_symlinked_lock_file_is_refused_and_target_untouched(tmp_path):
  outside = tmp_path / "outside"
  outside.write_text("precious")
  root = tmp_path / "root"
  root.mkdir()
  (root / destination.LOCK_NAME).symlink_to(outside)
  with pytest.raises(errors.MigrationError, match="symlink"):
    with destination.lock(str(root)):
      pass
  assert outside.read_text() == "precious"


def test_hard_linked_lock_file_is_refused_and_other_name_untouched(tmp_path):
  outside = tmp_path / "outside"
  outside.write_text("precious")
  root = tmp_path / "root"
  root.mkdir()
  os.link(outside, root / destination.LOCK_NAME)
  with pytest.raises(errors.MigrationError, match="hard links"):
    with destination.lock(str(root)):
      pass
  assert outside.read_text() == "precious"


def test_fifo_lock_file_is_refused_without_hanging(tmp_path):
  os.mkfifo(tmp_path / destination.LOCK_NAME)
  start = time.monotonic()
  with pytest.raises(errors.MigrationError, match="not a regular file"):
    with destination.lock(str(tmp_path)):
      pass
  assert time.monotonic() - start < 5


def test_manifest_round_trip(tmp_path):
  manifest = destination.read_manifest(str(tmp_path))
  assert manifest.sources == []
  manifest.record("/runs/a", 3, "ckpt-3", 300, kind="Checkpoint")
  manifest.record("/runs/a", 1, "ckpt-1", 100, verified=True)
  again = destination.read_manifest(str(tmp_path))
  assert again.sources == ["/runs/a"]
  recorded = again.recorded("/runs/a")
  assert sorted(recorded) == [1, 3]
  assert recorded[3]["step"] == 300 and recorded[1]["verified"] is True
  assert again.recorded("/runs/b") == {}
  # Written atomically: no temporary file is left beside it.
  assert sorted(os.listdir(tmp_path)) == [destination.MANIFEST_NAME]


def test_other_source_is_refused_unless_allowed(tmp_path):
  manifest = destination.read_manifest(str(tmp_path))
  manifest.record("/runs/a", 1, "ckpt-1", 1)
  manifest.check_source("/runs/a", allow_other_sources=False)
  with pytest.raises(errors.MigrationError, match="/runs/a") as e:
    manifest.check_source("/runs/b", allow_other_sources=False)
  assert "--allow-other-sources" in str(e.value)
  manifest.check_source("/runs/b", allow_other_sources=True)


def test_foreign_steps_are_refused_unless_allowed(tmp_path):
  manifest = destination.read_manifest(str(tmp_path))
  with pytest.raises(errors.MigrationError, match="step 5: an Orbax step"):
    manifest.check_source("/runs/a", allow_other_sources=False,
                          foreign_steps={5: "an Orbax step", 9: "x"})
  manifest.check_source("/runs/a", allow_other_sources=True,
                        foreign_steps={5: "an Orbax step"})


@pytest.mark.parametrize("content, problem", [
    (b"not json", "unreadable"),
    (b"[]", "format"),
    (json.dumps({"format": destination.MANIFEST_FORMAT}).encode(),
     "no list of sources"),
    (json.dumps({"format": destination.MANIFEST_FORMAT, "sources": [
        {"path": "/a", "checkpoints": [{"number": "1", "step": 1}]}]}
               ).encode(), "without number/step"),
])
def test_damaged_manifest_is_refused_naming_it(tmp_path, content, problem):
  (tmp_path / destination.MANIFEST_NAME).write_bytes(content)
  with pytest.raises(errors.MigrationError, match=problem) as e:
    destination.read_manifest(str(tmp_path))
  assert destination.MANIFEST_NAME in str(e.value)


def test_manifest_that_is_a_fifo_is_refused(tmp_path):
  os.mkfifo(tmp_path / destination.MANIFEST_NAME)
  with pytest.raises(errors.MigrationError, match="unreadable"):
    destination.read_manifest(str(tmp_path))


# --------------------------------------------------------------------------
# Real migrations: two at once, and kills at any moment.
# --------------------------------------------------------------------------


def _source(tmp_path, count=4, mib=8):
  """A CLU directory written by the real clu, `count` checkpoints of ~`mib`."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from migration_helpers import clu_save  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  n = mib * 2**20 // 4 // 4
  states = [{"step": np.int64(i), "w": {str(j): rng.standard_normal(n).astype(
      np.float32) for j in range(4)}} for i in range(1, count + 1)]
  clu_save(tmp_path / "src", states, max_to_keep=count)
  return tmp_path / "src"


def _migrate(src, dst, *args):
  return subprocess.Popen(
      [sys.executable, "-m", "clu_ckpt", "migrate", str(src), str(dst),
       "--compression", "none", *args],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _assert_listed_steps_restore_exactly(src, dst):
  """Every step Orbax lists restores bit-exactly (through stock Orbax)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from clu_ckpt import flax_format  # pylint: disable=g-import-not-at-top
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  from migration_helpers import same_tree  # pylint: disable=g-import-not-at-top
  if not dst.exists():
    return 0
  with ocp.CheckpointManager(dst) as mngr:
    steps = list(mngr.all_steps())
  for step in steps:
    expected = flax_format.load_file(str(src / f"ckpt-{step}.flax"))
    assert same_tree(migration.restore_state(str(dst), step), expected), step
  return len(steps)


@pytest.mark.thorough
def test_two_migrations_at_once_one_waits_out(tmp_path):
  src = _source(tmp_path, mib=1)  # the size does not matter here
  dst = tmp_path / "dst"
  holder = _holder(dst)   # the "first" migration, holding the lock
  try:
    second = _migrate(src, dst, "--step-naming", "number")
    out, err = second.communicate(timeout=300)
    assert second.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert f"pid {holder.pid}" in lines[0] and "another migration" in lines[0]
  finally:
    holder.kill()
    holder.wait()
  assert sorted(os.listdir(dst)) == [destination.LOCK_NAME]
  rerun = _migrate(src, dst, "--step-naming", "number")
  _, err = rerun.communicate(timeout=300)
  assert rerun.returncode == 0, err
  assert _assert_listed_steps_restore_exactly(src, dst) == 4


# A soak (run with --soak): the lock tests above are its quick versions.
@pytest.mark.soak
def test_killed_migrations_never_leave_a_bad_listed_step(tmp_path):
  import random  # pylint: disable=g-import-not-at-top
  src = _source(tmp_path)
  dst = tmp_path / "dst"
  rng = random.Random(7)
  for _ in range(4):
    # Two migrations race; one is killed at a random moment.
    a = _migrate(src, dst, "--step-naming", "number")
    b = _migrate(src, dst, "--step-naming", "number")
    time.sleep(rng.uniform(0.5, 4.0))
    victim, other = (a, b) if rng.random() < 0.5 else (b, a)
    victim.kill()
    victim.communicate()
    _, err = other.communicate(timeout=300)
    # The survivor either finished (0) or found the lock held (1, one line).
    assert other.returncode in (0, 1), err
    if other.returncode == 1:
      assert "another migration" in err and len(err.strip().splitlines()) == 1
    _assert_listed_steps_restore_exactly(src, dst)
  final = _migrate(src, dst, "--step-naming", "number", "--verify")
  _, err = final.communicate(timeout=300)
  assert final.returncode == 0, err
  assert _assert_listed_steps_restore_exactly(src, dst) == 4
  leftovers = [n for n in os.listdir(dst) if "tmp" in n or "discarded" in n]
  assert leftovers == []


# --------------------------------------------------------------------------
# The lease of object stores (exercised on the emulators in
# test_migration_destination_buckets.py).
# --------------------------------------------------------------------------


def test_lease_length_comes_from_the_environment(monkeypatch):
  monkeypatch.delenv(destination.LEASE_ENV, raising=False)
  assert destination.lease_seconds() == destination.LEASE_SECONDS == 60
  monkeypatch.setenv(destination.LEASE_ENV, "2.5")
  assert destination.lease_seconds() == 2.5
  for bad in ("0", "-1", "inf", "nan", "soon"):
    monkeypatch.setenv(destination.LEASE_ENV, bad)
    with pytest.raises(errors.MigrationError, match=destination.LEASE_ENV):
      destination.lease_seconds()
  # Stale after the lease plus the clock-skew margin.
  assert destination.stale_after(60) == 91
  assert destination.stale_after(2) == 4


def test_local_roots_are_never_lost(tmp_path):
  root = str(tmp_path)
  with destination.lock(root):
    # The flock is the lock: another holder's record written into the file
    # (what takes a lease over on a bucket) does not make it lost here.
    (tmp_path / ".clu_ckpt.lock").write_text(json.dumps(
        dict(host="elsewhere", pid=1, token="not-ours")))
    destination.ensure_held(root)  # raises if the root counted as lost
    manifest = destination.read_manifest(root)
    manifest.record("/runs/a", 1, "ckpt-1", 10)  # checks it, and writes
    assert destination.read_manifest(root).recorded("/runs/a").keys() == {1}
    with pytest.raises(errors.DestinationLockedError):
      with destination.lock(root):
        pass
  destination.ensure_held(root)  # not held: nothing to lose
  manifest.forget("/runs/a", 1)
  with destination.lock(root):  # released on leaving the block
    destination.ensure_held(root)
    manifest.record("/runs/a", 2, "ckpt-2", 20)
  assert destination.read_manifest(root).recorded("/runs/a").keys() == {2}


# --------------------------------------------------------------------------
# The lock file's details and the manifest's every rule (each assertion
# below kills a mutant of docs/MUTATION.md's run of this module).
# --------------------------------------------------------------------------


def _open_lock_fd(path):
  """This process' descriptor of `path` (the lock `lock()` keeps open)."""
  for name in os.listdir("/proc/self/fd"):
    try:
      if os.readlink(f"/proc/self/fd/{name}") == str(path):
        return int(name)
    except OSError:
      continue
  raise AssertionError(f"{path} is not open")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="Linux only")
def test_lock_file_is_opened_for_reading_and_writing_never_inherited(
    tmp_path):
  import fcntl  # pylint: disable=g-import-not-at-top
  old = os.umask(0o022)
  try:
    with destination.lock(str(tmp_path)) as holder:
      path = tmp_path / destination.LOCK_NAME
      fd = _open_lock_fd(path)
      flags = fcntl.fcntl(fd, fcntl.F_GETFL)
      assert flags & os.O_ACCMODE == os.O_RDWR
      assert flags & os.O_NONBLOCK  # a FIFO put there never blocks the open
      assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
      assert os.stat(path).st_mode & 0o777 == 0o644
      # The record names this process, as JSON from the file's first byte.
      assert json.loads(path.read_bytes()) == holder
      assert holder["host"] and holder["pid"] == os.getpid()
  finally:
    os.umask(old)
  assert (tmp_path / destination.LOCK_NAME).read_bytes() == b""


def test_lock_file_refusals_name_the_file_and_what_to_do(tmp_path):
  path = tmp_path / destination.LOCK_NAME
  path.symlink_to(tmp_path / "elsewhere")
  with pytest.raises(errors.MigrationError) as e:
    with destination.lock(str(tmp_path)):
      pass
  assert str(e.value) == (f"{path}: the lock file is a symlink; refused "
                          "(remove it if nothing is migrating)")
  path.unlink()
  os.mkfifo(path)
  with pytest.raises(errors.MigrationError) as e:
    with destination.lock(str(tmp_path)):
      pass
  assert str(e.value) == (f"{path}: the lock file is not a regular file; "
                          "refused (remove it if nothing is migrating)")
  path.unlink()
  path.mkdir()
  with pytest.raises(errors.MigrationError) as e:
    with destination.lock(str(tmp_path)):
      pass
  assert str(e.value) == (f"{path}: the lock file is a directory; refused "
                          "(remove it if nothing is migrating)")
  path.rmdir()
  (tmp_path / "other").write_text("")
  os.link(tmp_path / "other", path)
  os.link(tmp_path / "other", tmp_path / "third")
  with pytest.raises(errors.MigrationError) as e:
    with destination.lock(str(tmp_path)):
      pass
  assert str(e.value) == (f"{path}: the lock file has 3 hard links; refused "
                          "(remove it if nothing is migrating)")
  assert (tmp_path / "other").read_text() == ""


def test_lock_file_that_cannot_be_opened_is_the_os_error(tmp_path,
                                                         monkeypatch):
  # An error of the disk (not a refusal of what is there) stays the OS's own,
  # naming the file.
  path = str(tmp_path / destination.LOCK_NAME)
  def failing_open(name, *args, **kwargs):
    if name == path:
      raise OSError(errno.EIO, "Input/output error", name)
    return real_open(name, *args, **kwargs)
  real_open = os.open
  monkeypatch.setattr(os, "open", failing_open)
  with pytest.raises(OSError) as e:
    with destination.lock(str(tmp_path)):
      pass
  assert not isinstance(e.value, errors.MigrationError)
  assert (e.value.errno, e.value.filename) == (errno.EIO, path)


@pytest.mark.parametrize("record, named", [
    (b"[1, 2]", "a process"),          # JSON, but not a holder
    (b"\xff\xfe", "a process"),        # not UTF-8
    (b"{\"host\": ", "a process"),     # cut short
    (b"   ", "a process"),             # blank
    (json.dumps({"host": "h1", "pid": 7, "since": "s"}).encode(),
     "host h1, pid 7, since s"),
])
def test_a_held_lock_names_what_its_file_says(tmp_path, record, named):
  child = _holder(tmp_path)
  try:
    (tmp_path / destination.LOCK_NAME).write_bytes(record)
    with pytest.raises(errors.DestinationLockedError) as e:
      with destination.lock(str(tmp_path)):
        pass
    assert str(e.value) == (
        f"{tmp_path}: another migration is writing here ({named}; lock "
        f"{tmp_path / destination.LOCK_NAME}); wait for it, or stop it")
    expected = json.loads(record) if named != "a process" else {}
    assert e.value.holder == expected
  finally:
    child.kill()
    child.wait()


def test_manifest_records_replace_and_sort_and_keep_their_fields(tmp_path):
  manifest = destination.read_manifest(str(tmp_path))
  assert manifest.path == str(tmp_path / destination.MANIFEST_NAME)
  assert manifest.data == {"format": destination.MANIFEST_FORMAT,
                           "sources": []}
  manifest.record("/runs/a", 3, "ckpt-3", 300)
  manifest.record("/runs/a", 1, "ckpt-1", 100, kind="Checkpoint",
                  verified=True)
  manifest.record("/runs/a", 3, "ckpt-3", 333)  # written again: replaced
  manifest.record("/runs/b", 1, "model-1", 10, kind="MultihostCheckpoint")
  data = json.loads((tmp_path / destination.MANIFEST_NAME).read_bytes())
  assert data["format"] == destination.MANIFEST_FORMAT
  a, b = data["sources"]
  assert (a["path"], a["kind"], b["path"], b["kind"]) == (
      "/runs/a", "", "/runs/b", "MultihostCheckpoint")
  assert [(c["number"], c["name"], c["step"], c["verified"])
          for c in a["checkpoints"]] == [(1, "ckpt-1", 100, True),
                                         (3, "ckpt-3", 333, False)]
  assert all(c["migrated_at"].startswith("20") for c in a["checkpoints"])
  again = destination.read_manifest(str(tmp_path))
  assert again.data == data and again.sources == ["/runs/a", "/runs/b"]
  assert again.recorded("/runs/a") == {1: a["checkpoints"][0],
                                       3: a["checkpoints"][1]}
  assert again.recorded("/runs/b") == {1: b["checkpoints"][0]}


def test_forget_drops_one_record_and_writes_only_when_it_did(tmp_path):
  path = tmp_path / destination.MANIFEST_NAME
  manifest = destination.read_manifest(str(tmp_path))
  manifest.forget("/runs/a", 1)  # nothing recorded: nothing written
  assert not path.exists()
  for number in (1, 2):
    manifest.record("/runs/a", number, f"ckpt-{number}", number * 10)
  manifest.record("/runs/b", 1, "ckpt-1", 10)
  manifest.forget("/runs/a", 1)
  again = destination.read_manifest(str(tmp_path))
  assert sorted(again.recorded("/runs/a")) == [2]
  assert sorted(again.recorded("/runs/b")) == [1]
  written = os.stat(path).st_ino  # each save is a new file renamed over it
  manifest.forget("/runs/a", 1)   # already gone
  manifest.forget("/runs/c", 2)   # never recorded
  assert os.stat(path).st_ino == written
  manifest.forget("/runs/a", 2)
  assert destination.read_manifest(str(tmp_path)).recorded("/runs/a") == {}


def test_a_lost_lease_writes_no_manifest(tmp_path, monkeypatch):
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  from clu_ckpt.migration import lease as lease_lib  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv(lease_lib.LEASE_ENV, "60")
  root = str(tmp_path / "root")
  storage.makedirs(root)
  manifest = destination.read_manifest(root)
  lock = storage.join(root, destination.LOCK_NAME)
  held = lease_lib.Lease.acquire(root, lock)  # a lease, as on a bucket
  try:
    manifest.record("/runs/a", 1, "ckpt-1", 10)
    before = (tmp_path / "root" / destination.MANIFEST_NAME).read_bytes()
    with storage.atomic_writer(lock) as write:  # taken over
      write(json.dumps({"host": "thief", "pid": 42, "since": "then",
                        "token": "theirs"}).encode())
    for attempt in (lambda: manifest.record("/runs/a", 2, "ckpt-2", 20),
                    lambda: manifest.forget("/runs/a", 1),
                    manifest.save):
      with pytest.raises(errors.MigrationError) as e:
        attempt()
      assert str(e.value).startswith(f"lost the lock on {root} to thief "
                                     "pid 42")
    assert manifest.recorded("/runs/a").keys() == {1}  # not even in memory
    assert (tmp_path / "root" / destination.MANIFEST_NAME
            ).read_bytes() == before
  finally:
    held.release()


def test_other_sources_are_refused_with_what_and_how(tmp_path):
  manifest = destination.read_manifest(str(tmp_path))
  manifest.record("/runs/a", 1, "ckpt-1", 1)
  manifest.record("/runs/b", 1, "ckpt-1", 1)
  manifest.check_source("/runs/a", allow_other_sources=True)
  with pytest.raises(errors.MigrationError) as e:
    manifest.check_source("/runs/a", allow_other_sources=False)
  assert str(e.value) == (
      f"{tmp_path}: already holds the migration of /runs/b (see "
      f"{manifest.path}); choose another destination, or allow other "
      "sources (--allow-other-sources)")
  with pytest.raises(errors.MigrationError) as e:
    manifest.check_source("/runs/c", allow_other_sources=False)
  assert "the migration of /runs/a (see" in str(e.value)
  empty = destination.read_manifest(str(tmp_path / "new"))
  empty.check_source("/runs/a", allow_other_sources=False)
  empty.check_source("/runs/a", allow_other_sources=False, foreign_steps={})
  with pytest.raises(errors.MigrationError) as e:
    empty.check_source("/runs/a", allow_other_sources=False,
                       foreign_steps={9: "x", 5: "an Orbax step"})
  assert str(e.value) == (
      f"{tmp_path / 'new'}: holds 2 step(s) that are not from /runs/a "
      "(step 5: an Orbax step); choose another destination, or allow other "
      "sources (--allow-other-sources)")


@pytest.mark.parametrize("data, problem", [
    ({"format": "other"}, "format is not 'clu_ckpt.manifest/1'"),
    ({"sources": []}, "format is not 'clu_ckpt.manifest/1'"),
    ("clu_ckpt.manifest/1", "format is not 'clu_ckpt.manifest/1'"),
    ({"format": destination.MANIFEST_FORMAT, "sources": {}},
     "no list of sources"),
    ({"format": destination.MANIFEST_FORMAT, "sources": ["/a"]},
     "a source without a path"),
    ({"format": destination.MANIFEST_FORMAT, "sources": [{"path": 1}]},
     "a source without a path"),
    ({"format": destination.MANIFEST_FORMAT, "sources": [{"path": "/a"}]},
     "source /a: no list of checkpoints"),
    ({"format": destination.MANIFEST_FORMAT, "sources": [
        {"path": "/a", "checkpoints": [[1, 1]]}]},
     "source /a: a checkpoint without number/step"),
    ({"format": destination.MANIFEST_FORMAT, "sources": [
        {"path": "/a", "checkpoints": [{"number": 1, "step": 1}]},
        {"path": "/b", "checkpoints": [{"number": 1}]}]},
     "source /b: a checkpoint without number/step"),
    ({"format": destination.MANIFEST_FORMAT, "sources": [
        {"path": "/a", "checkpoints": [{"number": 1, "step": True}]}]},
     "source /a: a checkpoint without number/step"),
    ({"format": destination.MANIFEST_FORMAT, "sources": [
        {"path": "/a", "checkpoints": [{"number": 1.0, "step": 1}]}]},
     "source /a: a checkpoint without number/step"),
])
def test_not_a_manifest_is_refused_saying_what_is_wrong(tmp_path, data,
                                                        problem):
  path = tmp_path / destination.MANIFEST_NAME
  path.write_text(json.dumps(data))
  with pytest.raises(errors.MigrationError) as e:
    destination.read_manifest(str(tmp_path))
  assert str(e.value) == (f"{path}: not a clu_ckpt manifest ({problem}); "
                          "move it away if it is not needed")


def test_a_sound_manifest_of_every_shape_is_read(tmp_path):
  data = {"format": destination.MANIFEST_FORMAT, "sources": [
      {"path": "/a", "checkpoints": []},
      {"path": "/b", "kind": "Checkpoint", "checkpoints": [
          {"number": 1, "step": 10}, {"number": 2, "step": 20, "x": 1}]}]}
  (tmp_path / destination.MANIFEST_NAME).write_text(json.dumps(data))
  manifest = destination.read_manifest(str(tmp_path))
  assert manifest.data == data and manifest.sources == ["/a", "/b"]


def test_manifest_size_limit_and_unreadable_ones_name_the_file(tmp_path,
                                                               monkeypatch):
  path = tmp_path / destination.MANIFEST_NAME
  destination.read_manifest(str(tmp_path)).record("/a", 1, "ckpt-1", 1)
  size = path.stat().st_size
  monkeypatch.setattr(destination, "MAX_MANIFEST_BYTES", size)
  assert destination.read_manifest(str(tmp_path)).sources == ["/a"]
  monkeypatch.setattr(destination, "MAX_MANIFEST_BYTES", size - 1)
  with pytest.raises(errors.MigrationError) as e:
    destination.read_manifest(str(tmp_path))
  assert str(e.value) == (f"{path}: {size} bytes, not a clu_ckpt manifest "
                          f"(at most {size - 1})")
  monkeypatch.undo()
  path.write_bytes(b"\xff{}")
  with pytest.raises(errors.MigrationError) as e:
    destination.read_manifest(str(tmp_path))
  assert str(e.value).startswith(f"{path}: unreadable manifest: ")
  assert isinstance(e.value.__cause__, UnicodeDecodeError)


@pytest.mark.orbax  # migrates
def test_checkpoints_not_migrated_names_what_the_source_keeps(tmp_path):
  from migration_helpers import clu_save  # pylint: disable=g-import-not-at-top
  from migration_helpers import example_state  # pylint: disable=g-import-not-at-top
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  src, root = tmp_path / "src", tmp_path / "root"
  clu_save(src, [example_state(1), example_state(2), example_state(3)])
  assert destination.checkpoints_not_migrated(str(root), str(src)) == (
      destination.NotMigrated(str(src), ["ckpt-1", "ckpt-2", "ckpt-3"], 3))
  migration.migrate(str(src), str(root), checkpoints="latest",
                    step_naming="number")
  left = destination.checkpoints_not_migrated(str(root), str(src))
  assert left == destination.NotMigrated(str(src), ["ckpt-1", "ckpt-2"], 3)
  # Without the manifest (a root migrated before manifests): the step's
  # migration metadata still names its checkpoint.
  (root / destination.MANIFEST_NAME).unlink()
  assert destination.checkpoints_not_migrated(str(root), str(src)) == left
  # A step whose metadata names another source does not count.
  meta = root / "3" / "metadata" / "metadata"
  data = json.loads(meta.read_text())
  meta.write_text(json.dumps(dict(data, source=str(tmp_path / "other"))))
  assert destination.checkpoints_not_migrated(
      str(root), str(src)).names == ["ckpt-1", "ckpt-2", "ckpt-3"]
  meta.write_text(json.dumps(data))
  # A recorded checkpoint counts even when its step is gone (pruned).
  migration.migrate(str(src), str(root), step_naming="number")
  for step in ("1", "2"):
    shutil.rmtree(root / step)
  assert destination.checkpoints_not_migrated(str(root), str(src)).names == []
  assert destination.checkpoints_not_migrated(
      str(root), str(tmp_path / "nothing")) is None



def test_a_saved_at_time_that_is_no_number_is_not_the_same_checkpoint():
  """A manifest edited by hand: a record's time that is not a number makes
  the checkpoint another one (kept, named), never a crash of verify."""
  assert destination.same_checkpoint({"saved_at": 5.0}, 5.0)
  assert destination.same_checkpoint({}, 5.0)  # recorded before the times
  assert not destination.same_checkpoint({"saved_at": 6.0}, 5.0)
  for hostile in ("soon", [5.0], {"t": 5}):
    assert not destination.same_checkpoint({"saved_at": hostile}, 5.0)
