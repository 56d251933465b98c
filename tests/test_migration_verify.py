"""Tests for clu_ckpt.migration.verify: a step against its source, hosts
against each other, as `migrate` uses them."""

import numpy as np
import orbax.checkpoint as ocp

from clu_ckpt import flax_format
from clu_ckpt import migration
from migration_helpers import clu_save
from migration_helpers import example_state
from migration_helpers import multihost_save
from migration_helpers import orbax_restore


def test_multihost_hosts_that_differ_need_a_choice(tmp_path):
  base = tmp_path / "src" / "ckpts"
  multihost_save(base, [[example_state(1)], [example_state(1, scale=2.0)]])
  summary = migration.migrate(str(base), str(tmp_path / "dst"))
  assert not summary.ok
  error = summary.steps[0].error
  assert "hosts 0 and 1" in error and "/params" in error
  assert "--state-host" in error
  with ocp.CheckpointManager(tmp_path / "dst") as mngr:
    assert list(mngr.all_steps()) == []

  summary = migration.migrate(str(base), str(tmp_path / "dst"), state_host=1)
  assert summary.ok
  restored = orbax_restore(tmp_path / "dst", 1)
  np.testing.assert_array_equal(restored["state"]["params"]["w"],
                                example_state(1, scale=2.0)["params"]["w"])
  assert restored["metadata"]["state_host"] == 1
  assert sorted(restored["dataset"]) == ["process_0", "process_1"]


def test_verify_catches_a_difference(tmp_path):
  clu_save(tmp_path / "src", [example_state(1)])
  assert migration.migrate(str(tmp_path / "src"), str(tmp_path / "dst")).ok
  # Change one array's bytes in the source after the migration.
  flax = tmp_path / "src" / "ckpt-1.flax"
  leaf = next(l for l in flax_format.inspect_file(str(flax))
              if l.path == "/params/w")
  raw = bytearray(flax.read_bytes())
  raw[leaf.offset] ^= 0x01
  flax.write_bytes(bytes(raw))
  summary = migration.migrate(str(tmp_path / "src"), str(tmp_path / "dst"),
                              verify=True)
  assert summary.steps[0].status == "failed"
  assert "/params/w differs" in summary.steps[0].error
