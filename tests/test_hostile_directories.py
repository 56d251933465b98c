"""Hostile checkpoint directories: clu_ckpt never harms what lies outside them.

The threat model is written in `docs/CONTRACTS.md` ("Threat model"). Each test
builds a checkpoint directory `run/` beside `outside/`, a tree of victim files
named like checkpoints, makes `run/` lead there (TensorFlow's `checkpoint`
file listing absolute or `..` paths, symlinks, names of other programs), runs
the library, and asserts that nothing outside `run/` was created, changed or
deleted. The same operations on the real clu 0.0.12 are run where that shows
the test can fail: clu deletes the victims.
"""

import contextlib
import json
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile
import time

from clu import checkpoint as clu_checkpoint
import numpy as np
import pytest
import tensorflow as tf

from clu_ckpt import checkpoint
from clu_ckpt import inspection
from clu_ckpt import layout
from clu_ckpt import storage
from clu_ckpt import tf_manager

REPO = pathlib.Path(__file__).resolve().parents[1]


def dataset_iterator():
  return iter(tf.data.Dataset.range(1000).batch(2))


def snapshot(root: pathlib.Path, skip: tuple[str, ...] = ()) -> dict:
  """Every entry below `root` (not below `skip`): type, bytes, link, mtime."""
  out = {}
  for directory, dirs, files in os.walk(root):
    rel_dir = os.path.relpath(directory, root)
    dirs[:] = [d for d in dirs
               if os.path.normpath(os.path.join(rel_dir, d)) not in skip]
    for name in dirs + files:
      path = os.path.join(directory, name)
      rel = os.path.normpath(os.path.relpath(path, root))
      st = os.lstat(path)
      if os.path.islink(path):
        out[rel] = ("link", os.readlink(path))
      elif os.path.isdir(path):
        out[rel] = ("dir", st.st_mtime_ns)  # changes with its entries
      else:
        out[rel] = ("file", pathlib.Path(path).read_bytes(), st.st_mtime_ns)
  return out


def plant_victims(outside: pathlib.Path, name: str = "ckpt") -> None:
  """Files that look like checkpoints 1..6 of `name`, and a `_temp` dir."""
  outside.mkdir(parents=True, exist_ok=True)
  for n in range(1, 7):
    for suffix in (".index", ".data-00000-of-00001", ".flax"):
      (outside / f"{name}-{n}{suffix}").write_bytes(b"victim %d" % n)
    (outside / f"{name}-{n}_temp").mkdir()
    (outside / f"{name}-{n}_temp" / "part").write_bytes(b"victim")
  (outside / "checkpoint").write_text('model_checkpoint_path: "ckpt-6"\n')


def write_state(directory: pathlib.Path, latest: str, paths: list[str]) -> None:
  """A `checkpoint` file whose entries TensorFlow manages (recent stamps)."""
  now = time.time()
  lines = [f'model_checkpoint_path: "{latest}"']
  lines += [f'all_model_checkpoint_paths: "{p}"' for p in paths]
  lines += [f"all_model_checkpoint_timestamps: {now - 100 + i}"
            for i in range(len(paths))]
  lines.append(f"last_preserved_timestamp: {now - 1000}")
  directory.mkdir(parents=True, exist_ok=True)
  (directory / "checkpoint").write_text("\n".join(lines) + "\n")


def listing_forms(top: pathlib.Path, form: str) -> list[str]:
  """Paths of outside/ckpt-1..3 as the `checkpoint` file would list them."""
  outside = top / "outside"
  return {
      "absolute": [str(outside / f"ckpt-{n}") for n in (1, 2, 3)],
      "dotdot": [f"../outside/ckpt-{n}" for n in (1, 2, 3)],
      "dotdot_inside": [f"sub/../../outside/ckpt-{n}" for n in (1, 2, 3)],
  }[form]


