"""Tests for `clu_ckpt.state_file`: TensorFlow's `checkpoint` state file.

TensorFlow is the oracle: files written by a real `tf.train.CheckpointManager`
(or by hand, or at random) must parse exactly as `tf.train.get_checkpoint_state`
parses them, and `managed_checkpoints()` must list what a fresh
`tf.train.CheckpointManager` lists. Also: the re-exports (`layout`, `storage`)
are the same objects, the module works without TensorFlow, and huge or
pathological state files are refused or parsed in linear time (in a child
process with a timeout, the `run_child` fixture, so that a regression fails
instead of hanging).
"""

import errno
import logging
import os
import pathlib
import random
import re
import subprocess
import sys
import textwrap
import time
from typing import Optional
from importlib import metadata
from typing import Any, Callable
from unittest import mock
import warnings

from google.protobuf import text_encoding
from google.protobuf import text_format
import pytest
import tensorflow as tf
from tensorflow.python.checkpoint import checkpoint_management

from conftest import fuzz_examples
from clu_ckpt import errors
from clu_ckpt import layout
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


def _parses(parse: Callable[[str], Any], text: str) -> bool:
  try:
    parse(text)
  except ValueError:
    return False
  return True


def installed_rules() -> state_file.TextRules:
  """The text-format rules of the protobuf installed beside TensorFlow.

  Asked of that protobuf itself, so that each stack of the support matrix
  compares `state_file` with its own TensorFlow's behaviour.
  """
  return state_file.TextRules(
      leading_zeros=_parses(text_format.ParseFloat, "01"),
      upper_f=_parses(text_format.ParseFloat, "2F"),
      escapes=("current" if text_encoding.CUnescape("\\u20ac") ==
               "\u20ac".encode() else "legacy"))


# The rules of the protobuf releases the support matrix ran TensorFlow with
# (README.md, "Support matrix"); `installed_rules()` is one of them on each
# stack, and the reader accepts every file any of them accepts.
MEASURED_RULES = {
    "protobuf 4.25 (TensorFlow 2.16)": state_file.TextRules(True, False,
                                                            "legacy"),
    "protobuf 5.29 (TensorFlow 2.18)": state_file.TextRules(True, False,
                                                            "current"),
    "protobuf 7.x (TensorFlow 2.21)": state_file.TextRules(False, True,
                                                           "current"),
}


def test_installed_protobuf_has_measured_rules():
  assert installed_rules() in MEASURED_RULES.values(), (
      f"protobuf {metadata.version('protobuf')} reads the text format by "
      f"other rules ({installed_rules()}): measure them, add them to "
      "MEASURED_RULES and make state_file.LENIENT_RULES accept them")


def read_with_rules(directory: str, rules: state_file.TextRules,
                    strict: bool = False) -> Any:
  """read_checkpoint_state by `rules`; a raised ValueError is returned."""
  with mock.patch.object(state_file, "LENIENT_RULES", rules):
    try:
      return state_file.read_checkpoint_state(directory, strict=strict)
    except ValueError as e:
      return e


def _same_state(ours: Any, theirs: Any) -> bool:
  if isinstance(theirs, ValueError) or theirs is None:
    return type(ours) is type(theirs) or (
        isinstance(theirs, ValueError) and isinstance(ours, ValueError))
  # repr: nan equals nan, -0.0 differs from 0.0.
  return ours is not None and not isinstance(ours, ValueError) and (
      ours.model_checkpoint_path, ours.all_model_checkpoint_paths,
      repr(ours.all_model_checkpoint_timestamps),
      repr(ours.last_preserved_timestamp)) == (
          theirs.model_checkpoint_path, list(theirs.all_model_checkpoint_paths),
          repr(list(theirs.all_model_checkpoint_timestamps)),
          repr(theirs.last_preserved_timestamp))


