"""A store that cannot be reached fails fast, in one line naming the path.

Every "store" here is on 127.0.0.1: a port that refuses connections, one that
accepts them and never answers, and one that answers every request with 401
(no usable credentials). No request leaves the machine.
"""

import copy
import http.server
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

import emulators
from clu_ckpt import bucket_client
from clu_ckpt import errors
from clu_ckpt import fsspec_fs

_STORE_ENV = ("STORAGE_EMULATOR_HOST", "AWS_ENDPOINT_URL",
              "AWS_ENDPOINT_URL_S3", "TENSORSTORE_GCS_HTTP_URL")


@pytest.fixture
def refusing_port():
  """A port on 127.0.0.1 with nothing listening (connections are refused).

  The port stays bound (not listening) for the test, so that no other
  process (an emulator, another test run) can take it meanwhile.
  """
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    yield s.getsockname()[1]


@pytest.fixture
def silent_port():
  """A port that accepts connections (the kernel's backlog) and never answers.

  Yields:
    (port, count): count() is how many connections were made to it.
  """
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen(64)
  server.settimeout(0.05)
  accepted = []
  stop = threading.Event()

  def accept():
    while not stop.is_set():
      try:
        accepted.append(server.accept()[0])  # held open, never answered
      except (socket.timeout, OSError):
        continue

  thread = threading.Thread(target=accept, daemon=True)
  thread.start()
  yield server.getsockname()[1], lambda: len(accepted)
  stop.set()
  thread.join()
  for conn in accepted:
    conn.close()
  server.close()


@pytest.fixture
def unauthorized_port():
  """An HTTP server answering 401 to everything; yields (port, hits)."""
  hits = []

  class Handler(http.server.BaseHTTPRequestHandler):

    def _refuse(self):
      hits.append(self.path)
      body = (b'{"error": {"code": 401, "message": "Anonymous caller does '
              b'not have storage.objects.list access"}}')
      self.send_response(401)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_HEAD = do_DELETE = _refuse

    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  yield server.server_address[1], hits
  server.shutdown()
  server.server_close()


def _store_env(monkeypatch, url):
  for name, value in emulators.ENV.items():
    monkeypatch.setenv(name, value)
  for name in _STORE_ENV:
    monkeypatch.setenv(name, url)


def _cli(*argv, url):
  env = dict(os.environ, **emulators.ENV, TF_CPP_MIN_LOG_LEVEL="3")
  env.update({name: url for name in _STORE_ENV})
  started = time.monotonic()
  done = subprocess.run([sys.executable, "-m", "clu_ckpt", *argv],
                        capture_output=True, text=True, timeout=120, env=env)
  return done, time.monotonic() - started


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_a_refusing_store_fails_in_one_line_in_seconds(scheme, refusing_port):
  url = f"http://127.0.0.1:{refusing_port}"
  done, seconds = _cli("inspect", f"{scheme}://bucket/run1", url=url)
  assert done.returncode == 1
  lines = done.stderr.strip().splitlines()
  # Was ~40 lines of gcsfs tracebacks after 33-48 s of retries.
  assert len(lines) == 1, done.stderr
  assert lines[0].startswith(f"clu-ckpt inspect: error: {scheme}://bucket/run1:")
  assert "connect" in lines[0].lower(), lines[0]
  assert seconds < 20, seconds


def _in_thread(call, seconds):
  """What `call()` raised (None if it returned), failing if it takes longer
  than `seconds`: a hang fails the test that saw it, by name, in time (the
  thread is left to the fixture's teardown, which closes the connection)."""
  outcome = []

  def run():
    try:
      call()
      outcome.append(None)
    except BaseException as e:  # pylint: disable=broad-except
      outcome.append(e)
  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  thread.join(seconds)
  if thread.is_alive():
    pytest.fail(f"still waiting for the store after {seconds} s: the first "
                "contact is not bounded")
  return outcome[0]


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_a_silent_store_gets_one_bounded_try(scheme, silent_port, monkeypatch):
  port, connections = silent_port
  _store_env(monkeypatch, f"http://127.0.0.1:{port}")
  # 3 s: on a loaded machine the S3 client's own set-up took over 1 s, and
  # the deadline passed before it had connected at all (0 connections).
  monkeypatch.setattr(bucket_client, "FIRST_CONTACT_SECONDS", 3.0)
  fs = fsspec_fs.FsspecFileSystem(scheme)
  started = time.monotonic()
  raised = _in_thread(lambda: fs.listdir(f"{scheme}://bucket/run1"), 30)
  seconds = time.monotonic() - started
  assert isinstance(raised, fsspec_fs.StoreUnreachableError), raised
  assert raised.filename == f"{scheme}://bucket/run1"
  assert "no answer from the store at http://127.0.0.1:" in str(raised)
  # 3 s to answer, plus the client's own set-up (its first session, an
  # import) on a loaded machine; the clients alone wait 5 minutes.
  assert seconds < 30, seconds
  assert connections() == 1     # no retry of a store that never answered