def save_a_few(lib, run: pathlib.Path, restore: bool) -> list[str]:
  ckpt = lib.Checkpoint(str(run), dict(ds=dataset_iterator()), max_to_keep=2)
  saved = []
  if restore:
    try:
      ckpt.restore_or_initialize({"x": np.zeros(3)})
    except Exception:  # pylint: disable=broad-except
      pass  # what the listed outside files hold is not a checkpoint
  for step in range(4):
    saved.append(ckpt.save({"x": np.full(3, step)}))
  return saved


@pytest.mark.parametrize("form", ["absolute", "dotdot", "dotdot_inside"])
@pytest.mark.parametrize("restore", [False, True])
def test_save_never_touches_listed_checkpoints_outside(tmp_path, caplog, form,
                                                      restore):
  plant_victims(tmp_path / "outside")
  run = tmp_path / "run"
  paths = listing_forms(tmp_path, form)
  write_state(run, paths[-1], paths)
  before = snapshot(tmp_path, skip=("run",))
  with caplog.at_level(logging.WARNING):
    saved = save_a_few(checkpoint, run, restore)
  assert snapshot(tmp_path, skip=("run",)) == before
  # With or without the (failing) restore of the outside latest, the saves
  # number from 1 and only this directory's own files remain.
  assert saved == [f"{run}/ckpt-{n}" for n in (1, 2, 3, 4)]
  assert sorted(os.listdir(run)) == sorted(
      ["checkpoint"] + [f"ckpt-{n}{s}" for n in (3, 4) for s in
                        (".flax", ".index", ".data-00000-of-00001")])
  warned = "\n".join(r.getMessage() for r in caplog.records)
  assert "outside" in warned and "ckpt-3" in warned


def test_clu_deletes_listed_checkpoints_outside(tmp_path):
  # The threat is real: the same directory makes clu 0.0.12 delete victims.
  plant_victims(tmp_path / "outside")
  run = tmp_path / "run"
  paths = listing_forms(tmp_path, "absolute")
  write_state(run, paths[-1], paths)
  before = snapshot(tmp_path, skip=("run",))
  with pytest.raises(AssertionError):
    save_a_few(clu_checkpoint, run, restore=False)
  gone = set(before) - set(snapshot(tmp_path, skip=("run",)))
  assert "outside/ckpt-3.flax" in gone and "outside/ckpt-3.index" in gone


def test_outside_entries_between_own_checkpoints(tmp_path):
  plant_victims(tmp_path / "outside")
  run = tmp_path / "run"
  first = checkpoint.Checkpoint(str(run), dict(ds=dataset_iterator()),
                                max_to_keep=3)
  for step in range(2):
    first.save({"x": np.full(3, step)})
  write_state(run, f"{run}/ckpt-2",
              [str(tmp_path / "outside/ckpt-5"), f"{run}/ckpt-1",
               "../outside/ckpt-6", f"{run}/ckpt-2"])
  before = snapshot(tmp_path, skip=("run",))
  ckpt = checkpoint.Checkpoint(str(run), dict(ds=dataset_iterator()),
                               max_to_keep=2)
  state = ckpt.restore_or_initialize({"x": np.zeros(3)})
  np.testing.assert_array_equal(state["x"], np.full(3, 1))
  for step in range(2, 6):
    ckpt.save({"x": np.full(3, step)})
  assert snapshot(tmp_path, skip=("run",)) == before
  assert ckpt.tf_checkpoint_manager.checkpoints == [f"{run}/ckpt-5",
                                                   f"{run}/ckpt-6"]


def plant_symlinks(run: pathlib.Path, numbers=(1, 2)) -> None:
  """Symlinks where the next checkpoints' files go, all leading outside."""
  run.mkdir(parents=True, exist_ok=True)
  for n in numbers:
    os.symlink(f"../outside/ckpt-{n}.index", run / f"ckpt-{n}.index")
    os.symlink(f"../outside/ckpt-{n}.data-00000-of-00001",
               run / f"ckpt-{n}.data-00000-of-00001")
    os.symlink(f"../outside/ckpt-{n}.flax", run / f"ckpt-{n}.flax")
    os.symlink(f"../outside/ckpt-{n}_temp", run / f"ckpt-{n}_temp")
    os.symlink(f"../outside/ckpt-{n}.flax", run / f"ckpt-{n}.flax.tmp-1-ab")
  os.symlink("../outside/checkpoint", run / "checkpoint.tmp123")


