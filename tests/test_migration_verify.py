"""Tests for clu_ckpt.migration.verify: a step against its source, hosts
against each other, as `migrate` uses them."""

import copy
import dataclasses
import re
import shutil
import struct

from clu import checkpoint as clu_checkpoint
import numpy as np
import orbax.checkpoint as ocp
import pytest

from clu_ckpt import errors
from clu_ckpt import flax_format
from clu_ckpt import migration
from clu_ckpt.migration import orbax_target
from clu_ckpt.migration import plan
from clu_ckpt.migration import verify
from migration_helpers import clu_save
from migration_helpers import dataset_iterator
from migration_helpers import example_state
from migration_helpers import multihost_save
from migration_helpers import orbax_restore


def test_multihost_hosts_that_differ_need_a_choice(tmp_path):
  base = tmp_path / "src" / "ckpts"
  multihost_save(base, [[example_state(1)], [example_state(1, scale=2.0)]])
  summary = migration.migrate(str(base), str(tmp_path / "dst"))
  assert not summary.ok
  error = summary.steps[0].error
  assert "hosts 0 and 1" in error
  assert re.search(r"\(first difference at /params/\w+: \S+/ckpts-0/ckpt-1.flax "
                   r"vs \S+/ckpts-1/ckpt-1.flax\)", error), error
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


# --------------------------------------------------------------------------
# verify never says OK wrongly: each case changes the source after a
# migration and `verify_step` must name the difference (bit-exact floats,
# the dataset item, extra leaves).
# --------------------------------------------------------------------------

_QUIET_NAN = np.float32(np.nan).view(np.uint32)


def _special_state(step):
  return {
      "step": np.int64(step),
      "params": {"w": np.array([0.0, 1.0, np.nan], np.float32)},
      "lr": 0.0,
      "decay": float("nan"),
  }


@pytest.fixture(scope="module")
def migrated_special(tmp_path_factory):
  """A two-checkpoint source (iterator advanced between) and its migration."""
  top = tmp_path_factory.mktemp("special")
  it = dataset_iterator()
  ckpt = clu_checkpoint.Checkpoint(str(top / "src"), dict(ds=it))
  ckpt.save(_special_state(1))
  next(it)
  ckpt.save(_special_state(2))
  summary = migration.migrate(str(top / "src"), str(top / "dst"), verify=True)
  assert summary.ok, summary
  return top


def _copy_migrated(top, tmp_path):
  shutil.copytree(top / "src", tmp_path / "src")
  shutil.copytree(top / "dst", tmp_path / "dst")
  source = plan.discover(str(tmp_path / "src"))
  (first, second) = source.checkpoints
  steps = orbax_target.OrbaxTarget(str(tmp_path / "dst")).steps()
  return first, second, sorted(steps)


def _rewrite_source(tmp_path, change):
  path = str(tmp_path / "src" / "ckpt-1.flax")
  state = flax_format.load_file(path, writable=True)
  change(state)
  flax_format.save_file(state, path)


def _nan_with_payload(payload):
  return np.uint32(_QUIET_NAN | payload).view(np.float32)


def test_verify_step_passes_an_unchanged_source(migrated_special, tmp_path):
  first, second, steps = _copy_migrated(migrated_special, tmp_path)
  verify.verify_step(str(tmp_path / "dst"), steps[0], first, host=0)
  verify.verify_step(str(tmp_path / "dst"), steps[1], second, host=0)


@pytest.mark.parametrize("case", [
    "negative_zero_array", "nan_payload_array", "negative_zero_float",
    "nan_payload_float"])
