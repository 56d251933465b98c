"""Tests for `clu_ckpt.layout`: checkpoint names and directory containment."""

import logging
import os
import re

import pytest

from clu_ckpt import errors
from clu_ckpt import layout


@pytest.mark.parametrize("path, expected", [
    ("/ckpts/ckpt-7", ("ckpt", 7)),
    ("ckpt-0", ("ckpt", 0)),
    ("gs://b/run-9/model-12", ("model", 12)),
    ("/runs/exp-3/model.ckpt-5", ("model.ckpt", 5)),
    ("/a/ckpt-3-4", ("ckpt-3", 4)),
    ("/a/ckpt-007", ("ckpt", 7)),
    # Digits in a parent directory never make a number.
    ("/runs/exp-3/model.ckpt", None),
    ("/runs/exp-3/", None),
    ("ckpt-3.flax", None),
    ("ckpt", None),
    ("", None),
])
def test_split_checkpoint_reads_the_base_name_only(path, expected):
  assert layout.split_checkpoint(path) == expected


def test_checkpoint_number_requires_the_name():
  assert layout.checkpoint_number("/d/ckpt-4", "ckpt") == 4
  assert layout.checkpoint_number("/d/model.ckpt-4", "ckpt") is None
  assert layout.checkpoint_number("/d-4/model.ckpt", "model.ckpt") is None


@pytest.mark.parametrize("directory, path, inside", [
    ("/r/a", "/r/a/ckpt-1", True),
    ("/r/a/", "/r/a/./ckpt-1", True),
    ("/r/a", "/r/a/sub/ckpt-1", False),
    ("/r/a", "/r/a/../b/ckpt-1", False),
    ("/r/a", "/r/a/sub/../../a/ckpt-1", True),
    ("/r/a", "/elsewhere/ckpt-1", False),
    ("/r/a", "/r/a", False),
    ("/r/a", "/r/a/..", False),
    ("/r/a", "/r", False),
    ("gs://b/run", "gs://b/run/ckpt-1", True),
    ("gs://b/run", "gs://other/run/ckpt-1", False),
    ("gs://b/run", "s3://b/run/ckpt-1", False),
    ("gs://b/run", "/b/run/ckpt-1", False),
    ("file:///r/a", "/r/a/ckpt-1", True),
])
def test_is_contained(directory, path, inside):
  assert layout.is_contained(directory, path) is inside


def test_is_contained_relative_and_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert layout.is_contained("run", str(tmp_path / "run" / "ckpt-1"))
  assert layout.is_contained(str(tmp_path / "run"), "run/ckpt-1")
  assert not layout.is_contained("run", "other/ckpt-1")


def test_check_inside_follows_symlinks(tmp_path):
  run, outside = tmp_path / "run", tmp_path / "outside"
  run.mkdir()
  outside.mkdir()
  (outside / "secret").write_text("x")
  (run / "real.flax").write_text("x")
  os.symlink("real.flax", run / "alias.flax")
  os.symlink("../outside/secret", run / "ckpt-1.flax")
  os.symlink(str(outside), run / "sub")
  layout.check_inside(str(run), str(run / "real.flax"))
  layout.check_inside(str(run), str(run / "alias.flax"))
  with pytest.raises(layout.OutsideDirectoryError,
                     match=r"ckpt-1\.flax: resolves outside .*a symlink to"):
    layout.check_inside(str(run), str(run / "ckpt-1.flax"))
  with pytest.raises(layout.OutsideDirectoryError, match="'\\.\\.'"):
    layout.check_inside(str(run), f"{run}/../outside/secret")
  with pytest.raises(layout.OutsideDirectoryError, match="a path elsewhere"):
    layout.check_inside(str(run), str(outside / "secret"))
  with pytest.raises(layout.OutsideDirectoryError):
    layout.check_inside(str(run), str(run / "sub" / "secret"))