def assert_same_as_tf(directory: str) -> Optional[state_file.CheckpointState]:
  """read_checkpoint_state(directory) reads at least what TensorFlow reads.

  By the installed protobuf's own rules (`installed_rules()`), it equals
  tf.train.get_checkpoint_state exactly: where TensorFlow gives None, strict
  mode must raise CheckpointStateError; where it raises ValueError (no latest
  checkpoint), so must we. With the default (lenient) rules, everything this
  TensorFlow reads is read the same (strings whose escapes protobuf 4.x reads
  otherwise excepted: those get protobuf 5's meaning), and whatever another
  measured release reads is read too. Our parser must not warn
  (TensorFlow's warns about escapes such as `\\?`).
  """
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
      theirs = tf.train.get_checkpoint_state(directory)
    except ValueError as e:
      theirs = e
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    rules = installed_rules()
    exact = read_with_rules(directory, rules)
    assert _same_state(exact, theirs), (rules, exact, theirs)
    others = {name: read_with_rules(directory, r)
              for name, r in MEASURED_RULES.items()}
    ours = read_with_rules(directory, state_file.LENIENT_RULES)
    for name, other in others.items():
      if other is not None and not isinstance(other, ValueError):
        assert ours is not None and not isinstance(ours, ValueError), name
    if theirs is not None and not isinstance(theirs, ValueError):
      if rules.escapes == "legacy" and not _same_state(ours, theirs):
        # Only strings with `\u`, `\U` or `\N` escapes mean otherwise.
        text = pathlib.Path(directory, "checkpoint").read_text()
        assert re.search(r"\\[uUN]", text), text
        assert len(ours.all_model_checkpoint_paths) == len(
            theirs.all_model_checkpoint_paths)
        assert repr(ours.all_model_checkpoint_timestamps) == repr(list(
            theirs.all_model_checkpoint_timestamps))
        return ours
    elif not _same_state(ours, theirs):
      return ours  # another TensorFlow reads it (checked above)
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
# The module itself: re-exports, no TensorFlow, file URLs.
# ---------------------------------------------------------------------------


def test_layout_re_exports_the_state_file_names():
  for name in ("CheckpointState", "read_checkpoint_state", "STATE_FILENAME"):
    assert getattr(layout, name) is getattr(state_file, name), name
  assert state_file.CheckpointStateError is errors.CheckpointStateError
  assert storage.CheckpointStateError is errors.CheckpointStateError


def test_reads_without_tensorflow(tmp_path):
  (tmp_path / "checkpoint").write_text(
      'model_checkpoint_path: "ckpt-3"\n'
      'all_model_checkpoint_paths: ["ckpt-2", "ckpt-3"]\n'
      "all_model_checkpoint_timestamps: [1.5, 2.5]\n"
      "last_preserved_timestamp: 1.0\n")
  code = textwrap.dedent("""
    import sys

    class NoTensorFlow:
      def find_spec(self, name, path=None, target=None):
        if name == "tensorflow" or name.startswith("tensorflow."):
          raise ImportError("blocked: " + name)

    sys.meta_path.insert(0, NoTensorFlow())
    from clu_ckpt import state_file
    state = state_file.read_checkpoint_state(sys.argv[1])
    print(state.model_checkpoint_path, len(state.managed_checkpoints(now=3)))
    assert not any(m.startswith("tensorflow") for m in sys.modules)
  """)
  out = subprocess.run([sys.executable, "-c", code, str(tmp_path)],
                       capture_output=True, text=True, check=True).stdout
  assert out.split() == [f"{tmp_path}/ckpt-3", "2"]


def test_file_url_and_missing_directory(tmp_path):
  (tmp_path / "checkpoint").write_text('model_checkpoint_path: "c-1"\n')
  state = state_file.read_checkpoint_state(f"file://{tmp_path}")
  assert state.model_checkpoint_path == f"file://{tmp_path}/c-1"
  assert state_file.read_checkpoint_state(str(tmp_path / "absent")) is None


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
    # Comment runs longer than one skip takes on Python 3.10
    # (state_file._SKIP_COMMENTS): everywhere whitespace may be.
    "model_checkpoint_path" + "\n#c" * 40 + '\n: "a"' + " #c\n" * 40 +
    '"b"\n' + "# c\n" * 17 + "'c'" + "\n#" * 16 + '\n"d"\n',
    'model_checkpoint_path: "m"' + "\n#" * 40 + "\nall_model_checkpoint_paths:"
    " [" + "#c\n" * 40 + '"a",' + "#c\n" * 17 + '"b"' + "#c\n" * 40 + "]" +
    "#\n" * 40 + "all_model_checkpoint_timestamps: [1," + "#\n" * 40 + "2]",
    'model_checkpoint_path: "a"' + "\n#" * 20 + '\n"b"\n',
    # Around one skip's worth and two (the look-ahead must agree with it).
    *('model_checkpoint_path: "a"' + "\n#" * n + '\n"b"\n'
      for n in (15, 16, 17, 32, 33)),
    # Longer than three skips: every run is followed to its end.
    "model_checkpoint_path" + "\n#" * 100 + '\n: "a"' + "\n#" * 100 +
    '\n"b"' + "\n#" * 100 + "\nlast_preserved_timestamp: 1",
    'model_checkpoint_path: "lone"' + " # \"x\"\n" * 40 +
    "last_preserved_timestamp:" + "#\n" * 33 + "5",
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
    'model_checkpoint_path: "a\\"\n',
    'model_checkpoint_path: "\\u12"\n',
    'model_checkpoint_path: "\\N{NO SUCH NAME}"\n',
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
    'model_checkpoint_path: "x"\nlast_preserved_timestamp: 0x10\n',
    'model_checkpoint_path: "x"\nlast_preserved_timestamp: 1.5.2\n',
    'model_checkpoint_path: "x"\nlast_preserved_timestamp: 1X\n',
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


