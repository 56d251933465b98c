"""Reliability: kills at chosen points, a real multi-host job, full and read-only disks.

The short CI versions of the soak runs in tests/soak/ (see its README):

* single host: a child process trains and saves with `clu_ckpt.checkpoint`
  and is SIGKILLed inside the `.flax` write, between it and TensorFlow's
  commit, during pruning and during the clean-up of an uncommitted future
  checkpoint; after each kill a fresh process must restore exactly the last
  committed checkpoint, with state and tf.data iterator consistent;
* multi-host: two real `jax.distributed` processes, one killed mid-save,
  then both restarted: same checkpoint, nothing of the common set lost;
* a crash in the first save after restoring an older checkpoint (in-process,
  through a profiler hook) must not leave a listed checkpoint without its
  files (the newer checkpoints are unlisted before their files go);
* disk full (a real 2 MiB tmpfs, or RLIMIT_FSIZE where mounting is not
  allowed) and read-only directories (a tmpfs remounted read-only, or
  `chmod -R a-w` when not root).
"""

import contextlib
import errno
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "soak"))
import _harness  # pylint: disable=g-import-not-at-top,wrong-import-position

tf = pytest.importorskip("tensorflow")

from clu_ckpt import checkpoint  # pylint: disable=g-import-not-at-top,wrong-import-position
from clu_ckpt import inspection  # pylint: disable=g-import-not-at-top,wrong-import-position

P = _harness.kill_point


# --------------------------------------------------------------------------
# Single host: SIGKILL at chosen points, restore in a fresh process.
# --------------------------------------------------------------------------


@pytest.mark.thorough
def test_single_host_kill_point_restores_last_committed(tmp_path):
  """The quick version of the next test (a soak): one SIGKILL inside the
  .flax write, then a fresh process restores exactly the last committed
  checkpoint and saves on."""
  chain = _harness.SingleHostChain(tmp_path / "ckpts", timeout=240)
  # Saves 2 and 3 complete; the third save dies at its first write of the
  # temporary .flax of 4.
  r = chain.round(P("os.write"), 1, save=3)
  assert (r["restored"], r["returncode"], r["saves"]) == (1, -9, 2)
  # ckpt-4.flax was never renamed into place: 3 is the last committed.
  r = chain.round(None, steps=2)
  assert (r["restored"], r["returncode"], r["saves"]) == (3, 0, 2)
  report = inspection.verify_path(str(tmp_path / "ckpts"))
  assert report["ok"], report["problems"]
  assert report["checked"] == 3


@pytest.mark.soak
def test_single_host_kill_points_restore_last_committed(tmp_path):
  chain = _harness.SingleHostChain(tmp_path / "ckpts", timeout=240)

  # Fresh directory: ckpt-1 is the initial state; saves 2 and 3 complete,
  # the third save dies at its first write of the temporary .flax of 4.
  r = chain.round(P("os.write"), 1, save=3)
  assert (r["restored"], r["returncode"], r["saves"]) == (1, -9, 2)

  # ckpt-4.flax was never renamed into place: 3 is the last committed.
  # This child dies after TensorFlow wrote ckpt-4's files, before its commit.
  r = chain.round(P("_record_and_sweep_state"), 1)
  assert (r["restored"], r["returncode"], r["saves"]) == (3, -9, 0)

  # The uncommitted ckpt-4 files are ignored by the restore, then removed by
  # the next save: this child dies between two of those removals.
  r = chain.round(P("os.remove", "future_cleanup"), 2)
  assert r["restored"] == 3 and r["returncode"] == -9
  assert {"ckpt-4.flax", "ckpt-4.index"} <= set(chain.futures)

  # Dies while TensorFlow deletes ckpt-1's files after committing ckpt-4.
  r = chain.round(P("_delete_file_if_exists"), 1)
  assert (r["restored"], r["returncode"]) == (3, -9)

  # ckpt-4 was committed before the kill; the `checkpoint` file still lists
  # ckpt-1 (half deleted). This child dies before TensorFlow renames the new
  # `checkpoint` file of ckpt-5 into place.
  r = chain.round(P("rename", "flax_to_tf_commit"), 1)
  assert (r["restored"], r["midprune"], r["returncode"]) == (4, 1, -9)

  # Killed by the parent at a random time while it trains.
  r = chain.round(None, kill_after=0.2, steps=1000)
  assert (r["restored"], r["returncode"]) == (4, -9)

  # A last child restores what the last one committed and saves twice.
  r = chain.round(None, steps=2)
  assert r["returncode"] == 0 and r["saves"] == 2
  report = inspection.verify_path(str(tmp_path / "ckpts"))
  assert report["ok"], report["problems"]
  assert report["checked"] == 3


