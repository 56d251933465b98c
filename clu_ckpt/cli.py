"""The `clu-ckpt` command (also `python -m clu_ckpt`).

Synopsis::

  clu-ckpt inspect PATH [--checkpoint N] [--json]
  clu-ckpt verify PATH [--source CLU_DIR] [--json]
  clu-ckpt migrate SOURCE DESTINATION [--all | --latest | --number N ...]
      [--step-naming auto|state|number] [--state-host H]
      [--compression zstd|none] [--dry-run] [--verify] [--json]
      [--max-inflight-mib MIB] [--step-prefix PREFIX]
      [--step-format-fixed-length N] [--allow-other-sources]
      [--template MODULE:FUNCTION] [--staging-dir DIR]

`inspect` and `verify` read file names, TensorFlow's `checkpoint` file, the
`.flax` headers and Orbax's JSON metadata: they import neither TensorFlow nor
JAX (except `inspect` of a native Orbax step's tree, read through Orbax, and
with it JAX, when Orbax is installed), and `inspect` reads no array data (see
`clu_ckpt.inspection`). `verify` exits 0 only when every check holds.

`migrate` converts a CLU `Checkpoint` directory (or `MultihostCheckpoint`
base) into an Orbax CheckpointManager root; see `clu_ckpt.migration`. On a
terminal it draws a progress bar with the write rate; otherwise it prints one
line per event. Exit status: 0 when everything was migrated (or skipped as
already there), 1 when a checkpoint failed or the source is unusable, 2 for
bad usage, 130 when interrupted (Ctrl-C). `--template MODULE:FUNCTION`
imports MODULE (from the current directory or PYTHONPATH) and writes each
step's state in the structure of the train state `FUNCTION()` returns (see
`clu_ckpt.migration.template`).

Every failure ends with one line on stderr, `clu-ckpt COMMAND: error: PATH:
problem`, and exit status 1, except the problems `verify` finds: they are its
report, on stdout (`PROBLEM: ...` lines and the `FAILED` line), exit status 1.
Exit status 2 is for a command line refused before any work starts (an
unknown flag, an empty path, `verify --source` on what is not an Orbax root);
a value the library refuses once the command runs (an `s3://` destination, a
step prefix Orbax cannot use: `errors.UsageError`) is exit status 1 like any
other failure. Ctrl-C ends with one line, `clu-ckpt COMMAND: interrupted`
and what was done, and exit status 130. The Python traceback and the
libraries' own log messages are shown only with `--verbose`.

Each subcommand is a function `_add_<name>(subparsers)` that builds its
parser and sets `run`, a function of the parsed arguments returning the exit
status; `main` dispatches.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from typing import Any, Optional, Sequence, TextIO

from clu_ckpt import __version__
from clu_ckpt import library_logs
from clu_ckpt import progress
from clu_ckpt.migration import options

_MIB = 2**20


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs the command line.

  Args:
    argv: Arguments without the program name; default `sys.argv[1:]`.

  Returns:
    The exit status.
  """
  parser = build_parser()
  args = parser.parse_args(argv)
  if getattr(args, "run", None) is None:
    parser.print_help(sys.stderr)
    return 2
  for name in ("path", "source", "destination"):
    if getattr(args, name, None) == "":
      print(f"clu-ckpt {args.command}: error: {name.upper()} is empty",
            file=sys.stderr)
      return 2
  with library_logs.quieted(args.verbose):
    try:
      return args.run(args)
    except KeyboardInterrupt as e:
      if not args.verbose:
        # An abandoned step's asyncio tasks are collected only at exit.
        logging.getLogger("asyncio").disabled = True
      print(f"clu-ckpt {args.command}: interrupted"
            f"{_interrupted_detail(e, args)}", file=sys.stderr)
      return 130
    except BrokenPipeError:  # e.g. `clu-ckpt inspect ... | head`
      os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
      return 0
    except Exception as e:  # pylint: disable=broad-except
      if args.verbose:
        traceback.print_exc()
      print(f"clu-ckpt {args.command}: error: {_one_line(e, args)}",
            file=sys.stderr)
      return 1


def _interrupted_detail(error: KeyboardInterrupt,
                        args: argparse.Namespace) -> str:
  """What an interrupted command had done, for its one line on stderr."""
  summary = getattr(error, "summary", None)
  if summary is None:
    path = getattr(args, "path", None) or getattr(args, "source", None)
    return f": {path} not finished" if path else ""
  steps = summary.steps
  total = len(steps) + len(getattr(error, "remaining", []))
  done = [s for s in steps if s.status in ("migrated", "skipped")]
  names = ", ".join(f"ckpt-{s.number}" for s in done)
  text = f": {len(done)} of {total} checkpoints migrated"
  text += f" ({names})" if names else ""
  failed = [s for s in steps if s.status == "failed"]
  if failed:
    text += f"; {len(failed)} failed"
  abandoned = [s for s in steps if s.status == "interrupted"]
  if abandoned:
    text += f"; ckpt-{abandoned[0].number} abandoned"
  return text + "; re-run to resume"


