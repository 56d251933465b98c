"""Progress of the long commands, drawn for a terminal or written for a log.

On a terminal a tqdm bar covers the whole run (i/N, bytes done of the total,
rate, ETA) with a line per finished item above it; otherwise one line per
event, ending with the run's position, so a log shows progress too.

Synopsis::

  from clu_ckpt import progress

  report = progress.MigrationReport(sys.stderr, sys.stderr.isatty())
  migration.migrate(src, dst, progress=report)   # migration.Progress events
  report.close()

  report = progress.VerifyReport(sys.stderr, sys.stderr.isatty())
  inspection.verify_path(path, progress=report)  # report(i, n, name, nbytes)
  report.close()
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, TextIO

_GIB = 2**30
_MIB = 2**20
_REDRAW_SECONDS = 0.1


class MigrationReport:
  """Renders `migration.Progress` events for the terminal or a log.

  On a terminal: one tqdm bar over the bytes this run writes (checkpoint i/N,
  bytes done of the total, rate, ETA), with a line per finished checkpoint
  above it. Otherwise one line per event, ending with the run's progress.

  Sizes and rates are binary (KiB, MiB, GiB) on the bar and the lines alike.
  The total follows the events: a bucket's checkpoint is planned at its file
  size and counted at its array bytes once read, so the last line reads
  "N of N". Skipped checkpoints count as done but not as work: the rate and
  the ETA come from the bytes written in this run only.
  """

  def __init__(self, out: TextIO, tty: bool,
               clock: Callable[[], float] = time.monotonic):
    self._out = out
    self._tty = tty
    self._clock = clock
    self._lock = threading.Lock()
    self._count = self._index = 0
    self._total = self._finished = self._current = 0
    # Bytes written by this run (not skipped) and when writing began.
    self._written = 0
    self._skipped = 0
    self._work_started: Optional[float] = None
    self._step_started = clock()
    self._bar: Any = None

  def __call__(self, event: Any) -> None:
    with self._lock:
      if not self._count and getattr(event, "count", 0):
        self._on_plan(event)
      if self._count and getattr(event, "total_nbytes", 0):
        self._set_total(event.total_nbytes)
      handler = getattr(self, f"_on_{event.event}", None)
      if handler is not None:
        handler(event)

  def _label(self, event: Any) -> str:
    step = "?" if event.step is None else event.step
    return f"ckpt-{event.number} -> step {step}"

  def _on_plan(self, event: Any) -> None:
    """Learns the run's size from the first event that carries it."""
    self._count, self._total = event.count, event.total_nbytes
    if self._tty:
      self._bar = _binary_bar(
          total=event.total_nbytes, file=self._out,
          mininterval=_REDRAW_SECONDS, dynamic_ncols=True,
          desc=f"[0/{event.count}]", leave=False)

  def _set_total(self, total: int) -> None:
    """The run's bytes as the events now count them."""
    if total == self._total:
      return
    self._total = total
    if self._bar is not None:
      self._bar.total = max(0, total - self._skipped)
      self._bar.refresh()

  def _on_start(self, event: Any) -> None:
    self._index += 1
    self._current = 0
    self._step_started = self._clock()
    if self._work_started is None:
      self._work_started = self._step_started
    if self._bar is not None:
      self._bar.set_description_str(
          f"[{self._index}/{self._count}] {self._label(event)}")
    else:
      self._line(f"migrating {self._label(event)} ({size(event.nbytes)}) "
                 f"[{self._index}/{self._count}]")

  def _on_bytes(self, event: Any) -> None:
    self._current += event.nbytes
    if self._bar is not None:
      self._bar.update(event.nbytes)

  def _on_done(self, event: Any) -> None:
    seconds = max(self._clock() - self._step_started, 1e-9)
    self._finish(event.nbytes)
    self._written += event.nbytes
    self._line(f"migrated {self._label(event)}: {size(event.nbytes)} in "
               f"{seconds:.1f} s ({size(event.nbytes / seconds)}/s)"
               f"{self._overall()}")

  def _on_skipped(self, event: Any) -> None:
    self._index += 1
    self._finished += event.nbytes
    self._skipped += event.nbytes
    self._current = 0
    if self._bar is not None:
      # Not work: the bar (and tqdm's rate and ETA) covers written bytes.
      self._bar.total = max(0, self._total - self._skipped)
      self._bar.refresh()
    self._line(f"skipped {self._label(event)}: already in the destination"
               f"{self._overall()}")

  def _on_verified(self, event: Any) -> None:
    self._line(f"verified {self._label(event)}")

  def _on_failed(self, event: Any) -> None:
    if self._current or self._index == 0:
      self._finish(0)
    self._line(f"FAILED {self._label(event)}: {event.message}")

  def _finish(self, nbytes: int) -> None:
    """Counts a finished checkpoint's bytes (the bar catches up to them)."""
    if self._bar is not None:
      self._bar.update(max(0, nbytes - self._current))
    self._finished += nbytes
    self._current = 0

  def _overall(self) -> str:
    """" [i/N, done of total, ETA t]" (empty before the plan is known).

    The ETA is the bytes left at the rate this run has written so far
    (skipped checkpoints took no writing); none before anything is written.
    """
    if not self._count:
      return ""
    left = self._total - self._finished
    eta = ""
    if self._written and left > 0 and self._work_started is not None:
      elapsed = self._clock() - self._work_started
      eta = f", ETA {duration(elapsed * left / self._written)}"
    return (f" [{self._index}/{self._count}, {size(self._finished)} of "
            f"{size(self._total)}{eta}]")

  def _line(self, text: str) -> None:
    if self._bar is not None:
      self._bar.write(text, file=self._out)
    else:
      self._out.write(text + "\n")
      self._out.flush()

  def close(self) -> None:
    """Takes the bar off the terminal."""
    with self._lock:
      if self._bar is not None:
        self._bar.close()
        self._bar = None