# --------------------------------------------------------------------------
# Multi-host: real jax.distributed processes.
# --------------------------------------------------------------------------


# A soak (run with --soak); its quick versions: the in-process multi-host
# crash tests below and the two-process save in tests/test_orbax_items.py.
@pytest.mark.soak
def test_multihost_kill_one_host_mid_save(tmp_path):
  chain = _harness.MultihostChain(tmp_path / "checkpoints", 2, timeout=240)
  # Host 1 dies in its third save (ckpt-4) after TensorFlow wrote the files,
  # before the commit; host 0 finishes its ckpt-4 and is killed 1 s later.
  r = chain.round(1, P("_record_and_sweep_state"), 1, save=3, grace=1.0)
  assert r["returncodes"][1] == -9 and r["restored"] == 1
  assert chain.last[1] == 3 and chain.last[0] in (3, 4)
  # Both restart: both restore 3, the newest number both hosts hold, and
  # train on in step (each checks its state and iterator inside).
  r = chain.round(None, steps=2)
  assert r["restored"] == 3
  assert r["returncodes"] == [0, 0] and r["saves"] == [2, 2]


# --------------------------------------------------------------------------
# A crash in the first save after restoring an older checkpoint.
# --------------------------------------------------------------------------


class _Crash(BaseException):
  """Stands in for SIGKILL in-process: nothing after it runs."""


def _crash_at(spec, k):
  def crash():
    raise _Crash()
  return _harness.KillTrigger(spec, k, crash)


def _ds(host=0):
  start = _harness.host_offset(host)
  return iter(tf.data.Dataset.range(start, start + 1000).batch(4))


def _train(ckpt, it, base, steps, host=0, start=0):
  for step in range(start + 1, start + steps + 1):
    next(it)
    ckpt.save(_harness.make_state(step, base, host))


# Regression: the first save after restoring an older checkpoint used to
# delete the newer checkpoints' files while TensorFlow's `checkpoint` file
# still listed them (clu still does); a crash in that window left a listed
# checkpoint without files, and once the other hosts committed that number
# every restart failed.


@pytest.mark.parametrize("crash_at", [
    # Before the second removal: ckpt-3.data is gone.
    ("c:os.remove@clu_ckpt.save_protocol:delete_future_checkpoints", 2),
    # Clean-up done, the new .flax is being written.
    ("py:clu_ckpt.flax_encode:_Sink.large", 1),
], ids=["during_cleanup", "during_flax_write"])
def test_multihost_crash_in_first_save_after_restore_stays_restorable(
    tmp_path, crash_at):
  base = _harness._base()  # pylint: disable=protected-access
  prefix = str(tmp_path / "checkpoints")

  def host(h, it):
    return checkpoint.MultihostCheckpoint(prefix, dict(ds_iter=it),
                                          host_id=h, max_to_keep=3)

  # Both hosts save 1 and 2; host 0 also saves 3, host 1 is preempted.
  its = [_ds(0), _ds(1)]
  hosts = [host(0, its[0]), host(1, its[1])]
  for h in (0, 1):
    hosts[h].restore_or_initialize(_harness.make_state(0, base, h))
    _train(hosts[h], its[h], base, 1, h)
  _train(hosts[0], its[0], base, 1, 0, start=1)
  # Restart: both restore 2. Host 0 crashes in its first save (which first
  # removes its own ckpt-3), host 1 saves its ckpt-3.
  its = [_ds(0), _ds(1)]
  hosts = [host(0, its[0]), host(1, its[1])]
  states = [hosts[h].restore_or_initialize(_harness.make_state(0, base, h))
            for h in (0, 1)]
  assert [s["step"] for s in states] == [1, 1]
  trigger = _crash_at(*crash_at)
  trigger.install()
  try:
    with pytest.raises(_Crash):
      _train(hosts[0], its[0], base, 1, 0, start=1)
  finally:
    trigger.uninstall()
  _train(hosts[1], its[1], base, 1, 1, start=1)
  # Restart again: every host must restore a complete checkpoint.
  for h in (0, 1):
    it = _ds(h)
    ckpt = host(h, it)
    state = ckpt.restore_or_initialize(_harness.make_state(0, base, h))
    step = state["step"]
    _harness.check_state(state, step, base, f"host {h}", h)
    _harness.check_batch(next(it), step, f"host {h}", h)


