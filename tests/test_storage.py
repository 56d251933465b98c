"""Tests for `clu_ckpt.storage`: the `checkpoint` state file, atomic writes.

TensorFlow is the oracle for the state file: files written by a real
`tf.train.CheckpointManager` (or by hand, or at random) must parse exactly as
`tf.train.get_checkpoint_state` parses them, and `managed_checkpoints()` must
list what a fresh `tf.train.CheckpointManager` lists.

Hostile directories (a named pipe, `/dev/zero` or a directory where a file
should be, a symlink loop, a huge or pathological state file) run in a child
process with a timeout, so that a regression fails instead of hanging.
"""

import errno
import json
import os
import pathlib
import random
import resource
import signal
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any, Optional
import warnings

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.checkpoint import checkpoint_management

from clu_ckpt import local_fs
from clu_ckpt import state_file
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
    "ha#sh",
    '#"#',
    "# lead",
    "[br],;",
]


def manager(directory: str, name: str = "ckpt",
            max_to_keep: int = 3) -> tf.train.CheckpointManager:
  return tf.train.CheckpointManager(
      tf.train.Checkpoint(v=tf.Variable(1.0)), directory,
      max_to_keep=max_to_keep, checkpoint_name=name)


def assert_same_as_tf(directory: str) -> Optional[state_file.CheckpointState]:
  """read_checkpoint_state(directory) equals tf.train.get_checkpoint_state.

  Where TensorFlow gives None, strict mode must raise CheckpointStateError;
  where it raises ValueError (no latest checkpoint), so must we; and our
  parser must not warn (TensorFlow's warns about escapes such as `\\?`).
  """
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
      theirs = tf.train.get_checkpoint_state(directory)
    except ValueError as e:
      theirs = e
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    if isinstance(theirs, ValueError):
      for strict in (False, True):
        with pytest.raises(storage.CheckpointStateError,
                           match="Invalid checkpoint state"):
          state_file.read_checkpoint_state(directory, strict=strict)
      return None
    ours = state_file.read_checkpoint_state(directory)
    if theirs is None:
      assert ours is None
      if storage.exists(storage.join(directory, "checkpoint")):
        with pytest.raises(storage.CheckpointStateError) as raised:
          state_file.read_checkpoint_state(directory, strict=True)
        assert raised.value.path == storage.join(directory, "checkpoint")
      return None
    assert repr(state_file.read_checkpoint_state(directory, strict=True)) == (
        repr(ours))
  assert ours is not None
  assert ours.model_checkpoint_path == theirs.model_checkpoint_path
  assert ours.all_model_checkpoint_paths == list(
      theirs.all_model_checkpoint_paths)
  # repr: nan equals nan, -0.0 differs from 0.0.
  assert repr(ours.all_model_checkpoint_timestamps) == repr(list(
      theirs.all_model_checkpoint_timestamps))
  assert repr(ours.last_preserved_timestamp) == repr(
      theirs.last_preserved_timestamp)
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
    # `#` starts a comment only outside quotes.
    'model_checkpoint_path: "/ck#pts/a#1" # a comment with "quotes"\n',
    "model_checkpoint_path: '#' # '\nall_model_checkpoint_paths: \"'#'\"\n",
    'model_checkpoint_path: "x"#c\n#"y"\nall_model_checkpoint_paths:"z" #\n',
    # No newline at the end; CRLF; other whitespace; a raw CR in a path.
    'model_checkpoint_path: "no-newline"',
    'model_checkpoint_path: "crlf"\r\nlast_preserved_timestamp: 2\r\n',
    'model_checkpoint_path:\t"ws"\x0b\x0c\x1c\u3000last_preserved_timestamp:1',
    'model_checkpoint_path: "raw\rcr"\n',
    # Escapes: hex (one or two digits), octal, unknown ones kept, \u.
    'model_checkpoint_path: "\\x5\\xF\\x4a1\\101\\0\\7\\18"\n',
    'model_checkpoint_path: "\\?\\q\\8\\\\x"\n',
    'model_checkpoint_path: "\\u00e9\\U0001F600\\N{DIGIT ONE}\\\\u0041"\n',
    'model_checkpoint_path: "\\u005c\\u005c \\u005cn \\€"\n',
    # Adjacent strings join (escapes may span them); lists; separators.
    'model_checkpoint_path: "a" \'b\' # c\n "\\303" "\\251"\n',
    'model_checkpoint_path: "m" all_model_checkpoint_paths: ["a", "b" "c"],\n'
    'all_model_checkpoint_paths: [] all_model_checkpoint_timestamps: [1, 2f]',
    'model_checkpoint_path: "m", last_preserved_timestamp: 3;'
    'all_model_checkpoint_paths: "p";\n',
    # Numbers spelled the ways protobuf accepts.
    'model_checkpoint_path: "m"\nall_model_checkpoint_timestamps: [1e3f, inff,'
    ' -Infinity, NaN, 1_0, .5, -.5e1, +01, 1e999, -0, \u0663]\n',
    # Repeated singular fields: the last wins.
    'last_preserved_timestamp: 1 model_checkpoint_path: "a" '
    'last_preserved_timestamp: 2 model_checkpoint_path: "b"',
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
    'model_checkpoint_path: "\\400"\n',  # octal escape above 255
    'model_checkpoint_path: "a\\"\n',
    'model_checkpoint_path: "\\u12"\n',
    'model_checkpoint_path: "\\ud800"\n',
    'model_checkpoint_path: "\\N{NO SUCH NAME}"\n',
    'model_checkpoint_path: "\\N{EURO SIGN}"\n',  # above U+00FF
    'model_checkpoint_path: "x\nacross lines"\n',
    "model_checkpoint_path: 'x\"\n",
    'model_checkpoint_path: "x";;\n',
    'model_checkpoint_path: "x",;\n',
    'model_checkpoint_path "x"\n',
    'model_checkpoint_path: ["x"]\n',
    'all_model_checkpoint_paths: ["a",]\nmodel_checkpoint_path: "x"\n',
    'all_model_checkpoint_paths: ["a" "b"\nmodel_checkpoint_path: "x"\n',
    'Model_Checkpoint_Path: "x"\n',
    '\ufeffmodel_checkpoint_path: "x"\n',  # a byte order mark
    'model_checkpoint_path: "x"\nlast_preserved_timestamp: 01\n',
    'model_checkpoint_path: "x"\nlast_preserved_timestamp: 0x10\n',
    'model_checkpoint_path: "x"\nlast_preserved_timestamp: 1.5.2\n',
    'model_checkpoint_path: "x"\nlast_preserved_timestamp:\n',
    'model_checkpoint_path: "x" # "\nlast_preserved_timestamp: "1"\n',
])
def test_garbled_state_file_is_none(tmp_path, text):
  write_state(tmp_path, text)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    assert tf.train.get_checkpoint_state(str(tmp_path)) is None
  assert state_file.read_checkpoint_state(str(tmp_path)) is None
  with pytest.raises(storage.CheckpointStateError,
                     match=r"checkpoint: cannot parse: line \d+, column \d+"):
    state_file.read_checkpoint_state(str(tmp_path), strict=True)