@pytest.mark.parametrize("text", [
    # protobuf 4.25 and 5.29 (TensorFlow 2.16, 2.18) read leading zeros.
    'model_checkpoint_path: "x"\nlast_preserved_timestamp: 01\n',
    'model_checkpoint_path: "x"\nall_model_checkpoint_timestamps: [-007.5, 1]\n',
    # protobuf 7 (TensorFlow 2.21) reads an upper-case F suffix.
    'model_checkpoint_path: "x"\nlast_preserved_timestamp: 2F\n',
    # protobuf 4.25 keeps escapes above U+00FF as text (`\u0100`).
    'model_checkpoint_path: "\\400"\n',
    'model_checkpoint_path: "\\ud800"\n',
    'model_checkpoint_path: "\\N{EURO SIGN}"\n',
])
def test_files_some_supported_tensorflow_reads_are_read(tmp_path, text):
  write_state(tmp_path, text)
  state = assert_same_as_tf(str(tmp_path))
  assert state is not None
  readers = [name for name, rules in MEASURED_RULES.items()
             if isinstance(read_with_rules(str(tmp_path), rules),
                           state_file.CheckpointState)]
  assert readers and len(readers) < len(MEASURED_RULES), readers


def test_escapes_read_otherwise_by_protobuf_4_get_the_current_meaning(
    tmp_path):
  write_state(tmp_path, 'model_checkpoint_path: "\\u00c3\\u00a9\\u20ac"\n')
  legacy, current = (read_with_rules(str(tmp_path), MEASURED_RULES[name])
                     for name in ("protobuf 4.25 (TensorFlow 2.16)",
                                  "protobuf 5.29 (TensorFlow 2.18)"))
  assert legacy.model_checkpoint_path == str(tmp_path / "é\\u20ac")
  assert current.model_checkpoint_path == str(tmp_path / "Ã©€")
  assert state_file.read_checkpoint_state(str(tmp_path)) == current
  assert_same_as_tf(str(tmp_path))


# What each measured release reads where they differ, value by value (the
# values measured with protobuf 4.25.9, 5.29.6 and 7.36.2: `text_format.
# ParseFloat`, `text_encoding.CUnescape`); the TensorFlow installed checks
# only its own release's reading.
PROTOBUF_4 = MEASURED_RULES["protobuf 4.25 (TensorFlow 2.16)"]
PROTOBUF_5 = MEASURED_RULES["protobuf 5.29 (TensorFlow 2.18)"]


@pytest.mark.parametrize("token", ["1X", "1XF", "0x1", "1.5.2"])
def test_a_word_that_is_no_number_is_refused_by_every_release(tmp_path,
                                                              token):
  write_state(tmp_path, 'model_checkpoint_path: "x"\n'
              f"last_preserved_timestamp: {token}\n")
  path = tmp_path / "checkpoint"
  for name, rules in [*MEASURED_RULES.items(),
                      ("lenient", state_file.LENIENT_RULES)]:
    got = read_with_rules(str(tmp_path), rules, strict=True)
    assert isinstance(got, storage.CheckpointStateError), (name, got)
    assert str(got) == (
        f"checkpoint state file {path}: cannot parse: line 2, column 27: "
        f"not a number: {token!r}"), name


def test_infinities_keep_their_sign_in_every_spelling(tmp_path):
  write_state(tmp_path, 'model_checkpoint_path: "x"\n'
              "all_model_checkpoint_timestamps: [-inff, -Infinityf, -INFF, "
              "inff, -inf]\nall_model_checkpoint_timestamps: -Inff\n"
              "last_preserved_timestamp: -infinityF\n")
  inf = float("inf")
  for name, rules in MEASURED_RULES.items():
    got = read_with_rules(str(tmp_path), rules, strict=True)
    assert got.last_preserved_timestamp == -inf, name
    assert got.all_model_checkpoint_timestamps == [
        -inf, -inf, -inf, inf, -inf, -inf], name
  assert_same_as_tf(str(tmp_path))


