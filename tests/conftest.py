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

  def test_never_hangs(run_child, tmp_path):  # in a fresh Python, timed
    out = run_child("print(json.dumps(attempt(lambda: storage.stat("
                    "sys.argv[1]))))", str(tmp_path / "x"))
    # out: {"error": ..., "errno": ..., "seconds": ...} or {"returned": ...}

  @pytest.mark.soak  # minutes long: skipped unless `--soak` is given
  def test_kill_anywhere(tmp_path): ...

  @pytest.mark.thorough  # seconds long: skipped unless `--thorough`
  def test_two_cli_migrations_race(tmp_path): ...

  @pytest.mark.thorough("s3")  # only the s3 variant waits for --thorough
  def test_killed_holder_is_taken_over(bucket_store): ...

`python -m pytest -q tests` is the quick run (its time: docs/FIGURES.md): it
skips the `soak` tests (each has a quick version in the default run) and the
`thorough` ones (a real-process race, kill or fleet run whose family keeps a
representative in the quick run, or the second store of a test both stores
pass the same way). `--thorough` and `--soak` add them; `-m thorough` or
`-m soak` select only them (`-m thorough` with both variants of a test
marked for one store). Both are run before a release (README.md, "Tests").
"""

import json
from importlib import metadata
import os
import re
import pathlib
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
from typing import Any, Callable, Optional

import pytest

import emulators

# TensorFlow's C++ start-up chatter drowns pytest's output; set it before any
# test imports TensorFlow.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# Nothing but 127.0.0.1, in any test order: the cloud clients' metadata
# probes are off and etils' paths never choose TensorFlow's gs:// (which
# resolves www.googleapis.com) for the whole session, before any test imports
# Orbax. etils decides that once per process, at its first path, so setting
# it only in the emulator fixtures let a local Orbax test run first in the
# same process decide for the bucket tests after it.
NETWORK_GUARD = ("NO_GCE_CHECK", "GCE_METADATA_HOST", "GCE_METADATA_IP",
                 "GCE_METADATA_ROOT", "AWS_EC2_METADATA_DISABLED",
                 "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "EPATH_USE_TF")
os.environ.update({k: emulators.ENV[k] for k in NETWORK_GUARD})

# A run started in the background (`pytest ... &` in a script, nohup, some CI
# runners) inherits SIGINT ignored, and an ignored signal stays ignored in
# every process it starts: a child then never sees the Ctrl-C a test sends
# it, and a test of Ctrl-C fails (or passes) for the wrong reason. A handler
# that does nothing keeps this process as it was, and its children start
# with SIGINT at its default, as from a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
  signal.signal(signal.SIGINT, lambda signum, frame: None)

FIXTURES = (pathlib.Path(__file__).resolve().parents[2] / "shared" /
            "fixtures" / "clu-0.0.12")


# --------------------------------------------------------------------------
# Soak tests: long kill loops and end-to-end runs, skipped unless --soak.
# --------------------------------------------------------------------------

SOAK_REASON = ("soak test (minutes): run with `python -m pytest -q tests "
               "--soak -n 0` (all tests) or `python -m pytest -q tests --soak "
               "-n 0 -m soak` (only the soaks; one process, so that their "
               "1 GiB arrays never meet); they are run before a release")
THOROUGH_REASON = ("thorough test (seconds; its family has a quick "
                   "representative): run with `python -m pytest -q tests "
                   "--thorough`; run before a release")


def pytest_addoption(parser: pytest.Parser) -> None:
  parser.addoption(
      "--soak", action="store_true", default=False,
      help="also run the tests marked `soak` (long kill loops, end-to-end "
      "runs; run before a release). Add `-m soak` to run only them.")
  parser.addoption(
      "--thorough", action="store_true", default=False,
      help="also run the tests marked `thorough` (more real-process races, "
      "kills and fleet runs, the second store; run before a release). Add "
      "`-m thorough` to run only them.")


# --------------------------------------------------------------------------
# Orbax: the migration and the Orbax items need orbax-checkpoint >= 0.12.5
# (which needs jax >= 0.6). On an older stack (the support matrix's old
# sessions) their tests are skipped with this reason, not failed.
# --------------------------------------------------------------------------

MIGRATION_ORBAX = (0, 12, 5)


def installed_version(package: str) -> Optional[tuple[int, ...]]:
  """The installed `package`'s version as numbers, None when absent."""
  try:
    version = metadata.version(package)
  except metadata.PackageNotFoundError:
    return None
  return tuple(int(n) for n in re.findall(r"\d+", version.split("+")[0])[:3])


