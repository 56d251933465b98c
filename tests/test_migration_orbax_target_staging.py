"""Tests of the aligned staging of unaligned arrays (`memory.AlignedStaging`,
used by `orbax_target`'s bounded numpy handler): what TensorStore gets, that
a buffer is never reused while an array in it is alive, and that a migrated
state still restores bit-exactly through stock Orbax."""

import asyncio
import mmap

import flax.serialization
import numpy as np
import orbax.checkpoint as ocp
import pytest
from clu import checkpoint as clu_checkpoint

from clu_ckpt import flax_format
from clu_ckpt import migration
from clu_ckpt.migration import memory
from clu_ckpt.migration import orbax_target

_MIB = 2**20


def _unaligned(nbytes, dtype=np.float32, seed=0):
  """A read-only, unaligned array view of an anonymous map, as `.flax`
  arrays are views of the file's map."""
  itemsize = np.dtype(dtype).itemsize
  data = np.random.default_rng(seed).integers(
      0, 256, nbytes + 1, dtype=np.uint8)
  region = mmap.mmap(-1, nbytes + 1)
  region[:] = data.tobytes()
  arr = np.ndarray((nbytes // itemsize,), dtype, buffer=region, offset=1)
  assert not arr.flags.aligned
  return arr


def _stage(staging, arr):
  return asyncio.run(staging.stage(arr))


def test_only_large_unaligned_arrays_are_staged():
  staging = memory.AlignedStaging(8 * _MIB)
  aligned = np.arange(_MIB, dtype=np.float32)
  assert _stage(staging, aligned) is aligned
  small = _unaligned(memory.MIN_STAGED_BYTES // 2)
  assert _stage(staging, small) is small
  big = _unaligned(2 * _MIB)
  staged = _stage(staging, big)
  assert staged is not big and staged.flags.aligned
  assert staged.dtype == big.dtype and staged.shape == big.shape
  assert staged.tobytes() == big.tobytes()
  assert staging.staged_bytes == big.nbytes


def test_a_buffer_is_reused_only_once_nothing_refers_to_it():
  staging = memory.AlignedStaging(64 * _MIB)
  a, b, c = (_unaligned(3 * _MIB, seed=s) for s in range(3))
  first = _stage(staging, a)
  second = _stage(staging, b)  # `first` is alive: another buffer
  assert not np.shares_memory(first, second)
  assert first.tobytes() == a.tobytes() and second.tobytes() == b.tobytes()
  address = first.__array_interface__["data"][0]
  del first
  third = _stage(staging, c)  # the first buffer is free again
  assert third.__array_interface__["data"][0] == address
  assert third.tobytes() == c.tobytes() and second.tobytes() == b.tobytes()
  assert staging.allocated_bytes == 2 * 4 * _MIB  # 3 MiB -> 4 MiB buffers


def test_the_pool_keeps_at_most_its_limit():
  staging = memory.AlignedStaging(8 * _MIB)
  held = [_stage(staging, _unaligned(3 * _MIB, seed=s)) for s in range(5)]
  assert sum(b.nbytes for b in staging._pool) <= 8 * _MIB
  for arr, seed in zip(held, range(5)):
    assert arr.tobytes() == _unaligned(3 * _MIB, seed=seed).tobytes()


def test_an_array_larger_than_the_pool_leaves_the_pool_as_it_was():
  staging = memory.AlignedStaging(8 * _MIB)
  first = _stage(staging, _unaligned(3 * _MIB))
  del first
  _stage(staging, _unaligned(10 * _MIB, seed=1))  # over the limit
  assert [b.nbytes for b in staging._pool] == [4 * _MIB]
  before = staging.allocated_bytes
  _stage(staging, _unaligned(3 * _MIB, seed=2))  # reuses the 4 MiB buffer
  assert staging.allocated_bytes == before


def test_staging_bytes_follow_the_window():
  assert orbax_target.staging_bytes(128 * _MIB) == 192 * _MIB


def _arrays(tree, prefix=()):
  if isinstance(tree, dict):
    return {p: v for k, sub in tree.items()
            for p, v in _arrays(sub, prefix + (k,)).items()}
  if isinstance(tree, np.ndarray) and tree.ndim:
    return {prefix: tree}
  return {}


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_staged_arrays_restore_bit_exactly_through_stock_orbax(
    tmp_path, monkeypatch, compression):
  seen = []

  class Recording(memory.AlignedStaging):

    def __init__(self, limit):
      super().__init__(limit)
      seen.append(self)

  monkeypatch.setattr(memory, "AlignedStaging", Recording)
  rng = np.random.default_rng(7)
  layers = {f"layer_{i}{'x' * i}": {
      "kernel": rng.standard_normal(300_000 + i, dtype=np.float32),
      "moment": rng.standard_normal(600_001 + i).astype(np.float16)}
            for i in range(6)}
  src = tmp_path / "src"
  clu_checkpoint.Checkpoint(str(src)).save({"step": 3, "params": layers})
  flax_file = src / "ckpt-1.flax"
  with flax_format.FlaxFile(str(flax_file)) as f:
    unaligned = [v for v in _arrays(f.tree).values()
                 if memory.AlignedStaging.needs_staging(v)]
  assert len(unaligned) >= 4  # the test exercises the staging
  # A small window: buffers are reused across arrays.
  summary = migration.migrate(str(src), str(tmp_path / "dst"),
                              compression=compression,
                              inflight_bytes=3 * _MIB, verify=True)
  assert summary.ok, summary.failed
  if compression == "zstd":
    # TensorStore compresses from the array as it is: no staging copy.
    assert not seen
  else:
    assert sum(s.staged_bytes for s in seen) == sum(
        v.nbytes for v in unaligned)
    assert sum(s.allocated_bytes for s in seen) < sum(
        s.staged_bytes for s in seen)
  want = _arrays(flax.serialization.msgpack_restore(flax_file.read_bytes()))
  with ocp.CheckpointManager(str(tmp_path / "dst")) as mngr:
    got = _arrays(mngr.restore(3, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore()))["state"])
  assert set(got) == set(want)
  for path, value in want.items():
    assert got[path].dtype == value.dtype and got[path].shape == value.shape
    assert got[path].tobytes() == value.tobytes(), path
