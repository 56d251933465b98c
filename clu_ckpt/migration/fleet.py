r"""The fleet command: many CLU runs migrated to Orbax, on one or many machines.

Synopsis::

  python migration/migrate_runs.py \
      --source-glob='/runs/*/checkpoints' \
      --destination-root=/orbax_runs \
      --parallelism=4 --verify --report=/tmp/migration_report.json

  # What would be migrated, and what is skipped and why (writes nothing):
  python migration/migrate_runs.py --source-glob='/runs/*/checkpoints' \
      --exclude=/runs/lost+found --destination-root=/orbax_runs --dry-run

  # Retrying one run of that fleet: same destination root, same layout.
  python migration/migrate_runs.py --sources=/runs/c/checkpoints \
      --destination-root=/orbax_runs

  # The same fleet split over 3 machines (the same command on each, with its
  # own --shard-index), then the shard reports merged into one:
  python migration/migrate_runs.py --source-glob='/runs/*/checkpoints' \
      --destination-root=/orbax_runs --num-shards=3 --shard-index=0 \
      --report=/reports/shard-0.json
  python migration/migrate_runs.py --merge-reports=/reports/all.json \
      /reports/shard-*.json

Every `clu-ckpt migrate` option (`--latest`, `--number`, `--step-naming`,
`--state-host`, `--compression`, `--verify`, `--max-inflight-mib`,
`--step-prefix`, `--step-format-fixed-length`, `--allow-other-sources`,
`--template`) is accepted and applied to every run: both commands take
them from `clu_ckpt.migration.options.add_migrate_options`, their one definition. Flags
are spelled with hyphens; the underscored spellings (`--destination_root`)
are accepted too.

The command line of `migration/migrate_runs.py` (also `python -m
clu_ckpt.migration.fleet`); `main(argv)` runs it in-process. Its parts:
`fleet_discovery` (which runs), `fleet_assignment` (destinations, shards),
`fleet_workers` (the worker processes), `fleet_report` (progress, reports).

Finding the runs (`fleet_discovery`): every path a `--source-glob` matches
is a run or is listed as skipped with its reason (a path that cannot be
listed, a directory under the glob the walk cannot enter, a multihost run
with a host missing or empty, are runs with an error, never a skip; a run
named twice is one run). A glob or path naming a `MultihostCheckpoint`
base covers its `<base>-<int>` host directories, and a glob matching host
directories only covers their base (a checkpoint some of them lack is then
kept: they may be runs of their own; one matching `<name>` and
`<name>-<int>` alike cannot tell hosts from runs: an error). A glob that
matches nothing is an error naming it. In a bucket, each glob costs one
listing. `--exclude GLOB` (repeatable) leaves out what it matches and all
below it (a root-only `lost+found`), each listed as skipped with the
pattern.

Destinations: `<destination-root>/<the run's path relative to the source
root>`. The source root is `--source-root`, or the one recorded in
`<destination-root>/clu_ckpt_fleet.json` by an earlier run, or (first run)
the directory above the first wildcard of the globs (`/runs` for
`/runs/*/checkpoints`). It is recorded by the first migration into the
destination root; a later command giving another `--source-root` is
refused. A retry naming one run (`--sources=/runs/c/checkpoints`) therefore
writes where the fleet run did. Two runs mapping to one destination, or a
destination inside a source, are refused before anything is written.

Workers: `--parallelism` long-lived worker processes each import the
migration once and migrate run after run in-process
(`clu_ckpt.migration.migrate`). A run that kills its worker (a crash, the
kernel's out-of-memory killer) is reported as an error; a new worker takes
the next run. Steps already migrated are skipped, so the command can simply
be re-run.

Report: written (atomically) before the first run and after every finished
run (`fleet_report.ReportWriter`: at most a tenth of the time on a huge
fleet), so a killed fleet leaves the report of what finished. It lists every
run of the shard (source, destination, shard, status "ok", "failed" (some
checkpoint failed), "error" (the run could not be migrated, or its worker
died), "interrupted" or "pending", seconds, the migration's summary) and
every skipped path with its reason, the launch (a fingerprint of the
roots, shard count, options, the fleet's run list and `--launch-id`, which
every shard computes alike) and, sharded, the fleet's run list.
`--merge-reports=OUT REPORT...` merges the shard reports (partial ones
included) of the newest launch: a report of another launch is not merged
but listed as stale, and makes the merge not ok; so do shards missing, and
the runs of the fleet no report covers are listed as "missing".

Names: a local name that is not UTF-8 is shown with its bytes escaped
(`\xff` in the lines, `\udcff` in the JSON report); TensorStore cannot
write such a destination, so that run is an error naming it.

Stopping: the first Ctrl-C, SIGTERM or SIGHUP (a terminal that hung up)
starts no new run; the runs under way abandon their current step (nothing
of it stays, as with `clu-ckpt migrate`); the report is written; exit
status 130 (SIGINT), 143 (SIGTERM) or 129 (SIGHUP), within seconds. A
closed or hung-up stdout/stderr (`| head`, a dead log collector) stops
nothing: the output is dropped, the runs and the report go on. A second Ctrl-C stops at once (the report then holds every
run finished before). Re-running resumes.

Sharding: `--num-shards=N --shard-index=I` (0 <= I < N) migrates the runs
whose stable hash (SHA-256 of the source path as listed, modulo N) is I.
Without `--shard-index`, the index is read from `JOB_COMPLETION_INDEX`
(Kubernetes indexed Jobs) when `--num-shards` is above 1.

Progress: one line per finished run, e.g. `[3/12] /runs/a/checkpoints ok
(4 steps, 1.2 GiB, 35 s); 3.4 GiB of 9.0 GiB, 0 failures, ETA 2 min`; on a
terminal, one line rewritten in place (runs not ok keep their line).

Exit status: 0 when every run (of the shard, or of the merged fleet, with no
shard missing) is ok, 1 otherwise, 2 for a usage error, 130/143/129 when
stopped. Errors are one line on stderr; `--verbose` adds tracebacks and the
workers' log messages.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import traceback
from typing import Any, Mapping, Optional, Sequence, TextIO

from clu_ckpt.errors import UsageError  # one line on stderr, exit status 2
from clu_ckpt.migration.fleet_assignment import assign_destinations
from clu_ckpt.migration.fleet_assignment import choose_source_root
from clu_ckpt.migration.fleet_assignment import INDEX_ENV
from clu_ckpt.migration.fleet_assignment import read_recorded_root
from clu_ckpt.migration.fleet_assignment import record_root
from clu_ckpt.migration.fleet_assignment import resolve_shard
from clu_ckpt.migration.fleet_assignment import shard_sources
from clu_ckpt.migration.fleet_discovery import HOST_REASON
from clu_ckpt.migration.fleet_discovery import Plan
from clu_ckpt.migration.fleet_discovery import plain_local
from clu_ckpt.migration.fleet_discovery import plan_fleet
from clu_ckpt.migration.fleet_discovery import read_sources_file
from clu_ckpt.migration.fleet_discovery import Run
from clu_ckpt.migration.fleet_report import count_statuses
from clu_ckpt.migration.fleet_report import default_launch_id
from clu_ckpt.migration.fleet_report import sources_to_keep
from clu_ckpt.migration.fleet_report import FINISHED
from clu_ckpt.migration.fleet_report import MISSING
from clu_ckpt.migration.fleet_report import format_bytes
from clu_ckpt.migration.fleet_report import launch_identity
from clu_ckpt.migration.fleet_report import LAUNCH_ENV
from clu_ckpt.migration.fleet_report import load_report
from clu_ckpt.migration.fleet_report import merge_reports
from clu_ckpt.migration.fleet_report import now as _now
from clu_ckpt.migration.fleet_report import prepare_report
from clu_ckpt.migration.fleet_report import printable
from clu_ckpt.migration.fleet_report import ProgressPrinter
from clu_ckpt.migration.fleet_report import ReportWriter
from clu_ckpt.migration.fleet_report import SurvivingOutput
from clu_ckpt.migration.fleet_report import write_report
from clu_ckpt.migration.fleet_workers import migrate_kwargs
from clu_ckpt.migration.fleet_workers import WorkerPool

# The program name of the script's messages.
# The signals that stop a fleet cleanly: Ctrl-C, Kubernetes/Slurm's
# SIGTERM, a terminal that hung up.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

PROG = "migrate_runs.py"
# `clu-ckpt migrate` options the fleet does not pass through: it has its own
# `--dry-run` (the fleet's plan) and report (instead of `--json`).
NOT_PASSED = ("json", "dry_run")


# --------------------------------------------------------------------------
# The command line: the fleet's flags and `clu-ckpt migrate`'s.
# --------------------------------------------------------------------------


def _version() -> str:
  from clu_ckpt import __version__  # pylint: disable=g-import-not-at-top
  return __version__


class _Parser(argparse.ArgumentParser):
  """argparse, with a usage error in one line (status 2)."""

  def error(self, message: str) -> Any:
    self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(prog: str = PROG
                 ) -> tuple[argparse.ArgumentParser, list[str]]:
  """The fleet's argument parser: its own flags and `clu-ckpt migrate`'s.

  Args:
    prog: The program name its messages show.

  Returns:
    The parser, and the destinations (`dest`) of the `clu-ckpt migrate`
    options it passes through to every run (`migrate_options`).
  """
  parser = _Parser(
      prog=prog,
      description="Migrates many CLU runs (Checkpoint directories, "
      "MultihostCheckpoint bases) into Orbax roots, in long-lived worker "
      "processes, with a JSON report.",
      epilog="Exit status: 0 every run ok, 1 some run not ok, 2 bad usage, "
      "130/143/129 stopped by SIGINT/SIGTERM/SIGHUP.")
  parser.add_argument("--version", action="version",
                      version=f"{prog} (clu-ckpt {_version()})")
  parser.add_argument("-v", "--verbose", action="store_true",
                      help="tracebacks, and the workers' log messages")
  fleet = parser.add_argument_group("the fleet")
  fleet.add_argument("--sources", action="append", default=[],
                     metavar="PATH[,PATH...]",
                     help="CLU checkpoint directories / MultihostCheckpoint "
                     "bases (comma-separated; a comma inside an existing "
                     "local path stays; repeatable)")
  fleet.add_argument("--source-glob", action="append", default=[],
                     metavar="GLOB", help="a glob matching sources "
                     "(repeatable); quote it")
  fleet.add_argument("--exclude", action="append", default=[],
                     metavar="GLOB", help="leave out the runs this path or "
                     "glob matches, and all below it (a root-only "
                     "lost+found); each is listed as skipped (repeatable)")
  fleet.add_argument("--sources-file", metavar="FILE",
                     help="a file listing one source per line")
  fleet.add_argument("--destination-root", metavar="DIR",
                     help="where the Orbax roots are created (required "
                     "unless --merge-reports)")
  fleet.add_argument("--source-root", metavar="DIR",
                     help="the directory whose layout the destination root "
                     "mirrors (default: recorded in the destination root, "
                     "else the directory above the globs' first wildcard)")
  fleet.add_argument("--parallelism", type=int, default=2, metavar="N",
                     help="worker processes, i.e. runs migrated at the same "
                     "time (default 2)")
  fleet.add_argument("--num-shards", type=int, default=1, metavar="N",
                     help="split the fleet into N shards (machines)")
  fleet.add_argument("--shard-index", type=int, metavar="I",
                     help="the shard to migrate, 0 <= I < N (default "
                     f"${INDEX_ENV} when --num-shards > 1)")
  fleet.add_argument("--report", metavar="FILE",
                     help="the JSON report (default migration_report.json, "
                     "or migration_report-<I>-of-<N>.json for a shard)")
  fleet.add_argument("--launch-id", metavar="ID",
                     default=default_launch_id(os.environ),
                     help="names this launch of a sharded fleet, the same on "
                     f"every shard (default ${LAUNCH_ENV}, else the Slurm "
                     "array's $SLURM_ARRAY_JOB_ID); --merge-reports "
                     "merges the reports of one launch only")
  fleet.add_argument("--merge-reports", metavar="OUT",
                     help="migrate nothing: merge the reports given as "
                     "arguments into OUT")
  fleet.add_argument("--dry-run", action="store_true",
                     help="print the plan (runs, destinations, skipped paths "
                     "and why); write nothing")
  fleet.add_argument("--checkpoints", choices=("all", "latest"),
                     dest="checkpoints", default=argparse.SUPPRESS,
                     help="same as --all / --latest")
  parser.add_argument("reports", nargs="*", metavar="REPORT",
                      help="with --merge-reports: the reports to merge")
  from clu_ckpt.migration import options  # pylint: disable=g-import-not-at-top
  group = parser.add_argument_group(
      "clu-ckpt migrate options (applied to every run; see `clu-ckpt "
      "migrate --help`)")
  dests = options.add_migrate_options(group, exclude=NOT_PASSED)
  return parser, dests


def normalize_argv(argv: Sequence[str]) -> list[str]:
  """The underscored flag spellings of earlier releases, hyphenated.

  Args:
    argv: The arguments.

  Returns:
    `argv` with `--flag_name[=value]` spelled `--flag-name[=value]`
    (values and everything after `--` unchanged).
  """
  out = []
  for i, arg in enumerate(argv):
    if arg == "--":
      return out + list(argv[i:])
    if arg.startswith("--"):
      name, eq, value = arg.partition("=")
      arg = name.replace("_", "-") + eq + value
    out.append(arg)
  return out


def migrate_options(args: argparse.Namespace, dests: Sequence[str]
                    ) -> dict[str, Any]:
  """The `clu-ckpt migrate` options' values, for every run.

  Args:
    args: The parsed command line.
    dests: The destinations `build_parser` returned.

  Returns:
    Value by destination (for `fleet_workers.migrate_kwargs`).
  """
  return {d: getattr(args, d) for d in dests if hasattr(args, d)}


# --------------------------------------------------------------------------
# The modes.
# --------------------------------------------------------------------------


def run_merge(args: argparse.Namespace) -> int:
  """`--merge-reports=OUT REPORT...`: merges shard reports into OUT.

  Args:
    args: The parsed command line.

  Returns:
    The exit status: 0 when every run of the fleet is ok and no shard is
    missing, else 1.

  Raises:
    UsageError: Sources or `--report` given too, or unreadable reports.
  """
  if args.sources or args.source_glob or args.sources_file or args.report:
    raise UsageError("--merge-reports=OUT writes OUT from the reports given "
                     "as arguments; it takes no sources and no --report")
  prepare_report(args.merge_reports, "--merge-reports")
  merged = merge_reports([(p, load_report(p)) for p in args.reports])
  write_report(args.merge_reports, merged)
  for stale in merged["stale_reports"]:
    print(printable(f"not merged: {stale['report']}: {stale['reason']}"),
          flush=True)
  absent = [r["source"] for r in merged["runs"] if r["status"] == MISSING]
  if absent:
    shown = ", ".join(absent[:5]) + (f" and {len(absent) - 5} more"
                                     if len(absent) > 5 else "")
    print(printable(f"{len(absent)} run(s) of the fleet in no report of this "
                    f"launch, not migrated: {shown}"), flush=True)
  if merged["num_shards"] > 1 and not (merged["launch"] or {}).get("id"):
    print("note: this launch has no --launch-id: a report of an earlier "
          "launch identical to it (same runs, shard count and options) "
          "would pass as its own", flush=True)
  counts = merged["counts"]
  others = "".join(f", {n} {s}" for s, n in counts.items()
                   if s not in FINISHED)
  missing = (f"; shards missing: {merged['missing_shards']}"
             if merged["missing_shards"] else "")
  if merged["stale_reports"]:
    missing += (f"; {len(merged['stale_reports'])} report(s) of another "
                "launch not merged")
  print(f"{len(merged['runs'])} of {merged['fleet_size']} run(s): "
        f"{counts['ok']} ok, {counts['failed']} failed, {counts['error']} "
        f"error{others}{missing}; report: {args.merge_reports}")
  _say_sources_to_keep(merged)
  return 0 if merged["ok"] else 1


def _say_sources_to_keep(report: Mapping[str, Any]) -> None:
  if report["sources_to_keep"]:
    print(f"{len(report['sources_to_keep'])} source(s) keep checkpoints not "
          "migrated (\"sources_to_keep\" in the report): do not delete them",
          flush=True)


def split_sources(value: str) -> list[str]:
  """The paths of one `--sources` value.

  Commas separate paths, except inside an existing local path: run
  directories are often named by their hyperparameters
  (`runs/lr=0.1,bs=32`), and splitting one would leave that run out. So
  pieces are joined back, longest first, where the joined name exists.

  Args:
    value: One `--sources` argument.

  Returns:
    The paths it names, empty pieces dropped.

  Example::

    split_sources("/runs/a,/runs/b")   # ["/runs/a", "/runs/b"]
    split_sources("/runs/lr=0.1,bs=32/ckpt,/runs/b")
    # ["/runs/lr=0.1,bs=32/ckpt", "/runs/b"] when the first exists
  """
  pieces, paths, i = value.split(","), [], 0
  while i < len(pieces):
    # At most 16 commas in one name: `lexists` calls stay linear.
    end = next((j for j in range(min(len(pieces), i + 17), i + 1, -1)
                if os.path.lexists(plain_local(",".join(pieces[i:j])))),
               i + 1)
    paths.append(",".join(pieces[i:end]))
    i = end
  return [p for p in paths if p]


class _Shard:
  """One shard's migration: the plan, the report, the workers, the stop."""

  def __init__(self, args: argparse.Namespace, options: Mapping[str, Any],
               num_shards: int, shard_index: int):
    self.args = args
    self.options = dict(options)
    self.num_shards = num_shards
    self.shard_index = shard_index
    self.report_path = args.report or _default_report(num_shards,
                                                      shard_index)
    self.entries: dict[str, dict[str, Any]] = {}
    self.created = _now()
    self.launch: dict[str, Any] = {}

  def plan(self) -> tuple[Plan, list[Run], str]:
    """(the fleet's plan, this shard's runs, the source root)."""
    args = self.args
    if not args.destination_root:
      raise UsageError("--destination-root is required")
    migrate_kwargs(self.options)  # unknown options: refused now
    if self.options.get("template") is not None:
      from clu_ckpt.migration import options  # pylint: disable=g-import-not-at-top
      if not options.TEMPLATE_SPEC.match(self.options["template"]):
        raise UsageError(f"--template {self.options['template']!r}: "
                         "expected MODULE:FUNCTION")
    sources = [s for group in args.sources for s in split_sources(group)]
    if args.sources_file:
      sources += read_sources_file(args.sources_file)
    sources = [plain_local(s) for s in sources]
    if not sources and not args.source_glob:
      raise UsageError("no sources: pass --sources, --source-glob or "
                       "--sources-file")
    recorded = read_recorded_root(args.destination_root)
    root = choose_source_root(args.source_root, recorded, args.source_glob,
                              sources)
    plan = plan_fleet(sources, args.source_glob, excludes=args.exclude)
    assign_destinations(plan.runs, root, args.destination_root)
    for run in plan.runs:
      if run.error is None:
        run.error = _unwritable_name(run.destination)
    self.launch = launch_identity(
        args.destination_root, root, self.num_shards, self.options,
        [r.source for r in plan.runs], args.launch_id)
    mine = set(shard_sources([r.source for r in plan.runs], self.num_shards,
                             self.shard_index))
    return plan, [r for r in plan.runs if r.source in mine], root

  def report(self, plan: Plan, runs: Sequence[Run], root: str,
             complete: bool) -> dict[str, Any]:
    entries = []
    for run in runs:
      entry = self.entries.get(run.source) or {
          "source": run.source, "destination": run.destination,
          "status": "pending"}
      entries.append(dict(entry, shard=self.shard_index, kind=run.kind,
                          source_bytes=run.nbytes))
    report = {
        "created": self.created,
        "updated": _now(),
        "complete": complete,
        "destination_root": self.args.destination_root,
        "source_root": root,
        "launch": self.launch,
        "fleet_size": len(plan.runs),
        "num_shards": self.num_shards,
        "shard_index": self.shard_index,
        "options": self.options,
        "counts": count_statuses(entries),
        "sources_to_keep": sources_to_keep(entries),
        "runs": entries,
        "skipped": [dataclasses.asdict(s) for s in plan.skipped],
    }
    if self.num_shards > 1:  # the whole fleet: what the merge must find
      report["plan"] = sorted(r.source for r in plan.runs)
    return report


