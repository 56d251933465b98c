"""The test session reaches nothing but 127.0.0.1, whatever the test order.

`conftest.py` sets the network guard for the whole session before any test
imports Orbax; etils decides once per process whether `gs://` paths go
through TensorFlow (which resolves www.googleapis.com), so a guard set only
by the emulator fixtures came too late after a local Orbax test in the same
process.
"""

import os

import conftest
import emulators


def test_the_network_guard_is_set_for_the_whole_session():
  for key in conftest.NETWORK_GUARD:
    assert os.environ.get(key) == emulators.ENV[key], key


def test_etils_never_sends_bucket_paths_through_tensorflow():
  import orbax.checkpoint  # pylint: disable=g-import-not-at-top,unused-import
  from etils.epath import gpath  # pylint: disable=g-import-not-at-top
  # pylint: disable-next=protected-access
  assert gpath._is_tf_installed() is False
