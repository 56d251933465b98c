"""Tests for `clu_ckpt.storage`: the `checkpoint` state file, atomic writes.

TensorFlow is the oracle for the state file: files written by a real
`tf.train.CheckpointManager` (or by hand) must parse exactly as
`tf.train.get_checkpoint_state` parses them, and `managed_checkpoints()` must
list what a fresh `tf.train.CheckpointManager` lists.
"""

import errno
import os
import resource
import signal
import shutil
import tempfile
import pathlib
import time
from typing import Optional

import numpy as np
import pytest
import tensorflow as tf

from clu_ckpt import storage

WEIRD_NAMES = [
    "plain",
    "sp ace",
    'quo"te',
    "apo'strophe",
    "back\\slash",
    "tab\there",
    "new\nline",
    "ünïcødé-€",
    "ctrl\x01\x7f",
]


def manager(directory: str, name: str = "ckpt",
            max_to_keep: int = 3) -> tf.train.CheckpointManager:
  return tf.train.CheckpointManager(
      tf.train.Checkpoint(v=tf.Variable(1.0)), directory,
      max_to_keep=max_to_keep, checkpoint_name=name)


def assert_same_as_tf(directory: str) -> Optional[storage.CheckpointState]:
  """read_checkpoint_state(directory) equals tf.train.get_checkpoint_state."""
  ours = storage.read_checkpoint_state(directory)
  theirs = tf.train.get_checkpoint_state(directory)
  if theirs is None:
    assert ours is None
    return None
  assert ours is not None
  assert ours.model_checkpoint_path == theirs.model_checkpoint_path
  assert ours.all_model_checkpoint_paths == list(
      theirs.all_model_checkpoint_paths)
  assert ours.all_model_checkpoint_timestamps == list(
      theirs.all_model_checkpoint_timestamps)
  assert ours.last_preserved_timestamp == theirs.last_preserved_timestamp
  return ours


def fresh_manager_checkpoints(directory: str) -> list[str]:
  return tf.train.CheckpointManager(tf.train.Checkpoint(), directory,
                                    max_to_keep=5).checkpoints


def write_state(directory: pathlib.Path, text: str) -> None:
  directory.mkdir(parents=True, exist_ok=True)
  (directory / "checkpoint").write_text(text, encoding="utf-8")


def state_text(paths: list[str], stamps: Optional[list[float]],
               last_preserved: Optional[float]) -> str:
  lines = [f'model_checkpoint_path: "{paths[-1]}"']
  lines += [f'all_model_checkpoint_paths: "{p}"' for p in paths]
  lines += [f"all_model_checkpoint_timestamps: {t!r}" for t in stamps or []]
  if last_preserved is not None:
    lines.append(f"last_preserved_timestamp: {last_preserved!r}")
  return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# The `checkpoint` state file, written by TensorFlow.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("saves,max_to_keep", [(1, 3), (3, 3), (5, 2)])
def test_state_written_by_checkpoint_manager(tmp_path, saves, max_to_keep):
  directory = str(tmp_path / "ckpts")
  mgr = manager(directory, max_to_keep=max_to_keep)
  for _ in range(saves):
    mgr.save()
  state = assert_same_as_tf(directory)
  assert state.model_checkpoint_path == f"{directory}/ckpt-{saves}"
  assert state.managed_checkpoints() == fresh_manager_checkpoints(directory)
  assert state.managed_checkpoints() == mgr.checkpoints
  assert len(state.managed_checkpoints()) == min(saves, max_to_keep)


@pytest.mark.parametrize("name", WEIRD_NAMES)
def test_escaped_characters_in_paths(tmp_path, name):
  directory = tmp_path / f"dir {name}"
  directory.mkdir()
  mgr = manager(str(directory), name=f"ck-{name}")
  mgr.save()
  mgr.save()
  raw = (directory / "checkpoint").read_bytes()
  state = assert_same_as_tf(str(directory))
  assert state.model_checkpoint_path == f"{directory}/ck-{name}-2"
  assert state.managed_checkpoints() == fresh_manager_checkpoints(
      str(directory))
  if any(c in name for c in '"\\\t\n\x01'):
    assert b"\\" in raw  # the file really holds escapes


