"""Each Orbax line a user may be stuck on restores a migrated root.

The migration needs orbax-checkpoint >= 0.12.5 (an environment of its own), but
the training job that reads its output may run an older Orbax. The matrix
(noxfile.py) runs this module on Orbax 0.6.4 (the oldest stack), 0.11.24
(the middle one) and 0.12.x, with the call migration/README.md gives for
that line ("Restoring with an older Orbax"):

- 0.11 and later: `ocp.CheckpointManager(root).restore(step)`.
- 0.6: `ocp.CheckpointManager(root, item_names=("state", "dataset"))`
  `.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(),
  dataset=ocp.args.PyTreeRestore()))` (a plain `restore(step)` raises
  ValueError there: it knows no handler for the items).

`tests/data/migrated_tf2.16_flax0.8.5/` is frozen: what `clu-ckpt migrate`
(orbax-checkpoint 0.12.8) wrote from
`../shared/fixtures/old-stacks/tf2.16-flax0.8.5/single_host`, checkpoints
ckpt-2 and ckpt-3 as steps 200 and 300. Where the migration can run, the
module also checks that a fresh migration restores to the same state.

Synopsis::

  python -m pytest -q tests/test_orbax_lines.py
"""

import pathlib
import shutil
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from clu_ckpt import flax_format
from conftest import installed_version
from conftest import orbax_skip_reason

ocp = pytest.importorskip("orbax.checkpoint")

DATA = pathlib.Path(__file__).resolve().parent / "data"
MIGRATED = DATA / "migrated_tf2.16_flax0.8.5"
SOURCE = (pathlib.Path(__file__).resolve().parents[2] / "shared" /
          "fixtures" / "old-stacks" / "tf2.16-flax0.8.5" / "single_host")
# Next batch of `Dataset.range(10000).batch(4)` after each migrated save.
NEXT_BATCH = {200: [16, 17, 18, 19], 300: [24, 25, 26, 27]}


def restore_migrated(root: pathlib.Path, step: int) -> dict[str, Any]:
  """Restores a migrated step's state and dataset items with the call
  migration/README.md gives for the installed Orbax line."""
  if installed_version("orbax-checkpoint") >= (0, 11):
    return ocp.CheckpointManager(str(root)).restore(step)
  manager = ocp.CheckpointManager(str(root), item_names=("state", "dataset"))
  return manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(), dataset=ocp.args.PyTreeRestore()))


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  if isinstance(tree, dict):
    out = {}
    for key, value in tree.items():
      out.update(_flatten(value, f"{prefix}/{key}"))
    return out
  return {prefix: tree}


def _assert_same_values(restored: Any, flax_state: Any) -> None:
  """Stock Orbax gives numpy scalars back as 0-d arrays: same bits."""
  got, want = _flatten(restored), _flatten(flax_state)
  assert sorted(got) == sorted(want)
  for path, leaf in want.items():
    if isinstance(leaf, (np.ndarray, np.generic)):
      arr = np.asarray(got[path])
      assert (arr.dtype, arr.shape) == (leaf.dtype, np.shape(leaf)), path
      assert arr.tobytes() == np.asarray(leaf).tobytes(), path
    else:
      assert type(got[path]) is type(leaf) and got[path] == leaf, path


def _copy(tmp_path: pathlib.Path) -> pathlib.Path:
  root = tmp_path / "migrated"
  shutil.copytree(MIGRATED, root)
  return root


@pytest.mark.parametrize("step", [200, 300])
def test_installed_orbax_restores_a_migrated_root(tmp_path, step):
  if not SOURCE.is_dir():
    pytest.skip(f"old-stack fixture {SOURCE} is not available")
  root = _copy(tmp_path)
  restored = restore_migrated(root, step)
  number = {200: 2, 300: 3}[step]
  _assert_same_values(restored["state"], flax_format.load_file(
      str(SOURCE / f"ckpt-{number}.flax")))
  # The iterator resumes from the dataset item, on this Orbax too.
  from clu_ckpt import orbax_items  # pylint: disable=g-import-not-at-top
  it = iter(tf.data.Dataset.range(10000).batch(4))
  orbax_items.restore_tf_state(dict(ds_iter=it),
                               restored["dataset"]["process_0"])
  assert [int(x) for x in next(it)] == NEXT_BATCH[step]


def test_a_plain_restore_works_from_orbax_0_11_on(tmp_path):
  manager = ocp.CheckpointManager(str(_copy(tmp_path)))
  if installed_version("orbax-checkpoint") >= (0, 11):
    assert sorted(manager.restore(300)) == ["dataset", "metadata", "state"]
  else:  # 0.6: no handler is known for the items without the explicit call
    with pytest.raises(ValueError):
      manager.restore(300)


def test_a_fresh_migration_restores_like_the_frozen_one(tmp_path):
  reason = orbax_skip_reason()
  if reason:
    pytest.skip(reason)
  if not SOURCE.is_dir():
    pytest.skip(f"old-stack fixture {SOURCE} is not available")
  from clu_ckpt import migration  # pylint: disable=g-import-not-at-top
  source = tmp_path / "src"
  shutil.copytree(SOURCE, source, ignore=shutil.ignore_patterns("MANIFEST*"))
  for path in [source, *source.iterdir()]:
    path.chmod(0o755 if path.is_dir() else 0o644)
  assert migration.migrate(str(source), str(tmp_path / "fresh")).ok
  for step in (200, 300):
    fresh = restore_migrated(tmp_path / "fresh", step)
    frozen = restore_migrated(_copy(tmp_path / str(step)), step)
    _assert_same_values(fresh["state"], frozen["state"])
    assert sorted(fresh["dataset"]) == sorted(frozen["dataset"])