@pytest.mark.parametrize("escaped, legacy", [
    (r"a\\b\400", "a\\b\\u0100"),
    (r"\x5\777", "\x05\\u01ff"),
    (r"\xF\400\?", "\x0f\\u0100\\?"),
    (r"\\\400", "\\\\u0100"),
    (r"\101\x4a\7\303\251\400", "AJ\x07\xe9\\u0100"),
])
def test_strings_only_protobuf_4_reads_mean_what_it_reads(tmp_path, escaped,
                                                          legacy):
  # Octal escapes above \377 are text to protobuf 4 (`\u0100`) and an error
  # to 5.x on; the lenient reader falls back to protobuf 4's reading.
  write_state(tmp_path, f'model_checkpoint_path: "{escaped}"\n')
  for rules in (PROTOBUF_4, state_file.LENIENT_RULES):
    got = read_with_rules(str(tmp_path), rules, strict=True)
    assert got.model_checkpoint_path == f"{tmp_path}/{legacy}", rules
  assert isinstance(read_with_rules(str(tmp_path), PROTOBUF_5, strict=True),
                    storage.CheckpointStateError)


def test_a_string_no_release_reads_names_its_bad_escape(tmp_path):
  write_state(tmp_path, 'model_checkpoint_path: "ok"\n'
              'all_model_checkpoint_paths: "\\101\\400\\x"\n')
  # (protobuf 5 refuses it for its `\400` already, protobuf 4 for its `\x`.)
  for rules, why in ((PROTOBUF_5, r"octal escape above \\377"),
                     (PROTOBUF_4, r".*truncated \\xXX escape"),
                     (state_file.LENIENT_RULES, r".*truncated \\xXX escape")):
    got = read_with_rules(str(tmp_path), rules, strict=True)
    assert isinstance(got, storage.CheckpointStateError), rules
    assert re.fullmatch(
        r"checkpoint state file .*/checkpoint: cannot parse: line 2, column "
        r"29: bad escape in a string: " + why, str(got)), str(got)


@pytest.mark.parametrize("text, where_and_what", [
    ("model_checkpoint_path: 12\n",
     "line 1, column 24: expected a string for model_checkpoint_path, got '12'"),
    ("model_checkpoint_path: ",
     "line 1, column 24: expected a string for model_checkpoint_path, got the "
     "end of the file"),
    ("model_checkpoint_path: 'x\"\n",
     "line 1, column 24: expected a string for model_checkpoint_path, got a "
     "string not closed on its line"),
    ('model_checkpoint_path: ["x"]\n',
     "line 1, column 24: expected a string for model_checkpoint_path, got '['"),
    ('all_model_checkpoint_paths: ["a", 3]\n',
     "line 1, column 35: expected a string for all_model_checkpoint_paths, "
     "got '3'"),
    ('model_checkpoint_path: "a"\nlast_preserved_timestamp: "x"\n',
     "line 2, column 27: not a number: '\"x\"'"),
    ('all_model_checkpoint_timestamps: [1, "a"]\n',
     "line 1, column 38: not a number: '\"a\"'"),
    ('model_checkpoint_path: "a"\nlast_preserved_timestamp:',
     "line 2, column 26: expected a number for last_preserved_timestamp, got "
     "the end of the file"),
    ('all_model_checkpoint_paths: ["a" "b"\nmodel_checkpoint_path: "x"\n',
     "line 2, column 1: expected ',' or ']' in all_model_checkpoint_paths"),
    ("all_model_checkpoint_timestamps: [1 2]\n",
     "line 1, column 37: expected ',' or ']' in "
     "all_model_checkpoint_timestamps"),
    ("all_model_checkpoint_timestamps: [1, 2\n",
     "line 2, column 1: expected ',' or ']' in all_model_checkpoint_timestamps"),
    ('Model_Checkpoint_Path: "x"',
     "line 1, column 1: unknown field 'Model_Checkpoint_Path'"),
    ("x" * 50 + ": 1\n", f"line 1, column 1: unknown field {'x' * 40!r}..."),
    ("y" * 41 + ": 1\n", f"line 1, column 1: unknown field {'y' * 40!r}..."),
    ("z" * 40 + ": 1\n", f"line 1, column 1: unknown field {'z' * 40!r}"),
    ("\nx: 1\n", "line 2, column 1: unknown field 'x'"),
    ("\n  x: 1\n", "line 2, column 3: unknown field 'x'"),
    ('\n\n  model_checkpoint_path: "a";;\n',
     "line 3, column 30: unknown field ';'"),
    ('model_checkpoint_path "x"\n',
     "line 1, column 23: expected ':' after model_checkpoint_path"),
    ('model_checkpoint_path: "ok" "\\351"\n',
     "line 1, column 24: string not UTF-8 once unescaped (byte 2)"),
])
def test_syntax_errors_say_where_and_what(tmp_path, text, where_and_what):
  write_state(tmp_path, text)
  with pytest.raises(storage.CheckpointStateError) as raised:
    state_file.read_checkpoint_state(str(tmp_path), strict=True)
  assert str(raised.value) == (
      f"checkpoint state file {tmp_path / 'checkpoint'}: cannot parse: "
      f"{where_and_what}")
  # The parser's own error is kept as the cause.
  assert type(raised.value.__cause__) is ValueError  # pylint: disable=unidiomatic-typecheck
  assert str(raised.value.__cause__) == where_and_what


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
  parsed, cases = 0, fuzz_examples(1500)
  for i in range(cases):
    directory = tmp_path / str(i)
    write_state(directory, random_state_text(rng))
    parsed += assert_same_as_tf(str(directory)) is not None
  assert parsed > cases // 15  # not only errors (~12% parse)