def test_verify_step_compares_float_bits(migrated_special, tmp_path, case):
  first, _, steps = _copy_migrated(migrated_special, tmp_path)

  def change(state):
    w = state["params"]["w"]
    if case == "negative_zero_array":
      w[0] = np.float32(-0.0)
    elif case == "nan_payload_array":
      w[2] = _nan_with_payload(1)
    elif case == "negative_zero_float":
      state["lr"] = -0.0
    else:
      state["decay"] = struct.unpack(
          "<d", struct.pack("<Q", 0x7FF8000000000001))[0]

  _rewrite_source(tmp_path, change)
  leaf = "/params/w" if case.endswith("array") else (
      "/lr" if "zero" in case else "/decay")
  with pytest.raises(errors.VerificationError, match=f"{leaf} differs"):
    verify.verify_step(str(tmp_path / "dst"), steps[0], first, host=0)


def test_verify_step_compares_the_dataset(migrated_special, tmp_path):
  first, _, steps = _copy_migrated(migrated_special, tmp_path)
  # Checkpoint 1's TensorFlow files replaced by checkpoint 2's: the
  # iterator one element further on.
  src = tmp_path / "src"
  for suffix in (".index", ".data-00000-of-00001"):
    shutil.copyfile(src / f"ckpt-2{suffix}", src / f"ckpt-1{suffix}")
  with pytest.raises(errors.VerificationError, match="dataset/process_0 "
                     "differs"):
    verify.verify_step(str(tmp_path / "dst"), steps[0], first, host=0)


def test_verify_step_names_a_leaf_missing_from_the_step(migrated_special,
                                                       tmp_path):
  first, _, steps = _copy_migrated(migrated_special, tmp_path)
  _rewrite_source(tmp_path, lambda state: state.update(momentum=0.5))
  with pytest.raises(errors.VerificationError,
                     match="does not hold the same leaves as .*: /momentum$"):
    verify.verify_step(str(tmp_path / "dst"), steps[0], first, host=0)


def test_verify_step_of_a_step_orbax_does_not_list(migrated_special, tmp_path):
  first, _, steps = _copy_migrated(migrated_special, tmp_path)
  with pytest.raises(errors.VerificationError,
                     match=f"Orbax does not list step {max(steps) + 1} in "):
    verify.verify_step(str(tmp_path / "dst"), max(steps) + 1, first, host=0)


def test_verify_step_of_a_step_that_cannot_be_read_back(migrated_special,
                                                       tmp_path):
  first, _, steps = _copy_migrated(migrated_special, tmp_path)
  for chunk in (tmp_path / "dst" / str(steps[0]) / "state").glob("**/d/*"):
    chunk.unlink()
  with pytest.raises(errors.VerificationError) as raised:
    verify.verify_step(str(tmp_path / "dst"), steps[0], first, host=0)
  cause = raised.value.__cause__
  assert cause is not None
  first_line = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
  assert str(raised.value) == (
      f"verify: step {steps[0]} cannot be read back: {first_line}")


def test_verify_step_notices_a_dataset_the_source_lacks(migrated_special,
                                                        tmp_path):
  first, _, steps = _copy_migrated(migrated_special, tmp_path)
  for suffix in (".index", ".data-00000-of-00001"):
    (tmp_path / "src" / f"ckpt-1{suffix}").unlink()
  with pytest.raises(errors.VerificationError,
                     match=f"step {steps[0]} has an unexpected dataset"):
    verify.verify_step(str(tmp_path / "dst"), steps[0], first, host=0)


def test_verify_step_notices_a_host_missing_from_the_dataset(migrated_special,
                                                             tmp_path):
  # The source as two hosts (the second one's TensorFlow files those of
  # checkpoint 2); the step holds one host's iterator only.
  first, second, steps = _copy_migrated(migrated_special, tmp_path)
  two_hosts = dataclasses.replace(
      first, prefixes={0: first.prefixes[0], 1: second.prefixes[0]})
  with pytest.raises(errors.VerificationError,
                     match="dataset/process_1 differs"):
    verify.verify_step(str(tmp_path / "dst"), steps[0], two_hosts, host=0)


def test_verify_step_notices_extra_leaves_in_the_step(migrated_special,
                                                      tmp_path):
  first, _, steps = _copy_migrated(migrated_special, tmp_path)
  _rewrite_source(tmp_path, lambda state: state.pop("decay"))
  with pytest.raises(errors.VerificationError) as raised:
    verify.verify_step(str(tmp_path / "dst"), steps[0], first, host=0)
  assert str(raised.value) == (
      f"verify: step {steps[0]} does not hold the same leaves as "
      f"{first.flax_path(0)}: (extra leaves)")


