"""A TCP proxy on 127.0.0.1 that counts what crosses it, and can slow it down.

Put in front of an emulator (tests/emulators.py), it counts the bytes each
way, the connections and the HTTP requests (their request lines and `Range`
headers are kept), so that tests can check what a read downloads and how many
round trips it makes. With `rtt` and `rate` it also models a network link:
every chunk is delayed by half the round trip in each direction (requests in
flight overlap, as on a real link), and each connection carries at most
`rate` bytes per second each way.

Synopsis::

  proxy = LinkProxy(emulator.port, rtt=0.030, rate=60e6)
  proxy.start()                          # proxy.url: http://127.0.0.1:<port>
  ...                                    # point the client at proxy.url
  print(proxy.down, proxy.requests, proxy.request_lines)
  proxy.stop()
"""

from __future__ import annotations

import queue
import re
import socket
import threading
import time
from typing import Optional

_CHUNK = 256 * 2**10
_REQUEST = re.compile(
    rb"(?:^|\r\n)((?:GET|HEAD|POST|PUT|PATCH|DELETE) \S+ HTTP/1\.[01])\r\n"
    rb"((?:[^\r\n]+\r\n)*?)\r\n")
_RANGE = re.compile(rb"(?im)^range: *([^\r\n]+)")
_LENGTH = re.compile(rb"(?im)^content-length: *(\d+)")
# A request whose body is at least this long counts as an upload.
UPLOAD_BYTES = 2**20


