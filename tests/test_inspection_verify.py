"""`verify` never says OK wrongly, on every layout it checks.

Each case breaks one thing a sound checkpoint needs and `verify` must report
it, naming the file: a listed checkpoint whose `.index` is missing (a CLU
directory, a multihost base, the source of a migrated root), extra or
missing leaves in a migrated step (`verify ROOT --source`), hosts whose
states differ in one float's bits (`migrate`'s host comparison).
"""

import numpy as np
import pytest

from clu_ckpt import flax_format
from clu_ckpt import inspection
from clu_ckpt import migration
from migration_helpers import example_state
from migration_helpers import multihost_save


def _problems_naming(result, text):
  assert not result["ok"], result
  return [p for p in result["problems"] if text in p]


def test_a_clu_directory_with_a_listed_index_missing(golden_copy):
  d = golden_copy("single_host")
  assert inspection.verify_path(str(d))["ok"]
  (d / "ckpt-4.index").unlink()
  result = inspection.verify_path(str(d))
  assert _problems_naming(result, str(d / "ckpt-4.index"))


def test_a_multihost_base_with_a_listed_index_missing(golden_copy):
  d = golden_copy("multihost")
  base = d / "checkpoints"
  assert inspection.verify_path(str(base))["ok"]
  victim = sorted((d / "checkpoints-1").glob("ckpt-*.index"))[-1]
  victim.unlink()
  result = inspection.verify_path(str(base))
  assert _problems_naming(result, str(victim))


@pytest.fixture(name="migrated_base")
def migrated_base_fixture(tmp_path):
  base = tmp_path / "mh" / "ckpts"
  multihost_save(base, [[example_state(1), example_state(2)]] * 2)
  assert migration.migrate(str(base), str(tmp_path / "dst")).ok
  root = str(tmp_path / "dst")
  assert inspection.verify_orbax_root(root, str(base))["ok"]
  return base, root


def test_a_migrated_root_whose_source_lost_an_index(migrated_base):
  base, root = migrated_base
  victim = base.parent / "ckpts-1" / "ckpt-2.index"
  victim.unlink()
  result = inspection.verify_orbax_root(root, str(base))
  assert _problems_naming(result, str(victim))


@pytest.mark.parametrize("change", ["fewer_in_source", "more_in_source"])
def test_a_migrated_root_with_other_leaves_than_its_source(migrated_base,
                                                           change):
  base, root = migrated_base
  victim = base.parent / "ckpts-0" / "ckpt-1.flax"
  state = flax_format.load_file(str(victim), writable=True)
  if change == "fewer_in_source":  # the step holds a leaf the source lacks
    state["opt"].pop("flag")
  else:
    state["opt"]["extra"] = np.zeros(2, np.float32)
  flax_format.save_file(state, str(victim))
  result = inspection.verify_orbax_root(root, str(base))
  assert _problems_naming(result, str(victim))


@pytest.mark.parametrize("case", ["negative_zero", "nan_payload"])
def test_hosts_differing_in_float_bits_are_not_the_same(tmp_path, case):
  base = tmp_path / "mh" / "ckpts"
  other = example_state(1)
  if case == "negative_zero":
    other["params"]["w"][0, 0] = np.float32(-0.0)
    zero = example_state(1)
  else:
    zero = example_state(1)
    zero["params"]["w"][0, 0] = np.nan
    other["params"]["w"][0, 0] = np.uint32(0x7FC00001).view(np.float32)
  multihost_save(base, [[zero], [other]])
  summary = migration.migrate(str(base), str(tmp_path / "dst"))
  assert not summary.ok
  assert "hosts 0 and 1" in summary.steps[0].error
  assert "/params/w" in summary.steps[0].error