def _unwritable_name(destination: str) -> Optional[str]:
  """Why a run cannot be migrated into `destination`: a name that is not
  UTF-8 (its source's, under a local file system), which TensorStore cannot
  write; None when it can."""
  try:
    destination.encode("utf-8")
  except UnicodeEncodeError:
    return (f"its destination {printable(destination)} is not valid UTF-8 "
            "(the source's name holds bytes that are not): Orbax's "
            "TensorStore writes UTF-8 names only; rename the source and "
            "migrate it again")
  return None


def print_plan(plan: Plan, runs: Sequence[Run], out: TextIO,
               dry_run: bool) -> None:
  """Prints the skipped paths, and the runs on a dry run.

  Host directories skipped because their base is a run are one line when
  migrating (a big fleet's hosts would fill the log before the first run);
  the dry run prints each, as the report lists each.

  Args:
    plan: The fleet's plan.
    runs: This shard's runs.
    out: Where to print.
    dry_run: Print every skipped path, and each run ("would migrate ...",
      or "cannot migrate ..." with its error).
  """
  host_dirs = 0
  for s in plan.skipped:
    if not dry_run and s.reason.startswith(HOST_REASON):
      host_dirs += 1
    else:
      print(printable(f"skipped {s.path}: {s.reason}"), file=out)
  if host_dirs:
    plural = "y" if host_dirs == 1 else "ies"
    print(f"skipped {host_dirs} host director{plural} of the runs listed "
          "(each in the report)", file=out)
  if not dry_run:
    return
  for run in runs:
    if run.error:
      print(printable(f"cannot migrate {run.source}: {run.error}"), file=out)
      continue
    hosts = f", {len(run.hosts)} hosts" if run.hosts else ""
    through = ("; reached through its host directories only: a checkpoint "
               "some of them lack is kept" if run.through_hosts else "")
    print(printable(f"would migrate {run.source} -> {run.destination} "
                    f"({run.kind}{hosts}, {format_bytes(run.nbytes)}"
                    f"{through})"), file=out)