def test_absolute_paths_written_by_tf(tmp_path):
  directory = tmp_path / "ckpts"
  directory.mkdir()
  elsewhere = [f"/elsewhere/{name}-{i}" for i, name in enumerate(WEIRD_NAMES)]
  tf.compat.v1.train.update_checkpoint_state(
      str(directory), elsewhere[-1],
      all_model_checkpoint_paths=elsewhere,
      all_model_checkpoint_timestamps=[float(i) for i in range(len(elsewhere))],
      last_preserved_timestamp=0.5)
  state = assert_same_as_tf(str(directory))
  assert state.all_model_checkpoint_paths == elsewhere


@pytest.mark.parametrize("text", [
    'model_checkpoint_path: "\\303\\251t\\303\\251"\n',  # octal, UTF-8
    'model_checkpoint_path: "\\x41\\x4a\\x7"\n',
    "model_checkpoint_path: 'single \"quoted\" \\' '\n",
    'model_checkpoint_path: "a\\\\b\\"c\\\'d\\r\\a\\v\\f"\n',
    '# a comment\nmodel_checkpoint_path:"x" # trailing\n'
    'last_preserved_timestamp:1e3\n',
    'model_checkpoint_path: "a"; all_model_checkpoint_paths: "a"\n',
    'model_checkpoint_path: "old"\nmodel_checkpoint_path: "new"\n',
    'model_checkpoint_path: "a"\nlast_preserved_timestamp: -inf\n',
    'model_checkpoint_path: "a"\nall_model_checkpoint_timestamps: 12\n'
    'all_model_checkpoint_timestamps: -1.5e-3\n',
])
def test_hand_written_state_files(tmp_path, text):
  write_state(tmp_path, text)
  assert assert_same_as_tf(str(tmp_path)) is not None


@pytest.mark.parametrize("text", [
    "model_checkpoint_path: ",
    'model_checkpoint_path: "x"\nunknown_field: 3\n',
    'model_checkpoint_path: "unterminated',
    "{{{",
    'model_checkpoint_path: "\\xzz"',
    'last_preserved_timestamp: "x"\nmodel_checkpoint_path: "a"',
    "model_checkpoint_path: 12\n",
    'model_checkpoint_path: "\\351"\n',  # octal escape, invalid UTF-8
])
def test_garbled_state_file_is_none(tmp_path, text):
  write_state(tmp_path, text)
  assert tf.train.get_checkpoint_state(str(tmp_path)) is None
  assert storage.read_checkpoint_state(str(tmp_path)) is None


def test_binary_state_file_is_none(tmp_path):
  (tmp_path / "checkpoint").write_bytes(b"\x00\xff\xfe\x80garbage")
  assert storage.read_checkpoint_state(str(tmp_path)) is None


def test_missing_state_file_is_none(tmp_path):
  assert storage.read_checkpoint_state(str(tmp_path)) is None
  assert storage.read_checkpoint_state(str(tmp_path / "absent")) is None
  assert tf.train.get_checkpoint_state(str(tmp_path)) is None


@pytest.mark.parametrize("text", [
    "", 'model_checkpoint_path: ""\n', 'all_model_checkpoint_paths: "a"\n'])
def test_state_without_latest_raises_like_tf(tmp_path, text):
  write_state(tmp_path, text)
  with pytest.raises(ValueError):
    tf.train.get_checkpoint_state(str(tmp_path))
  with pytest.raises(ValueError, match="Invalid checkpoint state"):
    storage.read_checkpoint_state(str(tmp_path))


def test_file_url_directory(tmp_path):
  directory = tmp_path / "ckpts"
  mgr = manager(str(directory))
  mgr.save()
  url = f"file://{directory}"
  state = assert_same_as_tf(url)
  assert state.model_checkpoint_path == f"{url}/ckpt-1"


# ---------------------------------------------------------------------------
# managed_checkpoints(): what a fresh CheckpointManager would list.
# ---------------------------------------------------------------------------



@pytest.mark.parametrize("stamps,last_preserved", [
    ([-300, -200, -100], -400),     # all newer than last_preserved
    ([-300, -200, -100], -250),     # the oldest is preserved, not managed
    ([-300, -200, -100], -50),      # all preserved
    ([1000, 2000, -100], -400),     # timestamps from the future count as now
    ([-5, 2000, 3000], 1000),       # last_preserved from the future
    (None, -10),                    # old files without timestamps
    (None, None),
    ([-300, -200], -400),           # fewer timestamps than paths
])
def test_managed_checkpoints_equal_tf(tmp_path, stamps, last_preserved):
  now = time.time()
  paths = ["ckpt-1", "ckpt-2", "ckpt-3"]
  write_state(tmp_path, state_text(
      paths, None if stamps is None else [now + s for s in stamps],
      None if last_preserved is None else now + last_preserved))
  state = assert_same_as_tf(str(tmp_path))
  assert state.managed_checkpoints() == fresh_manager_checkpoints(
      str(tmp_path))


