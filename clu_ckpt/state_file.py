"""TensorFlow's `checkpoint` state file, read without TensorFlow.

`tf.train.CheckpointManager` keeps a text-format `CheckpointState` proto named
`checkpoint` beside its checkpoints; `read_checkpoint_state` parses it as
`tf.train.get_checkpoint_state` does, so that the latest checkpoint of a
directory can be found in an environment without TensorFlow (this module
never imports it). The file is read through `clu_ckpt.storage`'s file-system
seam, so any back end works. The parser is linear in the file's size; files
over `MAX_STATE_FILE_BYTES` are refused before they are read, and files
listing more than `MAX_STATE_ENTRIES` paths and timestamps while parsed.

Synopsis::

  from clu_ckpt import state_file

  state = state_file.read_checkpoint_state("/ckpts")
  state.model_checkpoint_path   # "/ckpts/ckpt-3"
  state.managed_checkpoints()   # what a fresh CheckpointManager would list
  state_file.read_checkpoint_state("/ckpts", strict=True)  # or raises
  text = state_file.format_checkpoint_state(    # what TensorFlow writes
      "gs://b/ckpts", "gs://b/ckpts/ckpt-3",
      ["gs://b/ckpts/ckpt-2", "gs://b/ckpts/ckpt-3"], [1.7e9, 1.7e9 + 5],
      last_preserved_timestamp=1.7e9 - 1)
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import math
import os
import re
import sys
import time
from typing import Any, Optional

from absl import logging

from clu_ckpt import errors
from clu_ckpt import storage

STATE_FILENAME = "checkpoint"
# TensorFlow writes a few hundred bytes per checkpoint; larger files are
# refused before they are read.
MAX_STATE_FILE_BYTES = 128 * 2**20
# Each listed path or timestamp costs ~100 bytes of Python objects however
# short it is in the file (`"a",`): files listing more are refused.
MAX_STATE_ENTRIES = 2**22


CheckpointStateError = errors.CheckpointStateError


@dataclasses.dataclass(frozen=True)
class TextRules:
  r"""The text-format rules of one protobuf release, where releases differ.

  TensorFlow parses the file with the text format of the protobuf installed
  beside it, and releases differ (measured against the real TensorFlow):
  protobuf 4.25 (TensorFlow 2.16) and 5.29 (TensorFlow 2.18) read numbers
  with leading zeros (`01` is 1.0) and only a lowercase `f` suffix; 7.x
  (TensorFlow 2.21) refuses leading zeros and also takes `2F`. Protobuf 4.25
  unescapes a string in one `unicode_escape` pass (a `\u` escape above U+00FF
  or an octal one above `\377` stays as the text `\uXXXX`); 5.29 and 7.x
  decode `\u` escapes first and refuse those.

  Attributes:
    leading_zeros: Numbers such as `01` and `-00.5` are read (4.25, 5.29).
    upper_f: A `F` suffix is read like `f` (7.x).
    escapes: "current" (5.x on), "legacy" (4.x), or "either" (current,
      falling back to legacy where current refuses a string).
  """
  leading_zeros: bool
  upper_f: bool
  escapes: str


# What `read_checkpoint_state` accepts: every file some supported TensorFlow
# reads (a string readable by both escape rules means what current protobuf
# says: TensorFlow itself never writes `\u` escapes).
LENIENT_RULES = TextRules(leading_zeros=True, upper_f=True, escapes="either")


@dataclasses.dataclass
class CheckpointState:
  """What TensorFlow's `checkpoint` state file says about a directory.

  Paths are joined with the directory when relative, as TensorFlow does.
  """
  model_checkpoint_path: str
  all_model_checkpoint_paths: list[str]
  all_model_checkpoint_timestamps: list[float]
  last_preserved_timestamp: float

  def managed_checkpoints(self, now: Optional[float] = None) -> list[str]:
    """The checkpoints a fresh `tf.train.CheckpointManager` would list.

    `CheckpointManager.checkpoints` keeps only paths whose timestamp is newer
    than `last_preserved_timestamp` (timestamps from the future count as now);
    files without timestamps list nothing.

    Args:
      now: The current time (default `time.time()`).

    Returns:
      Checkpoint prefixes, oldest first.
    """
    now = time.time() if now is None else now
    last = min(self.last_preserved_timestamp, now)
    stamps = self.all_model_checkpoint_timestamps or (
        [last] * len(self.all_model_checkpoint_paths))
    return [p for p, t in zip(self.all_model_checkpoint_paths, stamps)
            if min(t, now) > last]


def read_checkpoint_state(directory: str, *,
                          strict: bool = False) -> Optional[CheckpointState]:
  r"""Parses `<directory>/checkpoint` like `tf.train.get_checkpoint_state`.

  The file is a text-format `CheckpointState` proto; it is parsed as
  TensorFlow's (Python protobuf) reader does: comments (`#` outside quotes),
  `"`/`'` strings with C, hex, octal and `\u` escapes, adjacent strings
  concatenated, `field: [a, b]` lists, `,`/`;` separators, repeated scalar
  fields (the last wins), and the same float spellings (`1e3`, `inf`, `2f`).

  Example::

    state = read_checkpoint_state("/ckpts")
    latest = state.model_checkpoint_path if state else None

  Args:
    directory: A checkpoint directory (path or URL).
    strict: Raise `CheckpointStateError` for a file that cannot be read, is
      not UTF-8 or does not parse, instead of returning None with a warning
      (which TensorFlow does).

  Returns:
    The state, or None when the file is missing (or, unless `strict`, cannot
    be used).

  Raises:
    NotRegularFileError: The file is a named pipe, device, directory...
      (in both modes: TensorFlow would block on it or fail).
    CheckpointStateError: In both modes: the file is larger than
      `MAX_STATE_FILE_BYTES` (128 MiB; refused before reading), lists more
      than `MAX_STATE_ENTRIES` (4M) paths and timestamps, or parses but names
      no `model_checkpoint_path` ("Invalid checkpoint state", a ValueError as
      in TensorFlow). With `strict`, also when it cannot be read, is not UTF-8
      or does not parse. The message names the file and the problem ("not
      UTF-8 at byte 17", "cannot parse: line 2, column 5: ...").
  """
  path = storage.join(directory, STATE_FILENAME)
  try:
    data = _read_state_file(path)
  except (errors.NotRegularFileError, CheckpointStateError):
    raise
  except Exception as e:  # pylint: disable=broad-except
    if not (isinstance(e, OSError) or
            any(c.__name__ == "OpError" for c in type(e).__mro__)):
      raise
    return _unusable(path, f"cannot read: {e}", strict, e)
  if data is None:
    return None
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    return _unusable(path, f"not UTF-8 at byte {e.start}", strict, e)
  del data
  try:
    fields = _parse_text_proto(text, LENIENT_RULES)
  except _TooManyEntries as e:
    raise CheckpointStateError(path, str(e)) from None
  except ValueError as e:
    return _unusable(path, f"cannot parse: {e}", strict, e)
  del text
  latest = (fields["model_checkpoint_path"] or [""])[-1]
  if not latest:
    raise CheckpointStateError(
        path, f"Invalid checkpoint state loaded from {directory}: "
        "no model_checkpoint_path")
  # os.path.isabs and os.path.join (POSIX), inlined for long lists.
  prefix = directory if not directory or directory.endswith("/") else (
      directory + "/")
  absolute = lambda p: p if p.startswith("/") else prefix + p
  paths = fields["all_model_checkpoint_paths"]
  for i, p in enumerate(paths):  # in place: no second list of copies
    paths[i] = absolute(p)
  stamps = fields["last_preserved_timestamp"]
  return CheckpointState(
      model_checkpoint_path=absolute(latest),
      all_model_checkpoint_paths=paths,
      all_model_checkpoint_timestamps=fields["all_model_checkpoint_timestamps"],
      last_preserved_timestamp=stamps[-1] if stamps else 0.0,
  )


def format_checkpoint_state(directory: str, model_checkpoint_path: str,
                            all_model_checkpoint_paths: list[str],
                            all_model_checkpoint_timestamps: list[float],
                            last_preserved_timestamp: float) -> str:
  r"""The text of the `checkpoint` file TensorFlow's CheckpointManager writes.

  Byte for byte what `tf.train.CheckpointManager` writes for `directory`
  (its `_record_state`: `update_checkpoint_state_internal` with
  `save_relative_paths=True`, then `text_format.MessageToString`): paths that
  are not absolute (local relative paths, and URLs such as `gs://b/run/x`)
  are made relative to `directory` with `os.path.relpath`, the latest path is
  appended to the list unless it ends it, strings are C-escaped as current
  protobuf does (`\n`, `\"`, octal for ASCII control bytes), doubles are
  printed as Python's `str` does, and a `last_preserved_timestamp` of 0 is
  left out (proto3). For object stores, where clu_ckpt writes the file
  itself (`tf_manager.ObjectStoreManager`).

  Example::

    format_checkpoint_state("gs://b/run", "gs://b/run/ckpt-2",
                            ["gs://b/run/ckpt-1", "gs://b/run/ckpt-2"],
                            [1795254086.27, 1795254086.28], 1795254085.0)
    # 'model_checkpoint_path: "ckpt-2"\nall_model_checkpoint_paths: "ckpt-1"'...

  Args:
    directory: The checkpoint directory (path or URL).
    model_checkpoint_path: The latest checkpoint.
    all_model_checkpoint_paths: The managed checkpoints, oldest first.
    all_model_checkpoint_timestamps: Their timestamps (same length, or empty).
    last_preserved_timestamp: The manager's last preserved timestamp.

  Returns:
    The file's text.

  Raises:
    ValueError: The timestamps do not match the paths (as TensorFlow).
  """
  paths = list(all_model_checkpoint_paths)
  if not paths or paths[-1] != model_checkpoint_path:
    paths.append(model_checkpoint_path)
  if (all_model_checkpoint_timestamps and
      len(all_model_checkpoint_timestamps) != len(paths)):
    raise ValueError(
        f"Checkpoint timestamps, if provided, must match checkpoint paths (got "
        f"paths {paths} and timestamps {all_model_checkpoint_timestamps})")
  isabs = os.path.isabs

  def relative(p: str) -> str:
    # TensorFlow's two steps: absolute paths relative to the directory, then
    # (for a directory that is not absolute, e.g. a URL) every path that is
    # not absolute by then.
    if isabs(p):
      p = os.path.relpath(p, directory)
    if not isabs(directory) and not isabs(p):
      p = os.path.relpath(p, directory)
    return p

  lines = [f"model_checkpoint_path: {_quote(relative(model_checkpoint_path))}"]
  lines += [f"all_model_checkpoint_paths: {_quote(relative(p))}"
            for p in paths]
  lines += [f"all_model_checkpoint_timestamps: {float(t)}"
            for t in all_model_checkpoint_timestamps]
  if last_preserved_timestamp:
    lines.append(f"last_preserved_timestamp: {float(last_preserved_timestamp)}")
  return "".join(line + "\n" for line in lines)


# protobuf's `text_encoding.CEscape(value, as_utf8=True)`, what the
# `MessageToString` of current protobuf releases does (older ones also
# escaped non-ASCII bytes in octal, which every reader parses the same).
_C_ESCAPES = {**{i: f"\\{i:03o}" for i in range(128) if not 32 <= i < 127},
              ord("\n"): r"\n", ord("\r"): r"\r", ord("\t"): r"\t",
              ord('"'): r'\"', ord("'"): r"\'", ord("\\"): r"\\"}


def _quote(value: str) -> str:
  return '"' + value.translate(_C_ESCAPES) + '"'


def _read_state_file(path: str) -> Optional[bytes]:
  """The bytes of the state file, None if missing; refuses oversized ones."""
  fs = storage.filesystem(path)
  try:
    fs.check_regular_file(path)  # a FIFO, device...: NotRegularFileError
    if not fs.exists(path):
      return None
    size = fs.stat(path)[0]
  except (FileNotFoundError, NotADirectoryError):
    return None
  if size > MAX_STATE_FILE_BYTES:
    raise CheckpointStateError(
        path, f"{size} bytes, over the limit of {MAX_STATE_FILE_BYTES} "
        "(state_file.MAX_STATE_FILE_BYTES)")
  try:
    data = fs.read_bytes(path, 0, MAX_STATE_FILE_BYTES + 1)
  except (FileNotFoundError, NotADirectoryError):
    return None
  if len(data) > MAX_STATE_FILE_BYTES:  # grew while read
    raise CheckpointStateError(
        path, f"over the limit of {MAX_STATE_FILE_BYTES} bytes "
        "(state_file.MAX_STATE_FILE_BYTES)")
  return data


def _unusable(path: str, problem: str, strict: bool,
              cause: Exception) -> None:
  if strict:
    raise CheckpointStateError(path, problem) from cause
  logging.warning("%s: %s; checkpoint state ignored", path, problem)
  return None


# The text-format tokenizer. Every repetition is possessive (Python >= 3.11):
# `re` then keeps no backtracking state per repetition, so long strings,
# escape runs and comment runs cost no memory beyond the text. Python 3.10
# gets the same patterns without it (none needs it for its meaning): still
# linear in time, but each comment of a run and each escape of a string keeps
# ~90-130 bytes of backtracking state while it is matched (4 MiB of `#`
# lines cost 513 MiB). There a skip takes at most _SKIP_COMMENTS comments
# (`_token` and `_past_comments` go on past longer runs), and `_bounded`
# refuses lines over MAX_LINE_PY310 (bounding a string's escapes: a line of
# 1 Mi characters of escapes costs ~90 MiB there, 2 MiB on 3.11).
_PY310 = sys.version_info < (3, 11)


def _compile(pattern: Any) -> re.Pattern:
  if _PY310:
    strip = r"(?<=[*+?}])\+"
    pattern = re.sub(strip.encode() if isinstance(pattern, bytes) else strip,
                     pattern[:0], pattern)
  return re.compile(pattern)


_SKIP_COMMENTS = 16  # Python 3.10: comments one skip takes
# Whitespace and comments to the end of their line.
_SKIP = r"\s*+(?:#[^\n]*+(?![^\n])\s*+)" + (
    f"{{0,{_SKIP_COMMENTS}}}" if _PY310 else "*+")
_SKIP_RE = _compile(_SKIP)
MAX_LINE_PY310 = 2**20  # characters; TensorFlow writes a path per line
_LONG_LINE_RE = re.compile(r"^[^\n]{%d}" % (MAX_LINE_PY310 + 1), re.M)


def _bounded(text: str, py310: bool = _PY310) -> str:
  """`text`, when Python can parse it with bounded memory.

  Raises:
    ValueError: With `py310`, a line longer than MAX_LINE_PY310.
  """
  long_line = _LONG_LINE_RE.search(text) if py310 else None
  if long_line is not None:
    line = text.count("\n", 0, long_line.start()) + 1
    raise ValueError(
        f"line {line}: longer than {MAX_LINE_PY310} characters, which "
        "clu_ckpt does not read on Python 3.10 (its `re` would need memory "
        "in proportion; TensorFlow writes one path per line)")
  return text


def _past_comments(text: str, pos: int) -> int:
  """Where the whitespace and comments at `pos` end."""
  pos = _SKIP_RE.match(text, pos).end()
  while text.startswith("#", pos):  # a run longer than one skip takes
    pos = _SKIP_RE.match(text, pos).end()
  return pos


_WORD = r"[A-Za-z_][0-9A-Za-z_+-]*+|(?:[0-9+-]|\.[0-9])[0-9A-Za-z_.+-]*+"
_STRING = (r'"[^"\\\n]*+(?:\\.[^"\\\n]*+)*+"|'
           r"'[^'\\\n]*+(?:\\.[^'\\\n]*+)*+'")
# No adjacent string to join (on Python 3.10, nor more comments than a skip
# takes, after which one might follow).
_LONE_STRING = rf"(?:{_STRING})(?!{_SKIP}[\"'])" + (
    rf"(?!\s*(?:#[^\n]*\n\s*){{{_SKIP_COMMENTS}}}#)" if _PY310 else "")
_NUMBER = rf"(?!-?0[0-9])(?:{_WORD})"  # not octal-looking (an error)
_STRING_FIELDS = ("model_checkpoint_path", "all_model_checkpoint_paths")
_FLOAT_FIELDS = ("all_model_checkpoint_timestamps", "last_preserved_timestamp")
_REPEATED = ("all_model_checkpoint_paths", "all_model_checkpoint_timestamps")
_NAMES = {kind: f"(?:{'|'.join(names)})(?![0-9A-Za-z_+-])"
          for kind, names in (("s", _STRING_FIELDS), ("f", _FLOAT_FIELDS))}
# One token (any other character is a token by itself).
_TOKEN_RE = _compile(
    rf"{_SKIP}(?:(?P<word>{_WORD})|(?P<string>{_STRING})|(?P<char>.))?")
# Fast paths, matched as runs of up to 1024, then split with findall (no match
# object each): `name: value` fields with a single string or number, list
# items with their comma, adjacent strings. Anything else goes token by token.
# (No capturing group inside a possessive repeat: Python 3.11's `re` gets
# their spans wrong.)
_RUNS_RE = {
    "field": _compile(
        rf"(?:{_SKIP}(?:{_NAMES['s']}{_SKIP}:{_SKIP}{_LONE_STRING}|"
        rf"{_NAMES['f']}{_SKIP}:{_SKIP}{_NUMBER}){_SKIP}[,;]?){{1,1024}}+"),
    "string": _compile(rf"(?:{_SKIP}(?:{_STRING}){_SKIP},){{1,1024}}+"),
    "number": _compile(rf"(?:{_SKIP}{_NUMBER}{_SKIP},){{1,1024}}+"),
    "adjacent": _compile(rf"(?:{_SKIP}(?:{_STRING})){{1,1024}}+"),
}
_ITEMS_RE = {
    "field": _compile(
        rf"{_SKIP}(?:({_NAMES['s']}){_SKIP}:{_SKIP}({_STRING})|"
        rf"({_NAMES['f']}){_SKIP}:{_SKIP}({_WORD})){_SKIP}[,;]?"),
    "string": _compile(rf"{_SKIP}({_STRING}){_SKIP},"),
    "number": _compile(rf"{_SKIP}({_WORD}){_SKIP},"),
    "adjacent": _compile(rf"{_SKIP}({_STRING})"),
}


def _parse_text_proto(text: str,
                      rules: TextRules = LENIENT_RULES) -> dict[str, list]:
  """Parses the flat text proto of a CheckpointState into field -> values.

  `rules` says how numbers and escapes are read (`TextRules`); the tests
  check each protobuf release's rules against the TensorFlow installed.

  Raises:
    ValueError: "line 3, column 7: ..." (a syntax error, an unknown field, a
      bad escape or number, a string that is not UTF-8 once unescaped);
      `_TooManyEntries` over MAX_STATE_ENTRIES.
  """
  text = _bounded(text)
  fields: dict[str, list] = {n: [] for n in _STRING_FIELDS + _FLOAT_FIELDS}
  pos = bulk_from = 0
  while pos >= 0:
    if pos >= bulk_from:
      pos, bulk_from = _parse_run("field", text, pos, fields, rules)
    pos = _parse_field(text, pos, fields, rules)
    _check_entries(fields)
  return fields


class _TooManyEntries(ValueError):
  pass


def _check_entries(fields: dict[str, list]) -> None:
  """Keeps the last value of singular fields; enforces MAX_STATE_ENTRIES."""
  del fields["model_checkpoint_path"][:-1], fields[
      "last_preserved_timestamp"][:-1]
  if len(fields["all_model_checkpoint_paths"]) + len(
      fields["all_model_checkpoint_timestamps"]) > MAX_STATE_ENTRIES:
    raise _TooManyEntries(
        f"more than {MAX_STATE_ENTRIES} paths and timestamps "
        "(state_file.MAX_STATE_ENTRIES)")


def _parse_run(kind: str, text: str, pos: int, fields: dict[str, list],
               rules: TextRules, name: str = "") -> tuple[int, int]:
  """Appends a run of simple fields or list items at `pos` in bulk.

  Returns:
    (its end, where to try the next run); (pos, the run's end) when one of
    them is bad: parsed one by one, it is then reported precisely.
  """
  m = _RUNS_RE[kind].match(text, pos)
  if m is None:
    return pos, pos + 1
  end = m.end()
  found = _ITEMS_RE[kind].findall(text, pos, end)
  string = ((lambda t: t[1:-1]) if text.find("\\", pos, end) < 0 else
            (lambda t: _unescape(t, rules).decode("utf-8")))
  try:
    if kind == "field":
      values = [(s, string(v)) if s else (f, _double(w, rules))
                for s, v, f, w in found]
    elif kind == "number":
      try:
        values = list(map(float, found))
      except ValueError:
        values = [_double(t, rules) for t in found]
    else:
      values = list(map(string, found))
  except ValueError:
    return pos, end
  if kind == "field":
    for field, value in values:
      fields[field].append(value)
  else:
    fields[name] += values
  return end, end


def _token(text: str, pos: int) -> tuple[Optional[str], int, int]:
  """(kind, start, end) of the token after `pos`; kind None at the end."""
  m = _TOKEN_RE.match(text, pos)
  if m.lastgroup == "char" and text[m.start("char")] == "#":
    # Python 3.10: more comments than one skip takes.
    m = _TOKEN_RE.match(text, _past_comments(text, m.start("char")))
  kind = m.lastgroup
  return kind, m.start(kind) if kind else m.end(), m.end()


def _parse_field(text: str, pos: int, fields: dict[str, list],
                 rules: TextRules) -> int:
  """Parses one field of any form at `pos`; returns its end, -1 at the end."""
  kind, start, end = _token(text, pos)
  name = text[start:end]
  if kind is None:
    return -1
  if kind != "word" or name not in fields:
    raise _syntax_error(text, start, f"unknown field {_excerpt(name)}")
  kind, start, pos = _token(text, end)
  if text[start:pos] != ":":
    raise _syntax_error(text, start, f"expected ':' after {name}")
  kind, start, end = _token(text, pos)
  if name in _REPEATED and text[start:end] == "[":
    kind, start, pos = _token(text, end)
    if text[start:pos] != "]":
      pos = _parse_list(text, end, name, fields, rules)
  else:
    pos = _parse_value(text, pos, name, fields, rules)
  kind, start, end = _token(text, pos)
  return end if text[start:end] in (",", ";") else pos


def _parse_list(text: str, pos: int, name: str, fields: dict[str, list],
                rules: TextRules) -> int:
  """Parses `value, value]` at `pos` (after the `[`); returns its end."""
  kind = "string" if name in _STRING_FIELDS else "number"
  bulk_from = pos
  while True:
    if pos >= bulk_from:
      pos, bulk_from = _parse_run(kind, text, pos, fields, rules, name)
      _check_entries(fields)
    pos = _parse_value(text, pos, name, fields, rules)
    _, start, end = _token(text, pos)
    if text[start:end] == "]":
      return end
    if text[start:end] != ",":
      raise _syntax_error(text, start, f"expected ',' or ']' in {name}")
    pos = end


def _parse_value(text: str, pos: int, name: str, fields: dict[str, list],
                 rules: TextRules) -> int:
  """Appends the value at `pos` (adjacent strings joined); returns its end."""
  kind, start, end = _token(text, pos)
  if name in _FLOAT_FIELDS and kind is not None:
    try:
      fields[name].append(_double(text[start:end], rules))
    except ValueError as e:
      raise _syntax_error(text, start, str(e)) from None
    return end
  if kind != "string":
    got = _excerpt(text[start:end]) if kind else "the end of the file"
    if kind == "char" and text[start] in "\"'":
      got = "a string not closed on its line"
    what = "number" if name in _FLOAT_FIELDS else "string"
    raise _syntax_error(text, start, f"expected a {what} for {name}, got {got}")
  pieces = []
  while True:
    begin = pos
    m = _RUNS_RE["adjacent"].match(text, begin)
    if m is None and _PY310:  # more comments than one skip takes?
      begin = _past_comments(text, pos)
      m = _RUNS_RE["adjacent"].match(text, begin)
    if m is None:
      break
    if text.find("\\", begin, m.end()) < 0:
      pieces.append("".join(
          [t[1:-1] for t in _ITEMS_RE["adjacent"].findall(text, begin,
                                                          m.end())]
      ).encode("utf-8"))
    else:
      for t in _ITEMS_RE["adjacent"].finditer(text, begin, m.end()):
        try:
          pieces.append(_unescape(t[1], rules))
        except ValueError as e:
          raise _syntax_error(text, t.start(1),
                              f"bad escape in a string: {e}") from None
    pos = m.end()
  try:
    fields[name].append(b"".join(pieces).decode("utf-8"))
  except UnicodeDecodeError as e:
    raise _syntax_error(
        text, start, f"string not UTF-8 once unescaped (byte {e.start})"
    ) from None
  return pos


def _syntax_error(text: str, pos: int, problem: str) -> ValueError:
  line = text.count("\n", 0, pos) + 1
  column = pos - text.rfind("\n", 0, pos)
  return ValueError(f"line {line}, column {column}: {problem}")


def _excerpt(s: str) -> str:
  return repr(s[:40]) + ("..." if len(s) > 40 else "")


_OCTAL_FLOAT_RE = re.compile(r"-?0[0-9]")
_INF_RE = re.compile(r"(-?)inf(?:inity)?f?", re.I)
_NAN_RE = re.compile(r"nanf?", re.I)


def _double(token: str, rules: TextRules) -> float:
  """`token` read as protobuf's text format reads a double (`-inf`, `2f`)."""
  if rules.leading_zeros or not _OCTAL_FLOAT_RE.match(token):
    with contextlib.suppress(ValueError):
      return float(token)
    if m := _INF_RE.fullmatch(token):
      return -math.inf if m[1] else math.inf
    if _NAN_RE.fullmatch(token):
      return math.nan
    with contextlib.suppress(ValueError):
      return float(token.rstrip("fF" if rules.upper_f else "f"))
  raise ValueError(f"not a number: {_excerpt(token)}")


# TensorFlow's reader unescapes with Python's codecs: `\u`/`\U` first
# (raw_unicode_escape), then C escapes, octal and hex (unicode_escape) on the
# UTF-8 bytes, with a one-digit `\xf` allowed and unknown escapes (`\?`)
# kept verbatim. Escaped backslashes are hidden as 0xFF bytes (never in
# UTF-8) meanwhile, so that every backslash left starts an escape, which the
# patterns below (and numpy, for long strings) find without counting.
_WIDE_ESCAPE_RE = _compile(rb"\\[uU\xc4-\xf4]")  # \u, \U, \<char over U+00FF>
_BIG_OCTAL_RE = _compile(rb"\\[4-7][0-7][0-7]")
_SHORT_HEX_RE = _compile(rb"\\x(?=[0-9a-fA-F](?![0-9a-fA-F]))")
_UNKNOWN_ESCAPE_RE = _compile(rb"\\(?=[^\\'\"abfnrtvxuUN0-7\n])")
_VECTOR_MIN = 1 << 16  # longer strings are fixed with numpy (see _insert)
_CHUNK = 1 << 20


def _unescape(token: str, rules: TextRules) -> bytes:
  r"""The bytes a quoted string (`token`, with its quotes) stands for.

  Raises:
    ValueError: A bad escape (`\x` without digits, a trailing backslash; with
      current rules also `\400`, a truncated `\u`, a surrogate...).
  """
  if rules.escapes == "legacy":
    return _legacy_unescape(token)
  try:
    return _current_unescape(token)
  except ValueError:
    if rules.escapes != "either":
      raise
    return _legacy_unescape(token)


def _legacy_unescape(token: str) -> bytes:
  r"""`_unescape` as protobuf 4.x does it: one `unicode_escape` pass.

  The UTF-8 bytes of the text are decoded with `unicode_escape` (octal, hex,
  C, `\u`, `\U` and `\N{}` escapes at once) and encoded back with
  `raw_unicode_escape`: characters up to U+00FF become their byte, later ones
  the ASCII text `\uXXXX` / `\UXXXXXXXX`.
  """
  hidden = token.encode("utf-8").replace(b"\\\\", b"\xff\xff")
  if b"\\x" in hidden:
    hidden = _fix_escapes(hidden, "hex")
  hidden = _fix_escapes(hidden, "unknown")
  # `\400`..`\777` are U+0100..U+01FF to the codec (which warns about them).
  hidden = _BIG_OCTAL_RE.sub(lambda m: b"\\u%04x" % int(m[0][1:], 8), hidden)
  data = hidden.replace(b"\xff", b"\\")
  del hidden
  try:
    return codecs.unicode_escape_decode(memoryview(data)[1:-1])[0].encode(
        "raw_unicode_escape")
  except UnicodeError as e:
    raise ValueError(str(e)) from None


def _current_unescape(token: str) -> bytes:
  """`_unescape` as protobuf 5.x and later do it (see `_unescape`)."""
  hidden = token.encode("utf-8").replace(b"\\\\", b"\xff\xff")
  if b"\\x" in hidden:  # `\xf` -> `\x0f`, before `\u` escapes are decoded
    hidden = _fix_escapes(hidden, "hex")
  if _WIDE_ESCAPE_RE.search(hidden):
    hidden = hidden.replace(b"\xff", b"\\").decode("utf-8").encode(
        "raw_unicode_escape").decode("raw_unicode_escape").encode(
            "utf-8").replace(b"\\\\", b"\xff\xff")
  if _BIG_OCTAL_RE.search(hidden):
    raise ValueError("octal escape above \\377")
  # `\?` -> `\\?`: kept as the codec would, without its DeprecationWarning.
  hidden = _fix_escapes(hidden, "unknown")
  data = hidden.replace(b"\xff", b"\\")
  del hidden  # long strings: one copy fewer while decoding
  return codecs.unicode_escape_decode(memoryview(data)[1:-1])[0].encode(
      "latin-1")


# Pattern, re.sub template, byte inserted and where, into each escape found.
_FIXES = {"hex": (_SHORT_HEX_RE, rb"\\x0", ord("0"), 2),
          "unknown": (_UNKNOWN_ESCAPE_RE, rb"\\\\", ord("\\"), 0)}


def _fix_escapes(hidden: bytes, fix: str) -> bytes:
  """`hidden` with a byte inserted into each escape of kind `fix`."""
  pattern, template, byte, offset = _FIXES[fix]
  if not pattern.search(hidden):
    return hidden
  if len(hidden) < _VECTOR_MIN:
    return pattern.sub(template, hidden)
  return _insert(hidden, fix == "hex", byte, offset)  # re.sub: 180 B/escape


def _insert(hidden: bytes, hex_fix: bool, byte: int,
            offset: int) -> bytearray:
  """`_fix_escapes` for long strings: numpy, a chunk at a time."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  a = np.frombuffer(hidden, np.uint8)
  n = len(a)
  is_hex = np.zeros(257, bool)  # [256]: past the end
  is_hex[list(b"0123456789abcdefABCDEF")] = True
  unknown = np.ones(256, bool)
  unknown[list(b"\\'\"abfnrtvxuUN01234567\n")] = False
  out = bytearray()
  for i in range(0, n, _CHUNK):
    j = min(i + _CHUNK, n)
    s = np.flatnonzero(a[max(i - 2, 0):j] == ord("\\")) + max(i - 2, 0)
    s = s[s + 1 < n]  # a trailing backslash: the codec rejects it
    if not hex_fix:
      at = s[unknown[a[s + 1]]]
    else:
      s = s[(a[s + 1] == ord("x")) & (s + 2 < n)]
      after = np.where(s + 3 < n, a[np.minimum(s + 3, n - 1)], 256)
      at = s[is_hex[a[s + 2]] & ~is_hex[after]]
    at = at[(at + offset >= i) & (at + offset < j)] + offset - i
    out += np.insert(a[i:j], at, byte).tobytes()
  return out