def test_crash_during_future_cleanup_after_restoring_older(tmp_path):
  base = _harness._base()  # pylint: disable=protected-access
  it = _ds()
  ckpt = checkpoint.Checkpoint(str(tmp_path), dict(ds_iter=it), max_to_keep=5)
  ckpt.restore_or_initialize(_harness.make_state(0, base))
  _train(ckpt, it, base, 2)  # ckpt-1 .. ckpt-3
  ckpt.restore(None, str(tmp_path / "ckpt-1"))
  # Files are removed in glob order: ckpt-2.{data,flax,index}, then ckpt-3's;
  # the crash comes before the 5th removal, after ckpt-3.data is gone.
  trigger = _crash_at(P("os.remove", "future_cleanup").spec, 5)
  trigger.install()
  try:
    with pytest.raises(_Crash):
      ckpt.save(_harness.make_state(1, base))
  finally:
    trigger.uninstall()
  it = _ds()
  fresh = checkpoint.Checkpoint(str(tmp_path), dict(ds_iter=it), max_to_keep=5)
  state = fresh.restore_or_initialize(_harness.make_state(0, base))
  _harness.check_state(state, state["step"], base, "restored")
  _harness.check_batch(next(it), state["step"], "restored")


# --------------------------------------------------------------------------
# Disk full.
# --------------------------------------------------------------------------


def _mount_tmpfs(target: Path, size: str) -> bool:
  # CLU_CKPT_TEST_NO_MOUNT=1 exercises the fallbacks where mounting works.
  if (os.geteuid() != 0 or shutil.which("mount") is None or
      os.environ.get("CLU_CKPT_TEST_NO_MOUNT")):
    return False
  target.mkdir(parents=True, exist_ok=True)
  done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}",
                         "tmpfs", str(target)], capture_output=True,
                        check=False)
  return done.returncode == 0


def _umount(target: Path) -> None:
  subprocess.run(["umount", "-l", str(target)], capture_output=True,
                 check=False)