def test_managed_checkpoints_now_argument(tmp_path):
  write_state(tmp_path, state_text(["a-1", "a-2"], [100.0, 200.0], 50.0))
  state = storage.read_checkpoint_state(str(tmp_path))
  both = [f"{tmp_path}/a-1", f"{tmp_path}/a-2"]
  assert state.managed_checkpoints(now=1000.0) == both
  assert state.managed_checkpoints(now=150.0) == both  # min(t, now) > 50
  assert state.managed_checkpoints(now=40.0) == []     # before last_preserved


# ---------------------------------------------------------------------------
# atomic_writer, map_file and the small helpers.
# ---------------------------------------------------------------------------


def leftovers(directory: pathlib.Path) -> list[str]:
  return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


def test_atomic_writer_writes_all_pieces(tmp_path):
  target = tmp_path / "out.bin"
  with storage.atomic_writer(str(target)) as write:
    write(b"abc")
    write(bytearray(b"def"))
    write(memoryview(b"0123456789")[2:5])
  assert target.read_bytes() == b"abcdef234"
  assert leftovers(tmp_path) == []


def test_atomic_writer_replaces_existing_file(tmp_path):
  target = tmp_path / "out.bin"
  target.write_bytes(b"old content that is longer")
  with storage.atomic_writer(str(target)) as write:
    write(b"new")
  assert target.read_bytes() == b"new"
  assert leftovers(tmp_path) == []


@pytest.mark.parametrize("existing", [b"old content", None])
def test_atomic_writer_exception_keeps_old_content(tmp_path, existing):
  target = tmp_path / "out.bin"
  if existing is not None:
    target.write_bytes(existing)
  with pytest.raises(RuntimeError, match="midway"):
    with storage.atomic_writer(str(target)) as write:
      write(b"partial new content")
      assert leftovers(tmp_path)  # the data goes to a temporary file
      raise RuntimeError("midway")
  if existing is None:
    assert not target.exists()
  else:
    assert target.read_bytes() == existing
  assert leftovers(tmp_path) == []
  assert sorted(p.name for p in tmp_path.iterdir()) == (
      [] if existing is None else ["out.bin"])


def test_atomic_writer_file_url(tmp_path):
  target = tmp_path / "url.bin"
  with storage.atomic_writer(f"file://{target}") as write:
    write(b"via url")
  assert target.read_bytes() == b"via url"
  assert leftovers(tmp_path) == []


def test_atomic_writer_errors_name_the_file(tmp_path):
  # A real kernel error: RLIMIT_FSIZE makes writes past 64 KiB fail (EFBIG).
  target = tmp_path / "big.bin"
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  resource.setrlimit(resource.RLIMIT_FSIZE, (2**16, hard))
  try:
    with pytest.raises(OSError) as raised:
      with storage.atomic_writer(str(target)) as write:
        write(b"x" * 2**20)
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, handler)
  assert raised.value.errno == errno.EFBIG
  assert raised.value.filename == str(target)
  assert str(target) in str(raised.value)
  assert leftovers(tmp_path) == [] and not target.exists()
  # The caller's own OSErrors inside the block are not relabelled.
  with pytest.raises(FileNotFoundError) as raised:
    with storage.atomic_writer(str(target)) as write:
      write(b"x")
      open(tmp_path / "absent", "rb")  # pylint: disable=consider-using-with
  assert raised.value.filename == str(tmp_path / "absent")
  # Nor is the directory that does not exist hidden.
  with pytest.raises(FileNotFoundError) as raised:
    with storage.atomic_writer(str(tmp_path / "no" / "x.bin")) as write:
      write(b"x")
  assert raised.value.filename == str(tmp_path / "no" / "x.bin")


def test_glob_keeps_the_file_scheme(tmp_path):
  (tmp_path / "ckpt-1.flax").write_bytes(b"")
  assert storage.glob(f"file://{tmp_path}/ckpt-*") == [
      f"file://{tmp_path}/ckpt-1.flax"]
  assert storage.glob(f"{tmp_path}/ckpt-*") == [f"{tmp_path}/ckpt-1.flax"]