def test_binary_state_file_is_none(tmp_path):
  (tmp_path / "checkpoint").write_bytes(b"\x00\xff\xfe\x80garbage")
  assert state_file.read_checkpoint_state(str(tmp_path)) is None


def test_missing_state_file_is_none(tmp_path):
  assert state_file.read_checkpoint_state(str(tmp_path)) is None
  assert state_file.read_checkpoint_state(str(tmp_path / "absent")) is None
  assert tf.train.get_checkpoint_state(str(tmp_path)) is None


@pytest.mark.parametrize("text", [
    "", 'model_checkpoint_path: ""\n', 'all_model_checkpoint_paths: "a"\n'])
def test_state_without_latest_raises_like_tf(tmp_path, text):
  write_state(tmp_path, text)
  with pytest.raises(ValueError):
    tf.train.get_checkpoint_state(str(tmp_path))
  with pytest.raises(ValueError, match="Invalid checkpoint state"):
    state_file.read_checkpoint_state(str(tmp_path))


def test_file_url_directory(tmp_path):
  directory = tmp_path / "ckpts"
  mgr = manager(str(directory))
  mgr.save()
  url = f"file://{directory}"
  state = assert_same_as_tf(url)
  assert state.model_checkpoint_path == f"{url}/ckpt-1"


def test_relative_paths_written_by_tf(tmp_path):
  names = [f"ck#{i} {name}" for i, name in enumerate(WEIRD_NAMES)]
  checkpoint_management.update_checkpoint_state_internal(
      str(tmp_path), str(tmp_path / names[-1]),
      all_model_checkpoint_paths=[str(tmp_path / n) for n in names],
      save_relative_paths=True,
      all_model_checkpoint_timestamps=[1.5 * i for i in range(len(names))],
      last_preserved_timestamp=-1.0)
  raw = (tmp_path / "checkpoint").read_text()
  assert f'"{names[0]}"' in raw  # relative, with `#` inside the quotes
  state = assert_same_as_tf(str(tmp_path))
  assert state.all_model_checkpoint_paths == [str(tmp_path / n) for n in names]