def run_shard(args: argparse.Namespace, options: Mapping[str, Any],
              num_shards: int, shard_index: int, prog: str = PROG) -> int:
  """Migrates the runs of one shard (all when unsharded).

  Prints the skipped paths, then a progress line per finished run, then the
  counts; writes the report before the first run and after every finished
  one. SIGINT, SIGTERM and SIGHUP stop it cleanly (see `WorkerPool.stop`).

  Args:
    args: The parsed command line (`build_parser`).
    options: The `clu-ckpt migrate` option values (`migrate_options`).
    num_shards: The shard count (1: unsharded).
    shard_index: The shard to migrate (`resolve_shard`).
    prog: The program name of its messages.

  Returns:
    The exit status: 0 every run ok, 1 otherwise, 128 + the signal when
    stopped.

  Raises:
    UsageError: A bad command line, found before any work.
  """
  shard = _Shard(args, options, num_shards, shard_index)
  plan, runs, root = shard.plan()
  of = (f"shard {shard_index} of {num_shards}: {len(runs)} of "
        f"{len(plan.runs)} run(s)" if num_shards > 1 else
        f"{len(runs)} run(s)")
  total = sum(r.nbytes for r in runs)
  skipped = f"; {len(plan.skipped)} path(s) skipped" if plan.skipped else ""
  if args.dry_run:
    print_plan(plan, runs, sys.stdout, dry_run=True)
    print(f"dry run: would migrate {of} ({format_bytes(total)}) into "
          f"{args.destination_root} (source root {root}){skipped}; wrote "
          "nothing", flush=True)
    return 0 if all(r.error is None for r in runs) else 1
  prepare_report(shard.report_path)
  record_root(args.destination_root, root)
  writer = ReportWriter(shard.report_path,
                        lambda: shard.report(plan, runs, root, False))
  writer.update()  # every run pending
  print_plan(plan, runs, sys.stdout, dry_run=False)
  print(f"migrating {of} ({format_bytes(total)}) into "
        f"{args.destination_root}, {args.parallelism} at a time{skipped}",
        flush=True)
  progress = ProgressPrinter(len(runs), sys.stdout, total_bytes=total)
  sizes = {r.source: r.nbytes for r in runs}

  def on_entry(entry: dict[str, Any]) -> None:
    shard.entries[entry["source"]] = entry
    writer.update()
    progress.run_done(entry, sizes.get(entry["source"], 0))

  for run in runs:
    if run.error is not None:
      on_entry({"source": run.source, "destination": run.destination,
                "status": "error", "error": run.error, "seconds": 0.0})
  fleet = WorkerPool([r for r in runs if r.error is None], options,
                     args.parallelism, on_entry, verbose=args.verbose,
                     on_idle=writer.flush_due)
  previous = {s: signal.signal(s, lambda n, _: fleet.stop(n))
              for s in STOP_SIGNALS}
  try:
    fleet.run()
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
    progress.close()
  report = shard.report(plan, runs, root, fleet.stop_signal is None)
  writer.close(report)
  counts = report["counts"]
  others = "".join(f", {n} {s}" for s, n in counts.items()
                   if s not in FINISHED)
  print(f"{counts['ok']} ok, {counts['failed']} failed, {counts['error']} "
        f"error{others}; report: {shard.report_path}", flush=True)
  _say_sources_to_keep(report)
  if fleet.stop_signal is not None:
    name = signal.Signals(fleet.stop_signal).name
    print(f"{prog}: stopped by {name}: re-run the same command to resume",
          file=sys.stderr)
    return 128 + fleet.stop_signal
  return 0 if counts["ok"] == len(runs) else 1


