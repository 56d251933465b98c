"""Tests of clu_ckpt.library_logs: the libraries stay quiet unless asked."""

import datetime
import logging
import sys
import warnings

from absl import logging as absl_logging
import pytest

from clu_ckpt import library_logs


def test_quieted_silences_the_libraries_and_restores_them(caplog):
  gcsfs_logger = logging.getLogger("gcsfs")
  before = gcsfs_logger.level, absl_logging.get_verbosity(), sys.unraisablehook
  with library_logs.quieted():
    # What gcsfs does when a request runs out of retries.
    gcsfs_logger.error("_request out of retries on exception: refused")
    logging.getLogger("botocore.retryhandler").warning("retrying")
    assert absl_logging.get_verbosity() == absl_logging.FATAL
  assert not caplog.records, caplog.text
  assert (gcsfs_logger.level, absl_logging.get_verbosity(),
          sys.unraisablehook) == before


def test_verbose_leaves_the_logs_alone(caplog):
  with library_logs.quieted(verbose=True):
    logging.getLogger("gcsfs").error("_request out of retries")
  assert "out of retries" in caplog.text


def test_quieted_drops_only_googles_python_support_notice():
  # On Python 3.10, importing gcsfs' google.api_core printed this to stderr
  # for every gs:// command. The date puts any Python past its support.
  support = pytest.importorskip("google.api_core._python_version_support")
  later = datetime.date(2200, 1, 1)
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    with library_logs.quieted():
      support.check_python_version("google.api_core", today=later)
      warnings.warn("another library's", FutureWarning)
    support.check_python_version("google.api_core", today=later)
  assert [(w.category, str(w.message)[:45]) for w in seen] == [
      (FutureWarning, "another library's"),
      (FutureWarning, "You are using a non-supported Python version ")]


class _CallsLoopOnDeath:
  """Reports an unraisable exception when collected, as a callback would."""

  def __init__(self, loop, error=None):
    self.loop, self.error = loop, error

  def __del__(self):
    if self.error is not None:
      raise self.error
    self.loop.call_soon_threadsafe(print)


def test_only_callbacks_finding_their_loop_closed_are_dropped(monkeypatch):
  import asyncio  # pylint: disable=g-import-not-at-top
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", seen.append)
  monkeypatch.setattr(library_logs, "_closed_loop_filter_installed", False)
  loop = asyncio.new_event_loop()
  loop.close()
  _CallsLoopOnDeath(loop)                        # before: reported
  assert [str(u.exc_value) for u in seen] == ["Event loop is closed"]
  library_logs.drop_closed_loop_callbacks()
  library_logs.drop_closed_loop_callbacks()      # once, however often called
  _CallsLoopOnDeath(loop)                        # dropped
  _CallsLoopOnDeath(loop, RuntimeError("Event loop is closed"))  # not a loop's
  _CallsLoopOnDeath(loop, ValueError("other"))
  assert [str(u.exc_value) for u in seen] == [
      "Event loop is closed", "Event loop is closed", "other"]