@pytest.mark.parametrize("state_link", [False, True])
def test_writes_never_follow_symlinks_out(tmp_path, state_link):
  plant_victims(tmp_path / "outside")
  run = tmp_path / "run"
  plant_symlinks(run, numbers=(1, 2, 3))
  if state_link:
    os.symlink("../outside/checkpoint", run / "checkpoint")
  before = snapshot(tmp_path, skip=("run",))
  saved = save_a_few(checkpoint, run, restore=False)
  assert snapshot(tmp_path, skip=("run",)) == before
  assert saved[-1] == f"{run}/ckpt-4"
  for name in os.listdir(run):
    assert not os.path.islink(run / name), name
  restored = checkpoint.load_state_dict(str(run))
  np.testing.assert_array_equal(restored["x"], np.full(3, 3))


def test_tensorflow_alone_writes_through_a_symlinked_index(tmp_path):
  # Why clu_ckpt removes such symlinks itself: TensorFlow writes through one.
  plant_victims(tmp_path / "outside")
  run = tmp_path / "run"
  plant_symlinks(run, numbers=(1,))
  before = snapshot(tmp_path, skip=("run",))
  manager = tf.train.CheckpointManager(
      tf.train.Checkpoint(ds=dataset_iterator()), str(run), max_to_keep=2)
  manager.save()
  assert snapshot(tmp_path, skip=("run",)) != before


def test_multihost_save_never_touches_outside(tmp_path, caplog):
  plant_victims(tmp_path / "outside")
  base = tmp_path / "ckpts"
  for host in (0, 1):
    paths = [str(tmp_path / f"outside/ckpt-{n}") for n in (1, 2, 3)]
    write_state(pathlib.Path(f"{base}-{host}"), paths[-1], paths)
  before = snapshot(tmp_path, skip=("ckpts-0", "ckpts-1"))
  for host in (0, 1):
    ckpt = checkpoint.MultihostCheckpoint(
        str(base), dict(ds=dataset_iterator()), host_id=host, max_to_keep=2)
    # The outside entries do not count as common checkpoints.
    assert ckpt.get_latest_checkpoint_to_restore_from() is None
    ckpt.restore_or_initialize({"x": np.zeros(2)})
    for step in range(3):
      ckpt.save({"x": np.full(2, step)})
  assert snapshot(tmp_path, skip=("ckpts-0", "ckpts-1")) == before
  again = checkpoint.MultihostCheckpoint(str(base), host_id=0)
  assert again.get_latest_checkpoint_to_restore_from() == f"{base}-0/ckpt-4"


# ---------------------------------------------------------------------------
# Names of other programs in the `checkpoint` file (compared with clu).
# ---------------------------------------------------------------------------


def other_names(top: pathlib.Path, case: str) -> pathlib.Path:
  """A run directory whose `checkpoint` file lists another program's names."""
  run = top / ("exp-3/run" if case == "unnumbered_in_numbered_dir" else "run")
  names = {
      "other_prefix": ["model.ckpt-4", "model.ckpt-5"],
      "unnumbered": ["model.ckpt"],
      "unnumbered_in_numbered_dir": ["model.ckpt"],
      "foreign_then_own": ["model.ckpt-9", "ckpt-1"],
  }[case]
  run.mkdir(parents=True)
  for name in names:
    for suffix in (".index", ".data-00000-of-00001"):
      (run / f"{name}{suffix}").write_bytes(b"another program's file")
  if case == "foreign_then_own":
    (run / "ckpt-1.index").unlink()
    (run / "ckpt-1.data-00000-of-00001").unlink()
    helper = tf.train.CheckpointManager(
        tf.train.Checkpoint(ds=dataset_iterator()), str(run), 3)
    helper.save()
    (run / "ckpt-1.flax").write_bytes(
        checkpoint.flax_format.save({"x": np.zeros(3)}))
  write_state(run, names[-1], names)
  return run