FUZZ_ATOMS = [  # mostly valid
    "a", "é", "€", "#", " ", "\t", "\r", "\\\\", '\\"', "\\'", "\\n", "\\x5",
    "\\xFf", "\\x4a1", "\\101", "\\303\\251", "\\0", "\\?", "\\q",
    "\\u00e9", "\\u005c", "\\U0001F600", "\\N{DIGIT ONE}"] * 4 + [
        "'", '"', "\\x", "\\400", "\\351", "\\ud800", "\\"]
FUZZ_NUMBERS = ["1", "-2.5", "1e3", "2f", "inf", "-Infinity", "nan", "01",
                "+1", ".5", "1_0", "0x1", "1.2.3", "'1'", "x", "\u0663"]
FUZZ_SEPARATORS = ["", " ", "\n", "\r\n", ";", ",", " # c'\"\n", ";;",
                   "\u3000"]


def random_state_text(rng: random.Random) -> str:
  """A CheckpointState text proto, valid or subtly not."""

  def value(name: str) -> str:
    if "timestamp" in name:
      return rng.choice(FUZZ_NUMBERS)
    return " ".join(
        q + "".join(rng.choices(FUZZ_ATOMS, k=rng.randint(0, 5))) + q
        for q in rng.choices("\"\"'", k=rng.choice([1, 1, 1, 2])))

  fields = ['model_checkpoint_path: "m"\n'] if rng.random() < 0.8 else []
  for _ in range(rng.randint(1, 5)):
    name = rng.choice(["model_checkpoint_path", "all_model_checkpoint_paths",
                       "all_model_checkpoint_timestamps",
                       "last_preserved_timestamp"] * 5 + ["unknown"])
    if name.startswith("all_") and rng.random() < 0.3:
      items = ", ".join(value(name) for _ in range(rng.randint(0, 3)))
      v = f"[{items}{rng.choice([']', ']', ',]', ''])}"
    else:
      v = value(name)
    fields.append(name + rng.choice([":", ": ", " :", ""]) + v +
                  rng.choice(FUZZ_SEPARATORS))
  return "".join(fields)


def test_random_state_files_parse_as_tf(tmp_path):
  rng = random.Random(20240601)
  parsed = 0
  for i in range(1500):
    directory = tmp_path / str(i)
    write_state(directory, random_state_text(rng))
    parsed += assert_same_as_tf(str(directory)) is not None
  assert parsed > 100  # not only errors


def test_long_escaped_strings_parse_as_tf(tmp_path, monkeypatch):
  # Long strings are unescaped with numpy, in chunks: small odd ones here.
  monkeypatch.setattr(state_file, "_CHUNK", 4099)
  atoms = [a for a in FUZZ_ATOMS[:23] if a not in ("\\u005c", "\\xFf")]
  rng = random.Random(7)
  for i in range(12):
    body = "".join(rng.choices(atoms, k=20_000))
    assert len(body) > state_file._VECTOR_MIN
    write_state(tmp_path / str(i), f'model_checkpoint_path: "{body}"\n'
                f"all_model_checkpoint_paths: ['{body}', 'x{body}']\n")
    state = assert_same_as_tf(str(tmp_path / str(i)))
    assert len(state.model_checkpoint_path) > 20_000

# ---------------------------------------------------------------------------
# Strict mode and limits.
# ---------------------------------------------------------------------------


