"""The options of `clu-ckpt migrate`, and loading its `--template`.

One definition, shared by the two commands that migrate: `clu-ckpt migrate`
(`clu_ckpt.cli`) and the fleet (`clu_ckpt.migration.fleet`,
`migration/migrate_runs.py`), so an option added here is accepted by both,
and the fleet's workers load a `--template` as the command does.

Synopsis::

  import argparse
  from clu_ckpt.migration import options

  parser = argparse.ArgumentParser()
  added = options.add_migrate_options(parser, exclude=("json",))
  args = parser.parse_args(["--latest", "--compression", "none"])
  state = options.load_template("my_model:abstract_train_state")
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from typing import Any, Sequence


def add_migrate_options(container: Any, exclude: Sequence[str] = ()
                        ) -> list[str]:
  """Adds `clu-ckpt migrate`'s options (not SOURCE, DESTINATION) to a parser.

  The one definition of those options: `clu-ckpt migrate` and the fleet
  (`clu_ckpt.migration.fleet`, `migration/migrate_runs.py`) both call it,
  so an option added here is accepted by both.

  Args:
    container: An `argparse.ArgumentParser` or an argument group of one.
    exclude: Destinations (`dest`, e.g. "dry_run", "json") not to add.

  Returns:
    The destinations of the options added, in order, each once.
  """
  skip = set(exclude)
  added: list[str] = []

  def add(target: Any, *flags: str, **kwargs: Any) -> None:
    dest = kwargs.get("dest") or flags[0].lstrip("-").replace("-", "_")
    if dest in skip:
      return
    target.add_argument(*flags, **kwargs)
    if dest not in added:
      added.append(dest)

  which = container.add_mutually_exclusive_group()
  add(which, "--all", dest="checkpoints", action="store_const",
      const="all", default="all",
      help="every kept checkpoint (default)")
  add(which, "--latest", dest="checkpoints", action="store_const",
      const="latest", help="the latest checkpoint only")
  add(which, "--number", dest="numbers", type=int, action="append",
      metavar="N", help="checkpoint number N (ckpt-N); "
      "repeatable")
  add(container, "--step-naming", choices=("auto", "state", "number"),
      default="auto",
      help="Orbax step of each checkpoint: the state's top-level "
      "`step` (state), the CLU checkpoint number (number), or the "
      "state's step when every checkpoint has an increasing one "
      "(auto, default)")
  add(container, "--state-host", type=int, metavar="H",
      help="multihost: take the state from host H without "
      "comparing hosts (default: host 0, after checking all hosts "
      "hold the same state)")
  add(container, "--compression", choices=("zstd", "none"), default="zstd",
      help="array compression: zstd (Orbax's default; smaller, "
      "CPU-bound) or none (faster, larger)")
  add(container, "--dry-run", action="store_true",
      help="show what would be migrated; write nothing")
  add(container, "--verify", action="store_true",
      help="re-read every leaf through Orbax and compare it "
      "bit-exactly with the source")
  add(container, "--json", action="store_true",
      help="print a machine-readable summary on stdout")
  add(container, "--max-inflight-mib", type=int, default=None, metavar="MIB",
      help="array data handed to TensorStore at once (bounds "
      "memory; default 128, 16 for a gs:// destination)")
  add(container, "--staging-dir", metavar="DIR",
      help="gs:// destination: write each step here first, then upload "
      "it by many streams at once (named here or by $CLU_CKPT_STAGING_DIR: "
      "every step; else steps of about 1 GiB or more, in the system's "
      "temporary directory)")
  add(container, "--step-prefix", metavar="PREFIX",
      help="name steps <PREFIX>_<step>, as CheckpointManagerOptions"
      "(step_prefix=PREFIX) does")
  add(container, "--step-format-fixed-length", type=int, metavar="N",
      help="zero-pad step numbers to N digits, as "
      "CheckpointManagerOptions(step_format_fixed_length=N) does")
  add(container, "--allow-other-sources", action="store_true",
      help="migrate into a destination that already holds steps "
      "of another source (refused by default)")
  add(container, "--template", metavar="MODULE:FUNCTION",
      help="write the state in the structure of the train state "
      "FUNCTION() returns (MODULE imported from the current "
      "directory or PYTHONPATH), for StandardRestore(abstract)")
  return added


# What `--template` accepts: MODULE:FUNCTION (dotted module, identifier).
TEMPLATE_SPEC = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)"
                           r":([A-Za-z_]\w*)$")


class TemplateError(Exception):
  """`--template` could not be imported or called (exit status 1)."""


def load_template(spec: str) -> Any:
  """The train state `--template MODULE:FUNCTION` names.

  Example::

    # template.py in the current directory:
    #   def template():
    #     return jax.eval_shape(create_train_state, jax.random.key(0))
    abstract_state = load_template("template:template")

  Args:
    spec: "MODULE:FUNCTION"; MODULE is imported with the current directory
      first on `sys.path`, FUNCTION is called with no arguments.

  Returns:
    What FUNCTION returns.

  Raises:
    ValueError: `spec` is not MODULE:FUNCTION.
    TemplateError: The import or the call failed (message names `spec`).
  """
  match = TEMPLATE_SPEC.match(spec)
  if match is None:
    raise ValueError(f"--template {spec!r}: expected MODULE:FUNCTION, e.g. "
                     "my_model:abstract_train_state")
  module_name, function_name = match.groups()
  if os.getcwd() not in sys.path and "" not in sys.path:
    sys.path.insert(0, os.getcwd())
  try:
    module = importlib.import_module(module_name)
    function = getattr(module, function_name)
    return function()
  except Exception as e:  # pylint: disable=broad-except
    first = (str(e).strip().splitlines() or [""])[0]
    raise TemplateError(f"--template {spec}: {type(e).__name__}: "
                         f"{first}") from e