def _binary_bar(**kwargs: Any) -> Any:
  """A tqdm bar over bytes that shows sizes and rate in KiB, MiB, GiB.

  tqdm's own scaling prints decimal-looking units ("MB/s") even with a
  divisor of 1024; this bar formats them with `size`, like the lines.
  """
  import tqdm  # pylint: disable=g-import-not-at-top

  class BinaryBar(tqdm.tqdm):

    @property
    def format_dict(self):
      d = super().format_dict
      rate = d.get("rate")
      d["done_bin"] = size(d["n"])
      d["total_bin"] = size(d["total"] or 0)
      d["rate_bin"] = f"{size(rate)}/s" if rate else "?/s"
      return d

  return BinaryBar(
      unit="B", bar_format=("{desc}: {percentage:3.0f}%|{bar}| {done_bin} of "
                            "{total_bin} [{elapsed}<{remaining}, {rate_bin}]"),
      **kwargs)


def duration(seconds: float) -> str:
  """`seconds` as "42 s", "3 min 20 s" or "2 h 05 min"."""
  seconds = int(round(seconds))
  if seconds < 60:
    return f"{seconds} s"
  if seconds < 3600:
    return f"{seconds // 60} min {seconds % 60:02d} s"
  return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def size(n: float) -> str:
  """`n` bytes in binary units: "512 B", "3.2 KiB", "4.0 MiB", "1.25 GiB"."""
  if n >= _GIB:
    return f"{n / _GIB:.2f} GiB"
  if n >= _MIB:
    return f"{n / _MIB:.1f} MiB"
  return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{int(n)} B"


class VerifyReport:
  """Renders the progress of `verify`: one call per file checked.

  Called as `report(done, count, name, nbytes, total_nbytes)` after each
  file: a tqdm bar over the files on a terminal, else a line per file.
  """

  def __init__(self, out: TextIO, tty: bool,
               clock: Callable[[], float] = time.monotonic):
    self._out = out
    self._tty = tty
    self._clock = clock
    self._started = clock()
    self._bytes = 0
    self._bar: Any = None

  def __call__(self, done: int, count: int, name: str, nbytes: int,
               total_nbytes: int) -> None:
    self._bytes += nbytes
    if self._tty:
      if self._bar is None:
        import tqdm  # pylint: disable=g-import-not-at-top
        self._bar = tqdm.tqdm(total=count, unit="file", file=self._out,
                              mininterval=_REDRAW_SECONDS, leave=False,
                              dynamic_ncols=True)
      self._bar.set_description_str(name)
      self._bar.update(1)
      return
    elapsed = self._clock() - self._started
    left = total_nbytes - self._bytes
    eta = (f", ETA {duration(elapsed * left / self._bytes)}"
           if self._bytes and left > 0 else "")
    self._out.write(f"verified {name} [{done}/{count}, {size(self._bytes)} "
                    f"of {size(total_nbytes)}{eta}]\n")
    self._out.flush()

  def close(self) -> None:
    """Takes the bar off the terminal."""
    if self._bar is not None:
      self._bar.close()
      self._bar = None
