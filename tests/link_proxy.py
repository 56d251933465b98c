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
    max_open: The most connections opened since the last `reset` open at
      once.
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
      with self._lock:
        self.connections += 1
        self._open += 1
        self._open_now += 1
        self.max_open = max(self.max_open, self._open_now)
        self._sockets.update((client, upstream))
        done.append(self._generation)
      self._spawn(self._pipe, client, upstream, True, done)
      self._spawn(self._pipe, upstream, client, False, done)

  def _pipe(self, src: socket.socket, dst: socket.socket, upward: bool,
            done: list) -> None:
    shaped = self.rtt > 0 or self.rate
    chunks: queue.Queue = queue.Queue()
    if shaped:
      self._spawn(self._send_when_due, chunks, dst, upward)
    pending = b""
    try:
      while True:
        try:
          data = src.recv(_CHUNK)
        except OSError:
          data = b""
        if upward and data:
          pending = self._note_requests(pending + data)
        if shaped:
          chunks.put((time.monotonic(), data))
        elif data:
          try:
            dst.sendall(data)
          except OSError:
            data = b""
          self._count(upward, len(data))
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
      try:
        dst.sendall(data)
      except OSError:
        broken = True
        continue
      self._count(upward, len(data))

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

  def _note_requests(self, data: bytes) -> bytes:
    """Records the requests whose headers are complete; returns the tail."""
    if b" HTTP/1." not in data:  # a body: skip the (slow) pattern
      return data[-8192:]
    end = 0
    found = []
    for m in _REQUEST.finditer(data):
      rng = _RANGE.search(m.group(2))
      found.append((m.group(1).decode("latin-1"),
                    rng.group(1).decode("latin-1") if rng else None))
      end = m.end()
    if found:
      with self._lock:
        self.request_lines.extend(found)
    tail = data[end:]
    return tail[-8192:]  # a request line split across reads


def _close(sock: socket.socket) -> None:
  try:
    sock.close()
  except OSError:
    pass
