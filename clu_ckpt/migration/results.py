"""What `migrate` reports: per-step results, the summary, progress events.

`run.migrate` returns a `MigrationSummary` of `StepResult`s, calls its
`progress` function with `Progress` events as work advances, and raises
`MigrationInterrupted` (carrying the summary so far) on Ctrl-C. They are
re-exported by `clu_ckpt.migration.run` and `clu_ckpt.migration`.

Synopsis::

  from clu_ckpt.migration import results

  def show(event: results.Progress) -> None:
    print(f"{event.event} ckpt-{event.number} of {event.count} "
          f"({event.total_nbytes} bytes in all)")

  try:
    summary = migrate(src, dst, progress=show)
  except results.MigrationInterrupted as e:
    print([s.number for s in e.summary.steps if s.status == "migrated"])
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional


@dataclasses.dataclass
class StepResult:
  """What happened to one CLU checkpoint.

  Attributes:
    number: The CLU checkpoint number (`ckpt-<number>`).
    step: The Orbax step it maps to (None when its state could not be read
      to name it).
    status: "migrated", "skipped" (already in the destination), "planned"
      (dry run), "failed", or "interrupted" (abandoned on Ctrl-C: nothing
      of it is left; in `MigrationInterrupted.summary` only).
    nbytes: Bytes of array data in the state.
    seconds: Wall time spent on it.
    verified: True when `verify` compared it with the source.
    error: Why it failed.
  """
  number: int
  step: Optional[int]
  status: str
  nbytes: int = 0
  seconds: float = 0.0
  verified: bool = False
  error: Optional[str] = None


@dataclasses.dataclass
class MigrationSummary:
  """The outcome of `migrate`.

  Attributes:
    source: The source base directory.
    destination: The Orbax root directory.
    kind: "Checkpoint" or "MultihostCheckpoint".
    hosts: Host ids found (`[0]` for a single-host source).
    step_naming: "state" or "number": how steps were named.
    steps: One result per selected checkpoint, oldest first.
    not_on_all_hosts: Checkpoint numbers some host lacks (not migrated).
    dry_run: Nothing was written.
  """
  source: str
  destination: str
  kind: str
  hosts: list[int]
  step_naming: str
  steps: list[StepResult]
  not_on_all_hosts: list[int] = dataclasses.field(default_factory=list)
  dry_run: bool = False

  @property
  def ok(self) -> bool:
    """True when no checkpoint failed."""
    return not self.failed

  @property
  def failed(self) -> list[StepResult]:
    return [s for s in self.steps if s.status == "failed"]

  @property
  def step_mapping(self) -> dict[int, int]:
    """CLU checkpoint number -> Orbax step."""
    return {s.number: s.step for s in self.steps if s.step is not None}

  def to_json(self) -> dict[str, Any]:
    """The summary as JSON-serializable data."""
    data = dataclasses.asdict(self)
    data["ok"] = self.ok
    return data


@dataclasses.dataclass(frozen=True)
class Progress:
  """A progress report passed to `migrate(progress=...)`.

  Attributes:
    event: "start" (a step begins), "bytes" (array data written), "done",
      "skipped", "failed" or "verified".
    number: CLU checkpoint number.
    step: Orbax step.
    nbytes: For "start", "done" and "skipped", the step's array bytes; for
      "bytes", the bytes just written.
    message: For "failed", the error.
    count: The number of checkpoints this run processes (every event).
    total_nbytes: Their array bytes (of those whose file could be read).
  """
  event: str
  number: int
  step: Optional[int]
  nbytes: int = 0
  message: str = ""
  count: int = 0
  total_nbytes: int = 0


ProgressFn = Callable[[Progress], None]


class MigrationInterrupted(KeyboardInterrupt):
  """Ctrl-C (SIGINT, i.e. KeyboardInterrupt) stopped `migrate`.

  The step being written was abandoned: its temporary directories are
  removed, it is neither listed nor recorded in the manifest. The steps
  finished before it are complete and recorded: re-running `migrate`
  resumes after them. A KeyboardInterrupt, so code that does not know this
  class still stops.

  Attributes:
    summary: The steps processed before the interruption, then the
      abandoned one (status "interrupted") if a step was under way.
    remaining: Numbers of the selected checkpoints not started.
  """

  def __init__(self, summary: MigrationSummary, remaining: list[int]):
    super().__init__("interrupted")
    self.summary = summary
    self.remaining = remaining

  @property
  def abandoned(self) -> Optional[StepResult]:
    """The step that was under way, or None."""
    for step in self.summary.steps:
      if step.status == "interrupted":
        return step
    return None