def test_long_escaped_strings_parse_as_tf(tmp_path, monkeypatch):
  # Long strings are unescaped with numpy, in chunks: small odd ones here.
  monkeypatch.setattr(state_file, "_CHUNK", 4099)
  atoms = [a for a in FUZZ_ATOMS[:23] if a not in ("\\u005c", "\\xFf")]
  rng = random.Random(7)
  for i in range(fuzz_examples(12)):
    body = "".join(rng.choices(atoms, k=20_000))
    assert len(body) > state_file._VECTOR_MIN
    write_state(tmp_path / str(i), f'model_checkpoint_path: "{body}"\n'
                f"all_model_checkpoint_paths: ['{body}', 'x{body}']\n")
    state = assert_same_as_tf(str(tmp_path / str(i)))
    assert len(state.model_checkpoint_path) > 20_000

# Every kind of escape, known, unknown (`\?`, `\X`), hex of one and two digits
# of either case, a hex escape cut by a non-hex byte (`\xfX`) or by the end.
ESCAPE_ATOMS = [
    "a", "é", "X", "x", "\\\\", "\\n", "\\t", "\\a", "\\b", "\\f", "\\r", "\\v",
    "\\'", '\\"', "\\?", "\\q", "\\X", "\\c", "\\8", "\\ ", "\\\n", "\\x5",
    "\\xf", "\\xfX", "\\xfA", "\\xAg", "\\xA", "\\xFf", "\\x4a1", "\\xg", "\\x",
    "\\101", "\\0", "\\7", "\\u00e9", "\\U0001F600", "\\N{DIGIT ONE}", "\\\\x5"]


def _hidden_bodies(rng, cases):
  """Byte strings as `_fix_escapes` gets them (`\\` hidden as 0xFF 0xFF),
  longer than _VECTOR_MIN, some ending in an escape cut short."""
  for i in range(cases):
    body = "".join(rng.choices(ESCAPE_ATOMS, k=30_000))
    tail = ["", "\\", "\\x", "\\x5", "\\xf", "\\?", "\\xfA"][i % 7]
    yield (body + tail).encode("utf-8").replace(b"\\\\", b"\xff\xff")


@pytest.mark.parametrize("chunk", [1 << 20, 4099, 61])
def test_long_strings_get_the_escape_fixes_short_ones_get(monkeypatch, chunk):
  """`_fix_escapes` of a string past _VECTOR_MIN (numpy, a chunk at a time)
  is byte for byte what `re.sub` makes of it (the path of short strings,
  compared with TensorFlow by the tests above), for both fixes."""
  monkeypatch.setattr(state_file, "_CHUNK", chunk)
  rng = random.Random(chunk)
  for hidden in _hidden_bodies(rng, 7 if chunk > 61 else 2):
    assert len(hidden) > state_file._VECTOR_MIN
    for fix, (pattern, template, _, _) in state_file._FIXES.items():
      expected = pattern.sub(template, hidden)
      assert expected != hidden  # every fix has escapes to fix here
      got = state_file._fix_escapes(hidden, fix)
      assert bytes(got) == expected, (fix, hidden[-20:])