class _FailingTarget(orbax_target.OrbaxTarget):
  """An Orbax root one of whose reads fails (the `Target` seam)."""

  def __init__(self, root, failing, error):
    super().__init__(root)
    self._failing, self._error = failing, error

  def _fail(self, name, real, *args):
    if name == self._failing:
      raise self._error
    return real(*args)

  def read_metadata(self, step):
    return self._fail("read_metadata", super().read_metadata, step)

  def state_layout(self, step):
    return self._fail("state_layout", super().state_layout, step)

  def restore_dataset(self, step):
    return self._fail("restore_dataset", super().restore_dataset, step)


@pytest.mark.parametrize("failing", [
    "read_metadata", "state_layout", "restore_dataset"])
def test_every_read_back_that_fails_names_the_step(migrated_special,
                                                   tmp_path, failing):
  first, _, steps = _copy_migrated(migrated_special, tmp_path)
  target = _FailingTarget(str(tmp_path / "dst"), failing,
                          OSError("the store said no\nsecond line"))
  with pytest.raises(errors.VerificationError) as raised:
    verify.verify_step(target, steps[0], first, host=0)
  assert str(raised.value) == (
      f"verify: step {steps[0]} cannot be read back: the store said no")
  assert isinstance(raised.value.__cause__, OSError)
  # An error without a text is named by its type.
  target = _FailingTarget(str(tmp_path / "dst"), failing, KeyError())
  with pytest.raises(errors.VerificationError) as raised:
    verify.verify_step(target, steps[0], first, host=0)
  assert str(raised.value) == (
      f"verify: step {steps[0]} cannot be read back: KeyError")


def test_a_step_without_a_metadata_item_is_still_compared(tmp_path):
  """Arrays only (no stand-ins to undo): compared as they are stored."""
  clu_save(tmp_path / "src", [{"params": {"w": np.arange(6, dtype=np.float32),
                                          "b": np.ones(2, np.int32)}}])
  assert migration.migrate(str(tmp_path / "src"), str(tmp_path / "dst")).ok
  (ckpt,) = plan.discover(str(tmp_path / "src")).checkpoints
  target = orbax_target.OrbaxTarget(str(tmp_path / "dst"))
  (step,) = target.steps()
  shutil.rmtree(tmp_path / "dst" / str(step) / "metadata")
  assert target.read_metadata(step) == {}
  verify.verify_step(target, step, ckpt, host=0)
  _rewrite_source(tmp_path, lambda state: state["params"]["w"].__setitem__(
      1, np.float32(2.0)))
  with pytest.raises(errors.VerificationError, match="/params/w differs"):
    verify.verify_step(target, step, ckpt, host=0)


def _two_hosts(tmp_path, host0, host1):
  prefixes = {}
  for host, state in enumerate((host0, host1)):
    directory = tmp_path / f"ckpts-{host}"
    directory.mkdir()
    flax_format.save_file(state, str(directory / "ckpt-1.flax"))
    prefixes[host] = str(directory / "ckpt-1")
  return plan.SourceCheckpoint(number=1, prefixes=prefixes)


@pytest.mark.parametrize("host1, where", [
    ({"a": {"b": np.float32(1)}, "c": 1.0}, "/"),  # an extra key at the top
    ({"a": {"b": np.float32(1), "x": 2}}, "/a"),  # an extra key below
    ({"a": 1.0}, "/a"),  # a dict on one host, a leaf on the other
    ({"a": {"b": np.float32(2)}}, "/a/b"),
])
def test_hosts_first_difference_is_named_whole(tmp_path, host1, where):
  ckpt = _two_hosts(tmp_path, {"a": {"b": np.float32(1)}}, host1)
  a, b = ckpt.flax_path(0), ckpt.flax_path(1)
  for source in (None, flax_format.FlaxFile(a)):
    try:
      with pytest.raises(errors.MigrationError) as raised:
        verify.compare_hosts(ckpt, 0, 1, source)
    finally:
      if source is not None:
        source.close()
    assert str(raised.value) == (
        f"ckpt-1: hosts 0 and 1 hold different states (first difference at "
        f"{where}: {a} vs {b}); pass --state-host to take the state from one "
        "host")
  # Either way round.
  with pytest.raises(errors.MigrationError, match=f"at {where}: {b} vs {a}"):
    verify.compare_hosts(ckpt, 1, 0)