def test_check_inside_symlinked_directory_itself(tmp_path):
  # The directory a user names may itself be a symlink: its own files count.
  (tmp_path / "real").mkdir()
  (tmp_path / "real" / "ckpt-1.flax").write_text("x")
  os.symlink("real", tmp_path / "link")
  layout.check_inside(str(tmp_path / "link"),
                      str(tmp_path / "link" / "ckpt-1.flax"))


def test_check_inside_symlink_loop_is_not_an_error_here(tmp_path):
  # A loop cannot lead outside; reading it fails later with ELOOP.
  os.symlink("ckpt-1.flax", tmp_path / "ckpt-1.flax")
  layout.check_inside(str(tmp_path), str(tmp_path / "ckpt-1.flax"))


@pytest.mark.parametrize("path", ["gs://bucket//run/./ckpt/", "/a//b/../c/",
                                  "rel/./x/", "x", "/", "./a"])
def test_normpath(path):
  scheme, rest = layout.split_scheme(path)
  assert layout.normpath(path) == scheme + os.path.normpath(rest)


def test_absolute_makes_local_paths_plain_and_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert layout.absolute("runs/a/") == str(tmp_path / "runs" / "a")
  assert layout.absolute("file:///runs/x/../a/") == "/runs/a"
  assert layout.absolute("FILE:///runs/a") == "/runs/a"
  assert layout.absolute("gs://b//runs/./a/") == "gs://b/runs/a"
  with pytest.raises(errors.UsageError):
    layout.absolute("")


def test_multihost_latest_only_for_a_multihost_base(tmp_path):
  base = tmp_path / "checkpoints"
  assert layout.multihost_latest(str(base), "ckpt") is None  # nothing there
  base.mkdir()
  assert layout.multihost_latest(str(base), "ckpt") is None  # no hosts
  (tmp_path / "checkpoints-0").mkdir()
  (tmp_path / "checkpoints-1").mkdir()
  with pytest.raises(errors.CheckpointNotFoundError,
                     match=re.escape(str(base))):
    layout.multihost_latest(str(base), "ckpt")  # hosts, nothing in common
  (base / "ckpt-1.flax").write_bytes(b"")
  # The base holds checkpoints itself: it is read as a checkpoint directory.
  assert layout.multihost_latest(str(base), "ckpt") is None


def test_multihost_latest_newest_common_from_the_lowest_host(tmp_path,
                                                             caplog):
  from clu_ckpt import checkpoint  # pylint: disable=g-import-not-at-top
  base = str(tmp_path / "checkpoints")
  for host, count in {1: 4, 2: 3, 3: 5}.items():
    ck = checkpoint.MultihostCheckpoint(base, host_id=host, max_to_keep=3)
    for step in range(1, count + 1):
      ck.save({"step": step})
  with caplog.at_level(logging.INFO, logger="absl"):
    path = layout.multihost_latest(base + "/", "ckpt")
  assert path == f"{base}-1/ckpt-3"
  assert (f"{base}/ is a MultihostCheckpoint base: loading {path}, from host "
          f"1's directory {base}-1 (checkpoint 3 is the newest every host "
          "has)") in [r.getMessage() for r in caplog.records]
  with pytest.raises(errors.CheckpointNotFoundError, match="model-<number>"):
    layout.multihost_latest(base, "model")  # another name: none in common


def _host(directory, numbers, incomplete=()):
  """A host directory listing `numbers`, each with its three kinds of file
  (but for the `.index` of those in `incomplete`)."""
  directory.mkdir()
  paths = [f"{directory}/ckpt-{n}" for n in numbers]
  (directory / "checkpoint").write_text(layout.state_file.format_checkpoint_state(
      str(directory), paths[-1], paths, [1.0e9 + n for n in numbers],
      last_preserved_timestamp=1.0e9 - 1))
  for n in numbers:
    for ext in (".flax", ".data-00000-of-00001") + (
        () if n in incomplete else (".index",)):
      (directory / f"ckpt-{n}{ext}").write_bytes(b"x")
  return str(directory)


