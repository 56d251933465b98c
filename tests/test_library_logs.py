"""Tests of clu_ckpt.library_logs: the libraries stay quiet unless asked."""

import logging
import sys

from absl import logging as absl_logging

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