def _default_report(num_shards: int, shard_index: int) -> str:
  if num_shards == 1:
    return "migration_report.json"
  return f"migration_report-{shard_index}-of-{num_shards}.json"


class _Terminated(KeyboardInterrupt):
  """SIGTERM or SIGHUP, before the fleet's own handling starts."""

  def __init__(self, signum: int):
    super().__init__(signum)
    self.signum = signum


def _terminated(signum: int, frame: Any) -> None:
  del frame
  raise _Terminated(signum)


def main(argv: Optional[Sequence[str]] = None, prog: str = PROG) -> int:
  """The fleet's command line (`migration/migrate_runs.py`).

  Args:
    argv: The arguments, without the program name (default `sys.argv[1:]`).
    prog: The program name its messages show.

  Returns:
    The exit status: 0 every run ok, 1 some run not ok (or an error), 2 a
    usage error (one line on stderr), 130/143/129 stopped by
    SIGINT/SIGTERM/SIGHUP.
  """
  if argv is None:
    argv = sys.argv[1:]
  parser, dests = build_parser(prog)
  args = parser.parse_args(normalize_argv(argv))
  # Before the workers start (planning, a bucket's listing), SIGTERM and
  # SIGHUP stop like Ctrl-C: nothing has been written yet but the report.
  previous = {s: signal.signal(s, _terminated)
              for s in (signal.SIGTERM, signal.SIGHUP)}
  # A closed pipe or a hung-up terminal does not stop the runs.
  streams = sys.stdout, sys.stderr
  sys.stdout, sys.stderr = SurvivingOutput(sys.stdout), SurvivingOutput(
      sys.stderr)
  try:
    return _main(args, dests, prog)
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    sys.stdout, sys.stderr = streams
    for signum, handler in previous.items():
      signal.signal(signum, handler)


