r"""Migrates many CLU runs to Orbax at once, on one or many machines.

Synopsis::

  python migration/migrate_runs.py \
      --source-glob='/runs/*/checkpoints' \
      --destination-root=/orbax_runs \
      --parallelism=4 --verify --report=/tmp/migration_report.json

  # The same fleet split over 3 machines (the same command on each, with its
  # own --shard-index), then the shard reports merged into one:
  python migration/migrate_runs.py --source-glob='/runs/*/checkpoints' \
      --destination-root=/orbax_runs --num-shards=3 --shard-index=0 \
      --report=/reports/shard-0.json
  python migration/migrate_runs.py --merge-reports=/reports/all.json \
      /reports/shard-*.json

Every flag is spelled with hyphens like `clu-ckpt`'s (`--destination-root`);
the underscored spellings (`--destination_root`) are accepted as aliases.

Each source (a CLU `Checkpoint` directory or `MultihostCheckpoint` base) is
migrated by its own `python -m clu_ckpt migrate ... --json` process (the
`clu_ckpt` beside this script when run from a checkout), so a failing run
cannot stop the others, and the command can simply be re-run: steps already
migrated are skipped. The destination of a source is
`<destination-root>/<its path relative to the sources' common parent>`
(e.g. `/runs/a/checkpoints` -> `/orbax_runs/a/checkpoints`).

A `--source-glob` match named `<base>-<integer>` whose `<base>-0` sibling
exists stands for the `MultihostCheckpoint` base `<base>` (all its hosts).

Buckets: sources, globs and the destination root may be `gs://` URLs (and
sources `s3://` ones; an `s3://` destination is refused by `clu-ckpt
migrate`), e.g. `--source-glob='gs://b/runs/*/checkpoints'
--destination-root=gs://b/orbax_runs`; the clients are configured by the
usual variables (`STORAGE_EMULATOR_HOST`, `AWS_ENDPOINT_URL`...), which the
child processes inherit. All sources must then be on one store (one scheme
and bucket), so that their common parent is defined.

Sharding: `--num-shards=N --shard-index=I` (0 <= I < N) migrates only the
sources of shard I. Every machine lists the whole fleet the same way (the
sorted, normalized sources and their destinations, computed from the whole
list, so they do not depend on the shard), then keeps the sources whose
stable hash (SHA-256 of the source path as listed, modulo N) is I. A hash
rather than round-robin over the sorted list: a run added to or removed
from the fleet does not move the other runs to other shards, so shards
started at slightly different times still agree on all the others. Give
every machine the same paths (absolute, or relative to the same directory).
Without `--shard-index`, the index is read from `JOB_COMPLETION_INDEX` (set
by Kubernetes indexed Jobs) when `--num-shards` is above 1. Overlapping or
re-run shards are safe: a run migrated twice skips the steps already in its
destination.

Report: every run of the shard (source, destination, shard, "ok" / "failed"
(some checkpoint failed) / "error" (the run could not start or crashed),
exit code, seconds, and the `clu-ckpt migrate --json` summary), with the
fleet's destination root, size and shard. `--merge-reports=OUT REPORT...`
merges shard reports into one (when a source is in several, the newest
report's entry wins), lists the shards missing, and refuses reports of
different destination roots.

Progress: one line per finished run, e.g. `[3/12] /runs/a/checkpoints ok
(4 steps, 1.2 GiB, 35 s); ETA 2 min`; on a terminal, one line rewritten in
place (failed runs keep their line).

Exit status: 0 when every run (of the shard, or of the merged fleet, with no
shard missing) is ok, 1 otherwise, 2 for a usage error (one line on stderr).
"""

import concurrent.futures
import datetime
import glob
import hashlib
import json
import os
import posixpath
import re
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Mapping, Optional, Sequence, TextIO

from absl import app
from absl import flags

_SOURCES = flags.DEFINE_list(
    "sources", [], "CLU checkpoint directories / MultihostCheckpoint bases.")
_SOURCE_GLOB = flags.DEFINE_multi_string(
    "source-glob", [], "Glob(s) matching sources (repeatable).")
_SOURCES_FILE = flags.DEFINE_string(
    "sources-file", None, "A file listing one source per line.")
_DESTINATION_ROOT = flags.DEFINE_string(
    "destination-root", None,
    "Where the Orbax roots are created (required unless --merge-reports).")