def test_strict_names_the_problem(tmp_path):
  path = str(tmp_path / "checkpoint")
  (tmp_path / "checkpoint").write_bytes(
      b'model_checkpoint_path: "caf\xc3\xa9\xff"\n')
  assert state_file.read_checkpoint_state(str(tmp_path)) is None
  with pytest.raises(storage.CheckpointStateError) as raised:
    state_file.read_checkpoint_state(str(tmp_path), strict=True)
  assert raised.value.path == path
  assert str(raised.value) == (
      f"checkpoint state file {path}: not UTF-8 at byte 29")
  assert isinstance(raised.value.__cause__, UnicodeDecodeError)
  write_state(tmp_path, 'model_checkpoint_path: "a"\n\n  bogus: 1\n')
  with pytest.raises(storage.CheckpointStateError) as raised:
    state_file.read_checkpoint_state(str(tmp_path), strict=True)
  assert str(raised.value) == (
      f"checkpoint state file {path}: cannot parse: line 3, column 3: "
      "unknown field 'bogus'")
  assert isinstance(raised.value, ValueError)
  # Missing: None in both modes.
  assert state_file.read_checkpoint_state(str(tmp_path / "no"),
                                       strict=True) is None
  (tmp_path / "d").mkdir()
  (tmp_path / "d" / "checkpoint").symlink_to(tmp_path / "d" / "gone")
  assert state_file.read_checkpoint_state(str(tmp_path / "d"), strict=True) is None
  (tmp_path / "f").write_text("a file, not a directory")
  assert state_file.read_checkpoint_state(str(tmp_path / "f"), strict=True) is None


def test_size_and_entry_limits(tmp_path, monkeypatch):
  text = state_text([f"c-{i}" for i in range(5)], [1.0] * 5, 0.5)
  write_state(tmp_path, text)
  monkeypatch.setattr(state_file, "MAX_STATE_FILE_BYTES", len(text))
  monkeypatch.setattr(state_file, "MAX_STATE_ENTRIES", 10)
  assert len(state_file.read_checkpoint_state(str(tmp_path)).managed_checkpoints(
      now=2.0)) == 5
  write_state(tmp_path, text + " ")
  with pytest.raises(storage.CheckpointStateError, match="over the limit"):
    state_file.read_checkpoint_state(str(tmp_path))
  monkeypatch.setattr(state_file, "MAX_STATE_FILE_BYTES", 2**22)
  for extra in ("all_model_checkpoint_timestamps: 2\n",
                'all_model_checkpoint_paths: ["x", "y"]\n',
                "all_model_checkpoint_timestamps: [" + "1," * 2000 + "1]\n"):
    write_state(tmp_path, text + extra)
    for strict in (False, True):
      with pytest.raises(storage.CheckpointStateError,
                         match="more than 10 paths and timestamps"):
        state_file.read_checkpoint_state(str(tmp_path), strict=strict)
  write_state(tmp_path, 'model_checkpoint_path: "a"\n' * 100_000)
  assert state_file.read_checkpoint_state(str(tmp_path)).model_checkpoint_path == (
      f"{tmp_path}/a")  # singular fields do not count


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
  state = state_file.read_checkpoint_state(str(tmp_path))
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

CHILD_PRELUDE = """
import json, os, resource, sys, time
# Reading /dev/zero (or a huge file) to the end fails here, not the machine.
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
from clu_ckpt import local_fs
from clu_ckpt import state_file
from clu_ckpt import storage

def attempt(call):
  start = time.monotonic()
  try:
    out = dict(returned=type(call()).__name__)
  except Exception as e:
    out = dict(error=type(e).__name__, errno=getattr(e, "errno", None),
               filename=getattr(e, "filename", None), message=str(e)[:500],
               cause=repr(e.__cause__)[:500])
  out["seconds"] = time.monotonic() - start
  return out
"""


def run_child(code: str, *args: str, timeout: float = 30) -> Any:
  """Runs CHILD_PRELUDE + `code` in a fresh Python; returns the JSON it prints.

  A hang fails the test after `timeout` seconds instead of hanging the suite.
  """
  try:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD_PRELUDE + textwrap.dedent(code), *args],
        capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    pytest.fail(f"still running after {timeout} s (hung?):\n{code}")
  assert proc.returncode == 0, proc.stderr[-5000:]
  return json.loads(proc.stdout.splitlines()[-1])


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
def test_hostile_file_is_refused_at_once(tmp_path, kind):
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


def test_file_swapped_for_a_fifo_after_the_check_is_refused(tmp_path):
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


def test_state_file_over_the_size_limit_is_never_read(tmp_path):
  with open(tmp_path / "checkpoint", "wb") as f:
    f.truncate(64 * state_file.MAX_STATE_FILE_BYTES)  # sparse: 8 GiB of zeros
  out = run_child("""
    print(json.dumps([attempt(lambda: state_file.read_checkpoint_state(
        sys.argv[1], strict=strict)) for strict in (False, True)]))
  """, str(tmp_path))
  for outcome in out:
    assert outcome["error"] == "CheckpointStateError", outcome
    assert outcome["message"] == (
        f"checkpoint state file {tmp_path}/checkpoint: "
        f"{64 * state_file.MAX_STATE_FILE_BYTES} bytes, over the limit of "
        f"{state_file.MAX_STATE_FILE_BYTES} (state_file.MAX_STATE_FILE_BYTES)")
    assert outcome["seconds"] < 1


