"""Tests for `clu_ckpt.state_file` as a module of its own.

The parser's behaviour (against TensorFlow as the oracle) is tested in
tests/test_storage.py through the `storage` re-exports; here: the re-exports
are the same objects, and the module works without TensorFlow.
"""

import subprocess
import sys
import textwrap

from clu_ckpt import errors
from clu_ckpt import layout
from clu_ckpt import state_file
from clu_ckpt import storage


def test_layout_re_exports_the_state_file_names():
  for name in ("CheckpointState", "read_checkpoint_state", "STATE_FILENAME"):
    assert getattr(layout, name) is getattr(state_file, name), name
  assert state_file.CheckpointStateError is errors.CheckpointStateError
  assert storage.CheckpointStateError is errors.CheckpointStateError


def test_reads_without_tensorflow(tmp_path):
  (tmp_path / "checkpoint").write_text(
      'model_checkpoint_path: "ckpt-3"\n'
      'all_model_checkpoint_paths: ["ckpt-2", "ckpt-3"]\n'
      "all_model_checkpoint_timestamps: [1.5, 2.5]\n"
      "last_preserved_timestamp: 1.0\n")
  code = textwrap.dedent("""
    import sys

    class NoTensorFlow:
      def find_spec(self, name, path=None, target=None):
        if name == "tensorflow" or name.startswith("tensorflow."):
          raise ImportError("blocked: " + name)

    sys.meta_path.insert(0, NoTensorFlow())
    from clu_ckpt import state_file
    state = state_file.read_checkpoint_state(sys.argv[1])
    print(state.model_checkpoint_path, len(state.managed_checkpoints(now=3)))
    assert not any(m.startswith("tensorflow") for m in sys.modules)
  """)
  out = subprocess.run([sys.executable, "-c", code, str(tmp_path)],
                       capture_output=True, text=True, check=True).stdout
  assert out.split() == [f"{tmp_path}/ckpt-3", "2"]


def test_file_url_and_missing_directory(tmp_path):
  (tmp_path / "checkpoint").write_text('model_checkpoint_path: "c-1"\n')
  state = state_file.read_checkpoint_state(f"file://{tmp_path}")
  assert state.model_checkpoint_path == f"file://{tmp_path}/c-1"
  assert state_file.read_checkpoint_state(str(tmp_path / "absent")) is None