def test_hosts_with_the_same_state_in_other_bytes_are_the_same(tmp_path):
  # The same tree written in another key order: other bytes, same state.
  ckpt = _two_hosts(tmp_path, {"a": np.float32(1), "b": 2.0},
                    {"b": 2.0, "a": np.float32(1)})
  assert not verify._same_bytes(ckpt.flax_path(0), ckpt.flax_path(1))  # pylint: disable=protected-access
  verify.compare_hosts(ckpt, 0, 1)


def test_same_leaf_is_bit_exact():
  assert verify.same_leaf(np.float32(0.0), np.float32(0.0))
  assert not verify.same_leaf(np.float32(0.0), np.float32(-0.0))
  assert not verify.same_leaf(0.0, -0.0)
  assert not verify.same_leaf(np.array([np.nan], np.float32),
                              np.array([_nan_with_payload(1)], np.float32))
  assert verify.same_leaf(np.array([np.nan]), np.array([np.nan]))
  assert not verify.same_leaf(np.float32(1), np.float64(1))
  assert not verify.same_leaf(np.zeros((2, 1)), np.zeros((1, 2)))
  assert not verify.same_leaf(1, 1.0)
  assert not verify.same_leaf(complex(0.0, 0.0), complex(0.0, -0.0))
  assert not verify.same_leaf([0.0], [-0.0])
  assert not verify.same_leaf([0.0], [0.0, 0.0])
  assert not verify.same_leaf({"a": 1, "b": 2}, {"b": 2, "a": 1})


def test_hosts_files_are_the_same_bytes_only_when_every_byte_is(
    tmp_path, monkeypatch):
  # The byte comparison that lets two hosts' `.flax` files skip decoding:
  # a size difference, or one bit anywhere (first byte, a later block, a
  # float64's sign), makes them different.
  monkeypatch.setattr(verify, "_COMPARE_BLOCK", 16)
  data = bytes(range(64))
  a = tmp_path / "a"
  a.write_bytes(data)
  b = tmp_path / "b"
  b.write_bytes(data)
  assert verify._same_bytes(str(a), str(b))
  changes = [data + b"\0", bytes([1]) + data[1:], data[:63] + bytes([0]),
             bytes(8) + bytes([0] * 7 + [0x80]) + data[16:]]
  for first, second in [(data, changes[0]), (data, changes[1]),
                        (data, changes[2]),
                        (bytes(16) + data[16:], changes[3])]:
    a.write_bytes(first)
    b.write_bytes(second)
    assert not verify._same_bytes(str(a), str(b)), second


def test_same_leaf_says_same_only_of_equal_leaves():
  # Equal leaves of every kind are the same; one differing bit or value in
  # them is not.
  for x, y in [(complex(1.5, -2.0), complex(1.5, -2.5)),
               ([1.0, np.float32(2)], [1.0, np.float32(3)]),
               ((1, "a"), (1, "b")),
               ({"a": [1.0], "b": 2}, {"a": [1.5], "b": 2}),
               (7, 8), ("s", "t"), (b"x", b"y"), (True, False),
               (np.arange(6, dtype=np.int32).reshape(2, 3),
                np.arange(1, 7, dtype=np.int32).reshape(2, 3))]:
    assert verify.same_leaf(x, copy.deepcopy(x)), x
    assert not verify.same_leaf(x, y), (x, y)
  assert verify.same_leaf(None, None)