class SmallDisk:
  """A directory whose free space can be taken away for real.

  On a 2 MiB tmpfs (root, mount allowed) the disk is filled with a filler
  file: writes fail with ENOSPC. Elsewhere RLIMIT_FSIZE (soft limit, SIGXFSZ
  ignored) makes writing past `free` bytes into any file fail with EFBIG, a
  real kernel error too.
  """

  def __init__(self, root: Path):
    self.root = root
    self.path = root / "fs"
    self.tmpfs = _mount_tmpfs(self.path, "2m")
    if not self.tmpfs:
      self.path.mkdir(parents=True, exist_ok=True)
    self._filler = self.path / "filler"
    self._saved = None

  @property
  def errnos(self) -> tuple[int, ...]:
    return (errno.ENOSPC,) if self.tmpfs else (errno.EFBIG,)

  def leave(self, free: int) -> None:
    """Takes away all but about `free` bytes."""
    if not self.tmpfs:
      soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
      self._saved = (soft, hard, signal.signal(signal.SIGXFSZ,
                                               signal.SIG_IGN))
      resource.setrlimit(resource.RLIMIT_FSIZE, (free, hard))
      return
    fd = os.open(self._filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
      while True:
        st = os.statvfs(self.path)
        available = st.f_bavail * st.f_frsize
        if available <= free:
          break
        os.write(fd, b"\0" * min(2**16, available - free))
    finally:
      os.close(fd)

  def release(self) -> None:
    if self._saved is not None:
      soft, hard, handler = self._saved
      resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
      signal.signal(signal.SIGXFSZ, handler)
      self._saved = None
    with contextlib.suppress(FileNotFoundError):
      self._filler.unlink()

  def close(self) -> None:
    self.release()
    if self.tmpfs:
      _umount(self.path)


@pytest.fixture
def small_disk(tmp_path):
  disk = SmallDisk(tmp_path)
  try:
    yield disk
  finally:
    disk.close()


def _small_state(step, n=10_000):
  return {"w": np.full(n, step, np.float32), "step": step}


def _two_checkpoints(directory):
  it = _ds()
  ckpt = checkpoint.Checkpoint(str(directory), dict(ds_iter=it),
                               max_to_keep=3)
  ckpt.restore_or_initialize(_small_state(0))
  next(it)
  ckpt.save(_small_state(1))
  return ckpt, it


def _assert_restores(directory, number):
  it = _ds()
  fresh = checkpoint.Checkpoint(str(directory), dict(ds_iter=it),
                                max_to_keep=3)
  state = fresh.restore_or_initialize(_small_state(-1))
  assert fresh.restored_from == f"{directory}/ckpt-{number}"
  assert state["step"] == number - 1
  np.testing.assert_array_equal(state["w"], np.full(10_000, number - 1))
  np.testing.assert_array_equal(next(it), np.arange(4) + 4 * (number - 1))


def test_disk_full_during_flax_write_keeps_previous(small_disk):
  directory = small_disk.path / "ckpts"
  ckpt, it = _two_checkpoints(directory)
  before = sorted(os.listdir(directory))
  small_disk.leave(64 * 1024)
  try:
    next(it)
    with pytest.raises(OSError) as raised:
      ckpt.save(_small_state(2, n=2**18))  # 1 MiB of Flax state
  finally:
    small_disk.release()
  assert raised.value.errno in small_disk.errnos
  assert sorted(os.listdir(directory)) == before  # no temporary file left
  _assert_restores(directory, 2)
  # With space again, the same object saves the next number.
  assert ckpt.save(_small_state(2)) == f"{directory}/ckpt-3"
  _assert_restores(directory, 3)


def test_disk_full_error_names_the_file(small_disk):
  directory = small_disk.path / "ckpts"
  ckpt, it = _two_checkpoints(directory)
  small_disk.leave(64 * 1024)
  try:
    next(it)
    with pytest.raises(OSError) as raised:
      ckpt.save(_small_state(2, n=2**18))
  finally:
    small_disk.release()
  assert "ckpt-3.flax" in f"{raised.value} {raised.value.filename}"


def _fill_during_tf_write(small_disk):
  if not small_disk.tmpfs:
    pytest.skip("needs a tmpfs to fail TensorFlow's write and not the .flax")
  directory = small_disk.path / "ckpts"
  ckpt, it = _two_checkpoints(directory)
  # Room for the 40 KB .flax, not for TensorFlow's files after it.
  small_disk.leave(40_064 + 8192)
  try:
    next(it)
    with pytest.raises(OSError) as raised:
      ckpt.save(_small_state(2))
  finally:
    small_disk.release()
  # TensorFlow's own ResourceExhaustedError, as an OSError naming the
  # checkpoint, like a failed .flax write.
  assert raised.value.errno == errno.ENOSPC
  assert raised.value.filename == f"{directory}/ckpt-3"
  assert "No space left on device" in str(raised.value)
  assert "ckpt-3" in str(raised.value)
  # The uncommitted files are gone: only ckpt-1 and ckpt-2 remain.
  assert sorted(os.listdir(directory)) == ["checkpoint"] + [
      f"ckpt-{n}{ext}" for n in (1, 2)
      for ext in (".data-00000-of-00001", ".flax", ".index")]
  return directory, ckpt


def test_disk_full_during_tensorflow_write_keeps_previous(small_disk):
  directory, ckpt = _fill_during_tf_write(small_disk)
  _assert_restores(directory, 2)
  # With space again the same object saves; a fresh process restores it.
  saved = ckpt.save(_small_state(2))
  number = checkpoint.CheckpointInfo.from_path(saved).number
  it = _ds()
  fresh = checkpoint.Checkpoint(str(directory), dict(ds_iter=it),
                                max_to_keep=3)
  state = fresh.restore_or_initialize(_small_state(-1))
  assert fresh.restored_from == saved and state["step"] == 2
  np.testing.assert_array_equal(next(it), np.arange(8, 12))
  assert number == 3


def test_disk_full_during_tensorflow_write_retry_keeps_numbering(small_disk):
  directory, ckpt = _fill_during_tf_write(small_disk)
  assert ckpt.save(_small_state(2)) == f"{directory}/ckpt-3"
  assert not [f for f in os.listdir(directory) if "_temp" in f]


# --------------------------------------------------------------------------
# Read-only directories.
# --------------------------------------------------------------------------


@contextlib.contextmanager
def _read_only(directory: Path):
  """Makes `directory` read-only for real: a remounted tmpfs, or chmod."""
  if os.geteuid() == 0:
    if not _mount_tmpfs_ro_copy(directory):
      pytest.skip("root ignores permissions and cannot mount here")
    try:
      yield
    finally:
      _umount(directory)
    return
  modes = {p: p.stat().st_mode for p in [directory, *directory.rglob("*")]}
  for p in modes:
    p.chmod(modes[p] & ~0o222)
  try:
    yield
  finally:
    for p, mode in modes.items():
      p.chmod(mode)


def _mount_tmpfs_ro_copy(directory: Path) -> bool:
  """Replaces `directory` by a tmpfs holding its files, remounted read-only."""
  staged = directory.with_name(directory.name + "-staged")
  shutil.copytree(directory, staged)
  if not _mount_tmpfs(directory, "64m"):
    shutil.rmtree(staged)
    return False
  shutil.copytree(staged, directory, dirs_exist_ok=True)
  done = subprocess.run(["mount", "-o", "remount,ro", str(directory)],
                        capture_output=True, check=False)
  if done.returncode != 0:
    _umount(directory)
    return False
  return True


def test_read_only_directory_restores_and_inspects(tmp_path):
  directory = tmp_path / "ckpts"
  ckpt, it = _two_checkpoints(directory)
  next(it)
  ckpt.save(_small_state(2))
  with _read_only(directory):
    with pytest.raises(OSError):
      (directory / "probe").write_bytes(b"x")
    listing = sorted(os.listdir(directory))
    _assert_restores(directory, 3)
    state = checkpoint.load_state_dict(str(directory))
    assert state["step"] == 2
    report = inspection.inspect_path(str(directory))
    assert [c["number"] for c in report["checkpoints"]] == [1, 2, 3]
    assert all(c["committed"] for c in report["checkpoints"])
    verified = inspection.verify_path(str(directory))
    assert verified["ok"] and verified["checked"] == 3, verified["problems"]
    # A save fails with an OSError and changes nothing.
    it = _ds()
    writer = checkpoint.Checkpoint(str(directory), dict(ds_iter=it),
                                   max_to_keep=3)
    writer.restore_or_initialize(_small_state(-1))
    with pytest.raises(OSError) as raised:
      writer.save(_small_state(3))
    assert raised.value.errno in (errno.EROFS, errno.EACCES)
    assert sorted(os.listdir(directory)) == listing
