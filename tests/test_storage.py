"""Tests for `clu_ckpt.storage`: its public functions, atomic writes.

`atomic_writer`, `map_file`, `glob`, `remove_tree`, `sync` and the small
helpers, on local paths, `file://` URLs and (through gfile) `ram://`.

Hostile files (a named pipe, `/dev/zero` or a directory where a file should
be, a socket, a symlink loop) are refused at once; they run in a child
process with a timeout (the `run_child` fixture), so that a regression fails
instead of hanging. The `checkpoint` state file is tested in
tests/test_state_file.py.
"""

import errno
import os
import pathlib
import resource
import signal
import shutil
import socket
import tempfile

import numpy as np
import pytest
import tensorflow as tf

from clu_ckpt import local_fs
from clu_ckpt import state_file
from clu_ckpt import storage


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
    [0], [1], [local_fs._STAGE_BYTES - 1], [local_fs._STAGE_BYTES],
    [local_fs._STAGE_BYTES + 1], [3, local_fs._STAGE_BYTES * 2 + 5, 7],
    [local_fs._STAGE_BYTES - 3, 5, local_fs._STAGE_BYTES, 1],
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


# ---------------------------------------------------------------------------
# Hostile files: refused at once, in a child process so that a hang fails.
# ---------------------------------------------------------------------------


def make_hostile(kind: str, path: pathlib.Path) -> None:
  if kind == "named pipe":
    os.mkfifo(path)
  elif kind == "directory":
    path.mkdir()
  elif kind == "character device":
    if not os.path.exists("/dev/zero"):
      pytest.skip("no /dev/zero")
    path.symlink_to("/dev/zero")  # only the target's type counts
  elif kind == "socket":
    with socket.socket(socket.AF_UNIX) as s:
      try:
        s.bind(str(path))
      except OSError as e:  # a path too long for AF_UNIX
        pytest.skip(str(e))
  elif kind == "symlink loop":
    path.symlink_to(path.name)


@pytest.mark.parametrize("kind", ["named pipe", "directory", "character device",
                                  "socket", "symlink loop"])
def test_hostile_file_is_refused_at_once(tmp_path, kind, run_child):
  path = tmp_path / "checkpoint"
  make_hostile(kind, path)
  out = run_child("""
    path = sys.argv[1]
    directory = os.path.dirname(path)
    calls = dict(
        map_file=lambda: storage.map_file(path),
        map_file_url=lambda: storage.map_file("file://" + path),
        read_bytes=lambda: storage.read_bytes(path),
        check_regular_file=lambda: storage.check_regular_file(path),
        state=lambda: state_file.read_checkpoint_state(directory),
        strict_state=lambda: state_file.read_checkpoint_state(
            directory, strict=True),
        sync=lambda: storage.sync(path),
        stat=lambda: storage.stat(path)[0],
    )
    print(json.dumps({name: attempt(call) for name, call in calls.items()}))
  """, str(path))
  for name, outcome in out.items():
    assert outcome["seconds"] < 1, (name, outcome)
  assert "error" not in out["sync"], out["sync"]
  if kind == "symlink loop":
    for name in ("map_file", "map_file_url", "read_bytes",
                 "check_regular_file"):
      assert out[name]["errno"] == errno.ELOOP, out[name]
      assert out[name]["filename"] == str(path), out[name]
    assert out["state"]["returned"] == "NoneType"  # unreadable, as for TF
    assert out["strict_state"]["error"] == "CheckpointStateError"
    assert out["strict_state"]["message"].startswith(
        f"checkpoint state file {path}: cannot read: [Errno {errno.ELOOP}]")
    return
  code = errno.EISDIR if kind == "directory" else errno.EINVAL
  for name in ("map_file", "map_file_url", "read_bytes", "check_regular_file",
               "state", "strict_state"):
    assert out[name] == dict(
        error="NotRegularFileError", errno=code, filename=str(path),
        message=f"[Errno {code}] not a regular file (a {kind}): {str(path)!r}",
        cause="None", seconds=out[name]["seconds"]), name


def test_file_swapped_for_a_fifo_after_the_check_is_refused(tmp_path,
                                                            run_child):
  (tmp_path / "regular").write_bytes(b"x")
  os.mkfifo(tmp_path / "fifo")
  out = run_child("""
    regular, fifo = sys.argv[1:]
    real_stat = os.stat
    os.stat = lambda path, *args, **kwargs: real_stat(regular)  # the race
    print(json.dumps([attempt(lambda: storage.read_bytes(fifo)),
                      attempt(lambda: storage.map_file(fifo)),
                      attempt(lambda: state_file.read_checkpoint_state(
                          os.path.dirname(fifo) + "/swap"))]))
  """, str(tmp_path / "regular"), str(tmp_path / "fifo"))
  os.rename(tmp_path / "fifo", tmp_path / "unused")
  for outcome in out[:2]:
    assert outcome["error"] == "NotRegularFileError", outcome
    assert "(a named pipe)" in outcome["message"] and outcome["seconds"] < 1
  assert out[2]["returned"] == "NoneType"  # no "swap/checkpoint"


def test_symlinks_to_regular_files_are_read(tmp_path):
  (tmp_path / "real").mkdir()
  (tmp_path / "real" / "checkpoint").write_text(
      'model_checkpoint_path: "ckpt-1"\n', encoding="utf-8")
  (tmp_path / "real" / "data").write_bytes(b"12345")
  (tmp_path / "link").mkdir()
  (tmp_path / "link" / "checkpoint").symlink_to("../real/checkpoint")
  (tmp_path / "link" / "data").symlink_to("../real/data")
  assert state_file.read_checkpoint_state(
      str(tmp_path / "link")).model_checkpoint_path == f"{tmp_path}/link/ckpt-1"
  assert storage.read_bytes(str(tmp_path / "link" / "data")) == b"12345"
  assert bytes(storage.map_file(str(tmp_path / "link" / "data"))) == b"12345"
  assert storage.check_regular_file(str(tmp_path / "link" / "data")) is None
  with pytest.raises(FileNotFoundError):
    storage.check_regular_file(str(tmp_path / "absent"))
  with pytest.raises(FileNotFoundError):
    storage.read_bytes(str(tmp_path / "absent"))


def test_remove_tree_removes_a_symlink_not_its_target(tmp_path):
  target = tmp_path / "target"
  target.mkdir()
  (target / "keep").write_text("x")
  os.symlink(target, tmp_path / "link")
  os.symlink(tmp_path / "target" / "keep", tmp_path / "filelink")
  storage.remove_tree(str(tmp_path / "link"))
  storage.remove_tree(str(tmp_path / "filelink"))
  assert not os.path.lexists(tmp_path / "link")
  assert not os.path.lexists(tmp_path / "filelink")
  assert (target / "keep").read_text() == "x"
  inner = tmp_path / "tree"
  inner.mkdir()
  os.symlink(target, inner / "escape")
  storage.remove_tree(str(inner))
  assert not inner.exists() and (target / "keep").exists()
