"""A recording instrument for the local file-system seam's durability order.

`FsRecorder(root).install(monkeypatch)` wraps the `os` calls the local back
end makes (`write`, `fsync`, `replace`, `rename`, `link`, `remove`, `unlink`)
and records, in call order, those that touch a path under `root`, each with
the path it acted on (an fd's path is read from `/proc/self/fd`). Tests mark
points of their own with `mark(name)`, e.g. around TensorFlow's commit, which
writes from C++ and is not seen here. The `assert_*` helpers state the
durability contract (docs/CONTRACTS.md, "Durability") on a recording.

Synopsis::

  rec = FsRecorder(tmp_path)
  rec.install(monkeypatch)
  ... save ...
  rec.assert_every_rename_durable()
  rec.assert_synced_before(tmp_path / "checkpoint", first_removal_index)
"""

from __future__ import annotations

import os
import pathlib
import threading
from typing import Any, Iterable, Optional

_CALLS = ("write", "fsync", "fdatasync", "replace", "rename", "link", "remove",
          "unlink")


class FsRecorder:
  """Records the local seam's writes, syncs, renames and removals under a root.

  `events` is a list of tuples: `("write", path)`, `("fsync", path)`,
  `("rename", src, dst)` (also for `os.replace`), `("link", src, dst)`,
  `("remove", path)` and `("mark", name)`.
  """

  def __init__(self, root: Any):
    self.root = os.path.realpath(os.fspath(root))
    self.events: list[tuple] = []
    self._lock = threading.Lock()

  # -- recording -----------------------------------------------------------

  def _inside(self, path: Optional[str]) -> bool:
    return path is not None and (path == self.root or
                                 path.startswith(self.root + os.sep))

  def _add(self, event: tuple) -> None:
    if any(self._inside(p) for p in event[1:]):
      with self._lock:
        self.events.append(event)

  def mark(self, name: str) -> None:
    """Records a point of the test's own (always kept)."""
    with self._lock:
      self.events.append(("mark", name))

  def install(self, monkeypatch: Any) -> "FsRecorder":
    """Wraps the `os` calls through `monkeypatch` (undone after the test)."""
    real = {name: getattr(os, name) for name in _CALLS}

    def fd_path(fd: int) -> Optional[str]:
      try:
        return os.readlink(f"/proc/self/fd/{fd}")
      except OSError:
        return None

    def at(path: Any, dir_fd: Optional[int]) -> str:
      path = os.fspath(path)
      if isinstance(path, bytes):
        path = os.fsdecode(path)
      if dir_fd is not None and not os.path.isabs(path):
        return os.path.join(fd_path(dir_fd) or "", path)
      return os.path.realpath(os.path.join(os.path.dirname(
          os.path.abspath(path)), ".")) + os.sep + os.path.basename(path)

    def write(fd, data):
      self._add(("write", fd_path(fd)))
      return real["write"](fd, data)

    def fsync(fd):
      path = fd_path(fd if isinstance(fd, int) else fd.fileno())
      result = real["fsync"](fd)
      self._add(("fsync", path))
      return result

    def fdatasync(fd):
      path = fd_path(fd if isinstance(fd, int) else fd.fileno())
      result = real["fdatasync"](fd)
      self._add(("fsync", path))
      return result

    def mover(name):
      def move(src, dst, *, src_dir_fd=None, dst_dir_fd=None, **kw):
        event = (name if name == "link" else "rename", at(src, src_dir_fd),
                 at(dst, dst_dir_fd))
        result = real[name](src, dst, src_dir_fd=src_dir_fd,
                            dst_dir_fd=dst_dir_fd, **kw)
        self._add(event)
        return result
      return move

    def remover(name):
      def remove(path, *, dir_fd=None):
        event = ("remove", at(path, dir_fd))
        result = real[name](path, dir_fd=dir_fd)
        self._add(event)
        return result
      return remove

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    for name in ("replace", "rename", "link"):
      monkeypatch.setattr(os, name, mover(name))
    for name in ("remove", "unlink"):
      monkeypatch.setattr(os, name, remover(name))
    return self

  # -- queries -------------------------------------------------------------

  def index(self, kind: str, *paths: Any, start: int = 0) -> int:
    """Index of the first event `(kind, *paths)` from `start`; -1 if none."""
    want = tuple(_real(p) for p in paths)
    for i in range(start, len(self.events)):
      event = self.events[i]
      if event[0] == kind and event[1:1 + len(want)] == want:
        return i
    return -1

  def renames_into(self, final: Any) -> list[int]:
    final = _real(final)
    return [i for i, e in enumerate(self.events)
            if e[0] in ("rename", "link") and e[2] == final]

  def removals(self, paths: Iterable[Any]) -> list[int]:
    wanted = {_real(p) for p in paths}
    return [i for i, e in enumerate(self.events)
            if e[0] == "remove" and e[1] in wanted]

  # -- the contract ----------------------------------------------------------

  def assert_durable_rename(self, i: int) -> None:
    """Event `i` (a rename or link of a temp file) is durable and ordered.

    Its source was fsynced after its last write and before the rename, and
    the destination's directory is fsynced after it.
    """
    kind, src, dst = self.events[i]
    assert kind in ("rename", "link"), self.events[i]
    writes = [j for j in range(i) if self.events[j] == ("write", src)]
    syncs = [j for j in range(i) if self.events[j] == ("fsync", src)]
    assert syncs, f"{src} was never fsynced before it became {dst}"
    assert not writes or syncs[-1] > writes[-1], (
        f"{src} was written after its last fsync, before it became {dst}")
    directory = os.path.dirname(dst)
    assert self.index("fsync", directory, start=i + 1) > i, (
        f"{directory} was not fsynced after {src} became {dst}")

  def assert_every_rename_durable(self, minimum: int = 1) -> int:
    """Every rename/link of a temporary file under the root is durable.

    Returns:
      How many were checked (at least `minimum`).
    """
    checked = 0
    for i, event in enumerate(self.events):
      if event[0] in ("rename", "link") and ".tmp" in os.path.basename(
          event[1]):
        self.assert_durable_rename(i)
        checked += 1
    assert checked >= minimum, (checked, self.events)
    return checked

  def assert_synced_before(self, path: Any, before: int,
                           after: int = 0) -> None:
    """`path` and its directory were fsynced in `[after, before)`."""
    path = _real(path)
    file_sync = self.index("fsync", path, start=after)
    assert 0 <= file_sync < before, (
        f"{path} not fsynced between events {after} and {before}: "
        f"{self.events[after:before + 1]}")
    dir_sync = self.index("fsync", os.path.dirname(path), start=after)
    assert 0 <= dir_sync < before, (
        f"{os.path.dirname(path)} not fsynced between events {after} and "
        f"{before}")


def _real(path: Any) -> str:
  path = os.fspath(path)
  if isinstance(path, pathlib.PurePath):
    path = str(path)
  return os.path.join(os.path.realpath(os.path.dirname(path) or "."),
                      os.path.basename(path)) if os.path.basename(path) else (
                          os.path.realpath(path))