def orbax_skip_reason() -> Optional[str]:
  """Why tests that need the migration's Orbax are skipped here, or None."""
  version = installed_version("orbax-checkpoint")
  if version is not None and version >= MIGRATION_ORBAX:
    return None
  have = ("no orbax-checkpoint" if version is None else
          f"orbax-checkpoint {metadata.version('orbax-checkpoint')}")
  return (f"migration needs orbax-checkpoint >= 0.12.5 (with jax >= 0.6); "
          f"{have} is installed (README.md, \"Support matrix\")")


# Test modules that all need that Orbax (they migrate, or write with its
# API); single tests elsewhere carry the `orbax` mark.
ORBAX_MODULES = re.compile(r"test_(migration|migrate_runs|orbax_items|"
                           r"orbax_root)[a-z_]*\.py$")


# A test that needs that Orbax and carries no mark is not failed either: on an
# older Orbax, a test that fails (or errs in a fixture) after the migration
# refused for that reason is reported as skipped. Exactly that refusal
# counts: `orbax_target.check_orbax_version` of the installed version raising
# in this process (whatever the test did with the error after), or its
# message in the failure's text or captured output (a `clu-ckpt` child, a
# docs block). Any other failure stays a failure; on a recent Orbax nothing
# changes.
_refused: list[str] = []
_REFUSAL_KEY = pytest.StashKey[Optional[str]]()


def orbax_refusal() -> Optional[str]:
  """The start of the migration's refusal of the installed Orbax, or None.

  E.g. "migrating needs orbax-checkpoint >= 0.12.5 and the installed
  orbax-checkpoint is 0.6.4" (the product's own message, up to its first
  ";"); None when the installed Orbax is recent enough.
  """
  if orbax_skip_reason() is None:
    return None
  from clu_ckpt import errors  # pylint: disable=g-import-not-at-top
  from clu_ckpt.migration import orbax_target  # pylint: disable=g-import-not-at-top
  try:
    orbax_target.require_orbax()
  except errors.MigrationError as e:
    return str(e).split(";")[0]
  return None


def _record_refusals() -> None:
  """Wraps `check_orbax_version` to note each refusal of the installed Orbax."""
  from clu_ckpt.migration import orbax_target  # pylint: disable=g-import-not-at-top
  check = orbax_target.check_orbax_version
  installed = orbax_target.installed_orbax_version()

  def recording(version):
    try:
      return check(version)
    except Exception as e:
      if version == installed:
        _refused.append(str(e))
      raise

  orbax_target.check_orbax_version = recording


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
  del item
  _refused.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item):
  outcome = yield
  report = outcome.get_result()
  refusal = item.config.stash.get(_REFUSAL_KEY, None)
  if not (refusal and report.failed and report.when in ("setup", "call")):
    return
  text = "\n".join([str(report.longrepr)] +
                    [content for _, content in report.sections])
  if _refused or refusal in text:
    report.outcome = "skipped"
    report.longrepr = (str(item.path), item.location[1] or 0,
                       f"Skipped: {orbax_skip_reason()} (the migration "
                       f"refused: {refusal})")


# Whether this run has --thorough (set before collection, when the test
# modules are imported).
_THOROUGH_RUN = False


