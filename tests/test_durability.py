"""Durability order of every local write (docs/CONTRACTS.md, "Durability").

The local seam's calls are recorded (`fs_recorder.FsRecorder`) and the order
checked: a file's data is fsynced before its atomic rename and its
directory after it; a `.flax` is in place before TensorFlow's commit; the
rewritten `checkpoint` state file is fsynced (with its directory) before
any file it stopped listing is deleted; a migration's manifest is replaced
durably, after the step it records was committed.
"""

import os

import numpy as np
import pytest

from clu_ckpt import checkpoint
from clu_ckpt import flax_format
from clu_ckpt import local_fs
from clu_ckpt import save_protocol
from clu_ckpt import storage
from fs_recorder import FsRecorder
from migration_helpers import clu_save
from migration_helpers import dataset_iterator
from migration_helpers import example_state


def _marking_commit(monkeypatch, rec):
  """Marks TensorFlow's write and commit (C++, not seen by the recorder)."""
  real = save_protocol.commit

  def commit(manager, tf_checkpoint, base_directory, ckpt, **kw):
    rec.mark(f"commit-begin {os.path.basename(ckpt)}")
    real(manager, tf_checkpoint, base_directory, ckpt, **kw)
    rec.mark(f"commit-end {os.path.basename(ckpt)}")

  monkeypatch.setattr(save_protocol, "commit", commit)


def test_atomic_writer_syncs_data_before_rename_and_directory_after(
    tmp_path, monkeypatch):
  rec = FsRecorder(tmp_path).install(monkeypatch)
  with storage.atomic_writer(str(tmp_path / "a.bin")) as write:
    write(b"x" * 1000)
    write(b"y" * (17 << 20))  # more than one staging buffer
  storage.create_exclusive(str(tmp_path / "b.lock"), b"mine")
  flax_format.save_file({"w": np.arange(4.0)}, str(tmp_path / "c.flax"))
  assert rec.assert_every_rename_durable() == 3
  for name in ("a.bin", "b.lock", "c.flax"):
    assert len(rec.renames_into(tmp_path / name)) == 1, name


def test_save_puts_the_flax_durably_in_place_before_the_commit(
    tmp_path, monkeypatch):
  run = tmp_path / "run"
  rec = FsRecorder(tmp_path).install(monkeypatch)
  _marking_commit(monkeypatch, rec)
  ckpt = checkpoint.Checkpoint(str(run), dict(ds=dataset_iterator()), max_to_keep=1)
  for step in (1, 2):
    ckpt.save(example_state(step))
  assert rec.assert_every_rename_durable() >= 2
  for n in (1, 2):
    (flax,) = rec.renames_into(run / f"ckpt-{n}.flax")
    begin = rec.events.index(("mark", f"commit-begin ckpt-{n}"))
    assert flax < begin
    # The directory sync that makes the rename durable precedes the commit.
    assert flax < rec.index("fsync", run, start=flax) < begin
  # The pruned `.flax` of ckpt-1 goes after the commit of ckpt-2.
  (removed,) = rec.removals([run / "ckpt-1.flax"])
  assert removed > rec.events.index(("mark", "commit-end ckpt-2"))


def test_unlisting_is_synced_before_future_files_are_deleted(
    tmp_path, monkeypatch):
  run = tmp_path / "run"
  ckpt = checkpoint.Checkpoint(str(run), dict(ds=dataset_iterator()))
  for step in (1, 2, 3):
    ckpt.save(example_state(step))
  rec = FsRecorder(tmp_path).install(monkeypatch)
  _marking_commit(monkeypatch, rec)
  again = checkpoint.Checkpoint(str(run), dict(ds=dataset_iterator()))
  again.restore(example_state(0), checkpoint=str(run / "ckpt-1"))
  again.save(example_state(2))  # ckpt-2 and ckpt-3 are future checkpoints
  future = [run / f"ckpt-{n}{s}" for n in (2, 3)
            for s in (".flax", ".index", ".data-00000-of-00001")]
  removals = rec.removals(future)
  assert len(removals) >= 5, rec.events  # ckpt-2's .flax may be replaced
  begin = rec.events.index(("mark", "commit-begin ckpt-2"))
  assert min(removals) < begin
  rec.assert_synced_before(run / "checkpoint", min(removals))


def test_migration_records_a_step_durably_after_its_commit(tmp_path,
                                                            monkeypatch):
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  clu_save(tmp_path / "src", [example_state(1), example_state(2)])
  rec = FsRecorder(tmp_path / "dst").install(monkeypatch)
  assert migration.migrate(str(tmp_path / "src"), str(tmp_path / "dst")).ok
  manifest = rec.renames_into(tmp_path / "dst" / "clu_ckpt_manifest.json")
  assert len(manifest) == 2, rec.events
  for i in manifest:
    rec.assert_durable_rename(i)
  # Each record follows the rename that committed the step it records.
  for step, record in zip((1, 2), manifest):
    (committed,) = rec.renames_into(tmp_path / "dst" / str(step))
    assert committed < record


def test_exclusive_create_and_sync_flush_the_file_then_its_directory(
    tmp_path, monkeypatch):
  fs = local_fs.LocalFileSystem()
  (tmp_path / "f").write_bytes(b"x")
  os.mkfifo(tmp_path / "pipe")
  rec = FsRecorder(tmp_path).install(monkeypatch)
  fs.create_exclusive(str(tmp_path / "lock"), b"mine")
  (link,) = rec.renames_into(tmp_path / "lock")
  rec.assert_durable_rename(link)
  start = len(rec.events)
  fs.sync(str(tmp_path / "f"))
  fs.sync(str(tmp_path / "pipe"))  # not opened (it could block): its directory
  assert rec.events[start:] == [("fsync", str(tmp_path / "f")),
                                ("fsync", str(tmp_path)),
                                ("fsync", str(tmp_path))]
  # A path without a directory part is in the working directory.
  monkeypatch.chdir(tmp_path)
  fs.create_exclusive("lock2", b"mine")
  (link,) = rec.renames_into(tmp_path / "lock2")
  rec.assert_durable_rename(link)
  start = len(rec.events)
  fs.sync("f")
  assert rec.events[start:] == [("fsync", str(tmp_path / "f")),
                                ("fsync", str(tmp_path))]
