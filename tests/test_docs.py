"""The documentation's command blocks run, so that they cannot drift.

Every fenced ```bash, ```sh and ```python block of `DOCS` is run, in order,
against small real checkpoints (copies of the golden CLU fixtures) in a
temporary directory: the shell blocks of a document in one bash process,
the Python blocks in one Python process sharing one namespace (a document
reads top to bottom: a later block may use an earlier block's names).

A block that cannot run offline says so right above its fence, with the
reason, so that every exception is visible in the document itself::

  <!-- docs-test: skip (installs packages) -->
  ```bash
  pip install -e ".[all]"
  ```

Blocks marked `<!-- guide: NAME -->` are run by tests/test_migration.py,
which trains with them. New blocks are picked up automatically; one that
needs a bucket, a GPU, a cluster or a long run carries the skip marker.

The documents' example paths (`/runs/...`, `/work/run1/...`, `/reports/...`,
`/orbax_runs`, `/tmp/`) are rewritten to the temporary directory (`_PATHS`); Python
blocks also find the names a reader's own program would define (`workdir`,
`state`, `dataset`, `train_step`, ...; see `_PRELUDE`).
"""

import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

import emulators
from conftest import golden_case, make_writable

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCS = ("README.md", "migration/README.md")
RUNNABLE = ("bash", "sh", "python")
_FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)\s*$")
_SKIP = re.compile(r"^<!--\s*docs-test:\s*skip\s*\((?P<reason>[^)]*)\)\s*-->$")
_GUIDE = re.compile(r"^<!--\s*guide:\s*(?P<name>[\w-]+)\s*-->$")
# A document's example paths -> where they are in the test's directory.
_PATHS = ("/work/run1/", "/runs/", "/reports/", "/orbax_runs", "/orbax/",
          "/tmp/")


@dataclasses.dataclass
class Block:
  doc: str
  line: int           # of the opening fence, 1-based
  lang: str
  code: str
  skip: str = ""      # the reason, when marked `docs-test: skip`
  guide: str = ""     # the name, when run by tests/test_migration.py

  @property
  def where(self) -> str:
    return f"{self.doc}:{self.line}"


def doc_blocks(doc: str) -> list[Block]:
  """The fenced blocks of `doc`, with the marker above each, if any."""
  lines = (REPO / doc).read_text().splitlines()
  blocks, i = [], 0
  while i < len(lines):
    fence = _FENCE.match(lines[i])
    if not fence:
      i += 1
      continue
    end = i + 1
    while end < len(lines) and not lines[end].startswith(fence.group(1)):
      end += 1
    above = next((lines[k].strip() for k in range(i - 1, -1, -1)
                  if lines[k].strip()), "")
    skip, guide = _SKIP.match(above), _GUIDE.match(above)
    blocks.append(Block(doc, i + 1, fence.group(2).lower(),
                        "\n".join(lines[i + 1:end]) + "\n",
                        skip=skip.group("reason").strip() if skip else "",
                        guide=guide.group("name") if guide else ""))
    if skip and not skip.group("reason").strip():
      blocks[-1].skip = "?"  # a marker without a reason: reported below
      blocks[-1].code = ""
    i = end + 1
  return blocks


def _runnable(doc: str, langs: tuple[str, ...]) -> list[Block]:
  return [b for b in doc_blocks(doc)
          if b.lang in langs and not b.skip and not b.guide]


def _localize(code: str, root: pathlib.Path) -> str:
  """`code` with the example paths moved under `root` (in one pass)."""
  pattern = r"(?<![\w./-])(" + "|".join(map(re.escape, _PATHS)) + ")"
  return re.sub(pattern, lambda m: str(root) + m.group(1), code)


@pytest.fixture
def doc_root(tmp_path):
  """The checkpoints the documents' examples name, made in `tmp_path`.

  Also links the checkout's script directories there: the documents'
  commands run from a checkout of the repository.
  """
  for target, case in (("work/run1/checkpoints", "single_host"),
                       ("runs/a/checkpoints", "single_host")):
    shutil.copytree(golden_case(case), tmp_path / target)
  for host in ("0", "1"):
    shutil.copytree(golden_case("multihost") / f"checkpoints-{host}",
                    tmp_path / "runs" / "mh" / f"checkpoints-{host}")
  for sub in ("reports", "orbax_runs", "tmp"):
    (tmp_path / sub).mkdir()
  make_writable(tmp_path)
  # The commands are written to run from a checkout (`python migration/...`).
  for sub in ("migration", "examples", "benchmarks", "tests"):
    (tmp_path / sub).symlink_to(REPO / sub)
  return tmp_path