class LinkProxy:
  """Forwards 127.0.0.1:<port> to 127.0.0.1:`target_port`, counting.

  Plain threads and sockets: two per direction of each connection when the
  link is shaped (one receives, one sends when each chunk is due), one
  otherwise.

  Attributes:
    url: `http://127.0.0.1:<port>` once started.
    down: Bytes sent from the target to clients.
    up: Bytes sent from clients to the target.
    connections: Connections accepted.
    request_lines: ("GET /path HTTP/1.1", "bytes=0-99" or None) per request.
    request_times: When each of them reached the proxy (`time.monotonic()`).
    max_open: The most connections opened since the last `reset` open at
      once.
    uploads: [request line, body bytes, start, end, reset generation] per
      request with a body of at least `UPLOAD_BYTES`: from its headers
      arriving at the proxy to its final response's first bytes
      (`time.monotonic()`; end None while it runs).
    max_uploads: The most such uploads in flight at once.
  """

  def __init__(self, target_port: int, *, rtt: float = 0.0,
               rate: Optional[float] = None):
    self.target_port = target_port
    self.rtt = rtt
    self.rate = rate
    self.url = ""
    self._lock = threading.Lock()
    self._open = 0
    self._stopping = threading.Event()
    self._listener: Optional[socket.socket] = None
    self._sockets: set = set()
    self._threads: list = []
    self.reset()

  def reset(self) -> None:
    """Sets every counter back to zero."""
    with self._lock:
      self.down = self.up = self.connections = 0
      # Connections opened before this reset (a client's pool) are not
      # counted in max_open.
      self._generation = getattr(self, "_generation", 0) + 1
      self._open_now = 0
      self.max_open = 0
      self.request_lines: list[tuple[str, Optional[str]]] = []
      self.request_times: list[float] = []
      self.uploads: list[list] = []
      self._uploading = 0
      self.max_uploads = 0

  @property
  def requests(self) -> int:
    return len(self.request_lines)

  def start(self) -> "LinkProxy":
    self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    self._listener.bind(("127.0.0.1", 0))
    self._listener.listen(128)
    self._listener.settimeout(0.2)
    self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
    self._spawn(self._accept)
    return self

  def stop(self) -> None:
    self._stopping.set()
    with self._lock:
      sockets = list(self._sockets)
    for sock in sockets:
      try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv
      except OSError:
        pass
      _close(sock)
    deadline = time.monotonic() + 5
    for thread in list(self._threads):
      thread.join(max(0.0, deadline - time.monotonic()))
    if self._listener is not None:
      _close(self._listener)

  def __enter__(self) -> "LinkProxy":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

  # -- forwarding ---------------------------------------------------------------

  def _spawn(self, target, *args) -> None:
    thread = threading.Thread(target=target, args=args, daemon=True,
                              name="link-proxy")
    self._threads.append(thread)
    thread.start()

  def _accept(self) -> None:
    while not self._stopping.is_set():
      try:
        client, _ = self._listener.accept()
      except socket.timeout:
        continue
      except OSError:
        return
      try:
        upstream = socket.create_connection(("127.0.0.1", self.target_port))
      except OSError:
        _close(client)
        continue
      for sock in (client, upstream):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      done: list = []
      # The connection's upload in flight, and where its request parser is.
      state = {"upload": None, "buf": b"", "body": 0}
      with self._lock:
        self.connections += 1
        self._open += 1
        self._open_now += 1
        self.max_open = max(self.max_open, self._open_now)
        self._sockets.update((client, upstream))
        done.append(self._generation)
      self._spawn(self._pipe, client, upstream, True, done, state)
      self._spawn(self._pipe, upstream, client, False, done, state)

  def _pipe(self, src: socket.socket, dst: socket.socket, upward: bool,
            done: list, state: dict) -> None:
    shaped = self.rtt > 0 or self.rate
    chunks: queue.Queue = queue.Queue()
    if shaped:
      self._spawn(self._send_when_due, chunks, dst, upward)
    try:
      while True:
        try:
          data = src.recv(_CHUNK)
        except OSError:
          data = b""
        if upward and data:
          self._note_requests(data, state)
        elif data and state["upload"] is not None and data.startswith(
            b"HTTP/1.") and data[9:10] != b"1":  # not "100 Continue"
          self._upload_answered(state)
        if shaped:
          chunks.put((time.monotonic(), data))
        elif data:
          # Counted before it is passed on: a client that has its bytes
          # finds them counted (counting after the send raced with it).
          self._count(upward, len(data))
          try:
            dst.sendall(data)
          except OSError:
            data = b""
        if not data:
          break
    finally:
      if not shaped:
        self._finish(src, dst, done)
      else:
        chunks.put((None, (src, done)))

  def _send_when_due(self, chunks: queue.Queue, dst: socket.socket,
                     upward: bool) -> None:
    """Sends each chunk rtt/2 after it arrived, at most `rate` bytes/s."""
    sent, started = 0, None
    broken = False
    while True:
      arrived, data = chunks.get()
      if arrived is None:
        src, done = data
        self._finish(src, dst, done)
        return
      if broken or not data:
        continue
      wait = arrived + self.rtt / 2 - time.monotonic()
      if wait > 0:
        time.sleep(wait)
      if self.rate:
        now = time.monotonic()
        if started is None or now - started > sent / self.rate + 0.05:
          started, sent = now, 0  # idle: the link was free meanwhile
        sent += len(data)
        ahead = started + sent / self.rate - time.monotonic()
        if ahead > 0:
          time.sleep(ahead)
      self._count(upward, len(data))  # before the client can have it
      try:
        dst.sendall(data)
      except OSError:
        broken = True
        continue

  def _count(self, upward: bool, n: int) -> None:
    with self._lock:
      if upward:
        self.up += n
      else:
        self.down += n

  def _finish(self, src: socket.socket, dst: socket.socket,
              done: list) -> None:
    """Passes the end on; closes both sockets when both directions ended."""
    try:
      dst.shutdown(socket.SHUT_WR)
    except OSError:
      pass
    with self._lock:
      done.append(src)
      last = len(done) == 3  # the generation, then both directions
      if last:
        self._open -= 1
        if done[0] == self._generation:
          self._open_now -= 1
        self._sockets.difference_update((src, dst))
    if last:
      _close(src)
      _close(dst)

  def _upload_answered(self, state: dict) -> None:
    """The connection's upload got its response: it is no longer in flight."""
    with self._lock:
      upload, state["upload"] = state["upload"], None
      if upload is not None:
        upload[3] = time.monotonic()
        if upload[4] == self._generation:
          self._uploading -= 1

  def _note_requests(self, data: bytes, state: dict) -> None:
    """Records each request as its headers complete, skipping bodies.

    A body of known length (`Content-Length`) is skipped by counting, so
    that a request following a body in the same read is found; a body of
    unknown length (chunked) is searched for request lines instead.
    """
    found = []
    while data:
      if state["body"] > 0:
        n = min(state["body"], len(data))
        state["body"] -= n
        data = data[n:]
        continue
      buf = state["buf"] + data
      if state["body"] < 0:  # chunked: look for the next request line
        m = re.search(rb"\r\n(?=(?:GET|HEAD|POST|PUT|PATCH|DELETE) \S+ "
                      rb"HTTP/1\.[01]\r\n)", buf)
        if m is None:
          state["buf"] = buf[-8192:]
          break
        buf, state["body"] = buf[m.end():], 0
      end = buf.find(b"\r\n\r\n")
      if end < 0:
        state["buf"] = buf[-65536:]
        break
      state["buf"] = b""
      head, data = buf[:end + 2], buf[end + 4:]
      m = _REQUEST.search(b"\r\n" + head + b"\r\n")
      if m is None:  # not a request we know: skip its headers
        continue
      rng = _RANGE.search(m.group(2))
      length = _LENGTH.search(m.group(2))
      state["body"] = int(length.group(1)) if length else (
          -1 if re.search(rb"(?im)^transfer-encoding: *chunked", head)
          else 0)
      found.append((m.group(1).decode("latin-1"),
                    rng.group(1).decode("latin-1") if rng else None,
                    int(length.group(1)) if length else 0))
    if found:
      with self._lock:
        self.request_lines.extend((line, rng) for line, rng, _ in found)
        self.request_times.extend([time.monotonic()] * len(found))
        for line, _, length in found:
          if length >= UPLOAD_BYTES and state["upload"] is None:
            upload = [line, length, time.monotonic(), None, self._generation]
            state["upload"] = upload
            self.uploads.append(upload)
            self._uploading += 1
            self.max_uploads = max(self.max_uploads, self._uploading)


def _close(sock: socket.socket) -> None:
  try:
    sock.close()
  except OSError:
    pass
