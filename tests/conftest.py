"""Shared pytest fixtures: golden CLU checkpoint directories and quiet logs.

The golden directories were written by the real `clu` 0.0.12 and live beside
the repository in `../shared/fixtures/clu-0.0.12/` (read-only). Tests never
write there: `golden_copy("single_host")` copies a case into the test's
`tmp_path` and makes the copy writable. Tests that need the fixtures are
skipped when the directory is absent.

Synopsis::

  def test_restores(golden_copy, golden_manifest):
    base = golden_copy("single_host")         # a writable pathlib.Path
    manifest = golden_manifest("single_host")  # the case's MANIFEST.json
"""

import json
import os
import pathlib
import shutil
import stat
from typing import Any, Callable

import pytest

# TensorFlow's C++ start-up chatter drowns pytest's output; set it before any
# test imports TensorFlow.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

FIXTURES = (pathlib.Path(__file__).resolve().parents[2] / "shared" /
            "fixtures" / "clu-0.0.12")


def golden_case(name: str) -> pathlib.Path:
  """The read-only golden directory `name`; skips the test if it is absent."""
  path = FIXTURES / name
  if not (path / "MANIFEST.json").is_file():
    pytest.skip(f"golden fixture {path} is not available")
  return path


def read_manifest(name: str) -> dict[str, Any]:
  """The parsed MANIFEST.json of golden case `name`."""
  return json.loads((golden_case(name) / "MANIFEST.json").read_text())


def make_writable(root: pathlib.Path) -> None:
  """`chmod -R u+w root`."""
  for path in [root, *root.rglob("*")]:
    mode = path.stat().st_mode
    path.chmod(mode | stat.S_IWUSR | (stat.S_IXUSR if path.is_dir() else 0))


@pytest.fixture
def golden_copy(tmp_path: pathlib.Path) -> Callable[[str], pathlib.Path]:
  """Returns `copy(name)`: a writable copy of golden case `name` in tmp_path."""

  def copy(name: str) -> pathlib.Path:
    target = tmp_path / "golden" / name
    shutil.copytree(golden_case(name), target)
    make_writable(target)
    return target

  return copy


@pytest.fixture
def golden_manifest() -> Callable[[str], dict[str, Any]]:
  """Returns `manifest(name)`: the parsed MANIFEST.json of case `name`."""
  return read_manifest