def _env(root: pathlib.Path) -> dict[str, str]:
  env = dict(os.environ, **emulators.ENV)
  env["PATH"] = os.pathsep.join([str(pathlib.Path(sys.executable).parent),
                                 env.get("PATH", "")])
  env["PYTHONPATH"] = os.pathsep.join(
      [str(root), str(REPO), env.get("PYTHONPATH", "")])
  env["TF_CPP_MIN_LOG_LEVEL"] = "3"
  env.pop("STORAGE_EMULATOR_HOST", None)   # no bucket: those blocks skip
  env.pop("AWS_ENDPOINT_URL", None)
  return env


# --------------------------------------------------------------------------
# Every block is run here, run by the guide's test, or says why it is not.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("doc", DOCS)
def test_every_command_block_runs_or_says_why_not(doc):
  blocks = [b for b in doc_blocks(doc) if b.lang in RUNNABLE]
  assert blocks, f"{doc}: no command blocks found"
  problems = []
  for b in blocks:
    if b.skip == "?":
      problems.append(f"{b.where}: `docs-test: skip` without a (reason)")
    if not b.skip and re.search(r"\bpip install\b", b.code):
      problems.append(f"{b.where}: installs packages; mark it "
                      "`<!-- docs-test: skip (installs packages) -->`")
  assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS)
def test_install_lines_name_a_checkout_not_pypi(doc):
  # clu_ckpt is not on PyPI: `pip install clu_ckpt[...]` installs nothing.
  text = (REPO / doc).read_text()
  # Also across a line break: a shell continuation, or inside an `inline` span.
  wrong = re.findall(
      r"pip install(?:[^\n`]|\\\n)*?(?<![/\w.-])['\"]?clu_ckpt\b"
      r"|(?<!`)`[^`]*?pip install[^`]*?(?<![/\w.-])['\"]?clu_ckpt\b", text)
  assert not wrong, f"{doc}: {wrong}"


def test_install_hints_in_messages_name_a_checkout_not_pypi():
  wrong = [f"{path.relative_to(REPO)}:{n}"
           for path in sorted((REPO / "clu_ckpt").rglob("*.py"))
           for n, line in enumerate(path.read_text().splitlines(), 1)
           if re.search(r"pip install ['\"]?clu_ckpt\[", line)]
  assert not wrong, wrong


def test_the_architecture_table_has_every_module():
  text = (REPO / "README.md").read_text()
  table = text[text.index("## Architecture"):]
  table = table[:table.index("\n## ", 1)]
  missing = [str(path.relative_to(REPO))
             for path in sorted((REPO / "clu_ckpt").rglob("*.py"))
             if f"`{path.relative_to(REPO)}`" not in table
             and f"`{path.name}`" not in table]
  assert not missing, f"README.md, Architecture: no row for {missing}"


def _anchor(heading: str) -> str:
  """The anchor GitHub gives a Markdown heading."""
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return text.replace(" ", "-")


def test_no_file_holds_merge_conflict_markers():
  """A merge resolved by committing both sides leaves markers that neither
  Python (in a docstring) nor Markdown refuses."""
  tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True,
                           text=True, check=False).stdout.split()
  if not tracked:
    pytest.skip("not a git checkout")
  marker = re.compile(r"^(<<<<<<< |>>>>>>> |=======$)", re.M)
  found = []
  for name in tracked:
    path = REPO / name
    if path.suffix not in (".py", ".md", ".cfg", ".ini", ".toml", ".txt"):
      continue
    text = path.read_text(errors="replace")
    found += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}"
              for m in marker.finditer(text)]
  assert not found, found


@pytest.mark.parametrize("doc", DOCS + ("CHANGELOG.md", "docs/FIGURES.md",
                                        "benchmarks/README.md"))
def test_relative_links_reach_a_file_and_heading(doc):
  text = (REPO / doc).read_text()
  broken = []
  for target in re.findall(r"\]\(([^)\s]+)\)", text):
    if re.match(r"[a-z]+://", target):
      continue
    path, _, anchor = target.partition("#")
    file = (REPO / doc).parent / path if path else REPO / doc
    if not file.exists():
      broken.append(target)
    elif anchor and file.suffix == ".md":
      headings = re.findall(r"^#+ (.*)$", file.read_text(), re.M)
      if anchor not in {_anchor(h) for h in headings}:
        broken.append(target)
  assert not broken, f"{doc}: {broken}"


