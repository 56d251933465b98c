"""A bucket step written locally first, then uploaded by many streams at once.

Written straight to a bucket, an Orbax step goes up as TensorStore commits
it: one or two data files at a time, each commit followed by dependent small
round trips (OCDBT manifests, Orbax's metadata files through epath), so on a
link with real latency most of a migration is waiting, not sending. Here the
step is written by Orbax to a local staging directory (the same handlers,
the same files: no round trips), then its files go up `upload_streams()` at
once, and the step is committed last exactly as Orbax commits it on GCS: its
`commit_success.txt` (whose text names the step's URL, as Orbax writes it
there) is uploaded after every other file has arrived. A step whose upload
fails or is interrupted has no commit file: Orbax and `list_steps` do not
list it, and `OrbaxTarget.remove_partial` removes it (the next run too).

The staging directory is `staging_dir` (the `--staging-dir` option of
`clu-ckpt migrate`, `migrate(staging_dir=...)`), else
`$CLU_CKPT_STAGING_DIR`, else the system's temporary directory. Each step
is staged in a subdirectory named `clu_ckpt-staging-<pid>-<random>`, removed
when the step is uploaded, when it fails, on Ctrl-C and on SIGTERM; one a
killed process (SIGKILL) left is removed by the next staging in that
directory once its process is gone.

Synopsis::

  from clu_ckpt.migration import staging

  with staging.StagingArea(None) as area:          # $TMPDIR/clu_ckpt-staging-...
    write_step_with_orbax(area.path)               # <area>/<step>/...
    staging.upload_step(f"{area.path}/7", "gs://b/orbax/7")
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import re
import shutil
import signal
import tempfile
import threading
import time
import uuid
from typing import Any, Callable, Optional

from clu_ckpt import bucket_client
from clu_ckpt import orbax_root
from clu_ckpt import storage

# Where steps are staged when no directory is given.
STAGING_DIR_ENV = "CLU_CKPT_STAGING_DIR"
# Files sent at once by `upload_step` (CLU_CKPT_STAGING_STREAMS overrides).
# Chosen by measurement (benchmarks/bench_buckets.py, migrate@uN): see the
# README's bucket section.
UPLOAD_STREAMS = 8
STREAMS_ENV = "CLU_CKPT_STAGING_STREAMS"
# A file up to this size goes up as one request; a larger one as parallel
# parts the store joins (`storage.atomic_writer`).
SINGLE_REQUEST_BYTES = 32 * 2**20
# `StepUploader`: how often it looks for finished data files, and how long a
# file must keep its size and time to be taken as finished.
# Whether data files are uploaded while the step is being written
# (`StepUploader`) or all after it (`upload_step` alone).
# Measured (bench_buckets.py, 480 MiB, 3 runs, medians): with overlap 12.23
# s, after the step 11.33 s (within the noise: on 2 shared cores the writer
# slows down as the uploads run beside it); with 8 read-ahead streams 10.11
# s against 11.40 s. Sending through gcsfs on an event loop of its own
# (11.55 s) or through TensorStore's GCS store (~2x slower uploads through
# the proxy) did not help.
OVERLAP = True
POLL_SECONDS = 0.1
SETTLE_SECONDS = 0.3
# Files up to this size (Orbax's metadata, OCDBT's manifests and small data
# files) go up SMALL_FILE_STREAMS at a time beside the larger ones: each holds
# little memory, and at a step's end they are most of its files, each a
# round trip.
SMALL_FILE_BYTES = 2**20
SMALL_FILE_STREAMS = 32
# Free space the staging directory must have beyond the step's bytes.
SPACE_MARGIN_BYTES = 256 * 2**20
# The subdirectories of a staging directory: PREFIX<pid>-<random>.
PREFIX = "clu_ckpt-staging-"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-[0-9a-f]+$")
# The file whose arrival commits a step (and an item) on GCS.
COMMIT_FILE = orbax_root.COMMIT_SUCCESS_FILE
# What Orbax writes in it (`Checkpoint commit was successful to <path>`).
_COMMIT_TEXT = "Checkpoint commit was successful to {}"


def upload_streams() -> int:
  """How many files `upload_step` sends at once.

  `CLU_CKPT_STAGING_STREAMS` when set (a positive integer), else
  `UPLOAD_STREAMS`; read at each call.

  Raises:
    ValueError: The variable is set to anything but a positive integer.
  """
  return bucket_client.positive_int_setting(STREAMS_ENV, UPLOAD_STREAMS)


def staging_root(staging_dir: Optional[str] = None) -> str:
  """The directory steps are staged in: `staging_dir`, else
  `$CLU_CKPT_STAGING_DIR`, else the system's temporary directory."""
  return os.path.abspath(staging_dir or os.environ.get(STAGING_DIR_ENV) or
                         tempfile.gettempdir())