_PARALLELISM = flags.DEFINE_integer(
    "parallelism", 2, "Runs migrated at the same time.", lower_bound=1)
_NUM_SHARDS = flags.DEFINE_integer(
    "num-shards", 1, "Split the fleet into this many shards (machines).")
_SHARD_INDEX = flags.DEFINE_integer(
    "shard-index", None,
    "The shard to migrate, 0 <= I < --num-shards (default: "
    "$JOB_COMPLETION_INDEX when --num-shards > 1, else 0).")
_REPORT = flags.DEFINE_string(
    "report", None, "Where to write the JSON report (default "
    "migration_report.json, or migration_report-<I>-of-<N>.json for a "
    "shard).")
_MERGE_REPORTS = flags.DEFINE_string(
    "merge-reports", None,
    "Migrate nothing: merge the shard reports given as arguments into this "
    "JSON file.")
_CHECKPOINTS = flags.DEFINE_enum(
    "checkpoints", "all", ["all", "latest"], "Which checkpoints of each run.")
_STEP_NAMING = flags.DEFINE_enum(
    "step-naming", "auto", ["auto", "state", "number"],
    "How steps are named (see `clu-ckpt migrate --help`).")
_COMPRESSION = flags.DEFINE_enum(
    "compression", "zstd", ["zstd", "none"], "Array compression.")
_VERIFY = flags.DEFINE_bool(
    "verify", False, "Compare every migrated leaf with its source.")
_DRY_RUN = flags.DEFINE_bool("dry-run", False, "Plan only; write nothing.")
_MAX_INFLIGHT_MIB = flags.DEFINE_integer(
    "max-inflight-mib", None,
    "Per run: array MiB handed to TensorStore at once (default: clu-ckpt "
    "migrate's, 128, or 16 for a gs:// destination).")
_TEMPLATE = flags.DEFINE_string(
    "template", None,
    "MODULE:FUNCTION returning the train state whose structure each run's "
    "state is written in (passed to every `clu-ckpt migrate --template`; "
    "MODULE is imported from the current directory or PYTHONPATH).")

for _name in ("source-glob", "sources-file", "destination-root", "num-shards",
              "shard-index", "merge-reports", "step-naming", "dry-run",
              "max-inflight-mib"):
  flags.DEFINE_alias(_name.replace("-", "_"), _name)

_HOST_DIR_RE = re.compile(r"^(?P<base>.+)-(?P<host>\d+)$")
_URL_RE = re.compile(r"^[a-z][a-z0-9.+-]*://", re.I)
_INDEX_ENV = "JOB_COMPLETION_INDEX"
_PROG = "migrate_runs.py"


class UsageError(Exception):
  """A bad command line or input file: reported in one line, exit status 2."""


# --------------------------------------------------------------------------
# The fleet: sources, destinations, shards.
# --------------------------------------------------------------------------


def find_sources(sources: Sequence[str], globs: Sequence[str],
                 sources_file: Optional[str]) -> list[str]:
  """The sources named, matched and listed, normalized and de-duplicated.

  Args:
    sources: Paths given directly.
    globs: Glob patterns.
    sources_file: A file with one path per line ("#" starts a comment).

  Returns:
    Sorted unique sources.
  """
  found = [_normalize(s) for s in sources]
  for pattern in globs:
    found += [_as_source(m) for m in _glob(pattern)]
  if sources_file:
    with open(sources_file) as f:
      for line in f:
        line = line.split("#", 1)[0].strip()
        if line:
          found.append(_normalize(line))
  return sorted(set(found))


def _split_url(path: str) -> tuple[str, str]:
  """("gs://", "bucket/key") of a URL; ("", path) of a local path."""
  m = _URL_RE.match(path)
  return (m.group(0), path[m.end():]) if m else ("", path)


def _normalize(path: str) -> str:
  """A local path normalized; a URL with its key normalized (`//`, `..`)."""
  scheme, rest = _split_url(path)
  if not scheme:
    return os.path.normpath(path)
  return scheme.lower() + posixpath.normpath(rest).lstrip("/")


def _glob(pattern: str) -> list[str]:
  if not _split_url(pattern)[0]:
    return glob.glob(pattern)
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  return storage.glob(_normalize(pattern))


