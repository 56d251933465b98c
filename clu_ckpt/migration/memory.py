"""Keeping a migration's memory small while TensorStore writes arrays.

The bounded numpy handler of `orbax_target` admits arrays through a
`ByteBudget` (at most so many bytes handed to TensorStore at once), asks the
kernel to read memory-mapped arrays ahead of their writing (`Prefetcher`),
copies the arrays TensorStore would copy into buffers it reuses
(`AlignedStaging`), and gives freed heap back to the system as it goes
(`MemoryTrimmer`).

Why `AlignedStaging`: a `.flax` file's arrays are views of its memory map at
whatever offset msgpack put them, so most are not aligned to their item
size. TensorStore takes an aligned array as it is, but converts an unaligned
one with numpy first: a fresh allocation of the array's size, its pages
zeroed by the kernel, then a copy, in the thread that calls `write` (the
save's event loop), for every such array. Profiled on a 2 GiB migration
(`perf record`, zstd, 2 cores), the zeroing alone was 11 % of the CPU time.
Copying into a few reused aligned buffers leaves the copy and drops the
allocation and the zeroing; the copy runs in a worker thread (numpy releases
the GIL), beside the loop. The migration stages for uncompressed writes only:
with zstd the whole process was faster without it in the same quiet run
(`migration.orbax_target._bounded_numpy_handler` has the figures).

Synopsis::

  from clu_ckpt.migration import memory

  budget = memory.ByteBudget(128 * 2**20)
  await budget.acquire(arr.nbytes)      # in the writer's event loop
  ...                                   # write arr
  await budget.release(arr.nbytes)

  staging = memory.AlignedStaging(256 * 2**20)
  aligned = await staging.stage(arr)    # arr itself when already aligned
  await tensorstore_write(aligned)      # TensorStore keeps no copy of it
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any, Callable, Optional, Sequence

import numpy as np

# Arrays smaller than this are left to TensorStore: its copy costs little.
MIN_STAGED_BYTES = 1 << 20
# Buffers are allocated in multiples of this (a huge page), so that one
# serves arrays of similar sizes.
_STAGING_GRANULE = 2 << 20

class Prefetcher:
  """Asks the kernel to read memory-mapped arrays ahead of their writing.

  With a cold page cache, TensorStore's threads would otherwise fault the
  file in page by page. Reading ahead is bounded (`window` bytes beyond the
  array being admitted) and goes to the page cache, not to process memory.
  """

  def __init__(self, values: Sequence[Any], window: int):
    self._values = values
    self._window = window
    self._next = 0  # First array not yet prefetched.
    self._ahead = 0  # Bytes prefetched beyond the current array.

  def up_to(self, current: int) -> None:
    if current < self._next:
      self._ahead -= self._values[current].nbytes
    else:
      self._next = current
      self._ahead = 0
    while self._next < len(self._values) and self._ahead < self._window:
      value = self._values[self._next]
      will_need(value)
      if self._next > current:
        self._ahead += value.nbytes
      self._next += 1


def will_need(arr: Any) -> None:
  """madvise(WILLNEED) for an array that is a view of an `mmap`."""
  import mmap  # pylint: disable=g-import-not-at-top
  base = arr
  while base is not None and not isinstance(base, mmap.mmap):
    base = base.obj if isinstance(base, memoryview) else getattr(
        base, "base", None)
  if base is None or not hasattr(base, "madvise") or not arr.nbytes:
    return
  try:
    start = (arr.__array_interface__["data"][0] -
             np.frombuffer(base, np.uint8).__array_interface__["data"][0])
    aligned = start - start % mmap.PAGESIZE
    base.madvise(mmap.MADV_WILLNEED, aligned, arr.nbytes + start - aligned)
  except (ValueError, OSError, AttributeError):
    pass  # Only a hint.


class MemoryTrimmer:
  """Returns freed heap memory to the OS every `interval` bytes written.

  TensorStore's compression buffers are allocated and freed from many
  threads; glibc keeps the freed memory in per-thread arenas, so without
  `malloc_trim` the resident memory creeps up with the bytes written.
  """

  def __init__(self, interval: int):
    self._interval = interval
    self._pending = 0
    self._trim = malloc_trim()

  def written(self, n: int) -> None:
    self._pending += n
    if self._trim is not None and self._pending >= self._interval:
      self._pending = 0
      self._trim(0)


def malloc_trim() -> Optional[Callable[[int], int]]:
  try:
    import ctypes  # pylint: disable=g-import-not-at-top
    return ctypes.CDLL("libc.so.6").malloc_trim
  except (OSError, AttributeError):
    return None  # Not glibc.


class ByteBudget:
  """Admits work while fewer than `limit` bytes are in flight."""

  def __init__(self, limit: int):
    self._limit = limit
    self._used = 0
    self._cond = asyncio.Condition()

  async def acquire(self, n: int) -> None:
    async with self._cond:
      await self._cond.wait_for(
          lambda: self._used == 0 or self._used + n <= self._limit)
      self._used += n

  async def release(self, n: int) -> None:
    async with self._cond:
      self._used -= n
      self._cond.notify_all()



class AlignedStaging:
  """Aligned copies of unaligned arrays, in buffers reused once free.

  A buffer is free when nothing but the pool refers to it: TensorStore
  holds the array it is given (`can_reference_source_data_indefinitely`)
  until it no longer needs it, and that array is a view of the buffer. Free
  buffers are reused; the pool keeps at most `limit` bytes of buffers, so
  that a TensorStore that held on to every array would get new ones (and
  the pool would not grow past `limit` with them).
  """

  def __init__(self, limit: int):
    self._limit = limit
    self._pool: list[np.ndarray] = []  # Sorted by size.
    self.staged_bytes = 0  # Bytes copied (for tests and diagnosis).
    self.allocated_bytes = 0  # Bytes of buffers allocated.
    # What `_refs` counts for a buffer only the pool refers to, measured
    # the same way (the count depends on the interpreter).
    self._pool.append(np.empty(1, np.uint8))
    self._free_refs = self._refs(0)
    self._pool.clear()

  def _refs(self, i: int) -> int:
    return sys.getrefcount(self._pool[i])

  @staticmethod
  def needs_staging(arr: Any) -> bool:
    """Whether TensorStore would copy `arr` (a large unaligned array)."""
    return (isinstance(arr, np.ndarray) and arr.nbytes >= MIN_STAGED_BYTES
            and not arr.flags.aligned and arr.flags.c_contiguous)

  async def stage(self, arr: Any) -> Any:
    """`arr`, or an aligned copy of it when TensorStore would copy it.

    The copy is a view of a pooled buffer: the buffer is not reused while
    the copy (or any view of it) is alive.
    """
    if not self.needs_staging(arr):
      return arr
    buffer = self._take(arr.nbytes)
    target = buffer[:arr.nbytes]
    del buffer
    await asyncio.to_thread(np.copyto, target, _bytes_of(arr))
    self.staged_bytes += arr.nbytes
    return target.view(arr.dtype).reshape(arr.shape)

  def _take(self, nbytes: int) -> np.ndarray:
    """The smallest free buffer of at least `nbytes`, or a new one."""
    for i in range(len(self._pool)):
      if self._pool[i].nbytes >= nbytes and self._refs(i) <= self._free_refs:
        return self._pool[i]
    size = -(-nbytes // _STAGING_GRANULE) * _STAGING_GRANULE
    buffer = np.empty(size, np.uint8)
    self.allocated_bytes += size
    if size > self._limit:
      return buffer  # never pooled: the pool keeps what it holds
    pooled = sum(b.nbytes for b in self._pool)
    while self._pool and pooled + size > self._limit:
      # Make room: the pool lets go of its smallest buffers (one still in
      # use is freed by its last user).
      pooled -= self._pool.pop(0).nbytes
    if pooled + size <= self._limit:
      self._pool.append(buffer)
      self._pool.sort(key=lambda b: b.nbytes)
    return buffer


def _bytes_of(arr: np.ndarray) -> np.ndarray:
  """The bytes of a C-contiguous array, as a flat uint8 view."""
  return arr.reshape(-1).view(np.uint8)