def test_a_store_refusing_credentials_is_asked_once(unauthorized_port,
                                                    monkeypatch):
  port, hits = unauthorized_port
  _store_env(monkeypatch, f"http://127.0.0.1:{port}")
  fs = fsspec_fs.FsspecFileSystem("gs")
  with pytest.raises(errors.StoreAccessError, match="gs://bucket/run1"):
    fs.listdir("gs://bucket/run1")
  assert len(hits) == 1, hits


def test_once_the_store_answered_its_client_retries_again(gcs):
  fs = fsspec_fs.FsspecFileSystem("gs")
  client = fs.fs
  assert not client._answered  # pylint: disable=protected-access
  bucket = gcs.bucket()
  assert not fs.exists(f"gs://{bucket}/nothing")   # a 404 is an answer
  assert client._answered  # pylint: disable=protected-access
  # From then on gcsfs' own request, with all it is given: path parts,
  # parameters, headers, a body.
  client.pipe_file(f"{bucket}/run/a", b"0123456789")
  client.pipe_file(f"{bucket}/run/sub/b", b"b")
  assert client.cat_file(f"{bucket}/run/a", start=2, end=5) == b"234"
  assert fs.listdir(f"gs://{bucket}/run") == ["a", "sub"]
  assert fs.stat(f"gs://{bucket}/run/a")[0] == 10


