r"""What a fleet migration tells its operator: progress lines, the JSON report.

Synopsis::

  import sys
  from clu_ckpt.migration import fleet_report

  fleet_report.prepare_report("/reports/shard-0.json")  # before any work
  progress = fleet_report.ProgressPrinter(total=12, stream=sys.stdout,
                                          total_bytes=9 * 2**30)
  progress.run_done(entry, nbytes)   # "[3/12] /runs/a ok (4 steps, ...)"
  fleet_report.write_report("/reports/shard-0.json", report)  # atomic

  merged = fleet_report.merge_reports(
      [(p, fleet_report.load_report(p)) for p in shard_report_paths])

A report (JSON) holds every run of a shard with its status (FINISHED:
"ok", "failed", "error"; or "interrupted", "pending"), its seconds and its
migration summary, and every skipped path with its reason; "complete" is
true once the shard ended without being stopped. It is written atomically
after every finished run (`ReportWriter` bounds what that costs a huge
fleet), so a killed fleet leaves a report of what finished;
`merge_reports` accepts such partial reports. Each report records its
launch (`launch_identity`, the same on every shard of one launch);
`merge_reports` merges one launch, lists the reports of others as stale
and the runs of its fleet no report covers as "missing".

Progress: one line per finished run, in binary units, e.g.
`[3/12] /runs/a/checkpoints ok (4 steps, 1.2 GiB, 35 s); 3.4 GiB of 9.0 GiB,
0 failures, ETA 2 min`. On a terminal one line is rewritten in place (runs
not ok keep their line); elsewhere (a log, a pipe) one plain line per run.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import os
import posixpath
import time
from typing import Any, Callable, Mapping, Optional, Sequence, TextIO

from clu_ckpt.errors import UsageError
from clu_ckpt.migration.fleet_discovery import split_url

# The statuses of a run that ended (the others: "interrupted", "pending").
FINISHED = ("ok", "failed", "error")


# --------------------------------------------------------------------------
# Progress.
# --------------------------------------------------------------------------


def format_bytes(nbytes: float) -> str:
  """A size in binary units, as every fleet line shows sizes.

  Args:
    nbytes: A byte count.

  Returns:
    E.g. "512 B", "1.2 GiB" (`1288490188`).
  """
  units = ("B", "KiB", "MiB", "GiB", "TiB")
  scale = 0
  while nbytes >= 1024 and scale < len(units) - 1:
    nbytes /= 1024
    scale += 1
  return f"{nbytes:.0f} B" if not scale else f"{nbytes:.1f} {units[scale]}"


def format_seconds(seconds: float) -> str:
  """A duration, rounded as a person reads it.

  Args:
    seconds: The duration.

  Returns:
    "35 s" (`35`), "2 min" (`130`), "1 h 7 min" (`4000`).
  """
  if seconds < 60:
    return f"{seconds:.0f} s"
  minutes = round(seconds / 60)
  return f"{minutes} min" if minutes < 60 else (
      f"{minutes // 60} h {minutes % 60} min")


def printable(text: str) -> str:
  r"""`text` as a line can show it: a name's bytes that are not UTF-8 escaped.

  A local name that is not UTF-8 reaches Python holding those bytes as
  surrogates ("bad\udcff" for the bytes b"bad\xff"), which a UTF-8 output
  refuses. Lines show each such byte as `\xNN`; the JSON report keeps the
  surrogate, escaped as `\udcNN` (`os.fsencode` gives the bytes back).

  Args:
    text: A path or a message naming one.

  Returns:
    E.g. "/runs/bad\\xff" for "/runs/bad\udcff"; `text` itself when it is
    valid UTF-8.
  """
  return text.encode("utf-8", "surrogateescape").decode("utf-8",
                                                         "backslashreplace")


def describe_run(entry: Mapping[str, Any]) -> str:
  """A finished run in one line.

  Args:
    entry: Its report entry ("source", "status", "seconds", "summary",
      "error" or "warning").

  Returns:
    `source status (steps, bytes written, seconds)[: error or warning]`.
  """
  details = _step_details((entry.get("summary") or {}).get("steps"))
  details.append(format_seconds(entry.get("seconds", 0)))
  note = entry.get("error") or entry.get("warning")
  note = f": {note}" if note else ""
  return printable(
      f"{entry['source']} {entry['status']} ({', '.join(details)}){note}")


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
  """Prints `[i/N] <run>; <bytes> of <total>, <k> failed, ETA ...`.

  Bytes are the runs' source sizes when listed; the ETA extrapolates the
  fraction done (by bytes when sizes are known, else by runs). On a
  non-terminal, one line per run; on a terminal, one line rewritten in
  place, except that runs not ok keep their line.
  """

  def __init__(self, total: int, stream: TextIO,
               clock: Callable[[], float] = time.time,
               total_bytes: int = 0):
    self._total = total
    self._total_bytes = total_bytes
    self._stream = stream
    self._clock = clock
    self._start = clock()
    self._done = 0
    self._done_bytes = 0
    self._failures = 0
    self._tty = stream.isatty()
    self._pending_newline = False

  def run_done(self, entry: Mapping[str, Any], nbytes: int = 0) -> None:
    """Prints one finished run and the totals so far.

    Args:
      entry: The run's report entry.
      nbytes: Its source bytes (counted into the totals and the ETA).
    """
    self._done += 1
    if entry["status"] in FINISHED:
      self._done_bytes += nbytes
    if entry["status"] in ("failed", "error"):
      self._failures += 1
    line = (f"[{self._done}/{self._total}] {describe_run(entry)}; "
            f"{self._totals()}")
    if not self._tty:
      print(line, file=self._stream, flush=True)
      return
    self._stream.write(f"\r\x1b[K{line}")
    self._pending_newline = True
    if entry["status"] != "ok":
      self.close()
    self._stream.flush()

  def _totals(self) -> str:
    parts = []
    if self._total_bytes:
      parts.append(f"{format_bytes(self._done_bytes)} of "
                   f"{format_bytes(self._total_bytes)}")
    plural = "" if self._failures == 1 else "s"
    parts.append(f"{self._failures} failure{plural}")
    elapsed = self._clock() - self._start
    if self._done >= self._total:
      parts.append(f"all done in {format_seconds(elapsed)}")
    else:
      fraction = (self._done_bytes / self._total_bytes if self._total_bytes
                  and self._done_bytes else self._done / self._total)
      parts.append(f"ETA {format_seconds(elapsed / fraction - elapsed)}")
    return ", ".join(parts)

  def close(self) -> None:
    """Ends a line left open on a terminal."""
    if self._pending_newline:
      self._stream.write("\n")
      self._stream.flush()
      self._pending_newline = False


class SurvivingOutput:
  """A text stream whose loss does not stop the fleet.

  An operator's pipe closed early (`| head`), a log collector that died or
  a hung-up terminal makes every later write fail (EPIPE, EIO). The fleet's
  output is only a view of its report: once a write fails, the stream's
  file descriptor is pointed at /dev/null (so the interpreter's last flush
  succeeds too) and the migration goes on.

  Example::

    sys.stdout = SurvivingOutput(sys.stdout)
    print("[1/3] ...")           # never raises OSError

  Args:
    stream: The stream to write to (e.g. `sys.stdout`).
  """

  def __init__(self, stream: TextIO):
    self._stream = stream
    self.lost = False

  def write(self, text: str) -> int:
    """Writes `text` (names that are not UTF-8 escaped, `printable`), or
    drops it once the stream is gone."""
    try:
      try:
        return self._stream.write(text)
      except UnicodeEncodeError:  # nothing was written: the text is encoded
        try:                      # before it is written
          return self._stream.write(printable(text))
        except UnicodeEncodeError:  # an ASCII stream
          return self._stream.write(printable(text).encode(
              "ascii", "backslashreplace").decode("ascii"))
    except OSError:
      self._lose()
      return len(text)

  def flush(self) -> None:
    """Flushes, or drops what is buffered once the stream is gone."""
    try:
      self._stream.flush()
    except OSError:
      self._lose()

  def isatty(self) -> bool:
    return not self.lost and self._stream.isatty()

  def __getattr__(self, name: str) -> Any:
    return getattr(self._stream, name)

  def _lose(self) -> None:
    self.lost = True
    try:
      null = os.open(os.devnull, os.O_WRONLY)
      try:
        os.dup2(null, self._stream.fileno())
      finally:
        os.close(null)
      self._stream.flush()  # what was buffered goes to /dev/null
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
      self._stream = open(os.devnull, "w", encoding="utf-8")  # pylint: disable=consider-using-with


# --------------------------------------------------------------------------
# Reports.
# --------------------------------------------------------------------------


def now() -> str:
  """The time now (UTC), as the reports write it (to the microsecond: the
  merge takes the launch of the newest shard report)."""
  return datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="microseconds")


def sources_to_keep(runs: Sequence[Mapping[str, Any]]) -> list[str]:
  """The sources of runs that keep checkpoints not migrated.

  A run can be "ok" and still leave checkpoints in its source: `--latest`
  or `--number` select some, and training may have saved more since. Its
  entry lists them ("source_not_migrated"); deleting that source would lose
  them.

  Args:
    runs: Report entries.

  Returns:
    Their sources, sorted.
  """
  return sorted(r["source"] for r in runs if r.get("source_not_migrated"))


def count_statuses(runs: Sequence[Mapping[str, Any]]) -> dict[str, int]:
  """How many runs have each status.

  Args:
    runs: Report entries.

  Returns:
    {"ok": n, "failed": n, "error": n} and every other status present
    ("interrupted", "pending").
  """
  counts = {s: 0 for s in FINISHED}
  for r in runs:
    counts[r["status"]] = counts.get(r["status"], 0) + 1
  return counts


def report_bytes(report: Mapping[str, Any]) -> bytes:
  """A report as JSON text: a field a line, and each run (each skipped
  path) on a line of its own.

  Readable, and fast: each line goes through `json`'s C encoder (an indented
  dump of a 1000-run report takes the pure-Python one, 5x slower).

  Args:
    report: The report.

  Returns:
    UTF-8 JSON, which `json.loads` reads back as `report`.
  """
  fields = []
  for key, value in report.items():
    if isinstance(value, list) and value:
      items = ",\n".join(f"  {json.dumps(v)}" for v in value)
      fields.append(f" {json.dumps(key)}: [\n{items}\n ]")
    else:
      fields.append(f" {json.dumps(key)}: {json.dumps(value)}")
  return ("{\n" + ",\n".join(fields) + "\n}\n").encode("utf-8")


def write_report(path: str, report: Mapping[str, Any],
                 durable: bool = True) -> None:
  """Writes a report as JSON, atomically (a reader never sees half of it).

  Args:
    path: A local path or a bucket URL.
    report: The report.
    durable: Locally, fsync it before and after the rename (the final
      report). Without, the rename alone: a reader, or the process's
      death, still never leaves half of it; only a power cut may lose the
      latest rewrite (the fleet's progress rewrites, many and frequent).
  """
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  data = report_bytes(report)
  if durable or split_url(path)[0]:
    with storage.atomic_writer(path) as write:
      write(data)
    return
  temporary = f"{path}.tmp-{os.getpid()}"
  try:
    with open(temporary, "wb") as f:
      f.write(data)
    os.replace(temporary, path)
  except BaseException:
    try:
      os.remove(temporary)
    except OSError:
      pass
    raise


class ReportWriter:
  """Rewrites a fleet's report as its runs finish, at a bounded cost.

  A report grows with the fleet, so rewriting all of it after every run
  costs the fleet's process time quadratic in the number of runs. `update`
  (after every finished run) writes at once unless the last write ended
  less than `pause` times its own duration ago; the report is then written
  by the next `update` or `flush_due` (called every fraction of a second).
  The writes so take at most about 1 / (pause + 1) of the process's time:
  after every run on a small fleet, every few seconds on one of 10,000.

  Example::

    writer = ReportWriter(path, lambda: shard_report(complete=False))
    writer.update()                      # every run pending
    ...                                  # after each run: writer.update()
    writer.close(shard_report(complete=True))
  """

  def __init__(self, path: str, build: Callable[[], Mapping[str, Any]],
               pause: float = 10.0,
               clock: Callable[[], float] = time.monotonic,
               write: Callable[..., None] = write_report):
    self._path = path
    self._build = build
    self._pause = pause
    self._clock = clock
    self._write = write
    self._dirty = False
    self._next = float("-inf")

  def update(self) -> None:
    """The report changed: writes it now, or once the pause is over."""
    self._dirty = True
    self.flush_due()

  def flush_due(self) -> None:
    """Writes the report if it changed and the pause is over."""
    if not self._dirty or self._clock() < self._next:
      return
    start = self._clock()
    self._write(self._path, self._build(), durable=False)
    end = self._clock()
    self._next = end + self._pause * (end - start)
    self._dirty = False

  def close(self, report: Mapping[str, Any]) -> None:
    """Writes the final report, durably (fsync).

    Args:
      report: The final report.
    """
    self._write(self._path, report, durable=True)
    self._dirty = False


def prepare_report(path: str, flag: str = "--report") -> None:
  """Checks that a report can be written at `path`, making its directory.

  Called before any work, so that a fleet never ends without its report.

  Args:
    path: `--report` (local, or a bucket URL: only its directory is made).
    flag: The flag that named `path`, for the messages.

  Raises:
    UsageError: It cannot (a directory there, no permission, ...).
  """
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  if not split_url(path)[0]:
    if os.path.isdir(path):
      raise UsageError(f"{flag} {path}: is a directory")
    directory = os.path.dirname(os.path.abspath(path))
    try:
      os.makedirs(directory, exist_ok=True)
    except OSError as e:
      raise UsageError(f"{flag} {path}: cannot make {directory}: "
                       f"{e.strerror or e}") from None
    if not os.access(directory, os.W_OK):
      raise UsageError(f"{flag} {path}: {directory} is not writable")
  else:
    storage.makedirs(posixpath.dirname(path))


def load_report(path: str) -> dict[str, Any]:
  """A report written by the fleet (complete, partial or merged).

  Args:
    path: A local path or a bucket URL.

  Returns:
    The report.

  Raises:
    UsageError: Unreadable, not JSON, or not a report.
  """
  from clu_ckpt import storage  # pylint: disable=g-import-not-at-top
  try:
    report = json.loads(storage.read_bytes(path))
  except (OSError, ValueError) as e:
    raise UsageError(f"cannot read report {path}: {e}") from None
  if not (isinstance(report, dict) and isinstance(report.get("runs"), list)
          and "destination_root" in report):
    raise UsageError(f"{path} is not a fleet migration report")
  return report


# The environment variable naming a launch (`--launch-id`'s default).
LAUNCH_ENV = "CLU_CKPT_FLEET_LAUNCH_ID"
# Set by a scheduler to the same value in every task of one launch, and to
# another in the next: the default launch id when LAUNCH_ENV is not set
# (Slurm: the job id of an array, shared by its tasks).
SCHEDULER_LAUNCH_ENVS = ("SLURM_ARRAY_JOB_ID",)


def default_launch_id(environ: Mapping[str, str]) -> Optional[str]:
  """The launch id a shard takes without `--launch-id`.

  Args:
    environ: The environment.

  Returns:
    `$CLU_CKPT_FLEET_LAUNCH_ID`, else the scheduler's id of this launch
    (`$SLURM_ARRAY_JOB_ID`, as `--launch-id=$SLURM_ARRAY_JOB_ID` gives
    it), else None.
  """
  if environ.get(LAUNCH_ENV):
    return environ[LAUNCH_ENV]
  for name in SCHEDULER_LAUNCH_ENVS:
    if environ.get(name):
      return environ[name]
  return None
# Options that tune one machine, not what is written: a launch's shards may
# differ in them.
_MACHINE_OPTIONS = ("max_inflight_mib",)
# The status of a run of the plan that no report of its launch covers.
MISSING = "missing"


def launch_identity(destination_root: str, source_root: str,
                    num_shards: int, options: Mapping[str, Any],
                    sources: Sequence[str],
                    launch_id: Optional[str] = None) -> dict[str, Any]:
  """What every shard of one launch of a fleet shares, computed by each.

  A fingerprint (SHA-256) of the destination and source roots, the shard
  count, the options that change what is written, the whole fleet's run
  list and `launch_id`: shards started with the same command on the same
  runs agree on it, a launch with another shard count, other runs or
  another id does not. Two launches identical in all of these are one
  launch, unless given different ids.

  Args:
    destination_root: `--destination-root`.
    source_root: The source root in use.
    num_shards: The shard count.
    options: The `clu-ckpt migrate` option values.
    sources: Every run of the fleet (all shards).
    launch_id: `--launch-id` (or `$CLU_CKPT_FLEET_LAUNCH_ID`), if any.

  Returns:
    {"fingerprint": hex digest, "id": launch_id}.
  """
  scheme = split_url(destination_root)[0]
  root = (destination_root.rstrip("/") if scheme else
          os.path.normpath(destination_root))
  fields = json.dumps(
      [root, source_root, num_shards, launch_id,
       {k: v for k, v in options.items() if k not in _MACHINE_OPTIONS}],
      sort_keys=True)
  digest = hashlib.sha256(fields.encode("utf-8", "surrogateescape"))
  for source in sorted(sources):
    digest.update(b"\0" + source.encode("utf-8", "surrogateescape"))
  return {"fingerprint": digest.hexdigest(), "id": launch_id}


def merge_reports(reports: Sequence[tuple[str, Mapping[str, Any]]]
                  ) -> dict[str, Any]:
  """Merges shard reports of one launch (partial ones too) into one report.

  The launch merged is that of the newest shard report with a launch
  identity ("created"; a merged report given counts as its shard
  reports). A report of another launch ("launch": another shard count, run
  list, options or launch id), or without a launch identity, is stale:
  listed in "stale_reports" with why, its runs not merged, and the merged
  report neither ok nor complete.

  Args:
    reports: (path, report) pairs. When a source is in several, a finished
      entry ("ok", "failed", "error") wins over an unfinished one
      ("pending", "interrupted", "missing"); among equals, that of the
      newest report ("created"; ties: the later pair).

  Returns:
    The merged report: every run of the launch's plan with its "shard"
    (a run no report of the launch covers: status "missing"), every
    skipped path, the shard reports merged ("merged_from"; a merged
    report given as input stands for the shard reports it merged), the
    stale reports, the shards missing, counts, "complete" (every report
    was, none stale, no shard missing), "ok" (every run ok, none stale, no
    shard missing) and "sources_to_keep" (`sources_to_keep`: runs ok whose
    source keeps checkpoints not migrated).

  Raises:
    UsageError: No reports, or reports of different destination roots.
  """
  if not reports:
    raise UsageError("--merge-reports needs the reports to merge as arguments")
  root = _same_destination_root(reports)
  started = [_started(path, report) for path, report in reports]
  newest = max(range(len(reports)),
               key=lambda i: (_has_launch(reports[i][1]), started[i], i))
  current_path, current = reports[newest]
  stale = []
  mine = []
  for i, (path, report) in enumerate(reports):
    reason = _stale_reason(report, current, current_path)
    if reason is None:
      mine.append(i)
    else:
      stale.append({"report": path, "reason": reason})
  runs: dict[str, dict[str, Any]] = {}
  skipped: dict[str, Any] = {}
  for i in sorted(mine, key=lambda i: (started[i], i)):
    path, report = reports[i]
    for run in report["runs"]:
      previous = runs.get(run["source"])
      if previous is not None and (
          run["status"] == MISSING or
          previous["status"] in FINISHED and run["status"] not in FINISHED):
        continue
      runs[run["source"]] = dict(run, report=run.get("report", path),
                                 shard=run.get("shard", _shard(report)[0]))
    for s in report.get("skipped", []):
      skipped[s["path"]] = s
  num_shards = _shard(current)[1]
  merged_from = [m for i in mine for m in _shards_of(*reports[i])]
  missing = sorted(set(range(num_shards)) -
                   {m["shard_index"] for m in merged_from})
  plan = _plan(current)
  if plan is not None:
    for source in plan:
      if source not in runs:
        runs[source] = _missing_run(source, num_shards)
  merged_runs = [runs[s] for s in sorted(runs)]
  fleet_size = (len(plan) if plan is not None else
                current.get("fleet_size", len(current["runs"])))
  counts = count_statuses(merged_runs)
  merged = {
      "created": now(),
      "destination_root": root,
      "launch": current.get("launch"),
      "num_shards": num_shards,
      "merged_from": merged_from,
      "stale_reports": stale,
      "fleet_size": fleet_size,
      "missing_shards": missing,
      "complete": (all(reports[i][1].get("complete", True) for i in mine)
                   and not missing and not stale),
      "counts": counts,
      "ok": (counts["ok"] == len(merged_runs) == fleet_size and
             not missing and not stale),
      "sources_to_keep": sources_to_keep(merged_runs),
      "runs": merged_runs,
      "skipped": [skipped[p] for p in sorted(skipped)],
  }
  for key in ("source_root", "options"):
    if key in current:
      merged[key] = current[key]
  if plan is not None:
    merged["plan"] = plan
  return merged


def _started(path: str, report: Mapping[str, Any]) -> str:
  """When the newest shard report `report` stands for started ("created";
  for a merged report, of the shard reports it merged, not the merge's)."""
  return max((m.get("created") or "" for m in _shards_of(path, report)),
             default="")


def _has_launch(report: Mapping[str, Any]) -> bool:
  launch = report.get("launch")
  return isinstance(launch, dict) and bool(launch.get("fingerprint"))


def _plan(report: Mapping[str, Any]) -> Optional[list[str]]:
  """Every run of the fleet a report's launch planned: its "plan" (sharded
  reports, merged ones), else its runs (unsharded: its runs are the plan);
  None for a sharded report without one."""
  if isinstance(report.get("plan"), list):
    return list(report["plan"])
  if _shard(report)[1] == 1 and not isinstance(report.get("merged_from"),
                                               list):
    return [r["source"] for r in report["runs"]]
  return None


def _missing_run(source: str, num_shards: int) -> dict[str, Any]:
  from clu_ckpt.migration.fleet_assignment import shard_of  # pylint: disable=g-import-not-at-top
  shard = shard_of(source, num_shards)
  return {"source": source, "status": MISSING, "shard": shard,
          "error": f"not migrated: no report of this launch covers it "
                   f"(shard {shard} of {num_shards})"}


def _stale_reason(report: Mapping[str, Any], current: Mapping[str, Any],
                  current_path: str) -> Optional[str]:
  """Why `report` is not of the launch of `current` (the newest report,
  at `current_path`), or None when it is."""
  launch = report.get("launch")
  if not _has_launch(report):
    return ("no launch identity (written by an earlier version, or not by "
            "the fleet): which launch it is from cannot be told; re-run its "
            "shard")
  theirs = current.get("launch") or {}
  if launch.get("fingerprint") == theirs.get("fingerprint"):
    return None
  why = []
  if launch.get("id") != theirs.get("id"):
    why.append(f"launch id {launch.get('id')!r}, not {theirs.get('id')!r}")
  if _shard(report)[1] != _shard(current)[1]:
    why.append(f"{_shard(report)[1]} shards, not {_shard(current)[1]}")
  if report.get("source_root") != current.get("source_root"):
    why.append(f"source root {report.get('source_root')}, not "
               f"{current.get('source_root')}")
  if report.get("options") != current.get("options"):
    why.append("other options")
  plan, their_plan = _plan(report), _plan(current)
  if plan is not None and their_plan is not None and plan != their_plan:
    why.append(_plan_difference(plan, their_plan))
  return (f"from another launch than {current_path} (the newest): "
          f"{'; '.join(why) or 'another fleet command'}")


def _plan_difference(plan: Sequence[str], current: Sequence[str]) -> str:
  gone = sorted(set(plan) - set(current))
  new = sorted(set(current) - set(plan))
  parts = [f"another run list ({len(plan)} runs, not {len(current)}"]
  if new:
    parts.append(f"; without {printable(new[0])}" +
                 (f" and {len(new) - 1} more" if len(new) > 1 else ""))
  if gone:
    parts.append(f"; with {printable(gone[0])}" +
                 (f" and {len(gone) - 1} more" if len(gone) > 1 else "") +
                 " no longer planned")
  return "".join(parts) + ")"


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


def _shards_of(path: str, report: Mapping[str, Any]
               ) -> list[dict[str, Any]]:
  """The shard reports `report` stands for ("merged_from" entries): itself,
  or, for a merged report, the shard reports merged into it."""
  if isinstance(report.get("merged_from"), list):
    return [dict(m) for m in report["merged_from"]]
  index, count = _shard(report)
  return [{"report": path, "created": report.get("created"),
           "shard_index": index, "num_shards": count,
           "launch": (report.get("launch") or {}).get("fingerprint"),
           "complete": report.get("complete", True),
           "runs": len(report["runs"])}]