def test_long_strings_unescape_as_short_ones(monkeypatch):
  """A long quoted string means, by every rule, what it means read the
  short way (or is refused the same way)."""
  rng = random.Random(5)
  atoms = [a for a in ESCAPE_ATOMS if a not in ("\\8", "\\\n")]

  def unescaped(token, rules):
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      try:
        return state_file._unescape(token, rules)
      except ValueError as e:
        return type(e)
  for _ in range(3):
    token = '"' + "".join(rng.choices(atoms, k=30_000)) + '"'
    for escapes in ("legacy", "current", "either"):
      rules = state_file.TextRules(True, True, escapes)
      long_way = unescaped(token, rules)
      with monkeypatch.context() as m:
        m.setattr(state_file, "_VECTOR_MIN", 1 << 40)
        short_way = unescaped(token, rules)
      assert long_way == short_way, escapes
  # And one of each atom alone, long: none refused the long way only.
  for atom in atoms:
    token = '"' + "a" * (1 << 16) + atom + '"'
    for escapes in ("legacy", "current"):
      rules = state_file.TextRules(True, True, escapes)
      long_way = unescaped(token, rules)
      with monkeypatch.context() as m:
        m.setattr(state_file, "_VECTOR_MIN", 1 << 40)
        assert unescaped(token, rules) == long_way, (atom, escapes)


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


def _failing_reads(monkeypatch, error: Exception) -> None:
  """The local back end's reads raise `error` (stat and checks still work)."""
  def read_bytes(self, path, offset=0, length=None):
    raise error
  monkeypatch.setattr(local_fs.LocalFileSystem, "read_bytes", read_bytes)


class OpError(Exception):
  """Named as TensorFlow's I/O errors are (they are not OSErrors)."""


def test_a_state_file_that_cannot_be_read(tmp_path, monkeypatch, caplog):
  # I/O errors (OSError, or TensorFlow's OpError by name) make the file
  # unusable: None with a warning naming it, or with `strict` an error
  # naming it, caused by the I/O error. Any other error is a bug: raised.
  write_state(tmp_path, state_text(["ckpt-1"], [1.0], None))
  path = str(tmp_path / "checkpoint")
  for error in (OSError(errno.EIO, "Input/output error", path),
                OpError("the device is gone")):
    _failing_reads(monkeypatch, error)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      assert state_file.read_checkpoint_state(str(tmp_path)) is None
    assert f"{path}: cannot read: {error}; checkpoint state ignored" in (
        caplog.text)
    with pytest.raises(storage.CheckpointStateError) as raised:
      state_file.read_checkpoint_state(str(tmp_path), strict=True)
    assert raised.value.path == path
    assert raised.value.problem == f"cannot read: {error}"
    assert raised.value.__cause__ is error
  _failing_reads(monkeypatch, RuntimeError("a bug in a back end"))
  for strict in (False, True):
    with pytest.raises(RuntimeError, match="a bug in a back end"):
      state_file.read_checkpoint_state(str(tmp_path), strict=strict)


def test_the_read_is_bounded_by_the_size_limit(tmp_path, monkeypatch):
  # The limit is exact (a file of the limit's size is read whole: its last
  # byte closes a string), one byte more is asked for, and a file that grew
  # past the limit between its stat and its read is refused, naming it.
  text = 'model_checkpoint_path: "ckpt-1"'
  write_state(tmp_path, text)
  path = str(tmp_path / "checkpoint")
  monkeypatch.setattr(state_file, "MAX_STATE_FILE_BYTES", len(text))
  asked = []
  read_bytes = local_fs.LocalFileSystem.read_bytes

  def recorded(self, p, offset=0, length=None):
    asked.append((offset, length))
    return read_bytes(self, p, offset, length)

  monkeypatch.setattr(local_fs.LocalFileSystem, "read_bytes", recorded)
  state = state_file.read_checkpoint_state(str(tmp_path), strict=True)
  assert state.model_checkpoint_path == f"{tmp_path}/ckpt-1"
  assert asked == [(0, len(text) + 1)]
  write_state(tmp_path, text + "\n" * 10)
  monkeypatch.setattr(local_fs.LocalFileSystem, "stat",
                      lambda self, p: (len(text), 0.0))  # stat before growth
  for strict in (False, True):
    with pytest.raises(storage.CheckpointStateError) as raised:
      state_file.read_checkpoint_state(str(tmp_path), strict=strict)
    assert raised.value.path == path
    assert raised.value.problem == (
        f"over the limit of {len(text)} bytes "
        "(state_file.MAX_STATE_FILE_BYTES)")