@pytest.fixture
def plain_tmp():
  """A temporary directory with no `-<digit>` in its path (pytest's has)."""
  path = pathlib.Path(tempfile.mkdtemp(prefix="clu_ckpt_plain_"))
  assert not any(c.isdigit() for c in str(path).split("-", 1)[1:]), path
  yield path
  shutil.rmtree(path)


def _save_twice(lib, run: pathlib.Path) -> object:
  try:
    ckpt = lib.Checkpoint(str(run), dict(ds=dataset_iterator()),
                          max_to_keep=2)
    return [ckpt.save({"x": np.full(3, i)}) for i in range(2)]
  except Exception as e:  # pylint: disable=broad-except
    return e


@pytest.mark.parametrize("case", ["other_prefix", "unnumbered",
                                  "unnumbered_in_numbered_dir",
                                  "foreign_then_own"])
def test_other_programs_names_save_where_clu_saves(plain_tmp, case):
  tmp_path = plain_tmp
  theirs = other_names(tmp_path / "clu", case)
  ours = other_names(tmp_path / "ours", case)
  clu_result = _save_twice(clu_checkpoint, theirs)
  before = snapshot(tmp_path / "ours", skip=(os.path.relpath(
      ours, tmp_path / "ours"),))
  our_result = _save_twice(checkpoint, ours)
  # Where clu saves, clu_ckpt saves the same files; where clu fails (it mixes
  # the listed name with its own), clu_ckpt saves its own names all the same.
  assert our_result == [f"{ours}/ckpt-1", f"{ours}/ckpt-2"]
  if not isinstance(clu_result, Exception):
    assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
  assert snapshot(tmp_path / "ours", skip=(os.path.relpath(
      ours, tmp_path / "ours"),)) == before
  assert checkpoint.load_state_dict(str(ours))["x"].tolist() == [1, 1, 1]


def test_unnumbered_name_does_not_depend_on_the_parent_directory(plain_tmp):
  tmp_path = plain_tmp
  plain = other_names(tmp_path / "a", "unnumbered")
  numbered = other_names(tmp_path / "b", "unnumbered_in_numbered_dir")
  for run in (plain, numbered):
    _save_twice(checkpoint, run)
  assert sorted(os.listdir(plain)) == sorted(os.listdir(numbered))
  assert sorted(os.listdir(numbered.parent)) == ["run"]  # nothing in exp-3/


# ---------------------------------------------------------------------------
# Files that are not regular files: an error within a second, never a hang.
# ---------------------------------------------------------------------------


_NAMED_PIPE_CASES = {
    # the state file, when a manager is made and when it is read
    "checkpoint-manager": ("checkpoint",
                           lambda run, ds: checkpoint.Checkpoint(
                               run, dict(ds=ds))),
    "checkpoint-load": ("checkpoint",
                        lambda run, ds: checkpoint.load_state_dict(run)),
    "flax-load": ("ckpt-1.flax",
                  lambda run, ds: checkpoint.load_state_dict(run)),
    "flax-restore": ("ckpt-1.flax",
                     lambda run, ds: checkpoint.Checkpoint(run).restore(None)),
    # what TensorFlow opens on restore
    "index-restore": ("ckpt-1.index",
                      lambda run, ds: checkpoint.Checkpoint(
                          run, dict(ds=ds)).restore(None)),
    "data-restore": ("ckpt-1.data-00000-of-00001",
                     lambda run, ds: checkpoint.Checkpoint(
                         run, dict(ds=ds)).restore(None)),
}