def test_newest_common_is_the_newest_number_every_host_has_whole(tmp_path,
                                                                 caplog):
  d0 = _host(tmp_path / "c-0", [1, 2, 3])
  d1 = _host(tmp_path / "c-1", [1, 2, 3, 4], incomplete=[3])
  with caplog.at_level(logging.INFO, logger="absl"):
    found = layout.newest_common({0: d0, 1: d1}, "ckpt")
  assert found == (2, {d0: f"{d0}/ckpt-2", d1: f"{d1}/ckpt-2"})
  messages = [r.getMessage() for r in caplog.records]
  assert (f"Checked checkpoint directories {[d0, d1]}: common numbers "
          "{1, 2, 3}, exclusive numbers {4}") in messages
  assert (f"Checkpoint number 3 is listed by every host, but files are "
          f"missing in {[d1]}; trying older ones") in messages


def test_newest_common_without_a_whole_one_is_the_newest_listed(tmp_path):
  # The restore then fails naming the missing file, rather than starting
  # over (which would delete every host's checkpoints).
  d0 = _host(tmp_path / "c-0", [1, 2], incomplete=[1])
  d1 = _host(tmp_path / "c-1", [1, 2], incomplete=[2])
  assert layout.newest_common({0: d0, 1: d1}, "ckpt") == (
      2, {d0: f"{d0}/ckpt-2", d1: f"{d1}/ckpt-2"})


def test_newest_common_of_no_hosts_or_nothing_common_is_none(tmp_path):
  assert layout.newest_common({}, "ckpt") is None
  d0 = _host(tmp_path / "c-0", [1])
  d1 = _host(tmp_path / "c-1", [2])
  assert layout.newest_common({0: d0, 1: d1}, "ckpt") is None
  assert layout.newest_common({0: d0}, "ckpt") == (1, {d0: f"{d0}/ckpt-1"})


def test_has_files_needs_all_three_kinds(tmp_path):
  kinds = (".flax", ".index", ".data-00000-of-00001")
  for i, missing in enumerate((None,) + kinds):
    for ext in kinds:
      if ext != missing:
        (tmp_path / f"ckpt-{i}{ext}").write_bytes(b"x")
    assert layout.has_files(str(tmp_path / f"ckpt-{i}")) is (
        missing is None), missing
  listing = {}
  assert layout.has_files(str(tmp_path / "ckpt-0"), listing)
  assert str(tmp_path) in listing
  assert not layout.has_files(str(tmp_path / "gone" / "ckpt-0"), listing)


def test_debris_names_may_hold_any_character():
  names = {"ckpt-1.flax.tmp-a\nb", "ckpt-1.flax"}
  assert layout.is_debris("ckpt-1.flax.tmp-a\nb", names, "ckpt", 3, 4)
  assert not layout.is_debris("ckpt-1.flax.tmp-a\nb", names, "ckpt", 1, 4)


@pytest.mark.parametrize("base", ["runX", "run "])
def test_host_directories_are_the_bases_own(tmp_path, base):
  for name in (f"{base}-0", f"{base.rstrip('X ')}-1", f"{base}-x"):
    (tmp_path / name).mkdir()
  assert layout.host_directories(str(tmp_path / base)) == {
      0: str(tmp_path / f"{base}-0")}


def test_debris_bounds_are_the_latest_and_the_oldest_kept_number():
  # TensorFlow's `_temp/` up to the latest number (that of the latest
  # itself is left from its write); a `.flax` only below the oldest kept.
  assert layout.is_debris("ckpt-4_temp", set(), "ckpt", 3, 4)
  assert not layout.is_debris("ckpt-5_temp", set(), "ckpt", 3, 4)
  assert not layout.is_debris("ckpt-3.flax", {"ckpt-3.flax"}, "ckpt", 3, 4)
  assert layout.is_debris("ckpt-2.flax", {"ckpt-2.flax"}, "ckpt", 3, 4)