def _one_line(error: BaseException, args: argparse.Namespace) -> str:
  """The error in one line that names the path it concerns."""
  if isinstance(error, OSError) and error.filename is not None:
    message = f"{error.filename}: {error.strerror or error}"
  else:
    text = str(error).strip()
    message = text.splitlines()[0] if text else type(error).__name__
    if not isinstance(error, (OSError, ValueError)):
      message = f"{type(error).__name__}: {message}"
  path = getattr(args, "path", None) or getattr(args, "source", None)
  if path and path not in message:
    message = f"{path}: {message}"
  return message


def build_parser() -> argparse.ArgumentParser:
  """The `clu-ckpt` argument parser, every subcommand included.

  Returns:
    The parser; parsed arguments carry `run`, the subcommand's function.
  """
  parser = argparse.ArgumentParser(
      prog="clu-ckpt",
      description="CLU/Flax checkpoints: fast access and migration to Orbax.")
  parser.add_argument("-v", "--verbose", action="store_true",
                      help="show the libraries' log messages")
  parser.add_argument("--version", action="version",
                      version=f"clu-ckpt {__version__}")
  subparsers = parser.add_subparsers(title="commands", metavar="COMMAND",
                                     dest="command")
  _add_inspect(subparsers)
  _add_verify(subparsers)
  _add_migrate(subparsers)
  return parser


# --------------------------------------------------------------------------
# inspect and verify
# --------------------------------------------------------------------------


def _add_inspect(subparsers: Any) -> None:
  p = subparsers.add_parser(
      "inspect", help="list checkpoints and the tree of one, headers only",
      description=(
          "Lists the checkpoints of a CLU directory, MultihostCheckpoint base "
          "or migrated Orbax root (number, step, size, time, hosts, committed "
          "or torn), and the tree of one checkpoint (path, dtype, shape, "
          "bytes, totals per top-level subtree), from headers only."))
  p.add_argument("path", metavar="PATH",
                 help="CLU checkpoint directory, MultihostCheckpoint base, "
                 ".flax file or Orbax root")
  p.add_argument("--checkpoint", type=int, metavar="N",
                 help="show the tree of checkpoint number N (Orbax: step N); "
                 "default the latest")
  p.add_argument("--json", action="store_true",
                 help="print a machine-readable report on stdout")
  p.set_defaults(run=_run_inspect)


# The manifest a migration leaves in its root
# (`clu_ckpt.migration.destination.MANIFEST_NAME`), read here without
# importing the migration package.
_MANIFEST_NAME = "clu_ckpt_manifest.json"


def _migration_manifest(root: str) -> dict[str, list[dict[str, Any]]]:
  """{source path: its recorded checkpoints} of a migrated root's manifest
  ({} for a root without one, or one that cannot be read)."""
  from clu_ckpt import layout  # pylint: disable=g-import-not-at-top
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  try:
    path = storage.join(layout.absolute(root), _MANIFEST_NAME)
    data = json.loads(storage.read_bytes(path))
  except (OSError, ValueError):
    return {}
  sources = data.get("sources") if isinstance(data, dict) else None
  return {s["path"]: [c for c in s.get("checkpoints") or []
                      if isinstance(c, dict)]
          for s in sources or []
          if isinstance(s, dict) and isinstance(s.get("path"), str)}


def _step_hint(root: str, number: int) -> str:
  """What a migrated root's manifest says about `--checkpoint number`: the
  step checkpoint `number` became, or the recorded mapping."""
  mapping = []
  for source, checkpoints in _migration_manifest(root).items():
    for c in checkpoints:
      name, step = c.get("name"), c.get("step")
      if c.get("number") == number:
        return (f"; checkpoint {name or number} of {source} was migrated to "
                f"step {step}: inspect {root} --checkpoint {step}")
      mapping.append(f"{name} -> {step}")
  if not mapping:
    return ""
  shown = ", ".join(mapping[:8]) + (", ..." if len(mapping) > 8 else "")
  return (f"; --checkpoint takes an Orbax step here, not a CLU checkpoint "
          f"number (migrated: {shown})")


