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

import asyncio
import re
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

  Attributes:
    url: `http://127.0.0.1:<port>` once started.
    down: Bytes sent from the target to clients.
    up: Bytes sent from clients to the target.
    connections: Connections accepted.
    request_lines: ("GET /path HTTP/1.1", "bytes=0-99" or None) per request.
    max_open: The most connections open at once.
  """

  def __init__(self, target_port: int, *, rtt: float = 0.0,
               rate: Optional[float] = None):
    self.target_port = target_port
    self.rtt = rtt
    self.rate = rate
    self.url = ""
    self._loop: Optional[asyncio.AbstractEventLoop] = None
    self._thread: Optional[threading.Thread] = None
    self._server = None
    self._lock = threading.Lock()
    self._open = 0
    self.reset()

  def reset(self) -> None:
    """Sets every counter back to zero."""
    with getattr(self, "_lock", threading.Lock()):
      self.down = self.up = self.connections = 0
      self.max_open = getattr(self, "_open", 0)
      self.request_lines: list[tuple[str, Optional[str]]] = []

  @property
  def requests(self) -> int:
    return len(self.request_lines)

  def start(self) -> "LinkProxy":
    ready = threading.Event()

    def run() -> None:
      self._loop = asyncio.new_event_loop()
      asyncio.set_event_loop(self._loop)
      self._server = self._loop.run_until_complete(asyncio.start_server(
          self._handle, "127.0.0.1", 0, limit=_CHUNK))
      port = self._server.sockets[0].getsockname()[1]
      self.url = f"http://127.0.0.1:{port}"
      ready.set()
      self._loop.run_forever()

    self._thread = threading.Thread(target=run, daemon=True,
                                    name="link-proxy")
    self._thread.start()
    if not ready.wait(10):
      raise RuntimeError("the proxy did not start")
    return self

  def stop(self) -> None:
    if self._loop is None:
      return

    async def close() -> None:
      self._server.close()
      tasks = [t for t in asyncio.all_tasks()
               if t is not asyncio.current_task()]
      for task in tasks:
        task.cancel()
      await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._thread.join(10)
    self._loop.close()
    self._loop = None

  def __enter__(self) -> "LinkProxy":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

  # -- forwarding ---------------------------------------------------------------

  async def _handle(self, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> None:
    try:
      up_reader, up_writer = await asyncio.open_connection(
          "127.0.0.1", self.target_port, limit=_CHUNK)
    except OSError:
      writer.close()
      return
    with self._lock:
      self.connections += 1
      self._open += 1
      self.max_open = max(self.max_open, self._open)
    try:
      await asyncio.gather(self._pump(reader, up_writer, True),
                           self._pump(up_reader, writer, False))
    except (OSError, asyncio.CancelledError):
      pass
    finally:  # pylint: disable=lost-exception
      with self._lock:
        self._open -= 1
      for w in (writer, up_writer):
        w.close()

  async def _pump(self, reader: asyncio.StreamReader,
                  writer: asyncio.StreamWriter, upward: bool) -> None:
    """Copies one direction, delayed by rtt/2 and paced to `rate`."""
    queue: asyncio.Queue = asyncio.Queue()
    pending = b""

    async def receive() -> None:
      nonlocal pending
      while True:
        data = await reader.read(_CHUNK)
        queue.put_nowait((time.monotonic(), data))
        if not data:
          return
        if upward:
          pending = self._note_requests(pending + data)

    receiving = asyncio.ensure_future(receive())
    sent = 0
    started = None
    try:
      while True:
        arrived, data = await queue.get()
        if not data:
          break
        wait = arrived + self.rtt / 2 - time.monotonic()
        if wait > 0:
          await asyncio.sleep(wait)
        if self.rate:
          now = time.monotonic()
          if started is None or now - started > sent / self.rate + 0.05:
            started, sent = now, 0  # idle: the link was free meanwhile
          sent += len(data)
          ahead = started + sent / self.rate - time.monotonic()
          if ahead > 0:
            await asyncio.sleep(ahead)
        writer.write(data)
        await writer.drain()
        with self._lock:
          if upward:
            self.up += len(data)
          else:
            self.down += len(data)
    finally:
      receiving.cancel()
      try:
        await asyncio.gather(receiving, return_exceptions=True)
      except asyncio.CancelledError:
        pass
      try:
        writer.write_eof()
      except (OSError, RuntimeError):
        pass

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