# How long a case may block before its pipe is opened for writing, which
# wakes a reader stuck in open(2) (and then read(2) sees end-of-file): the
# case fails naming the path instead of hanging the run.
_PIPE_TIMEOUT = 5.0

# A separate process, not a thread: TensorFlow blocks in open(2) holding the
# GIL. It records in $2 that it had to unblock a reader of $1.
_UNBLOCKER = """
sleep "$3"
: > "$1" && echo hung > "$2"
while :; do : > "$1"; sleep 0.05; done
"""


@contextlib.contextmanager
def _unblocking(fifo: pathlib.Path, seconds: float):
  """Yields a function telling whether a reader of `fifo` was still blocked
  after `seconds` (it was then woken by a writer opening the pipe)."""
  marker = fifo.parent.parent / f"{fifo.name}.hung"
  helper = subprocess.Popen(
      ["sh", "-c", _UNBLOCKER, "sh", str(fifo), str(marker), str(seconds)],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    yield marker.exists
  finally:
    helper.kill()
    helper.wait()


@pytest.mark.parametrize("case", list(_NAMED_PIPE_CASES))
def test_named_pipe_is_an_error_not_a_hang(tmp_path, case):
  fifo_name, call = _NAMED_PIPE_CASES[case]
  run = tmp_path / "run"
  checkpoint.Checkpoint(str(run), dict(ds=dataset_iterator())).save(
      {"x": np.arange(3)})
  fifo = run / fifo_name
  fifo.unlink()
  os.mkfifo(fifo)
  ds = dataset_iterator()
  with _unblocking(fifo, _PIPE_TIMEOUT) as hung:
    start = time.monotonic()
    try:
      call(str(run), ds)
      error = None
    except Exception as e:  # pylint: disable=broad-except
      error = e
    seconds = time.monotonic() - start
  assert not hung(), (f"{fifo} was opened as a file: blocked for more than "
                    f"{_PIPE_TIMEOUT} s ({error!r} once unblocked)")
  assert isinstance(error, storage.NotRegularFileError), repr(error)
  assert str(fifo) in str(error) and "named pipe" in str(error)
  assert seconds < 1.0


# ---------------------------------------------------------------------------
# Containment against a sibling whose name begins with the directory's own
# (`/x/ckpt` and `/x/ckpt-evil`): a prefix test of paths would let it in.
# ---------------------------------------------------------------------------


def _sibling_link(tmp_path: pathlib.Path, name: str) -> pathlib.Path:
  """`tmp_path/ckpt/<name>` a symlink to `tmp_path/ckpt-evil/<name>`."""
  run, evil = tmp_path / "ckpt", tmp_path / "ckpt-evil"
  evil.mkdir(exist_ok=True)
  (run / name).rename(evil / name)
  (run / name).symlink_to(evil / name)
  return run / name


def test_check_inside_refuses_a_symlink_into_a_sibling_prefix(tmp_path):
  run = tmp_path / "ckpt"
  run.mkdir()
  (run / "ckpt-1.flax").write_bytes(b"x")
  layout.check_inside(str(run), str(run / "ckpt-1.flax"))
  link = _sibling_link(tmp_path, "ckpt-1.flax")
  with pytest.raises(layout.OutsideDirectoryError, match="ckpt-evil"):
    layout.check_inside(str(run), str(link))
  # The directory itself reached through a symlink is still inside.
  (tmp_path / "alias").symlink_to(run)
  layout.check_inside(str(tmp_path / "alias"),
                      str(tmp_path / "alias" / "ckpt-2.flax"))


@pytest.mark.parametrize("name", ["ckpt-1.flax", "ckpt-1.index"])
def test_verify_refuses_a_file_linked_into_a_sibling_prefix(tmp_path, name):
  run = tmp_path / "ckpt"
  checkpoint.Checkpoint(str(run), dict(ds=dataset_iterator())).save(
      {"x": np.arange(3)})
  assert inspection.verify_path(str(run))["ok"]
  link = _sibling_link(tmp_path, name)
  result = inspection.verify_path(str(run))
  assert not result["ok"]
  assert [p for p in result["problems"] if str(link) in p and "ckpt-evil" in p]


def test_bucket_pruning_never_deletes_outside_the_directory(gcs):
  """A save in `gs://B/t/ckpt` prunes nothing in `t/ckpt-evil/` or `t/`.

  The `checkpoint` file lists checkpoints there (kept out of the manager's
  list) and `clu_ckpt-pruning.json` names them (a save killed after its
  commit leaves it; the next save deletes what it names that is unlisted).
  """
  fs = gcs.fs()
  bucket = gcs.bucket()
  run = f"gs://{bucket}/t/ckpt"
  victims = {}
  for where in ("t/ckpt-evil", "t"):
    for n in (1, 2):
      for suffix in (".index", ".data-00000-of-00001", ".flax"):
        key = f"{bucket}/{where}/ckpt-{n}{suffix}"
        victims[key] = f"victim {key}".encode()
        fs.pipe_file(key, victims[key])
  outside = [f"gs://{bucket}/t/ckpt-evil/ckpt-1", f"{run}-evil/ckpt-2",
             f"gs://{bucket}/t/ckpt-1", f"{run}/../ckpt-2"]
  now = time.time()
  state = [f'model_checkpoint_path: "{outside[-1]}"']
  state += [f'all_model_checkpoint_paths: "{p}"' for p in outside]
  state += [f"all_model_checkpoint_timestamps: {now - 100 + i}"
            for i in range(len(outside))]
  state.append(f"last_preserved_timestamp: {now - 1000}")
  fs.pipe_file(f"{bucket}/t/ckpt/checkpoint", "\n".join(state).encode())
  fs.pipe_file(f"{bucket}/t/ckpt/{tf_manager.PRUNING_FILENAME}",
               json.dumps(outside).encode())
  ckpt = checkpoint.Checkpoint(run, dict(ds=dataset_iterator()),
                               max_to_keep=1)
  for step in range(3):
    ckpt.save({"x": np.full(3, step)})
  fs = gcs.fs()
  for key, data in victims.items():
    assert fs.exists(key), f"{key} was deleted"
    assert fs.cat_file(key) == data, key
  assert sorted(storage.listdir(run)) == [
      "checkpoint", "ckpt-3.data-00000-of-00001", "ckpt-3.flax",
      "ckpt-3.index"]


def test_outside_errors_name_the_path_the_directory_and_how(tmp_path):
  run, evil = tmp_path / "ckpt", tmp_path / "ckpt-evil"
  run.mkdir()
  evil.mkdir()
  (run / "link").symlink_to(evil / "x")
  for path, how in ((f"{run}/../ckpt-evil/x", "a path through '..'"),
                    (f"{evil}/x", "a path elsewhere"),
                    (f"{run}/link", f"a symlink to {evil}/x")):
    with pytest.raises(layout.OutsideDirectoryError) as raised:
      layout.check_inside(str(run), path)
    assert str(raised.value) == (f"{path}: resolves outside the checkpoint "
                                 f"directory {run} ({how}); refused")
    assert (raised.value.path, raised.value.directory) == (path, str(run))


def test_what_is_not_a_checkpoint_directory(tmp_path):
  assert not layout.is_checkpoint_directory(str(tmp_path / "missing"))
  assert not layout.is_checkpoint_directory(str(tmp_path))
  (tmp_path / "ckpt-1.flax").write_bytes(b"")
  assert layout.is_checkpoint_directory(str(tmp_path))
  with pytest.raises(ValueError, match="^an empty path$"):
    layout.absolute("")


def test_no_directory_contains_itself(tmp_path):
  assert not layout.is_contained("/", "/")  # the one path with an empty name
  assert not layout.is_contained(str(tmp_path), str(tmp_path))
  assert not layout.is_contained(str(tmp_path), f"{tmp_path}/.")