def test_refusals_name_the_state_file(tmp_path, monkeypatch):
  path = str(tmp_path / "checkpoint")
  write_state(tmp_path, state_text(["a", "b", "c"], None, None))
  monkeypatch.setattr(state_file, "MAX_STATE_ENTRIES", 2)
  with pytest.raises(storage.CheckpointStateError) as raised:
    state_file.read_checkpoint_state(str(tmp_path))
  assert raised.value.path == path
  assert raised.value.problem == (
      "more than 2 paths and timestamps (state_file.MAX_STATE_ENTRIES)")
  monkeypatch.setattr(state_file, "MAX_STATE_FILE_BYTES", 10)
  with pytest.raises(storage.CheckpointStateError) as raised:
    state_file.read_checkpoint_state(str(tmp_path))
  assert raised.value.path == path
  size = (tmp_path / "checkpoint").stat().st_size
  assert raised.value.problem == (
      f"{size} bytes, over the limit of 10 (state_file.MAX_STATE_FILE_BYTES)")
  monkeypatch.setattr(state_file, "MAX_STATE_FILE_BYTES", 2**20)
  write_state(tmp_path, "all_model_checkpoint_paths: 'a'\n")
  with pytest.raises(storage.CheckpointStateError) as raised:
    state_file.read_checkpoint_state(str(tmp_path))
  assert raised.value.path == path
  assert raised.value.problem == (
      f"Invalid checkpoint state loaded from {tmp_path}: "
      "no model_checkpoint_path")


def test_a_directory_named_with_a_trailing_slash(tmp_path):
  write_state(tmp_path, state_text(["ckpt-1", "ckpt-2"], None, None))
  state = state_file.read_checkpoint_state(f"{tmp_path}/")
  assert state.model_checkpoint_path == f"{tmp_path}/ckpt-2"
  assert state.all_model_checkpoint_paths == [
      f"{tmp_path}/ckpt-1", f"{tmp_path}/ckpt-2"]


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
# Over the size limit: never read (in a child, so that a hang fails).
# ---------------------------------------------------------------------------


def test_state_file_over_the_size_limit_is_never_read(tmp_path, run_child):
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


@pytest.mark.thorough("all escapes", "1.5M fields", "1M list items", "60 MiB path")
@pytest.mark.skipif(not os.path.exists("/proc/self/status"),
                    reason="peak memory is read from /proc/self/status")
