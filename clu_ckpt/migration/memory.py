"""Keeping a migration's memory small while TensorStore writes arrays.

The bounded numpy handler of `orbax_target` admits arrays through a
`ByteBudget` (at most so many bytes handed to TensorStore at once), asks the
kernel to read memory-mapped arrays ahead of their writing (`Prefetcher`),
and gives freed heap back to the system as it goes (`MemoryTrimmer`).

Synopsis::

  from clu_ckpt.migration import memory

  budget = memory.ByteBudget(128 * 2**20)
  await budget.acquire(arr.nbytes)      # in the writer's event loop
  ...                                   # write arr
  await budget.release(arr.nbytes)
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Optional, Sequence

import numpy as np

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