def _run_inspect(args: argparse.Namespace) -> int:
  from clu_ckpt import errors  # pylint: disable=g-import-not-at-top
  from clu_ckpt import inspection  # pylint: disable=g-import-not-at-top
  try:
    report = inspection.inspect_path(args.path, args.checkpoint)
  except errors.CheckpointNotFoundError as e:
    if args.checkpoint is None or not inspection.is_orbax_root(args.path):
      raise
    hint = _step_hint(args.path, args.checkpoint)
    if not hint:
      raise
    print(f"clu-ckpt inspect: error: {_one_line(e, args)}{hint}",
          file=sys.stderr)
    return 1
  if args.json:
    print(json.dumps(report, indent=1))
  else:
    print(inspection.format_inspect(report))
  problems = report.get("problems") or []
  if problems:
    print(f"clu-ckpt inspect: error: {args.path}: {len(problems)} problem"
          f"{'s' if len(problems) != 1 else ''} (see above)",
          file=sys.stderr)
  return 1 if problems else 0


def _add_verify(subparsers: Any) -> None:
  p = subparsers.add_parser(
      "verify", help="check that every committed checkpoint is sound",
      description=(
          "Checks that every committed .flax decodes completely, its "
          "TensorFlow files are present and multihost directories agree on "
          "common numbers; for an Orbax root, that every step is complete "
          "(and with --source, that it matches its CLU source's headers and "
          "holds every checkpoint the source keeps). "
          "Exit status 0 only when everything holds."))
  p.add_argument("path", metavar="PATH",
                 help="CLU checkpoint directory, MultihostCheckpoint base, "
                 ".flax file or Orbax root")
  p.add_argument("--source", metavar="CLU_DIR",
                 help="for an Orbax root: the CLU directory it was migrated "
                 "from")
  p.add_argument("--json", action="store_true",
                 help="print a machine-readable report on stdout")
  p.set_defaults(run=_run_verify)


def _run_verify(args: argparse.Namespace) -> int:
  from clu_ckpt import inspection  # pylint: disable=g-import-not-at-top
  if args.source is not None:
    if not inspection.is_orbax_root(args.path):
      from clu_ckpt import orbax_root  # pylint: disable=g-import-not-at-top
      print(f"clu-ckpt verify: error: --source needs an Orbax root; "
            f"{args.path} is not one{orbax_root.step_naming_hint(args.path)}",
            file=sys.stderr)
      return 2
    result = inspection.verify_orbax_root(args.path, args.source)
    _name_the_recorded_source(args.path, args.source, result)
    _name_unmigrated_checkpoints(args.path, args.source, result)
  else:
    report = progress.VerifyReport(sys.stderr, sys.stderr.isatty())
    try:
      result = inspection.verify_path(args.path, progress=report)
    finally:
      report.close()
  if args.json:
    print(json.dumps(result, indent=1))
  else:
    for note in result.get("notes", ()):
      print(f"note: {note}")
    for problem in result["problems"]:
      print(f"PROBLEM: {problem}")
    print(f"{args.path}: {result['checked']} checked, "
          f"{len(result['problems'])} problem"
          f"{'s' if len(result['problems']) != 1 else ''}: "
          f"{'OK' if result['ok'] else 'FAILED'}")
  return 0 if result["ok"] else 1


def _name_the_recorded_source(root: str, source: str, result: dict) -> None:
  """Puts first among `result`'s problems, when `source` is not what the
  root's manifest says it was migrated from, the source it names."""
  from clu_ckpt import layout  # pylint: disable=g-import-not-at-top
  recorded = list(_migration_manifest(root))
  try:
    given = layout.absolute(source)
  except (OSError, ValueError):
    given = source
  if not recorded or given in recorded or source in recorded:
    return
  result["problems"].insert(0, (
      f"{source}: not the source {root} was migrated from; its manifest names "
      f"{', '.join(recorded)}: verify {root} --source {recorded[0]}"))
  result["ok"] = False


def _name_unmigrated_checkpoints(root: str, source: str,
                                 result: dict) -> None:
  """Adds a problem when `source` keeps checkpoints that were never migrated
  into `root` (`destination.checkpoints_not_migrated`): the question
  `verify --source` answers before a source is deleted."""
  from clu_ckpt.migration import destination  # pylint: disable=g-import-not-at-top
  left = destination.checkpoints_not_migrated(root, source)
  if left is None or not left.anything:
    return  # unreadable: verify_orbax_root has said why
  if left.names:
    result["problems"].append(
        f"{left.source}: {len(left.names)} of {left.total} checkpoint(s) "
        f"not migrated into {root} ({_first_ten(left.names)}): deleting the "
        f"source would lose them; `clu-ckpt migrate {source} {root}` "
        "migrates them")
  if left.removed:
    result["problems"].append(
        f"{left.source}: {len(left.removed)} checkpoint(s) migrated into "
        f"{root} whose step it no longer holds ({_first_ten(left.removed)}; "
        "removed since, by a CheckpointManager's max_to_keep or by hand): the "
        "source holds their only copy and deleting it would lose them")
  if left.entries:
    result["problems"].append(
        f"{left.source}: also holds {_first_ten(left.entries)}, which the "
        "migration did not read (Orbax steps, other runs, Flax files, "
        "directories): deleting the source would delete them; move or "
        "migrate them first")
  result["ok"] = False