def test_symlinks_to_regular_files_are_read(tmp_path):
  (tmp_path / "real").mkdir()
  write_state(tmp_path / "real", 'model_checkpoint_path: "ckpt-1"\n')
  (tmp_path / "real" / "data").write_bytes(b"12345")
  (tmp_path / "link").mkdir()
  (tmp_path / "link" / "checkpoint").symlink_to("../real/checkpoint")
  (tmp_path / "link" / "data").symlink_to("../real/data")
  assert state_file.read_checkpoint_state(
      str(tmp_path / "link")).model_checkpoint_path == f"{tmp_path}/link/ckpt-1"
  assert storage.read_bytes(str(tmp_path / "link" / "data")) == b"12345"
  assert bytes(storage.map_file(str(tmp_path / "link" / "data"))) == b"12345"
  assert storage.check_regular_file(str(tmp_path / "link" / "data")) is None
  assert storage.check_regular_file("gs://bucket/ckpt-1.index") is None
  with pytest.raises(FileNotFoundError):
    storage.check_regular_file(str(tmp_path / "absent"))
  with pytest.raises(FileNotFoundError):
    storage.read_bytes(str(tmp_path / "absent"))


# ---------------------------------------------------------------------------
# The state-file parser is linear: big pathological files, in a child.
# ---------------------------------------------------------------------------

BIG = 64 * 2**20
HEAD = 'model_checkpoint_path: "ckpt-1"\n'


# name: (prefix, unit repeated to 64 MiB, suffix, each path unescaped or None)
BIG_CASES = {
    "60 MiB path": ('all_model_checkpoint_paths: "', "ab", '"\n', "ab"),
    "1.5M fields": ("", 'all_model_checkpoint_paths: "ckpt-12345678"\n', "",
                    "ckpt-12345678"),
    "1M list items": ("all_model_checkpoint_paths: [", f'"{"c" * 60}", ',
                      f'"{"c" * 60}"]\n', "c" * 60),
    "all escapes": ('all_model_checkpoint_paths: "',
                    r'\\\"\303\251\n\x5\q\u00e9#\'', '"\n',
                    "\\\"é\n\x05\\qé#'"),
    "comments": ("", '# all_model_checkpoint_paths: "x"\n', "", None),
}


@pytest.mark.skipif(not os.path.exists("/proc/self/status"),
                    reason="peak memory is read from /proc/self/status")
@pytest.mark.parametrize("case", BIG_CASES)
def test_big_state_file_parses_in_linear_time(tmp_path, case):
  """64 MiB: seconds, and peak memory a small multiple of the size.

  Seen on 2 busy cores: 0.7-4 s, 2-5.4x (memory does not depend on load).
  """
  prefix, unit, suffix, value = BIG_CASES[case]
  count = (BIG - len(HEAD + prefix + suffix)) // len(unit)
  with open(tmp_path / "checkpoint", "w", encoding="utf-8") as f:
    f.write(HEAD + prefix)
    block = 2**20 // len(unit)
    for done in range(0, count, block):
      f.write(unit * min(block, count - done))
    f.write(suffix)
  out = run_child("""
    def peak():
      with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM"))
    before = peak()
    outcome = attempt(lambda: state_file.read_checkpoint_state(
        sys.argv[1], strict=True))
    outcome["peak_extra_kib"] = peak() - before
    state = state_file.read_checkpoint_state(sys.argv[1])
    paths = [p[len(sys.argv[1]) + 1:] for p in state.all_model_checkpoint_paths]
    outcome["paths"] = len(paths)
    outcome["lengths"] = sorted({len(p) for p in paths})
    outcome["sample"] = paths[0][:200] if paths else None
    print(json.dumps(outcome))
  """, str(tmp_path), timeout=120)
  assert "error" not in out, out
  assert out["seconds"] < 15, out
  assert out["peak_extra_kib"] * 1024 < 8 * BIG, out
  if value is None:
    assert out["paths"] == 0
  elif prefix.endswith('"'):  # one long path
    assert out["paths"] == 1 and out["lengths"] == [len(value) * count]
    assert out["sample"] == (value * count)[:200]
  else:
    assert out["paths"] == count + ("[" in prefix)
    assert out["lengths"] == [len(value)] and out["sample"] == value


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
