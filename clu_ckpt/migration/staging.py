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
import uuid
from typing import Any, Callable, Optional

from clu_ckpt import bucket_client
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
# Free space the staging directory must have beyond the step's bytes.
SPACE_MARGIN_BYTES = 256 * 2**20
# The subdirectories of a staging directory: PREFIX<pid>-<random>.
PREFIX = "clu_ckpt-staging-"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-[0-9a-f]+$")
# The file whose arrival commits a step (and an item) on GCS.
COMMIT_FILE = "commit_success.txt"
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


def _put(local: str, url: str, data: Optional[bytes] = None) -> None:
  """Uploads one local file (or `data`) to `url`."""
  if data is None:
    size = os.path.getsize(local)
  else:
    size = len(data)
  if size > SINGLE_REQUEST_BYTES:
    with open(local, "rb") as f, storage.atomic_writer(url) as write:
      while True:
        block = f.read(8 * 2**20)
        if not block:
          break
        write(block)
    return
  client = storage.filesystem(url).fs
  key = url.split("://", 1)[1]
  try:
    if data is not None or size == 0:
      client.pipe_file(key, data if data is not None else b"")
      return
    with open(local, "rb") as f, mmap.mmap(f.fileno(), 0,
                                           access=mmap.ACCESS_READ) as m:
      client.pipe_file(key, m)
  except FileNotFoundError:
    raise
  except OSError as e:
    raise OSError(e.errno, f"uploading {local} to {url}: {e}") from e


def upload_step(local_step: str, url: str, *,
                streams: Optional[int] = None,
                on_file: Optional[Callable[[str, int], None]] = None) -> int:
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

  Returns:
    The bytes uploaded.

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
  # Largest first: the long uploads start early, the small ones fill in.
  files.sort(key=lambda n: -os.path.getsize(os.path.join(local_step, n)))
  total = 0

  def one(name: str) -> int:
    local = os.path.join(local_step, name)
    target = f"{url}/{name.replace(os.sep, '/')}"
    data = None
    if os.path.basename(name) == COMMIT_FILE:
      data = _COMMIT_TEXT.format(target.rsplit("/", 1)[0]).encode()
    _put(local, target, data)
    size = len(data) if data is not None else os.path.getsize(local)
    if on_file is not None:
      on_file(name, size)
    return size

  pool = concurrent.futures.ThreadPoolExecutor(
      width, thread_name_prefix="clu_ckpt-staged-upload")
  try:
    futures = [pool.submit(one, name) for name in files]
    for future in concurrent.futures.as_completed(futures):
      total += future.result()
  finally:
    pool.shutdown(wait=True, cancel_futures=True)
  total += one(COMMIT_FILE)
  return total