def test_the_marker_parser_sees_skips_and_guides(tmp_path, monkeypatch):
  monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
  (tmp_path / "x.md").write_text(textwrap.dedent("""\
      <!-- docs-test: skip (needs a bucket) -->

      ```bash
      clu-ckpt inspect gs://b/run
      ```
      <!-- guide: common -->
      ```python
      x = 1
      ```
      ```sh
      echo hi
      ```
      <!-- docs-test: skip () -->
      ```python
      y = 2
      ```
      """))
  blocks = doc_blocks("x.md")
  assert [(b.lang, b.skip, b.guide) for b in blocks] == [
      ("bash", "needs a bucket", ""), ("python", "", "common"),
      ("sh", "", ""), ("python", "?", "")]
  assert [b.line for b in blocks] == [3, 7, 10, 14]


# --------------------------------------------------------------------------
# Running them.
# --------------------------------------------------------------------------


def _paths_outside(code: str, root: pathlib.Path) -> list[str]:
  """Absolute paths in localized `code` that are not under `root`.

  A path after `}`, `>` or a word character is a tail (`{workdir}/x`,
  `<workdir>/x`, `a/b`), not an absolute path; `/dev/null` is allowed.
  """
  found = re.findall(r"(?<![\w./:}>-])/[\w.~-][^\s'\"`),;]*", code)
  return [p for p in found
          if not p.startswith(str(root)) and p not in ("/dev/null",)]


@pytest.mark.parametrize("doc", DOCS)
def test_example_paths_all_move_into_the_test_dir(doc):
  # A block naming a path `_PATHS` does not know would read or write the
  # machine's own (it once wrote /orbax/a): the list must grow with the docs.
  root = pathlib.Path("/TESTROOT")
  outside = [f"{b.where}: {p}"
             for b in _runnable(doc, ("bash", "sh", "python"))
             for p in _paths_outside(_localize(b.code, root), root)]
  assert not outside, ("example paths not moved into the test's directory "
                       f"(add them to _PATHS): {outside}")


def test_the_path_guard_sees_an_unknown_absolute_path():
  root = pathlib.Path("/TESTROOT")
  code = _localize('clu-ckpt migrate /runs/a /elsewhere/out\n'
                   'open("/data/x.flax")  # {workdir}/ckpt-1 <workdir>/y\n'
                   'cat a/b > /dev/null\n', root)
  assert _paths_outside(code, root) == ["/elsewhere/out", "/data/x.flax"]


@pytest.mark.parametrize("doc", DOCS)
def test_shell_blocks_run(doc, doc_root):
  blocks = _runnable(doc, ("bash", "sh"))
  if not blocks:
    pytest.skip(f"{doc} has no shell block to run")
  script = ["set -u"]
  for b in blocks:
    script.append(f"( set -e; cd {doc_root}\n{_localize(b.code, doc_root)})"
                  f" || {{ echo 'FAILED: the block at {b.where}' >&2; "
                  "exit 1; }")
  done = subprocess.run(["bash", "-c", "\n".join(script)], cwd=doc_root,
                        env=_env(doc_root), capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"


# What the documents' snippets take from the reader's own program.
_PRELUDE = """
import flax
import numpy as np
import tensorflow as tf

@flax.struct.dataclass
class _TrainState:
  step: int
  params: dict

workdir = "{root}/workdir"
multihost_base = "{root}/runs/mh/checkpoints"
state = _TrainState(step=0, params={{"w": np.arange(3, dtype=np.float32)}})
dataset = tf.data.Dataset.range(100).repeat()
num_steps = 3

def train_step(state, batch):
  return state.replace(step=state.step + 1)
"""

_RUNNER = """
import sys, traceback
namespace = {"__name__": "__docs__"}
exec(compile(sys.argv[1], "<prelude>", "exec"), namespace)
blocks = sys.argv[2:]
for where, code in zip(blocks[::2], blocks[1::2]):
  try:
    exec(compile(code, where, "exec"), namespace)
  except BaseException:
    traceback.print_exc()
    print(f"FAILED: the block at {where}", file=sys.stderr)
    sys.exit(1)
"""


@pytest.mark.parametrize("doc", DOCS)
def test_python_blocks_run(doc, doc_root):
  blocks = _runnable(doc, ("python",))
  if not blocks:
    pytest.skip(f"{doc} has no Python block to run")
  argv = [sys.executable, "-c", _RUNNER, _PRELUDE.format(root=doc_root)]
  for b in blocks:
    argv += [b.where, _localize(b.code, doc_root)]
  done = subprocess.run(argv, cwd=doc_root, env=_env(doc_root),
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