def _main(args: argparse.Namespace, dests: Sequence[str],
          prog: str) -> int:
  # `file://` URLs name local paths: planned, compared and written as such.
  for name in ("source_glob", "reports", "exclude"):
    setattr(args, name, [plain_local(p) for p in getattr(args, name)])
  for name in ("sources_file", "destination_root", "source_root", "report",
               "merge_reports"):
    if getattr(args, name):
      setattr(args, name, plain_local(getattr(args, name)))
  try:
    if args.parallelism < 1:
      raise UsageError(
          f"--parallelism must be >= 1, not {args.parallelism}")
    if args.merge_reports:
      return run_merge(args)
    if args.reports:
      raise UsageError(
          f"unexpected arguments: {' '.join(args.reports)}")
    index = resolve_shard(args.num_shards, args.shard_index, os.environ)
    return run_shard(args, migrate_options(args, dests), args.num_shards,
                     index, prog)
  except UsageError as e:
    print(f"{prog}: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt as e:
    print(f"{prog}: interrupted before any run started", file=sys.stderr)
    return 128 + (e.signum if isinstance(e, _Terminated) else signal.SIGINT)
  except Exception as e:  # pylint: disable=broad-except
    if args.verbose:
      traceback.print_exc()
    if isinstance(e, OSError) and e.filename is not None:
      text = f"{e.filename}: {e.strerror or e}"
    else:
      text = (str(e).strip().splitlines() or [""])[0]
      text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    print(f"{prog}: error: {text}", file=sys.stderr)
    return 1


if __name__ == "__main__":
  sys.exit(main(prog="python -m clu_ckpt.migration.fleet"))
