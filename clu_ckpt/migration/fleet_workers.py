r"""A fleet's worker processes: each imports the migration once, migrates
many runs.

Synopsis::

  from clu_ckpt.migration import fleet_workers

  pool = fleet_workers.WorkerPool(
      runs,                             # fleet_discovery.Run, destinations set
      options={"compression": "zstd"},  # `clu-ckpt migrate` option values
      parallelism=2,
      on_entry=lambda entry: print(entry["source"], entry["status"]))
  signal.signal(signal.SIGINT, lambda n, _: pool.stop(n))
  pool.run()                            # until every run is done, or stopped

`WorkerPool` keeps `parallelism` long-lived worker processes, each running
`worker_main`: it imports `clu_ckpt.migration` once and migrates run after
run in-process (`migration.migrate`). A run that kills its worker (a crash,
the kernel's out-of-memory killer) is reported as an "error" entry; a new
worker takes the next run. After `_MAX_FAILED_STARTS` workers in a row die
before taking a run, the pending runs are reported as errors.

Stopping: `stop(signum)` starts no new run and sends SIGINT to each worker
with a run under way, which abandons its current step as `clu-ckpt migrate`
does (nothing of it stays) and answers "interrupted"; runs still under way
after `stop_seconds` are killed. A second `stop` kills the workers at once.
Workers run in their own session (a terminal's Ctrl-C reaches the fleet
process alone, which stops them at the right moment) and ask Linux for
SIGTERM when the fleet process dies.

Protocol (JSON lines): the worker's stdin gets `{"options": {...}}`, then
one `{"source", "destination"}` per run; it answers `{"ready": true}` once
imported, then one report entry per run, on its original stdout (its
stdout itself goes to its log, stderr).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Mapping, Optional, Sequence

from clu_ckpt.errors import UsageError
from clu_ckpt.migration.fleet_discovery import Run

# How long runs under way may take to abandon their step after a stop.
STOP_SECONDS = 30.0
# Workers dying in a row before taking a run: the pending runs then fail.
_MAX_FAILED_STARTS = 3
_MIB = 2**20
# The worker's command line after the interpreter. `-c`, not `-m`: the
# current directory ("" first on sys.path with either, unless
# PYTHONSAFEPATH) is removed before anything is imported, so a file there
# cannot shadow a library.
WORKER_ARGS = (
    "-c", "import sys; sys.path[:1] = [p for p in sys.path[:1] if p]; "
    "from clu_ckpt.migration import fleet_workers; "
    "sys.exit(fleet_workers.worker_main())", "--worker")


# --------------------------------------------------------------------------
# The worker: one process, many runs.
# --------------------------------------------------------------------------

# `clu-ckpt migrate` option -> `migration.migrate` keyword, for the options
# passed as they are.
_SAME = ("step_naming", "state_host", "compression", "verify", "step_prefix",
         "step_format_fixed_length", "allow_other_sources")


def migrate_kwargs(options: Mapping[str, Any]) -> dict[str, Any]:
  """`migration.migrate` keywords from `clu-ckpt migrate`'s option values.

  Args:
    options: Option values by destination (`fleet.migrate_options`).

  Returns:
    The keywords for `clu_ckpt.migration.migrate` (but `template`, which
    each worker loads once).

  Raises:
    UsageError: An option the fleet does not know how to pass (a newer
      `clu-ckpt migrate` option), given a value other than its default.
  """
  known = set(_SAME) | {"checkpoints", "numbers", "max_inflight_mib",
                        "template"}
  unknown = [k for k, v in options.items() if k not in known and v not in (
      None, False)]
  if unknown:
    raise UsageError(f"--{unknown[0].replace('_', '-')} is not supported by "
                     "the fleet migration yet; use clu-ckpt migrate")
  kwargs = {k: options[k] for k in _SAME if k in options}
  kwargs["checkpoints"] = (options.get("numbers") or
                           options.get("checkpoints") or "all")
  mib = options.get("max_inflight_mib")
  kwargs["inflight_bytes"] = None if mib is None else max(1, mib) * _MIB
  return kwargs


class _Worker:
  """The worker process's loop: read a run, migrate it, answer.

  Protocol (JSON lines): stdin first `{"options": {...}}`, then one
  `{"source", "destination"}` per run; each answered on the result pipe
  (the original stdout; stdout itself goes to stderr) by the run's entry.
  """

  def __init__(self):
    self.running = False
    self.stopped = False
    self._template: Any = None
    self._template_error: Optional[str] = None
    self._template_loaded = False

  def on_signal(self, signum: int, frame: Any) -> None:
    del frame
    if self.stopped:
      return  # one interruption per worker: the abandon runs undisturbed
    self.stopped = True
    if self.running:
      raise KeyboardInterrupt()
    sys.exit(128 + signum)

  def template(self, spec: Optional[str]) -> Any:
    """The template of `--template`, loaded once per worker."""
    if spec is None:
      return None
    if not self._template_loaded:
      from clu_ckpt.migration import options  # pylint: disable=g-import-not-at-top
      try:
        self._template = options.load_template(spec)
      except Exception as e:  # pylint: disable=broad-except
        self._template_error = str(e)
      self._template_loaded = True
    if self._template_error is not None:
      raise _RunError(self._template_error)
    return self._template

  def migrate(self, task: Mapping[str, Any], options: Mapping[str, Any]
              ) -> dict[str, Any]:
    """Migrates one run; its report entry (never raises but to stop)."""
    from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
    start = time.time()
    entry = {"source": task["source"], "destination": task["destination"]}
    self.running = True  # a stop now interrupts this run
    try:
      try:
        kwargs = migrate_kwargs(options)
        template = self.template(options.get("template"))
        summary = migration.migrate(task["source"], task["destination"],
                                    template=template, **kwargs)
      finally:
        self.running = False
    except migration.MigrationInterrupted as e:
      entry.update(status="interrupted", summary=e.summary.to_json(),
                   error=_interrupted_text(e))
      self.stopped = True
    except KeyboardInterrupt:
      entry.update(status="interrupted", error="interrupted")
      self.stopped = True
    except (_RunError, UsageError) as e:
      entry.update(status="error", error=str(e))
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc()
      entry.update(status="error", error=migration.describe_error(e))
    else:
      entry["summary"] = summary.to_json()
      lacking = list(summary.not_on_all_hosts)
      if lacking:
        entry["warning"] = (f"not on every host, not migrated: "
                            f"{', '.join(f'ckpt-{n}' for n in lacking)}")
      hosts_only = task.get("through_hosts")
      # Read as hosts, runs of their own lose what only some of them keep,
      # and, with --state-host, the states of the others (not compared).
      # A named base too: the other hosts' states are not in the step.
      names = hosts_only or [f"{task['source'].rstrip('/')}-{i}"
                             for i in summary.hosts]
      unread = [f"state of {h} (not compared: --state-host)"
                for i, h in zip(summary.hosts if not hosts_only else
                                range(len(names)), names)
                if options.get("state_host") not in (None, i)] if (
                    len(summary.hosts) > 1) else []
      if hosts_only and (lacking or unread):
        entry["warning"] = "; ".join(filter(None, [
            entry.get("warning"), ", ".join(unread)])) + _hosts_or_runs(
                task["source"], hosts_only)
      if summary.ok and lacking and not summary.steps:
        # Checkpoints are there, but none on every host: nothing migrated,
        # which an operator must not read as a run done.
        entry.update(status="failed", error=entry["warning"])
      elif summary.ok:
        entry["status"] = "ok"
        _name_what_the_source_keeps(entry, summary.dry_run)
        if hosts_only and (lacking or unread) and not summary.dry_run:
          # Maybe not unfinished saves: the checkpoints of a run of its own.
          kept = entry.get("source_not_migrated", [])
          entry["source_not_migrated"] = [
              *(f"ckpt-{n}" for n in lacking if f"ckpt-{n}" not in kept),
              *unread, *kept]
        elif unread and not summary.dry_run:
          entry["source_not_migrated"] = [
              *unread, *entry.get("source_not_migrated", [])]
          note = (f"{', '.join(unread)}: not in the destination; do not "
                  "delete the source unless the hosts' states are the same")
          entry["warning"] = (f"{entry['warning']}; {note}"
                              if entry.get("warning") else note)
      else:
        entry.update(status="failed", error="; ".join(
            f"ckpt-{s.number}: {s.error}" for s in summary.failed))
    entry["seconds"] = round(time.time() - start, 3)
    return entry


def _hosts_or_runs(base: str, hosts: Sequence[str]) -> str:
  """What a run reached through its host directories only adds to the note
  on checkpoints some hosts lack: they may be runs of their own."""
  return (f" (reached through {', '.join(hosts)} only, no glob or path "
          f"naming {base}: the hosts of one MultihostCheckpoint, or runs of "
          "their own whose own checkpoints these are? Kept: do not delete "
          f"it. Name them with --sources={base} (one run) or --sources="
          f"{','.join(hosts)} (runs of their own))")


def _name_what_the_source_keeps(entry: dict[str, Any], dry_run: bool
                                ) -> None:
  """Notes in a run's entry the checkpoints its source keeps that are not in
  its destination (`--latest`, `--number`, saved during the migration), so
  that an "ok" run is never read as a source safe to delete."""
  from clu_ckpt.migration import destination  # pylint: disable=g-import-not-at-top
  if dry_run:
    return
  left = destination.checkpoints_not_migrated(entry["destination"],
                                              entry["source"])
  if left is None:  # read moments ago, not now (a bucket's outage...)
    note = ("the source could not be read again after its migration: what "
            "it keeps is not verified: do not delete it")
    entry["source_not_migrated"] = [f"(not verified: {note.split(': ')[0]})"]
    entry["warning"] = (f"{entry['warning']}; {note}" if entry.get("warning")
                        else note)
    return
  if not left.anything:
    return
  # Entries the migration does not read (an Orbax step, a run inside the
  # run) count as what the source keeps: `sources_to_keep` follows this.
  kept = left.names + left.removed + left.entries
  entry["source_not_migrated"] = kept
  shown = ", ".join(kept[:5]) + (
      f" and {len(kept) - 5} more" if len(kept) > 5 else "")
  parts = []
  if left.names:
    parts.append(f"{len(left.names)} of {left.total} checkpoint(s) not "
                 "migrated")
  if left.removed:
    parts.append(f"{len(left.removed)} checkpoint(s) whose step the "
                 "destination no longer holds")
  if left.entries:
    parts.append(f"{len(left.entries)} other "
                 f"entr{'y' if len(left.entries) == 1 else 'ies'} not migrated")
  note = f"the source keeps {' and '.join(parts)} ({shown}): do not delete it"
  entry["warning"] = (f"{entry['warning']}; {note}" if entry.get("warning")
                      else note)


class _RunError(Exception):
  """A run that cannot start (its message is the report's error)."""


def _interrupted_text(e: Any) -> str:
  steps = e.summary.steps
  done = [s for s in steps if s.status in ("migrated", "skipped")]
  total = len(steps) + len(e.remaining)
  text = f"interrupted: {len(done)} of {total} checkpoints migrated"
  abandoned = e.abandoned
  if abandoned is not None:
    text += f"; ckpt-{abandoned.number} abandoned"
  return text + "; re-run to resume"


def _die_with_parent() -> None:
  """Asks Linux for SIGTERM (a clean stop) when the fleet process dies."""
  try:
    import ctypes  # pylint: disable=g-import-not-at-top
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
  except (OSError, AttributeError):
    pass


def worker_main() -> int:
  """The worker process's main (started by `WorkerPool`; not for people).

  Reads its options, then one run a line, on stdin; answers each run with
  its report entry (one JSON line) on the original stdout.

  Returns:
    The exit status (0; a stop by signal exits 128 + the signal).
  """
  parent = os.getppid()
  _die_with_parent()
  if os.getppid() != parent:
    return 1
  results = os.fdopen(os.dup(1), "w", buffering=1)
  os.dup2(2, 1)  # libraries' prints go to the log, not to the results
  worker = _Worker()
  signal.signal(signal.SIGINT, worker.on_signal)
  signal.signal(signal.SIGTERM, worker.on_signal)
  try:
    options = json.loads(sys.stdin.readline() or "{}").get("options", {})
    if not os.environ.get("CLU_CKPT_FLEET_VERBOSE"):
      _quiet_libraries()
    # The migration's modules (`clu_ckpt.migration` imports them on first
    # use), imported once, before the first run: a worker that cannot
    # import them dies before taking a run (and the fleet gives up after a
    # few), and a `--template` putting the current directory first on
    # sys.path cannot shadow what they import.
    # pylint: disable-next=g-import-not-at-top,unused-import
    from clu_ckpt.migration import run
    results.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
      if worker.stopped:
        break
      entry = worker.migrate(json.loads(line), options)
      results.write(json.dumps(entry) + "\n")
      if worker.stopped:
        break
  except (KeyboardInterrupt, SystemExit, BrokenPipeError):
    pass
  return 0


def _quiet_libraries() -> None:
  import logging  # pylint: disable=g-import-not-at-top
  # pylint: disable-next=g-import-not-at-top
  from absl import logging as absl_logging
  absl_logging.set_verbosity(absl_logging.FATAL)
  for name in ("absl", "asyncio", "jax", "orbax", "tensorflow",
               "google.auth"):
    logging.getLogger(name).setLevel(logging.CRITICAL)
  # An abandoned step's writes end in callbacks on a closed event loop.
  sys.unraisablehook = threading.excepthook = lambda *_: None


# --------------------------------------------------------------------------
# The pool: long-lived workers, replaced when they die.
# --------------------------------------------------------------------------


def _child_environment(environ: Mapping[str, str]) -> dict[str, str]:
  """`environ`, with this checkout's `clu_ckpt` first on PYTHONPATH."""
  import clu_ckpt  # pylint: disable=g-import-not-at-top
  # The directory this process imported clu_ckpt from (a checkout run as
  # `python migration/migrate_runs.py`, or an installation).
  checkout = os.path.dirname(os.path.dirname(os.path.abspath(
      clu_ckpt.__file__)))
  env = dict(environ)
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  env["PYTHONPATH"] = os.pathsep.join(
      [checkout] + [p for p in [environ.get("PYTHONPATH")] if p])
  return env


class _WorkerProcess:
  """The fleet's handle on one worker: its process, log and current run."""

  def __init__(self, number: int, options: Mapping[str, Any],
               messages: "queue.Queue[tuple[_WorkerProcess, Any]]",
               verbose: bool):
    self.number = number
    self.run: Optional[Run] = None
    self.started: float = 0.0
    self.killed = False
    env = _child_environment(os.environ)
    if verbose:
      env["CLU_CKPT_FLEET_VERBOSE"] = "1"
      self.log = None
    else:
      self.log = tempfile.TemporaryFile(prefix="clu_ckpt-fleet-worker-")
    # Its own session: a terminal's Ctrl-C reaches the fleet alone, which
    # then stops the workers itself (one SIGINT each, at the right moment).
    self.process = subprocess.Popen(
        [sys.executable, *WORKER_ARGS],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
        env=env, text=True, start_new_session=True)
    self.process.stdin.write(json.dumps({"options": options}) + "\n")
    self.process.stdin.flush()
    self.ready = False
    threading.Thread(target=self._read, args=(messages,), daemon=True,
                     name=f"worker-{number}-reader").start()

  def _read(self, messages: "queue.Queue[tuple[_WorkerProcess, Any]]"
            ) -> None:
    for line in self.process.stdout:
      try:
        messages.put((self, json.loads(line)))
      except json.JSONDecodeError:
        continue
    self.process.wait()
    messages.put((self, None))

  def send(self, run: Run) -> None:
    self.run = run
    self.started = time.time()
    task = {"source": run.source, "destination": run.destination}
    if run.through_hosts:
      task["through_hosts"] = run.hosts
    self.process.stdin.write(json.dumps(task) + "\n")
    self.process.stdin.flush()

  def close_input(self) -> None:
    try:
      self.process.stdin.close()
    except OSError:
      pass

  def signal(self, signum: int) -> None:
    try:
      self.process.send_signal(signum)
    except (OSError, ProcessLookupError):
      pass

  def death(self) -> str:
    """Why the worker died, for its run's report entry."""
    code = self.process.returncode
    if self.killed:
      return "stopped at once (second interrupt, or the stop timed out)"
    if code is not None and code < 0:
      try:
        name = signal.Signals(-code).name
      except ValueError:
        name = f"signal {-code}"
      cause = f"killed by {name}"
      if -code == signal.SIGKILL:
        cause += " (out of memory?)"
    else:
      cause = f"exit status {code}"
    last = self._last_log_line()
    return (f"worker process died ({cause}) while migrating this run"
            + (f"; its last message: {last}" if last else ""))

  def _last_log_line(self) -> str:
    if self.log is None:
      return ""
    try:
      self.log.seek(0, os.SEEK_END)
      size = self.log.tell()
      self.log.seek(max(0, size - 4096))
      lines = self.log.read().decode("utf-8", "replace").strip().splitlines()
    except OSError:
      return ""
    return lines[-1].strip()[:300] if lines else ""


class WorkerPool:
  """Migrates runs in `parallelism` long-lived workers; stops cleanly.

  `run` calls `on_entry(entry)` (in the main thread) as each run finishes,
  and `on_idle()` when no worker has said anything for 0.2 s.
  `stop(signum)` (from a signal handler) starts no new run and interrupts
  the runs under way; a second `stop` kills the workers at once.
  """

  def __init__(self, runs: Sequence[Run], options: Mapping[str, Any],
               parallelism: int, on_entry: Callable[[dict[str, Any]], None],
               verbose: bool = False, stop_seconds: float = STOP_SECONDS,
               on_idle: Optional[Callable[[], None]] = None):
    self._on_idle = on_idle
    self._pending = list(runs)
    self._options = dict(options)
    self._parallelism = max(1, parallelism)
    self._on_entry = on_entry
    self._verbose = verbose
    self._stop_seconds = stop_seconds
    self._messages: "queue.Queue[tuple[_WorkerProcess, Any]]" = queue.Queue()
    self._workers: list[_WorkerProcess] = []
    self._started = 0
    self.stop_signal: Optional[int] = None
    self._stop_deadline = float("inf")
    self._failed_starts = 0

  def stop(self, signum: int) -> None:
    """A stop request (from a signal handler).

    The first starts no new run and interrupts the runs under way (each
    worker gets SIGINT); the second kills the workers at once.

    Args:
      signum: The signal (its number is the exit status, + 128).
    """
    if self.stop_signal is not None:
      self.kill()
      return
    self.stop_signal = signum
    self._stop_deadline = time.monotonic() + self._stop_seconds
    for w in self._workers:
      if w.run is not None:
        w.signal(signal.SIGINT)
      else:
        w.close_input()

  def kill(self) -> None:
    """Kills every worker now (their runs are reported interrupted)."""
    for w in self._workers:
      w.killed = True
      w.signal(signal.SIGKILL)

  def run(self) -> None:
    """Migrates every run, until done or stopped; `on_entry` per run.

    Returns when no run is under way any more; the workers have then
    exited (or been killed after 10 s).
    """
    try:
      while True:
        self._dispatch()
        busy = [w for w in self._workers if w.run is not None]
        if not busy and (self.stop_signal is not None or not self._pending):
          break
        self._handle_next_message()
    finally:
      for w in self._workers:
        w.close_input()
      for w in self._workers:
        try:
          w.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
          w.signal(signal.SIGKILL)

  def _dispatch(self) -> None:
    if self.stop_signal is not None:
      return
    for w in self._workers:
      if w.run is None and w.ready and w.process.poll() is None and (
          self._pending):
        w.send(self._pending.pop(0))
    alive = [w for w in self._workers if w.process.poll() is None]
    waiting = sum(1 for w in alive if not w.ready)
    while (len(alive) < self._parallelism and
           len(self._pending) > waiting):
      self._started += 1
      w = _WorkerProcess(self._started, self._options, self._messages,
                         self._verbose)
      self._workers.append(w)
      alive.append(w)
      waiting += 1

  def _handle_next_message(self) -> None:
    try:
      worker, message = self._messages.get(timeout=0.2)
    except queue.Empty:
      if time.monotonic() > self._stop_deadline:
        self.kill()
        self._stop_deadline = float("inf")
      if self._on_idle is not None:
        self._on_idle()
      return
    if message is None:  # the worker ended
      self._workers.remove(worker)
      if not worker.ready and self.stop_signal is None:
        self._failed_start(worker)
      if worker.run is not None:
        status = "interrupted" if self.stop_signal is not None else "error"
        self._finish(worker, {"source": worker.run.source,
                              "destination": worker.run.destination,
                              "status": status, "error": worker.death(),
                              "seconds": round(time.time() - worker.started,
                                               3)})
      return
    if message.get("ready"):
      worker.ready = True
      self._failed_starts = 0
      if self.stop_signal is not None:
        worker.close_input()
      return
    self._finish(worker, message)

  def _failed_start(self, worker: _WorkerProcess) -> None:
    """A worker died before taking a run: after 3 in a row, give up."""
    self._failed_starts += 1
    if self._failed_starts < _MAX_FAILED_STARTS:
      return
    error = worker.death().replace(" while migrating this run",
                                   " before taking a run")
    while self._pending:
      run = self._pending.pop(0)
      self._on_entry({"source": run.source, "destination": run.destination,
                      "status": "error", "error": error, "seconds": 0.0})

  def _finish(self, worker: _WorkerProcess, entry: dict[str, Any]) -> None:
    worker.run = None
    self._on_entry(entry)


