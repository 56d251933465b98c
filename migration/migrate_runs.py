"""Migrates many CLU runs to Orbax at once, with a JSON report.

Synopsis::

  python migration/migrate_runs.py \
      --source_glob='/runs/*/checkpoints' \
      --destination_root=/orbax_runs \
      --parallelism=4 --verify --report=/tmp/migration_report.json

Each source (a CLU `Checkpoint` directory or `MultihostCheckpoint` base) is
migrated by its own `python -m clu_ckpt migrate ... --json` process, so a
failing run cannot stop the others, and the command can simply be re-run:
steps already migrated are skipped. The destination of a source is
`<destination_root>/<its path relative to the sources' common parent>`
(e.g. `/runs/a/checkpoints` -> `/orbax_runs/a/checkpoints`).

A `--source_glob` match named `<base>-<integer>` whose `<base>-0` sibling
exists stands for the `MultihostCheckpoint` base `<base>` (all its hosts).

The report lists every run: source, destination, "ok" / "failed" (some
checkpoint failed) / "error" (the run could not start or crashed), exit
code, seconds, and the `clu-ckpt migrate --json` summary. The exit status is
0 when every run is ok.
"""

import concurrent.futures
import datetime
import glob
import json
import os
import re
import subprocess
import sys
import threading
import time
from typing import Any, Optional, Sequence

from absl import app
from absl import flags

_SOURCES = flags.DEFINE_list(
    "sources", [], "CLU checkpoint directories / MultihostCheckpoint bases.")
_SOURCE_GLOB = flags.DEFINE_multi_string(
    "source_glob", [], "Glob(s) matching sources (repeatable).")
_SOURCES_FILE = flags.DEFINE_string(
    "sources_file", None, "A file listing one source per line.")
_DESTINATION_ROOT = flags.DEFINE_string(
    "destination_root", None, "Where the Orbax roots are created.",
    required=True)
_PARALLELISM = flags.DEFINE_integer(
    "parallelism", 2, "Runs migrated at the same time.", lower_bound=1)
_REPORT = flags.DEFINE_string(
    "report", "migration_report.json", "Where to write the JSON report.")
_CHECKPOINTS = flags.DEFINE_enum(
    "checkpoints", "all", ["all", "latest"], "Which checkpoints of each run.")
_STEP_NAMING = flags.DEFINE_enum(
    "step_naming", "auto", ["auto", "state", "number"],
    "How steps are named (see `clu-ckpt migrate --help`).")
_COMPRESSION = flags.DEFINE_enum(
    "compression", "zstd", ["zstd", "none"], "Array compression.")
_VERIFY = flags.DEFINE_bool(
    "verify", False, "Compare every migrated leaf with its source.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Plan only; write nothing.")
_MAX_INFLIGHT_MIB = flags.DEFINE_integer(
    "max_inflight_mib", 128,
    "Per run: array MiB handed to TensorStore at once.")

_HOST_DIR_RE = re.compile(r"^(?P<base>.+)-(?P<host>\d+)$")


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
  found = [os.path.normpath(s) for s in sources]
  for pattern in globs:
    found += [_as_source(m) for m in glob.glob(pattern)]
  if sources_file:
    with open(sources_file) as f:
      for line in f:
        line = line.split("#", 1)[0].strip()
        if line:
          found.append(os.path.normpath(line))
  return sorted(set(found))


def _as_source(match: str) -> str:
  match = os.path.normpath(match)
  m = _HOST_DIR_RE.match(match)
  if m and not os.path.exists(m.group("base")) and os.path.isdir(
      f"{m.group('base')}-0"):
    return m.group("base")
  return match


def destinations(sources: Sequence[str], root: str) -> dict[str, str]:
  """Source -> `<root>/<source relative to the sources' common parent>`."""
  if not sources:
    return {}
  parent = os.path.commonpath([os.path.dirname(os.path.abspath(s))
                               for s in sources])
  return {s: os.path.join(root, os.path.relpath(os.path.abspath(s), parent))
          for s in sources}


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
    run = subprocess.run(command, capture_output=True, text=True, check=False)
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
             "--compression", _COMPRESSION.value,
             "--max-inflight-mib", str(_MAX_INFLIGHT_MIB.value)]
  if _CHECKPOINTS.value == "latest":
    options.append("--latest")
  if _VERIFY.value:
    options.append("--verify")
  if _DRY_RUN.value:
    options.append("--dry-run")
  return options


def main(argv: Sequence[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  sources = find_sources(_SOURCES.value, _SOURCE_GLOB.value,
                         _SOURCES_FILE.value)
  if not sources:
    raise app.UsageError("no sources: pass --sources, --source_glob or "
                         "--sources_file")
  targets = destinations(sources, _DESTINATION_ROOT.value)
  options = _options()
  lock = threading.Lock()
  runs = []
  print(f"migrating {len(sources)} run(s) into {_DESTINATION_ROOT.value}, "
        f"{_PARALLELISM.value} at a time", flush=True)
  with concurrent.futures.ThreadPoolExecutor(_PARALLELISM.value) as pool:
    futures = [pool.submit(migrate_one, s, targets[s], options)
               for s in sources]
    for done in concurrent.futures.as_completed(futures):
      entry = done.result()
      with lock:
        runs.append(entry)
        note = f": {entry['error']}" if entry.get("error") else ""
        print(f"[{len(runs)}/{len(sources)}] {entry['status']:6s} "
              f"{entry['source']} -> {entry['destination']} "
              f"({entry['seconds']:.1f} s){note}", flush=True)
  runs.sort(key=lambda e: e["source"])
  counts = {s: sum(1 for r in runs if r["status"] == s)
            for s in ("ok", "failed", "error")}
  report = {
      "created": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      "destination_root": _DESTINATION_ROOT.value,
      "options": options,
      "counts": counts,
      "runs": runs,
  }
  with open(_REPORT.value, "w") as f:
    json.dump(report, f, indent=1)
  print(f"{counts['ok']} ok, {counts['failed']} failed, {counts['error']} "
        f"error; report: {_REPORT.value}")
  return 0 if counts["ok"] == len(runs) else 1


if __name__ == "__main__":
  app.run(main)
