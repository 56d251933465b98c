"""The libraries' own log messages: off the terminal unless asked for.

TensorFlow, JAX, Orbax, absl, gcsfs, s3fs, botocore and google-auth log
warnings (and gcsfs whole tracebacks, once per retried request) that
repeat what clu_ckpt reports itself in one line. `clu-ckpt` runs its
commands inside `quieted()`, and `--verbose` leaves the logs as they are.

Warnings are left alone, but for one: google-api-core's notice that the
running Python is (or will soon be) out of its support, a FutureWarning
printed to stderr at the first `gs://` use of every command on such a
Python; the command's errors are one line.

What Python logging cannot reach (see README, "Quiet output"): TensorStore's
C++ log lines, such as `google_auth_provider.cc` saying it found no
credentials file when no credentials are configured. They are written by C++
straight to file descriptor 2.

Synopsis::

  from clu_ckpt import library_logs

  with library_logs.quieted():          # the libraries say nothing
    migration.migrate(src, dst)

  with library_logs.quieted(verbose=True):   # everything, as configured
    migration.migrate(src, dst)
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import Any, Iterator
import warnings

from absl import logging as absl_logging

# The Python loggers of the libraries clu_ckpt drives.
NOISY_LOGGERS = ("absl", "asyncio", "jax", "orbax", "tensorflow",
                 "google.auth", "gcsfs", "fsspec", "s3fs", "aiobotocore",
                 "botocore", "aiohttp", "urllib3")
# The module whose FutureWarnings (all about the running Python's support by
# Google's client libraries, warned once per package at import) are dropped.
PYTHON_SUPPORT_NOTICE_MODULE = r"google\.api_core\._python_version_support"


@contextlib.contextmanager
def quieted(verbose: bool = False) -> Iterator[None]:
  """Keeps the libraries' logging off the terminal while the block runs.

  Sets the loggers in `NOISY_LOGGERS` to CRITICAL and absl's verbosity to
  FATAL (errors too: Orbax logs each failed write with its traceback, gcsfs
  each failed request's, and the caller reports every failure itself), sets
  `TF_CPP_MIN_LOG_LEVEL=2` unless set, and drops unraisable exceptions and
  uncaught thread exceptions (an abandoned step's writes end in TensorStore
  callbacks that find Orbax's event loop closed), and ignores the
  FutureWarnings of `PYTHON_SUPPORT_NOTICE_MODULE`. Everything is restored
  when the block ends.

  Args:
    verbose: Leave logging as it is (the block runs unchanged).

  Yields:
    Nothing.
  """
  if verbose:
    yield
    return
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  verbosity = absl_logging.get_verbosity()
  levels = {name: logging.getLogger(name).level for name in NOISY_LOGGERS}
  absl_logging.set_verbosity(absl_logging.FATAL)
  for name in NOISY_LOGGERS:
    logging.getLogger(name).setLevel(logging.CRITICAL)
  hooks = sys.unraisablehook, threading.excepthook
  sys.unraisablehook = threading.excepthook = lambda *_: None
  try:
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", category=FutureWarning,
                              module=PYTHON_SUPPORT_NOTICE_MODULE)
      yield
  finally:
    sys.unraisablehook, threading.excepthook = hooks
    absl_logging.set_verbosity(verbosity)
    for name, level in levels.items():
      logging.getLogger(name).setLevel(level)


_CLOSED_LOOP_FILTER = threading.Lock()
_closed_loop_filter_installed = False


def drop_closed_loop_callbacks() -> None:
  """Drops one harmless unraisable exception, process-wide, from now on.

  When an Orbax restore fails (a step that does not read back, in
  `verify`), Orbax's event loop ends with the error while TensorStore still
  completes the restore's other reads; TensorStore then hands each result to
  the closed loop (`call_soon_threadsafe`) from its own threads, and Python
  prints `RuntimeError: Event loop is closed` as an unraisable exception.
  The results were discarded with the failed restore: nothing is lost. This
  wraps `sys.unraisablehook` (once) so that exactly these are dropped; every
  other unraisable exception still reaches the previous hook.
  """
  global _closed_loop_filter_installed
  with _CLOSED_LOOP_FILTER:
    if _closed_loop_filter_installed:
      return
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
      if not _is_closed_loop_callback(unraisable):
        previous(unraisable)

    sys.unraisablehook = hook
    _closed_loop_filter_installed = True


def _is_closed_loop_callback(unraisable: Any) -> bool:
  """Whether `unraisable` is a callback finding its event loop closed."""
  error = unraisable.exc_value
  if not (isinstance(error, RuntimeError) and
          str(error) == "Event loop is closed"):
    return False
  tb = unraisable.exc_traceback
  while tb is not None:
    if tb.tb_frame.f_code.co_name == "call_soon_threadsafe":
      return True
    tb = tb.tb_next
  return False