def has_room(staging_dir: Optional[str], nbytes: int) -> bool:
  """Whether the staging directory exists and has room for `nbytes` plus
  `SPACE_MARGIN_BYTES`."""
  root = staging_root(staging_dir)
  try:
    free = shutil.disk_usage(root).free
  except OSError:
    return False
  return os.path.isdir(root) and free >= nbytes + SPACE_MARGIN_BYTES


def _alive(pid: int) -> bool:
  if pid == os.getpid():
    return True
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  return True


def sweep(staging_dir: Optional[str] = None) -> list[str]:
  """Removes the staging subdirectories whose process is gone (SIGKILLed).

  Returns:
    The paths removed.
  """
  root = staging_root(staging_dir)
  removed = []
  try:
    names = os.listdir(root)
  except OSError:
    return removed
  for name in names:
    match = _NAME.match(name)
    if match and not _alive(int(match.group(1))):
      path = os.path.join(root, name)
      shutil.rmtree(path, ignore_errors=True)
      removed.append(path)
  return removed


class StagingArea:
  """A fresh subdirectory of the staging directory, removed on exit.

  Entering it sweeps what killed processes left (`sweep`), creates
  `<root>/clu_ckpt-staging-<pid>-<random>` (`path`) and, in the main thread
  while SIGTERM has its default action, turns SIGTERM into a
  KeyboardInterrupt, so that the migration abandons the step as on Ctrl-C
  and the subdirectory is removed (the process exits with status 130
  then). Leaving it (success, error, interrupt) removes the subdirectory
  and restores SIGTERM's handler.

  Args:
    staging_dir: See `staging_root`.
  """

  def __init__(self, staging_dir: Optional[str] = None):
    self.root = staging_root(staging_dir)
    self.path = os.path.join(self.root,
                             f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
    self._previous: Any = None

  def __enter__(self) -> "StagingArea":
    sweep(self.root)
    os.makedirs(self.path)
    if (threading.current_thread() is threading.main_thread() and
        signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
      self._previous = signal.signal(signal.SIGTERM, _terminated)
    return self

  def remove(self) -> None:
    """Removes the subdirectory (again: writers may have recreated parts)."""
    shutil.rmtree(self.path, ignore_errors=True)

  def __exit__(self, *exc: Any) -> None:
    try:
      self.remove()
    finally:
      if self._previous is not None:
        signal.signal(signal.SIGTERM, self._previous)
        self._previous = None


def _terminated(signum: int, frame: Any) -> None:
  del signum, frame
  raise KeyboardInterrupt("SIGTERM")


def _files(local_step: str) -> list[str]:
  """The step's files, relative to it, sorted."""
  found = []
  for directory, _, names in os.walk(local_step):
    for name in names:
      found.append(os.path.relpath(os.path.join(directory, name), local_step))
  return sorted(found)


class _Missing(Exception):
  """The local file is not there (renamed or removed by Orbax meanwhile)."""


def _put(local: str, url: str, data: Optional[bytes] = None) -> None:
  """Uploads one local file (or `data`) to `url`.

  Raises:
    _Missing: `local` is not there.
    OSError: The upload failed (the message names both).
  """
  try:
    f = None if data is not None else open(local, "rb")
  except FileNotFoundError as e:
    raise _Missing(local) from e
  try:
    size = len(data) if f is None else os.fstat(f.fileno()).st_size
    if f is not None and size > SINGLE_REQUEST_BYTES:
      with storage.atomic_writer(url) as write:
        while True:
          block = f.read(8 * 2**20)
          if not block:
            break
          write(block)
      return
    client = storage.filesystem(url).fs
    key = url.split("://", 1)[1]
    if f is None or size == 0:
      client.pipe_file(key, data if f is None else b"")
      return
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
      client.pipe_file(key, m)
  except Exception as e:  # pylint: disable=broad-except
    raise OSError(f"uploading {local} to {url}: "
                  f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
                  ) from e
  finally:
    if f is not None:
      f.close()


def upload_step(local_step: str, url: str, *,
                streams: Optional[int] = None,
                on_file: Optional[Callable[[str, int], None]] = None,
                uploaded: Optional[dict[str, tuple[int, int]]] = None) -> int:
  """Uploads a step Orbax wrote locally; commits it last, as Orbax on GCS.

  Every file but the step's `commit_success.txt` goes up first,
  `streams` at a time (the items' commit files with the text Orbax writes
  on GCS, naming their URL); once all of them have arrived, the step's
  `commit_success.txt` (naming `url`). On any failure (or interrupt) the
  uploads under way finish or stop, no more start, and the error is
  raised: the step has no commit file.

  Args:
    local_step: The step's local directory (`<staging>/<step name>`).
    url: The step's URL in the bucket (`gs://b/root/<step name>`).
    streams: Files in flight at once; None: `upload_streams()`.
    on_file: Called with (relative name, bytes) as each file arrives.
    uploaded: Files already uploaded while the step was written
      (`StepUploader`): relative name -> (size, mtime in ns) of the local
      file sent. Those unchanged are not sent again; those no longer in
      the step are removed from the bucket.

  Returns:
    The bytes of the step's files (the staging disk it used).

  Raises:
    OSError: A file could not be uploaded (the message names it).
  """
  url = url.rstrip("/")
  width = streams or upload_streams()
  files = _files(local_step)
  if COMMIT_FILE not in files:
    raise FileNotFoundError(2, "the staged step has no commit file",
                            os.path.join(local_step, COMMIT_FILE))
  files.remove(COMMIT_FILE)
  done = dict(uploaded or {})
  stats = {n: os.stat(os.path.join(local_step, n)) for n in files}
  total = sum(st.st_size for st in stats.values())
  present = {_remote(n) for n in stats}
  gone = [n for n in done if n not in present]
  todo = [n for n in files if done.get(_remote(n)) != (
      stats[n].st_size, stats[n].st_mtime_ns)]
  # Largest first: the long uploads start early, the small ones fill in.
  todo.sort(key=lambda n: -stats[n].st_size)
  if gone:  # written early, then replaced: not part of the step
    client = storage.filesystem(url).fs
    client.rm([f"{url.split('://', 1)[1]}/{n}" for n in gone])
  _upload_all(local_step, url, todo, width, on_file,
              small={n for n in todo if stats[n].st_size <= SMALL_FILE_BYTES})
  _upload_one(local_step, url, COMMIT_FILE, on_file)
  return total


def _remote(name: str) -> str:
  """The object name (relative to the step) of a local relative path."""
  return "/".join(_TMP.sub("", part) for part in name.split(os.sep))


# What Orbax appends to the names of directories being written locally.
_TMP = re.compile(re.escape(orbax_root.ORBAX_TMP_MARKER) + ".*$")


def _upload_one(local_root: str, url: str, name: str,
                on_file: Optional[Callable[[str, int], None]]) -> int:
  local = os.path.join(local_root, name)
  target = f"{url}/{_remote(name)}"
  data = None
  if os.path.basename(name) == COMMIT_FILE:
    data = _COMMIT_TEXT.format(target.rsplit("/", 1)[0]).encode()
  _put(local, target, data)
  size = len(data) if data is not None else os.path.getsize(local)
  if on_file is not None:
    on_file(name, size)
  return size


def _upload_all(local_root: str, url: str, names: list[str], width: int,
                on_file: Optional[Callable[[str, int], None]],
                small: Optional[set[str]] = None) -> None:
  """Uploads `names`, `width` at a time, and those in `small` beside them
  `SMALL_FILE_STREAMS` at a time; the first failure is raised once the
  uploads under way have ended (no more start)."""
  if not names:
    return
  small = small or set()
  pools = [concurrent.futures.ThreadPoolExecutor(
      n, thread_name_prefix="clu_ckpt-staged-upload")
           for n in (width, max(width, SMALL_FILE_STREAMS))]
  try:
    futures = [pools[name in small].submit(_upload_one, local_root, url,
                                           name, on_file)
               for name in names]
    for future in concurrent.futures.as_completed(futures):
      future.result()
  finally:
    for pool in pools:
      pool.shutdown(wait=True, cancel_futures=True)


class StepUploader:
  """Uploads a step's data files while Orbax is still writing the step.

  OCDBT data files (in a `d/` directory) are written once and never
  changed: each is sent as soon as it has kept its size and time for
  `SETTLE_SECONDS`, `streams` at a time, beside the writing. `finish` then
  sends the rest (and again any file that changed since it was sent; one
  no longer in the step is removed) and commits the step last
  (`upload_step`). `abort` stops it; the caller removes the step.

  Args:
    area: The staging area's directory (Orbax's root there).
    step_name: The step's directory name.
    url: The step's URL in the bucket.
    streams: Files in flight at once; None: `upload_streams()`.
    ready: What must end before anything of the step is sent (the removal
      of what a killed run left of it in the bucket); its error, if any,
      is raised by `finish` and nothing is sent.
  """

  def __init__(self, area: str, step_name: str, url: str,
               streams: Optional[int] = None,
               ready: Optional[concurrent.futures.Future] = None):
    self.area, self.step_name, self.url = area, step_name, url.rstrip("/")
    self._ready = ready
    self._pending: set[str] = set()
    self.streams = streams or upload_streams()
    self.uploaded: dict[str, tuple[int, int]] = {}
    self._seen: dict[str, tuple[int, int]] = {}
    self._stop = threading.Event()
    self._pool = concurrent.futures.ThreadPoolExecutor(
        self.streams, thread_name_prefix="clu_ckpt-staged-upload")
    self._futures: list[concurrent.futures.Future] = []
    self._thread = threading.Thread(target=self._watch, daemon=True,
                                    name="clu_ckpt-staged-watch")

  def start(self) -> "StepUploader":
    self._thread.start()
    return self

  def _watch(self) -> None:
    while not self._stop.wait(POLL_SECONDS):
      try:
        self._poll()
      except OSError:  # a directory renamed under the walk: next time
        pass

  def _poll(self) -> None:
    now = time.time_ns()
    for directory, _, names in os.walk(self.area):
      if os.path.basename(directory) != "d":
        continue
      rel_dir = os.path.relpath(directory, self.area)
      if _TMP.sub("", rel_dir.split(os.sep)[0]) != self.step_name:
        continue
      for name in names:
        if "." in name:  # a lock or temporary file, not a data file
          continue
        rel = os.path.join(rel_dir, name)
        remote = _remote(rel)[len(self.step_name) + 1:]
        if remote in self.uploaded or remote in self._pending:
          continue
        try:
          st = os.stat(os.path.join(directory, name))
        except FileNotFoundError:
          continue
        key = (st.st_size, st.st_mtime_ns)
        if (self._seen.get(remote) == key and st.st_size and
            now - st.st_mtime_ns >= SETTLE_SECONDS * 1e9):
          self._pending.add(remote)
          self._futures.append(self._pool.submit(
              self._send, os.path.join(directory, name), remote, key))
        self._seen[remote] = key

  def _send(self, local: str, remote: str, key: tuple[int, int]) -> None:
    if self._ready is not None:
      self._ready.result()  # raises its error: nothing is sent
    # Orbax may have renamed the temporary directories since: the file is
    # then under the step's final name (if neither, `finish` decides).
    final = os.path.join(self.area, self.step_name, *remote.split("/"))
    for path in (local, final):
      try:
        _put(path, f"{self.url}/{remote}")
      except _Missing:
        continue
      self.uploaded[remote] = key
      return

  def finish(self) -> int:
    """Stops watching, waits for the uploads under way, sends the rest and
    commits the step (`upload_step`).

    Returns:
      The bytes of the step's files.

    Raises:
      OSError: A file could not be uploaded.
    """
    self._stop_watching()
    try:
      if self._ready is not None:
        self._ready.result()
      for future in self._futures:
        future.result()
    finally:
      self._pool.shutdown(wait=True, cancel_futures=True)
    return upload_step(os.path.join(self.area, self.step_name), self.url,
                       streams=self.streams, uploaded=self.uploaded)

  def abort(self) -> None:
    """Stops watching and uploading (the uploads under way end first)."""
    self._stop_watching()
    self._pool.shutdown(wait=True, cancel_futures=True)

  def _stop_watching(self) -> None:
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join()