@pytest.mark.parametrize("case", BIG_CASES)
def test_big_state_file_parses_in_linear_time(tmp_path, case, run_child):
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
    paths = [p[len(sys.argv[1]) + 1:]
             for p in (state.all_model_checkpoint_paths if state else [])]
    outcome["paths"] = len(paths)
    outcome["lengths"] = sorted({len(p) for p in paths})
    outcome["sample"] = paths[0][:200] if paths else None
    print(json.dumps(outcome))
  """, str(tmp_path), timeout=120)
  assert out["seconds"] < 15, out
  assert out["peak_extra_kib"] * 1024 < 8 * BIG, out
  if sys.version_info < (3, 11) and "\n" not in unit:
    # One line of 64 MiB: Python 3.10's `re` (no possessive repeats) would
    # keep backtracking state per escape or item; such lines are refused
    # there.
    assert out["error"] == "CheckpointStateError", out
    assert (f"line 2: longer than {state_file.MAX_LINE_PY310} characters"
            in out["message"]), out
    return
  assert "error" not in out, out
  if value is None:
    assert out["paths"] == 0
  elif prefix.endswith('"'):  # one long path
    assert out["paths"] == 1 and out["lengths"] == [len(value) * count]
    assert out["sample"] == (value * count)[:200]
  else:
    assert out["paths"] == count + ("[" in prefix)
    assert out["lengths"] == [len(value)] and out["sample"] == value


# ---------------------------------------------------------------------------
# format_checkpoint_state: the file TensorFlow writes, without TensorFlow.
# ---------------------------------------------------------------------------


def _tf_state_text(directory, latest, paths, stamps, last_preserved):
  """What `CheckpointManager._record_state` writes, without writing it."""
  from google.protobuf import text_format  # pylint: disable=g-import-not-at-top
  # update_checkpoint_state_internal(save_relative_paths=True), step one.
  rel = lambda p: os.path.relpath(p, directory) if os.path.isabs(p) else p
  proto = checkpoint_management.generate_checkpoint_state_proto(
      directory, rel(latest), all_model_checkpoint_paths=[rel(p) for p in paths],
      all_model_checkpoint_timestamps=stamps or None,
      last_preserved_timestamp=last_preserved)
  return text_format.MessageToString(proto)


_UNICODE_PATH = checkpoint_management.generate_checkpoint_state_proto(
    "/d", "é")


@pytest.mark.parametrize("directory", [
    "gs://b/run", "s3://b/r/sub", "/tmp/abs/run", "rel/run"])
def test_format_checkpoint_state_is_tensorflows(directory):
  rng = random.Random(directory)
  names = WEIRD_NAMES + ["ckpt-1", "ckpt-2"]
  for trial in range(40):
    paths = [f"{directory}/{rng.choice(names)}-{i}"
             for i in range(rng.randrange(0, 4))]
    if trial % 5 == 0:
      paths.append("/elsewhere/ckpt-9")
    latest = paths[-1] if paths and trial % 3 else f"{directory}/ckpt-77"
    count = len(paths) + (not paths or paths[-1] != latest)
    stamps = [rng.choice([rng.uniform(1e9, 2e9), 1.0, 1e16, 0.5])
              for _ in range(count)] if trial % 4 else []
    last = rng.choice([0.0, 1795254085.0282855, 1e16, float("inf")])
    ours = state_file.format_checkpoint_state(
        directory, latest, paths, stamps, last)
    theirs = _tf_state_text(directory, latest, list(paths), stamps, last)
    if '"é"' not in text_format.MessageToString(_UNICODE_PATH):
      # protobuf 4.x (TensorFlow 2.16) escapes non-ASCII bytes in octal,
      # which every reader reads the same; the rest is byte for byte.
      ours = "".join(c if c.isascii() else "".join(
          f"\\{b:03o}" for b in c.encode()) for c in ours)
    assert ours == theirs


def test_format_checkpoint_state_reads_back(tmp_path):
  text = state_file.format_checkpoint_state(
      str(tmp_path), f"{tmp_path}/ckpt-2", [f"{tmp_path}/ckpt-1"],
      [1795254086.25, 1795254087.5], 1795254085.0)
  (tmp_path / "checkpoint").write_text(text)
  state = state_file.read_checkpoint_state(str(tmp_path))
  assert state == state_file.CheckpointState(
      f"{tmp_path}/ckpt-2", [f"{tmp_path}/ckpt-1", f"{tmp_path}/ckpt-2"],
      [1795254086.25, 1795254087.5], 1795254085.0)
  assert text.startswith('model_checkpoint_path: "ckpt-2"\n')
  with pytest.raises(ValueError, match="must match"):
    state_file.format_checkpoint_state("/d", "/d/c-1", ["/d/c-1"], [1., 2.], 0.)


# ---------------------------------------------------------------------------
# Python 3.10: bounded memory without possessive repeats.
# ---------------------------------------------------------------------------


def test_a_line_too_long_for_python_3_10_is_refused_there():
  line = ('model_checkpoint_path: "' +
          "\\n" * (state_file.MAX_LINE_PY310 // 2) + '"\n')
  assert len(line) > state_file.MAX_LINE_PY310
  text = 'last_preserved_timestamp: 1\n' + line
  with pytest.raises(ValueError) as raised:
    state_file._bounded(text, py310=True)  # pylint: disable=protected-access
  assert str(raised.value) == (
      f"line 2: longer than {state_file.MAX_LINE_PY310} characters, which "
      "clu_ckpt does not read on Python 3.10 (its `re` would need memory in "
      "proportion; TensorFlow writes one path per line)")
  # Counted from the first line, whatever it holds (here nothing), not
  # from the end.
  with pytest.raises(ValueError, match="^line 2: longer than"):
    state_file._bounded("\n" + line + "x\n" * 3, py310=True)  # pylint: disable=protected-access
  assert state_file._bounded(text, py310=False) == text  # pylint: disable=protected-access
  short = "x" * state_file.MAX_LINE_PY310 + "\n"
  assert state_file._bounded(short * 3, py310=True) == short * 3  # pylint: disable=protected-access


@pytest.mark.skipif(not os.path.exists("/proc/self/status"),
                    reason="peak memory is read from /proc/self/status")
def test_comment_runs_cost_no_memory(tmp_path, run_child):
  """4 MiB of comment lines: 513 MiB of backtracking state on Python 3.10
  before runs were taken a few comments at a time."""
  text = (HEAD + "# c\n" * 2**20 + 'all_model_checkpoint_paths: "a"' +
          " #\n" * 2**20)
  (tmp_path / "checkpoint").write_text(text)
  out = run_child("""
    def peak():
      with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM"))
    before = peak()
    state = state_file.read_checkpoint_state(sys.argv[1], strict=True)
    print(json.dumps({"extra_kib": peak() - before,
                      "paths": state.all_model_checkpoint_paths}))
  """, str(tmp_path), timeout=120)
  assert out["paths"] == [f"{tmp_path}/a"], out
  assert out["extra_kib"] < 64 * 1024, out