def fuzz_examples(full: int) -> int:
  """How many cases a fuzz test draws: `full` with --thorough, a third
  (at least one) in the quick run. A fixed seed then draws the first of
  the thorough run's cases.

  Example::

    @settings(max_examples=fuzz_examples(300))
  """
  return full if _THOROUGH_RUN else max(1, full // 3)


# One emulator of each kind for a whole xdist run: the controlling process
# starts them (without waiting: moto imports for seconds while the workers
# start) and names them to the workers through the variables
# `emulators.Emulator.shared_variable`, which the workers inherit. One pair
# per worker cost a second moto (0.1-0.25 GiB) and its start-up in each.
_RUN_EMULATORS = pytest.StashKey[tuple]()


def _starts_run_emulators(config: pytest.Config) -> bool:
  """Whether this process controls xdist workers (more than one)."""
  workers = getattr(config.option, "numprocesses", None)
  return (not hasattr(config, "workerinput") and isinstance(workers, int) and
          workers > 1 and getattr(config.option, "dist", "no") != "no" and
          not config.option.collectonly)


def _launch_run_emulators() -> tuple:
  import tempfile  # pylint: disable=g-import-not-at-top
  root = pathlib.Path(tempfile.mkdtemp(prefix="clu_ckpt-test-emulators-"))
  started = []
  for kind in (emulators.FakeGcs, emulators.MotoS3):
    if os.environ.get(kind.shared_variable):
      continue  # already shared from outside the run
    emulator = kind(root / kind.__name__.lower())
    try:
      emulator.launch()
    except (ImportError, OSError):
      continue  # each worker tries (and skips its tests) as without sharing
    os.environ[kind.shared_variable] = emulator.url
    started.append(emulator)
  return root, started


def pytest_unconfigure(config: pytest.Config) -> None:
  root, started = config.stash.get(_RUN_EMULATORS, (None, []))
  for emulator in started:
    emulator.stop()
    os.environ.pop(emulator.shared_variable, None)
  if root is not None:
    shutil.rmtree(root, ignore_errors=True)


def pytest_configure(config: pytest.Config) -> None:
  global _THOROUGH_RUN
  if _starts_run_emulators(config):
    config.stash[_RUN_EMULATORS] = _launch_run_emulators()
  _THOROUGH_RUN = bool(config.getoption("--thorough"))
  config.stash[_REFUSAL_KEY] = refusal = orbax_refusal()
  if refusal:
    _record_refusals()
  config.addinivalue_line(
      "markers", "orbax: needs orbax-checkpoint >= 0.12.5 (the migration's); "
      "skipped on an older Orbax")
  config.addinivalue_line(
      "markers", "soak: a long soak or end-to-end kill test; skipped unless "
      "--soak is given (run before a release)")
  config.addinivalue_line(
      "markers", "thorough(*params): skipped unless --thorough is given; with "
      "arguments, only the variants parametrized with one of them (e.g. "
      "'s3')")


def is_thorough(item: pytest.Item) -> bool:
  """Whether `item` carries a `thorough` mark that applies to its variant."""
  for mark in item.iter_markers("thorough"):
    if not mark.args:
      return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    if any(v in mark.args for v in params.values() if isinstance(v, str)):
      return True
  return False


def pytest_collection_modifyitems(config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
  soak = config.getoption("--soak")
  thorough = config.getoption("--thorough")
  no_orbax = orbax_skip_reason()
  for item in items:
    if no_orbax and (item.get_closest_marker("orbax") is not None or
                     ORBAX_MODULES.search(item.fspath.basename)):
      item.add_marker(pytest.mark.skip(reason=no_orbax))
    if not soak and item.get_closest_marker("soak") is not None:
      item.add_marker(pytest.mark.skip(reason=SOAK_REASON))
    elif not thorough and is_thorough(item):
      item.add_marker(pytest.mark.skip(reason=THOROUGH_REASON))


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


# What `run_child` runs first: a memory limit, the storage modules and
# `attempt(call)`, which returns what `call()` returned or raised, and when.
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


@pytest.fixture(name="run_child")
def run_child_fixture() -> Callable[..., Any]:
  """Returns `run_child(code, *args, timeout=30)`: see `run_child`."""
  return run_child


# --------------------------------------------------------------------------
# Object-store emulators (tests/emulators.py), one of each per session (per
# run under xdist: see `_launch_run_emulators`).
# --------------------------------------------------------------------------


def _emulator(kind, tmp_path_factory):
  import emulators  # pylint: disable=g-import-not-at-top
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  emulator = kind(tmp_path_factory.mktemp(kind.__name__.lower()))
  try:
    emulator.start()
  except (ImportError, OSError, RuntimeError) as e:
    emulator.stop()
    pytest.skip(f"the {kind.__name__} emulator cannot start here: {e}")
  saved = {k: os.environ.get(k) for k in
           list(emulators.ENV) + list(emulator.env())}
  os.environ.update(emulators.ENV)
  os.environ.update(emulator.env())
  storage._INSTANCES.pop(emulator.scheme, None)  # pylint: disable=protected-access
  try:
    yield emulator
  finally:
    emulator.stop()
    storage._INSTANCES.pop(emulator.scheme, None)  # pylint: disable=protected-access
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


@pytest.fixture(scope="session")
def gcs(tmp_path_factory):
  """fake-gcs-server on 127.0.0.1 (`emulators.FakeGcs`); env set in-process."""
  import emulators  # pylint: disable=g-import-not-at-top
  yield from _emulator(emulators.FakeGcs, tmp_path_factory)


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
  """moto's S3 server on 127.0.0.1 (`emulators.MotoS3`); env set in-process."""
  import emulators  # pylint: disable=g-import-not-at-top
  yield from _emulator(emulators.MotoS3, tmp_path_factory)


@pytest.fixture(params=["gcs", "s3"])
def bucket_store(request):
  """Each emulator in turn (for tests every store must pass)."""
  return request.getfixturevalue(request.param)