def test_a_gcs_first_contact_is_made_with_all_it_is_given(gcs):
  bucket = gcs.bucket()
  writer = fsspec_fs.FsspecFileSystem("gs").fs
  writer.pipe_file(f"{bucket}/run/a", b"0123456789")
  writer.pipe_file(f"{bucket}/run/sub/b", b"b")
  fresh = fsspec_fs.FsspecFileSystem("gs")
  assert fresh.listdir(f"gs://{bucket}/run") == ["a", "sub"]  # path parts
  fresh = fsspec_fs.FsspecFileSystem("gs").fs
  assert not fresh._answered  # pylint: disable=protected-access
  assert fresh.cat_file(f"{bucket}/run/a", start=2, end=5) == b"234"  # headers


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_the_file_systems_copy_like_fsspecs_own(scheme, monkeypatch,
                                                refusing_port):
  # fsspec rebuilds a file system from `__reduce__` (copies, processes that
  # are handed one): the class must be found again by its module and name.
  _store_env(monkeypatch, f"http://127.0.0.1:{refusing_port}")
  client = fsspec_fs.FsspecFileSystem(scheme).fs
  duplicate = copy.deepcopy(client)
  assert type(duplicate) is type(client) and not duplicate._answered  # pylint: disable=protected-access
  cls = type(client)
  assert (cls.__module__, cls.__qualname__) == (bucket_client.__name__,
                                                cls.__name__)
  done = subprocess.run(  # a fresh process finds the class by its name
      [sys.executable, "-c", "import importlib, sys; "
       "m = importlib.import_module(sys.argv[1]); "
       "print(getattr(m, sys.argv[2]).__name__)", cls.__module__,
       cls.__qualname__],
      capture_output=True, timeout=120,
      env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
  assert done.stdout.decode().strip() == cls.__name__, done.stderr


def test_a_glob_in_a_missing_bucket_names_the_directory_not_the_pattern(gcs):
  del gcs  # the emulator, with no bucket of that name
  fs = fsspec_fs.FsspecFileSystem("gs")
  with pytest.raises(FileNotFoundError,
                     match="bucket 'no-such-bucket-g4' does not exist") as e:
    fs.glob("gs://no-such-bucket-g4/run1/checkpoints-*")
  assert e.value.filename == "gs://no-such-bucket-g4/run1"
  assert "*" not in str(e.value)


def test_an_s3_store_that_answered_is_asked_as_usual(s3, monkeypatch):
  fs = fsspec_fs.FsspecFileSystem("s3")
  client = fs.fs
  assert not client._answered  # pylint: disable=protected-access
  bucket = s3.bucket()
  with pytest.raises(FileNotFoundError):  # an error status is an answer
    client.cat_file("no-such-bucket-a1/nothing")  # only errors
  assert client._answered  # pylint: disable=protected-access
  fresh = fsspec_fs.FsspecFileSystem("s3")
  assert fresh.listdir(f"s3://{bucket}") == []  # a success is an answer
  assert fresh.fs._answered  # pylint: disable=protected-access


def test_s3_uploads_are_not_timed_as_a_first_contact(s3, monkeypatch):
  # A deadline no request meets: uploads pass, anything else times out.
  monkeypatch.setattr(bucket_client, "FIRST_CONTACT_SECONDS", 1e-6)
  bucket = s3.bucket()
  client = fsspec_fs.FsspecFileSystem("s3").fs
  client.pipe_file(f"{bucket}/a", b"data")  # put_object
  assert not client._answered  # pylint: disable=protected-access
  with pytest.raises(fsspec_fs.StoreUnreachableError) as raised:
    client.ls(bucket)
  assert raised.value.strerror == (
      f"no answer from the store at {s3.url} within 1e-06 s (network, "
      "endpoint or firewall?)")


def test_an_unanswered_s3_client_names_its_own_endpoint(s3, silent_port,
                                                        monkeypatch):
  port, _ = silent_port
  monkeypatch.setattr(bucket_client, "FIRST_CONTACT_SECONDS", 0.5)
  cls = bucket_client.FirstContactS3FileSystem
  client = cls(key="testing", secret="testing", skip_instance_cache=True,
               client_kwargs={"endpoint_url": f"http://127.0.0.1:{port}"})
  with pytest.raises(fsspec_fs.StoreUnreachableError) as raised:
    client.ls("bucket")
  assert f"at http://127.0.0.1:{port} within" in raised.value.strerror
  assert s3.url not in raised.value.strerror  # not the environment's


def test_every_operation_on_a_refusing_store_names_its_url(unauthorized_port,
                                                           monkeypatch):
  port, _ = unauthorized_port
  _store_env(monkeypatch, f"http://127.0.0.1:{port}")
  fs = fsspec_fs.FsspecFileSystem("gs")
  fs._buckets.add("bucket")  # pylint: disable=protected-access
  url = "gs://bucket/run1/ckpt-1.flax"
  for name, call in (("remove", lambda: fs.remove(url)),
                     ("remove_tree", lambda: fs.remove_tree(url)),
                     ("create_exclusive",
                      lambda: fs.create_exclusive(url, b"x")),
                     ("read_bytes", lambda: fs.read_bytes(url, 0, 4)),
                     ("stat", lambda: fs.stat(url))):
    with pytest.raises(errors.StoreAccessError) as raised:
      call()
    assert str(raised.value).startswith(f"{url}: "), (name, raised.value)


def test_a_glob_names_the_directory_before_its_first_wildcard():
  searched = fsspec_fs._searched  # pylint: disable=protected-access
  assert searched("gs://b/run1/checkpoints-*") == "gs://b/run1"
  assert searched("gs://b/run*/ckpt-1/x") == "gs://b"
  assert searched("gs://b/run1/[ab]/x?") == "gs://b/run1"
  assert searched("gs://b/*") == "gs://b"
  assert searched("gs://b/run1/x") == "gs://b/run1/x"  # no wildcard
  # A wildcard in the bucket's name: the pattern itself.
  assert searched("gs://b*/run") == "gs://b*/run"
  assert searched("gs://*") == "gs://*"


@pytest.fixture
def scripted_port():
  """An HTTP server answering with the statuses in `script`, in turn.

  Yields:
    (port, script, hits, hold): `script` a list to fill with statuses (an
    empty list: 200 to everything), `hits` the paths asked, `hold` an Event
    each answer waits for (set: no wait).
  """
  script, hits = [], []
  hold = threading.Event()
  hold.set()

  class Handler(http.server.BaseHTTPRequestHandler):

    def do_GET(self):  # pylint: disable=invalid-name
      hits.append(self.path)
      assert hold.wait(30)
      status = script.pop(0) if script else 200
      body = b"data" if status == 200 else (
          b'{"error": {"code": %d, "message": "busy"}}' % status)
      self.send_response(status)
      self.send_header("Content-Type", "application/octet-stream"
                       if status == 200 else "application/json")
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  yield server.server_address[1], script, hits, hold
  hold.set()
  server.shutdown()
  server.server_close()


@pytest.mark.parametrize("first", [200, 503])
def test_a_gcs_store_retries_as_gcsfs_does_from_its_first_answer(
    first, scripted_port, monkeypatch):
  port, script, hits, _ = scripted_port
  _store_env(monkeypatch, f"http://127.0.0.1:{port}")
  client = fsspec_fs.FsspecFileSystem("gs").fs
  # The first answer, a success or an error status: no retry of it.
  script.extend([first, 503, 200])
  if first == 200:
    assert client.cat_file("bucket/x") == b"data"
  else:
    with pytest.raises(Exception) as raised:  # gcsfs' HttpError
      client.cat_file("bucket/x")
    assert bucket_client.status_of(raised.value) == 503
  assert len(hits) == 1 and client._answered  # pylint: disable=protected-access
  # From then on gcsfs' own retries: a 503 is asked again (after ~1-2 s).
  assert client.cat_file("bucket/x") == b"data"
  assert len(hits) == 3, hits


def test_a_gcs_first_contact_has_short_timeouts_then_the_clients_own(
    scripted_port, monkeypatch):
  import aiohttp  # pylint: disable=g-import-not-at-top
  port, _, hits, hold = scripted_port
  _store_env(monkeypatch, f"http://127.0.0.1:{port}")
  monkeypatch.setattr(bucket_client, "FIRST_CONTACT_SECONDS", 6.0)
  client = bucket_client.FirstContactGCSFileSystem(
      token="anon", skip_instance_cache=True, requests_timeout=77)
  hold.clear()  # the store's answer waits while the request is looked at
  got = []
  reader = threading.Thread(target=lambda: got.append(
      client.cat_file("bucket/x")))
  reader.start()
  try:
    deadline = time.monotonic() + 30
    while not hits and time.monotonic() < deadline:
      time.sleep(0.01)
    assert hits, "the request never arrived"
    # Half the deadline to connect, the deadline to read, no total.
    assert client.requests_timeout == aiohttp.ClientTimeout(
        total=None, sock_connect=3.0, sock_read=6.0)
  finally:
    hold.set()
    reader.join(30)
  assert got == [b"data"]
  assert client.requests_timeout == 77  # the client's own again


def test_an_s3_first_contact_is_tried_once_by_s3fs(monkeypatch):
  # A store that answers every request "SlowDown" (503), which s3fs would
  # try again as a whole (botocore told to make one attempt of each).
  hits = []

  class Handler(http.server.BaseHTTPRequestHandler):

    def do_GET(self):  # pylint: disable=invalid-name
      hits.append(self.path)
      body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown'
              b'</Code><Message>Please reduce your request rate.</Message>'
              b'<RequestId>1</RequestId></Error>')
      self.send_response(503)
      self.send_header("Content-Type", "application/xml")
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    _store_env(monkeypatch, f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    client = fsspec_fs.FsspecFileSystem("s3").fs
    with pytest.raises(OSError):
      client.ls("bucket")
    assert len(hits) == 1, hits
    assert client._answered  # pylint: disable=protected-access
    hits.clear()  # answered: s3fs' own retries from now on
    client.retries = 2  # (5 by default, 2 s of waits)
    with pytest.raises(OSError):
      client.ls("bucket")
    assert len(hits) == 2, hits
  finally:
    server.shutdown()
    server.server_close()