def _as_source(match: str) -> str:
  match = _normalize(match)
  m = _HOST_DIR_RE.match(match)
  if not m:
    return match
  base = m.group("base")
  if _split_url(match)[0]:
    from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
    exists, isdir = storage.exists, storage.isdir
  else:
    exists, isdir = os.path.exists, os.path.isdir
  if not exists(base) and isdir(f"{base}-0"):
    return base
  return match


def destinations(sources: Sequence[str], root: str) -> dict[str, str]:
  """Source -> `<root>/<source relative to the sources' common parent>`.

  Raises:
    UsageError: The sources are not all local, or not all in one bucket.
  """
  if not sources:
    return {}
  schemes = {_split_url(s)[0] for s in sources}
  if len(schemes) > 1 or (schemes != {""} and len(
      {_split_url(s)[1].split("/", 1)[0] for s in sources}) > 1):
    raise UsageError("sources on different stores (local paths and URLs, or "
                     "several buckets): migrate each store's runs with its "
                     "own command")
  scheme = schemes.pop()
  if scheme:
    keys = {s: _split_url(s)[1] for s in sources}
    parent = posixpath.commonpath([posixpath.dirname(k)
                                   for k in keys.values()])
    relative = {s: posixpath.relpath(k, parent) for s, k in keys.items()}
  else:
    parent = os.path.commonpath([os.path.dirname(os.path.abspath(s))
                                 for s in sources])
    relative = {s: os.path.relpath(os.path.abspath(s), parent)
                for s in sources}
  if _split_url(root)[0]:
    return {s: f"{root.rstrip('/')}/{r}" for s, r in relative.items()}
  return {s: os.path.join(root, r) for s, r in relative.items()}


