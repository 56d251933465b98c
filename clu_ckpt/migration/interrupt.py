"""Ctrl-C during a migration: abandoning the step being written, cleanly.

Python delivers SIGINT as a KeyboardInterrupt in the main thread only. While
a step is written, that thread waits in Orbax's `Checkpointer.save` (a
`Thread.join` on its futures); Orbax's writer threads (`np_type_handler`,
`write_metadata_after_commits`, an asyncio executor) and TensorStore go on
writing the step, and recreate its `<step>.orbax-checkpoint-tmp` directory
after `Target.write_step` removed it (or make that removal fail with
`[Errno 39] Directory not empty`: an OSError raised while handling the
KeyboardInterrupt, which an `except Exception` then took for an ordinary
failure of the step, and the run went on). Here, the writers are stopped
(`cancel_running_tasks`, from the `on_bytes` callback they call) and waited
for before the temporary directories are removed (`abandon`).

Synopsis::

  from clu_ckpt.migration import interrupt

  before = set(threading.enumerate())
  try:
    target.write_step(step, items, on_bytes)
  except BaseException as e:
    if interrupt.caused_by_interrupt(e):
      stop.set()       # on_bytes now calls interrupt.cancel_running_tasks()
      interrupt.abandon(target, step, before)
    raise
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from typing import Any, Iterator

# How long an abandoned step's writers may take to stop.
SETTLE_SECONDS = 60.0
# After the writers stopped, the temporary directories are removed this many
# times, this far apart (TensorStore may still finish an operation it had
# under way when the Python side stopped).
_SWEEPS = 3
_SWEEP_SECONDS = 0.2
_POLL_SECONDS = 0.05


def caused_by_interrupt(error: BaseException) -> bool:
  """Whether `error` is, or was raised while handling, a KeyboardInterrupt."""
  seen = set()
  while error is not None and id(error) not in seen:
    if isinstance(error, KeyboardInterrupt):
      return True
    seen.add(id(error))
    error = error.__cause__ or error.__context__
  return False


def cancel_running_tasks() -> None:
  """Cancels every task of the asyncio loop running in this thread.

  Called from `on_bytes` (which the writing loop calls after each array)
  once the step is abandoned: the writing coroutine stops at its next
  `await` instead of writing the rest of the step. Outside a running loop,
  nothing happens.
  """
  try:
    loop = asyncio.get_running_loop()
  except RuntimeError:
    return
  for task in asyncio.all_tasks(loop):
    task.cancel()


def abandon(target: Any, step: int, before: set[threading.Thread],
            timeout: float = SETTLE_SECONDS) -> None:
  """Removes an interrupted write of `step` once its writers have stopped.

  With SIGINT ignored meanwhile: waits (at most `timeout` seconds) for the
  threads not in `before` (those the write started), then removes the
  step's temporary directories (`target.remove_partial`), again a little
  later in case TensorStore finished an operation in between.

  Args:
    target: The `orbax_target.Target` the step was written to.
    step: The step.
    before: The threads alive before the write began.
    timeout: Seconds to wait for the writer threads.

  Raises:
    OSError: The temporary directories could not be removed.
  """
  with sigint_ignored():
    _join_new_threads(before, time.monotonic() + timeout)
    for sweep in range(_SWEEPS):
      time.sleep(_SWEEP_SECONDS)
      try:
        target.remove_partial(step)
      except OSError:
        if sweep == _SWEEPS - 1:
          raise


def _join_new_threads(before: set[threading.Thread], deadline: float) -> None:
  """Waits until every thread not in `before` has ended, or `deadline`.

  Polls `is_alive` rather than calling `join`: Orbax's threads override
  `join` to raise TimeoutError.
  """
  me = threading.current_thread()
  while time.monotonic() < deadline:
    if not any(t not in before and t is not me and t.is_alive()
               for t in threading.enumerate()):
      return
    time.sleep(_POLL_SECONDS)


@contextlib.contextmanager
def sigint_ignored() -> Iterator[None]:
  """SIGINT ignored meanwhile (in the main thread; elsewhere, a no-op)."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)