def test_remove_tree_and_sync(tmp_path):
  (tmp_path / "d" / "e").mkdir(parents=True)
  (tmp_path / "d" / "e" / "f").write_bytes(b"x")
  storage.remove_tree(str(tmp_path / "d"))
  storage.remove_tree(str(tmp_path / "d"))  # already gone: not an error
  assert not (tmp_path / "d").exists()
  (tmp_path / "s").write_bytes(b"x")
  storage.sync(str(tmp_path / "s"))
  storage.sync(str(tmp_path / "absent"))  # nothing to flush: not an error
  remote = f"ram://clu_ckpt_storage_{os.getpid()}/d"
  tf.io.gfile.makedirs(f"{remote}/e")
  with tf.io.gfile.GFile(f"{remote}/e/f", "wb") as f:
    f.write(b"x")
  storage.sync(f"{remote}/e/f")  # remote: a no-op
  storage.remove_tree(remote)
  assert not tf.io.gfile.exists(remote)


def test_map_file(tmp_path):
  empty = tmp_path / "empty"
  empty.write_bytes(b"")
  mapped = storage.map_file(str(empty))
  assert len(mapped) == 0
  assert bytes(mapped) == b""
  data = tmp_path / "data"
  content = bytes(range(256)) * 100
  data.write_bytes(content)
  mapped = storage.map_file(str(data))
  assert len(mapped) == len(content)
  assert bytes(memoryview(mapped)) == content
  assert bytes(memoryview(storage.map_file(f"file://{data}"))[:3]) == (
      content[:3])
  with pytest.raises(FileNotFoundError):
    storage.map_file(str(tmp_path / "absent"))


def test_small_helpers(tmp_path):
  assert storage.is_local("/a/b") and storage.is_local("rel/x")
  assert storage.is_local("file:///a") and storage.is_local("FILE:///a")
  assert not storage.is_local("gs://bucket/x")
  assert not storage.is_local("s3://bucket/x")
  (tmp_path / "b-2").write_bytes(b"12345")
  (tmp_path / "a-1").write_bytes(b"")
  (tmp_path / "sub").mkdir()
  assert storage.glob(f"{tmp_path}/*-*") == [f"{tmp_path}/a-1",
                                             f"{tmp_path}/b-2"]
  assert storage.listdir(str(tmp_path)) == ["a-1", "b-2", "sub"]
  assert storage.exists(str(tmp_path / "a-1"))
  assert storage.isdir(str(tmp_path / "sub"))
  assert not storage.isdir(str(tmp_path / "a-1"))
  assert storage.stat(str(tmp_path / "b-2"))[0] == 5
  assert storage.read_bytes(str(tmp_path / "b-2")) == b"12345"
  storage.remove(str(tmp_path / "b-2"))
  storage.remove(str(tmp_path / "b-2"))  # already gone: not an error
  assert not storage.exists(str(tmp_path / "b-2"))
  storage.makedirs(str(tmp_path / "x" / "y"))
  storage.makedirs(str(tmp_path / "x" / "y"))
  assert (tmp_path / "x" / "y").is_dir()
  assert os.path.isdir(tmp_path / "x")


@pytest.mark.parametrize("sizes", [
    [0], [1], [storage._STAGE_BYTES - 1], [storage._STAGE_BYTES],
    [storage._STAGE_BYTES + 1], [3, storage._STAGE_BYTES * 2 + 5, 7],
    [storage._STAGE_BYTES - 3, 5, storage._STAGE_BYTES, 1],
])
@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_atomic_writer_stream_is_exact(tmp_path, sizes, where):
  """Staged (O_DIRECT where allowed) writes reproduce the stream exactly."""
  if where == "tmpfs":
    if not os.path.isdir("/dev/shm"):
      pytest.skip("no /dev/shm")
    base = tempfile.mkdtemp(dir="/dev/shm")
  else:
    base = str(tmp_path)
  rng = np.random.default_rng(sum(sizes))
  pieces = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
  path = os.path.join(base, "out.bin")
  try:
    with storage.atomic_writer(path) as write:
      for piece in pieces:
        write(memoryview(piece) if len(piece) % 2 else piece.tobytes())
    with open(path, "rb") as f:
      assert f.read() == b"".join(p.tobytes() for p in pieces)
    assert os.listdir(base) == ["out.bin"]
  finally:
    if where == "tmpfs":
      shutil.rmtree(base)