def shard_of(source: str, num_shards: int) -> int:
  """The shard of `source`: SHA-256 of its path, modulo `num_shards`.

  The same on every machine and Python process (unlike `hash`), and
  independent of the other sources.
  """
  digest = hashlib.sha256(source.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") % num_shards


def shard_sources(sources: Sequence[str], num_shards: int,
                  shard_index: int) -> list[str]:
  """The sources of shard `shard_index` of `num_shards`, sorted."""
  return sorted(s for s in sources if shard_of(s, num_shards) == shard_index)


def resolve_shard(num_shards: int, shard_index: Optional[int],
                  environ: Mapping[str, str]) -> int:
  """The shard index to run, validated.

  Args:
    num_shards: `--num-shards`.
    shard_index: `--shard-index`, or None when not given.
    environ: The environment (for `JOB_COMPLETION_INDEX`).

  Returns:
    The shard index.

  Raises:
    UsageError: A bad count or index.
  """
  if num_shards < 1:
    raise UsageError(f"--num-shards must be >= 1, not {num_shards}")
  if shard_index is None:
    if num_shards == 1:
      return 0
    if _INDEX_ENV not in environ:
      raise UsageError(f"--num-shards={num_shards} needs --shard-index (or "
                       f"${_INDEX_ENV})")
    try:
      shard_index = int(environ[_INDEX_ENV])
    except ValueError:
      raise UsageError(f"${_INDEX_ENV}={environ[_INDEX_ENV]!r} is not an "
                       "integer") from None
  if not 0 <= shard_index < num_shards:
    raise UsageError(f"--shard-index must be in [0, {num_shards}) with "
                     f"--num-shards={num_shards}, not {shard_index}")
  return shard_index


# --------------------------------------------------------------------------
# One run.
# --------------------------------------------------------------------------


def migrate_one(source: str, destination: str, options: Sequence[str]
                ) -> dict[str, Any]:
  """Runs `clu-ckpt migrate --json` on one source; never raises.

  Args:
    source: The source.
    destination: Its Orbax root.
    options: Extra `clu-ckpt migrate` options.

  Returns:
    The run's report entry.
  """
  start = time.time()
  command = [sys.executable, "-m", "clu_ckpt", "migrate", source, destination,
             "--json", *options]
  entry = {"source": source, "destination": destination}
  try:
    run = subprocess.run(command, capture_output=True, text=True, check=False,
                         env=_child_environment(os.environ))
  except OSError as e:
    return dict(entry, status="error", exit_code=None, error=str(e),
                seconds=time.time() - start)
  entry.update(exit_code=run.returncode, seconds=time.time() - start)
  summary = _last_json(run.stdout)
  if summary is None:
    lines = run.stderr.strip().splitlines()
    return dict(entry, status="error",
                error=lines[-1] if lines else f"exit code {run.returncode}")
  entry["summary"] = summary
  if summary.get("ok"):
    entry["status"] = "ok"
  elif "steps" in summary:
    entry["status"] = "failed"
    entry["error"] = "; ".join(
        f"ckpt-{s['number']}: {s['error']}" for s in summary["steps"]
        if s.get("error"))
  else:
    entry["status"] = "error"
    entry["error"] = summary.get("error", "unknown error")
  return entry


def _child_environment(environ: Mapping[str, str]) -> dict[str, str]:
  """`environ`, with this checkout's `clu_ckpt` first on PYTHONPATH.

  The script then runs the package beside it, installed or not.
  """
  checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if not os.path.isfile(os.path.join(checkout, "clu_ckpt", "__init__.py")):
    return dict(environ)
  path = [checkout] + [p for p in [environ.get("PYTHONPATH")] if p]
  return dict(environ, PYTHONPATH=os.pathsep.join(path))


def _last_json(stdout: str) -> Optional[dict[str, Any]]:
  start = stdout.find("{")
  if start < 0:
    return None
  try:
    return json.loads(stdout[start:])
  except json.JSONDecodeError:
    return None


def _options() -> list[str]:
  options = ["--step-naming", _STEP_NAMING.value,
             "--compression", _COMPRESSION.value]
  if _MAX_INFLIGHT_MIB.value is not None:
    options += ["--max-inflight-mib", str(_MAX_INFLIGHT_MIB.value)]
  if _CHECKPOINTS.value == "latest":
    options.append("--latest")
  if _VERIFY.value:
    options.append("--verify")
  if _DRY_RUN.value:
    options.append("--dry-run")
  if _TEMPLATE.value is not None:
    if not re.match(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", _TEMPLATE.value):
      raise UsageError(f"--template {_TEMPLATE.value!r}: expected "
                       "MODULE:FUNCTION")
    options += ["--template", _TEMPLATE.value]
  return options


# --------------------------------------------------------------------------
# Progress.
# --------------------------------------------------------------------------


def format_bytes(nbytes: float) -> str:
  """`1288490188` -> "1.2 GiB"."""
  units = ("B", "KiB", "MiB", "GiB", "TiB")
  scale = 0
  while nbytes >= 1024 and scale < len(units) - 1:
    nbytes /= 1024
    scale += 1
  return f"{nbytes:.0f} B" if not scale else f"{nbytes:.1f} {units[scale]}"


def format_seconds(seconds: float) -> str:
  """`35` -> "35 s", `130` -> "2 min", `4000` -> "1 h 7 min"."""
  if seconds < 60:
    return f"{seconds:.0f} s"
  minutes = round(seconds / 60)
  return f"{minutes} min" if minutes < 60 else (
      f"{minutes // 60} h {minutes % 60} min")


def describe_run(entry: Mapping[str, Any]) -> str:
  """`source status (steps, bytes written, seconds)[: error]` of a run.

  A run that did not get as far as its steps shows only its seconds.
  """
  details = _step_details(entry.get("summary", {}).get("steps"))
  details.append(format_seconds(entry["seconds"]))
  note = f": {entry['error']}" if entry.get("error") else ""
  return f"{entry['source']} {entry['status']} ({', '.join(details)}){note}"


def _step_details(steps: Optional[Sequence[Mapping[str, Any]]]) -> list[str]:
  """["4 steps", "1 skipped", "1.2 GiB" (not skipped)], or [] for None."""
  if steps is None:
    return []
  skipped = sum(1 for s in steps if s.get("status") == "skipped")
  nbytes = sum(s.get("nbytes", 0) for s in steps
               if s.get("status") != "skipped")
  return ([f"{len(steps)} step{'' if len(steps) == 1 else 's'}"] +
          ([f"{skipped} skipped"] if skipped else []) + [format_bytes(nbytes)])


class ProgressPrinter:
  """Prints `[i/N] <run>; ETA ...` as runs finish.

  On a non-terminal, one line per run; on a terminal, one line rewritten in
  place, except that runs not ok keep their line.
  """

  def __init__(self, total: int, stream: TextIO,
               clock: Callable[[], float] = time.time):
    self._total = total
    self._stream = stream
    self._clock = clock
    self._start = clock()
    self._done = 0
    self._tty = stream.isatty()
    self._pending_newline = False

  def run_done(self, entry: Mapping[str, Any]) -> None:
    """Reports one finished run."""
    self._done += 1
    line = f"[{self._done}/{self._total}] {describe_run(entry)}; {self._eta()}"
    if not self._tty:
      print(line, file=self._stream, flush=True)
      return
    self._stream.write(f"\r\x1b[K{line}")
    self._pending_newline = True
    if entry["status"] != "ok":
      self.close()
    self._stream.flush()

  def _eta(self) -> str:
    elapsed = self._clock() - self._start
    remaining = self._total - self._done
    if not remaining:
      return f"all done in {format_seconds(elapsed)}"
    return f"ETA {format_seconds(elapsed / self._done * remaining)}"

  def close(self) -> None:
    """Ends a line left open on a terminal."""
    if self._pending_newline:
      self._stream.write("\n")
      self._stream.flush()
      self._pending_newline = False


# --------------------------------------------------------------------------
# Reports.
# --------------------------------------------------------------------------


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds")


def count_statuses(runs: Sequence[Mapping[str, Any]]) -> dict[str, int]:
  """{"ok": n, "failed": n, "error": n} over `runs`."""
  return {s: sum(1 for r in runs if r["status"] == s)
          for s in ("ok", "failed", "error")}


def write_report(path: str, report: Mapping[str, Any]) -> None:
  """Writes `report` as JSON, atomically (a reader never sees half of it)."""
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  with storage.atomic_writer(path) as write:
    write(json.dumps(report, indent=1).encode("utf-8"))


def load_report(path: str) -> dict[str, Any]:
  """A report written by this script.

  Raises:
    UsageError: Unreadable, not JSON, or not a report.
  """
  try:
    with open(path) as f:
      report = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise UsageError(f"cannot read report {path}: {e}") from None
  if not (isinstance(report, dict) and "runs" in report and
          "destination_root" in report):
    raise UsageError(f"{path} is not a migrate_runs.py report")
  return report


def merge_reports(reports: Sequence[tuple[str, Mapping[str, Any]]]
                  ) -> dict[str, Any]:
  """Merges shard reports of one fleet into one report.

  Args:
    reports: (path, report) pairs. When a source is in several, the entry of
      the newest report ("created"; ties: the later pair) wins.

  Returns:
    The merged report: every run with its "shard", the reports merged, the
    shards missing (when all reports agree on the shard count), counts and
    "ok" (every run ok, no shard missing, no run of the fleet missing).

  Raises:
    UsageError: No reports, or reports of different destination roots.
  """
  if not reports:
    raise UsageError("--merge-reports needs the reports to merge as arguments")
  root = _same_destination_root(reports)
  order = sorted(range(len(reports)),
                 key=lambda i: (reports[i][1].get("created", ""), i))
  runs = {}
  for i in order:
    path, report = reports[i]
    for run in report["runs"]:
      runs[run["source"]] = dict(run, report=path,
                                 shard=run.get("shard", _shard(report)[0]))
  merged_runs = [runs[s] for s in sorted(runs)]
  missing = _missing_shards([r for _, r in reports])
  fleet_size = max(r.get("fleet_size", len(r["runs"])) for _, r in reports)
  counts = count_statuses(merged_runs)
  return {
      "created": _now(),
      "destination_root": root,
      "merged_from": [_merged_from(p, r) for p, r in reports],
      "fleet_size": fleet_size,
      "missing_shards": missing,
      "counts": counts,
      "ok": (counts["ok"] == len(merged_runs) == fleet_size and
             not missing),
      "runs": merged_runs,
  }


def _same_destination_root(reports: Sequence[tuple[str, Mapping[str, Any]]]
                           ) -> str:
  first_path, first = reports[0]
  root = first["destination_root"]
  for path, report in reports[1:]:
    if os.path.normpath(report["destination_root"]) != os.path.normpath(root):
      raise UsageError(
          f"refusing to merge reports of different fleets: {first_path} "
          f"migrated into {root}, {path} into {report['destination_root']}")
  return root


def _shard(report: Mapping[str, Any]) -> tuple[int, int]:
  """(shard index, shard count) of a report (0, 1 for an unsharded one)."""
  return report.get("shard_index", 0), report.get("num_shards", 1)


def _missing_shards(reports: Sequence[Mapping[str, Any]]) -> list[int]:
  counts = {_shard(r)[1] for r in reports}
  if len(counts) != 1:
    return []
  return sorted(set(range(counts.pop())) - {_shard(r)[0] for r in reports})


def _merged_from(path: str, report: Mapping[str, Any]) -> dict[str, Any]:
  index, count = _shard(report)
  return {"report": path, "created": report.get("created"),
          "shard_index": index, "num_shards": count,
          "runs": len(report["runs"])}


# --------------------------------------------------------------------------
# The two modes.
# --------------------------------------------------------------------------


def run_merge(output: str, paths: Sequence[str]) -> int:
  """`--merge-reports=OUTPUT PATH...`: the exit status."""
  if (_SOURCES.value or _SOURCE_GLOB.value or _SOURCES_FILE.value or
      _REPORT.value):
    raise UsageError("--merge-reports=OUT writes OUT from the reports given "
                     "as arguments; it takes no sources and no --report")
  merged = merge_reports([(p, load_report(p)) for p in paths])
  write_report(output, merged)
  counts = merged["counts"]
  missing = (f"; shards missing: {merged['missing_shards']}"
             if merged["missing_shards"] else "")
  print(f"{len(merged['runs'])} of {merged['fleet_size']} run(s): "
        f"{counts['ok']} ok, {counts['failed']} failed, {counts['error']} "
        f"error{missing}; report: {output}")
  return 0 if merged["ok"] else 1


def run_shard(num_shards: int, shard_index: int) -> int:
  """Migrates the sources of one shard (all when unsharded): the status."""
  root = _DESTINATION_ROOT.value
  if not root:
    raise UsageError("--destination-root is required")
  fleet = find_sources(_SOURCES.value, _SOURCE_GLOB.value,
                       _SOURCES_FILE.value)
  if not fleet:
    raise UsageError("no sources: pass --sources, --source-glob or "
                     "--sources-file")
  options = _options()
  targets = destinations(fleet, root)
  sources = shard_sources(fleet, num_shards, shard_index)
  what = (f"shard {shard_index} of {num_shards}: migrating {len(sources)} of "
          f"{len(fleet)} run(s)" if num_shards > 1 else
          f"migrating {len(fleet)} run(s)")
  print(f"{what} into {root}, {_PARALLELISM.value} at a time", flush=True)
  runs = _migrate_all(sources, targets, options, shard_index)
  counts = count_statuses(runs)
  report_path = _REPORT.value or _default_report(num_shards, shard_index)
  write_report(report_path, {
      "created": _now(),
      "destination_root": root,
      "fleet_size": len(fleet),
      "num_shards": num_shards,
      "shard_index": shard_index,
      "options": options,
      "counts": counts,
      "runs": runs,
  })
  print(f"{counts['ok']} ok, {counts['failed']} failed, {counts['error']} "
        f"error; report: {report_path}")
  return 0 if counts["ok"] == len(runs) else 1


def _migrate_all(sources: Sequence[str], targets: Mapping[str, str],
                 options: Sequence[str], shard_index: int
                 ) -> list[dict[str, Any]]:
  """Migrates `sources`, `--parallelism` at a time, printing progress."""
  progress = ProgressPrinter(len(sources), sys.stdout)
  lock = threading.Lock()
  runs = []
  with concurrent.futures.ThreadPoolExecutor(_PARALLELISM.value) as pool:
    futures = [pool.submit(migrate_one, s, targets[s], options)
               for s in sources]
    for done in concurrent.futures.as_completed(futures):
      entry = dict(done.result(), shard=shard_index)
      with lock:
        runs.append(entry)
        progress.run_done(entry)
  progress.close()
  return sorted(runs, key=lambda e: e["source"])


def _default_report(num_shards: int, shard_index: int) -> str:
  if num_shards == 1:
    return "migration_report.json"
  return f"migration_report-{shard_index}-of-{num_shards}.json"


def main(argv: Sequence[str]) -> int:
  """Merges reports or migrates a shard; usage errors: one line, status 2."""
  try:
    if _MERGE_REPORTS.value:
      return run_merge(_MERGE_REPORTS.value, argv[1:])
    if len(argv) > 1:
      raise UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    index = resolve_shard(_NUM_SHARDS.value, _SHARD_INDEX.value, os.environ)
    return run_shard(_NUM_SHARDS.value, index)
  except UsageError as e:
    print(f"{_PROG}: error: {e}", file=sys.stderr)
    return 2


def parse_flags(argv: Sequence[str]) -> list[str]:
  """absl's parsing, with a flag error reported in one line (status 2)."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    print(f"{_PROG}: error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