def _first_ten(names: list[str]) -> str:
  return ", ".join(names[:10]) + (
      f" and {len(names) - 10} more" if len(names) > 10 else "")


# --------------------------------------------------------------------------
# migrate
# --------------------------------------------------------------------------


def _add_migrate(subparsers: Any) -> None:
  p = subparsers.add_parser(
      "migrate",
      help="convert CLU checkpoints into an Orbax CheckpointManager root",
      description=(
          "Converts the checkpoints of a CLU Checkpoint directory or "
          "MultihostCheckpoint base into Orbax steps (items state, dataset, "
          "metadata) that stock orbax.checkpoint.CheckpointManager reads. "
          "Re-running skips the steps already migrated."))
  p.add_argument("source", metavar="SOURCE",
                 help="CLU checkpoint directory, or MultihostCheckpoint base "
                 "(the <SOURCE>-<host_id> directories)")
  p.add_argument("destination", metavar="DESTINATION",
                 help="Orbax CheckpointManager root directory")
  options.add_migrate_options(p)
  p.set_defaults(run=_run_migrate)


def _run_migrate(args: argparse.Namespace) -> int:
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  from clu_ckpt import quick_exit  # pylint: disable=g-import-not-at-top
  quick_exit.skip_final_collection()  # about 0.25 s of a tiny run's process
  # The migration's modules, before `--template` puts the current directory
  # first on sys.path (`clu_ckpt.migration` imports them on first use).
  migrate = migration.migrate
  if args.template is not None and not options.TEMPLATE_SPEC.match(args.template):
    print(f"clu-ckpt migrate: error: --template {args.template!r}: expected "
          "MODULE:FUNCTION", file=sys.stderr)
    return 2
  template = None
  if args.template is not None:
    try:
      template = options.load_template(args.template)
    except options.TemplateError as e:
      if args.verbose:
        traceback.print_exc()
      print(f"clu-ckpt migrate: error: {e}", file=sys.stderr)
      return 1
  report = progress.MigrationReport(sys.stderr, sys.stderr.isatty())
  try:
    summary = migrate(
        args.source,
        args.destination,
        checkpoints=args.numbers or args.checkpoints,
        step_naming=args.step_naming,
        state_host=args.state_host,
        compression=args.compression,
        dry_run=args.dry_run,
        verify=args.verify,
        inflight_bytes=(None if args.max_inflight_mib is None else
                        max(1, args.max_inflight_mib) * _MIB),
        step_prefix=args.step_prefix,
        step_format_fixed_length=args.step_format_fixed_length,
        allow_other_sources=args.allow_other_sources,
        template=template,
        staging_dir=args.staging_dir,
        progress=report)
  except (migration.MigrationError, OSError, ValueError) as e:
    report.close()
    print(f"clu-ckpt migrate: error: {migration.describe_error(e)}",
          file=sys.stderr)
    if args.json:
      print(json.dumps({"ok": False, "error": migration.describe_error(e)}))
    return 1
  report.close()
  if args.json:
    print(json.dumps(summary.to_json(), indent=1))
  else:
    _print_summary(summary, sys.stdout)
  if not summary.ok:
    failed = summary.failed
    print(f"clu-ckpt migrate: error: {len(failed)} of {len(summary.steps)} "
          f"checkpoints failed; first, ckpt-{failed[0].number}: "
          f"{failed[0].error}", file=sys.stderr)
  return 0 if summary.ok else 1


def _print_summary(summary: Any, out: TextIO) -> None:
  counts = {}
  for step in summary.steps:
    counts[step.status] = counts.get(step.status, 0) + 1
  hosts = len(summary.hosts)
  print(f"{summary.source} ({summary.kind}, {hosts} host"
        f"{'s' if hosts != 1 else ''}) -> {summary.destination}", file=out)
  naming = ("the state's `step`" if summary.step_naming == "state" else
            "CLU checkpoint number")
  print(f"steps named by {naming}:", file=out)
  for step in summary.steps:
    name = "?" if step.step is None else step.step
    line = f"  ckpt-{step.number} -> step {name}: {step.status}"
    if step.verified:
      line += ", verified"
    if step.error:
      line += f": {step.error}"
    print(line, file=out)
  if summary.not_on_all_hosts:
    print(f"not on every host (not migrated): {summary.not_on_all_hosts}",
          file=out)
  print(", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
        or "nothing to migrate", file=out)


if __name__ == "__main__":
  sys.exit(main())


_ProgressReport = progress.MigrationReport  # the name tests used
