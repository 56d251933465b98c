"""What one bucket operation keeps (`clu_ckpt.bucket_cache`), and when it forgets.

The back end (`fsspec_fs.FsspecFileSystem`) runs here on fsspec's own
in-memory file system instead of an emulator (`MemoryBucket`: the same
fsspec calls, no process to start), with every call the back end makes to it
counted, so that each test can say what was asked of the store and what was
answered from the cache. The emulator tests of the same paths are in
`test_bucket_reads.py` and `test_fsspec_fs.py`.
"""

import collections
import os
import threading

import pytest
from fsspec.implementations import memory

from clu_ckpt import bucket_cache
from clu_ckpt import errors
from clu_ckpt import fsspec_fs


class CountingMemory(memory.MemoryFileSystem):
  """fsspec's in-memory file system with a store of its own, counting calls.

  `calls[name]` counts the back end's calls of `name` (not the file system's
  calls of its own methods); `reads` lists each `cat_file`'s (path, start,
  end). `fail` (an exception) is raised by the next call, once.
  """

  cachable = False  # fsspec would hand every test the same instance

  def __init__(self):
    super().__init__()
    self.store = {}
    self.pseudo_dirs = [""]
    self.calls = collections.Counter()
    self.reads = []
    self.fail = None
    self.in_flight = 0
    self.peak = 0
    self.hold = None  # a threading.Event each read waits for, if set
    self._count_lock = threading.Lock()
    self._depth = threading.local()

  def _counted(name):  # pylint: disable=no-self-argument
    def method(self, *args, **kwargs):
      depth = getattr(self._depth, "n", 0)
      if depth == 0:
        self.calls[name] += 1
        if self.fail is not None:
          fail, self.fail = self.fail, None
          raise fail
      self._depth.n = depth + 1
      try:
        found = getattr(memory.MemoryFileSystem, name)(self, *args, **kwargs)
      finally:
        self._depth.n = depth
      if depth == 0 and isinstance(found, list):
        # Names as gcsfs and s3fs give them: `bucket/key`, no leading `/`.
        found = [f.lstrip("/") if isinstance(f, str) else f for f in found]
      return found
    method.__name__ = name
    return method

  info = _counted("info")
  ls = _counted("ls")
  exists = _counted("exists")
  isdir = _counted("isdir")
  glob = _counted("glob")
  find = _counted("find")
  rm_file = _counted("rm_file")
  rm = _counted("rm")
  _cat_file = _counted("cat_file")

  def cat_file(self, path, start=None, end=None, **kwargs):
    with self._count_lock:
      self.reads.append((path, start, end))
      self.in_flight += 1
      self.peak = max(self.peak, self.in_flight)
    try:
      if self.hold is not None:
        assert self.hold.wait(60), "reads held too long"
      return self._cat_file(path, start=start, end=end, **kwargs)
    finally:
      with self._count_lock:
        self.in_flight -= 1

  def put_object(self, key: str, data: bytes) -> None:
    """Another process's write: straight into the store, past the back end."""
    memory.MemoryFileSystem.pipe_file(self, key, data)


class MemoryBucket(fsspec_fs.FsspecFileSystem):
  """The bucket back end with fsspec's in-memory file system as its client."""

  def __init__(self, scheme: str = "gs"):
    super().__init__(scheme)
    self.store = CountingMemory()

  def _make(self):
    return self.store


@pytest.fixture
def bucket():
  return MemoryBucket("gs")


def _put(bucket_, name, data):
  bucket_.store.put_object(f"bk/{name}", data)
  return f"gs://bk/{name}"


# -- metadata_cache ----------------------------------------------------------


def test_metadata_is_asked_once_per_block_and_afresh_outside(bucket):
  url = _put(bucket, "run/a", b"0123456789")
  _put(bucket, "run/b", b"x")
  assert bucket.exists(url) and bucket.exists(url)
  assert bucket.store.calls["info"] == 2  # outside a block: each time
  bucket.store.calls.clear()
  with bucket_cache.metadata_cache():
    for _ in range(3):
      assert bucket.exists(url)
      assert not bucket.isdir(url)  # its own answer, not exists' True
      assert bucket.stat(url)[0] == 10
      assert bucket.listdir("gs://bk/run") == ["a", "b"]
      assert bucket.listdir("gs://bk/run/") == ["a", "b"]  # the same key
      assert bucket.glob("gs://bk/run/*") == ["gs://bk/run/a",
                                               "gs://bk/run/b"]
    # The glob of a listed directory is answered by its listing.
    assert bucket.store.calls == {"info": 1, "ls": 1}, (
        bucket.store.calls)
  bucket.store.calls.clear()
  assert bucket.exists(url) and bucket.listdir("gs://bk/run") == ["a", "b"]
  assert bucket.store.calls == {"info": 1, "ls": 1}, bucket.store.calls


def test_each_path_has_its_own_answer_whatever_it_ends_with(bucket):
  _put(bucket, "run/a", b"abc")
  with bucket_cache.metadata_cache():
    assert bucket.exists("gs://bk/run/a")
    for other in ("gs://bk/run/aX", "gs://bk/run/a ", "gs://bk/run/a\t",
                  "gs://bk/run/a/X"):
      assert not bucket.exists(other), other


def test_blocks_nest_and_the_outermost_keeps_the_answers(bucket):
  url = _put(bucket, "run/a", b"abc")
  with bucket_cache.metadata_cache():
    assert bucket.exists(url)
    with bucket_cache.metadata_cache():
      assert bucket.exists(url)  # the outer block's answer
      assert bucket.listdir("gs://bk/run") == ["a"]
    assert bucket.listdir("gs://bk/run") == ["a"]  # the inner one's, kept
    assert bucket.store.calls == {"info": 1, "ls": 1}, bucket.store.calls
  assert bucket.exists(url)
  assert bucket.store.calls == {"info": 2, "ls": 1}, bucket.store.calls


def test_another_process_write_is_seen_outside_a_block_at_once(bucket):
  assert not bucket.exists("gs://bk/run/a")
  with bucket_cache.metadata_cache():
    assert not bucket.exists("gs://bk/run/a")
    _put(bucket, "run/a", b"new")
    assert not bucket.exists("gs://bk/run/a")  # kept: the block's promise
  assert bucket.exists("gs://bk/run/a")


def test_a_write_or_removal_through_the_back_end_is_seen_next(bucket):
  url = _put(bucket, "run/a", b"abc")
  with bucket_cache.metadata_cache():
    assert bucket.listdir("gs://bk/run") == ["a"]
    with bucket.atomic_writer("gs://bk/run/b") as write:
      write(b"bb")
    assert bucket.listdir("gs://bk/run") == ["a", "b"]
    assert bucket.stat("gs://bk/run/b")[0] == 2
    with bucket.atomic_writer("gs://bk/run/b") as write:
      write(b"bbbb")
    assert bucket.stat("gs://bk/run/b")[0] == 4  # not the kept 2
    bucket.remove(url)
    assert not bucket.exists(url)
    assert bucket.listdir("gs://bk/run") == ["b"]
    bucket.create_exclusive("gs://bk/run/c", b"c")
    assert bucket.exists("gs://bk/run/c")
    bucket.remove_tree("gs://bk/run")
    assert not any(bucket.exists(f"gs://bk/run/{name}") for name in "bc")


def test_missing_and_prefix_answers_are_kept_other_errors_are_not(bucket):
  _put(bucket, "run/sub/a", b"abc")
  with bucket_cache.metadata_cache():
    for _ in range(2):
      with pytest.raises(FileNotFoundError) as missing:
        bucket.stat("gs://bk/run/nothing")
      assert missing.value.filename == "gs://bk/run/nothing"
      with pytest.raises(errors.NotRegularFileError) as prefix:
        bucket.stat("gs://bk/run/sub")
      assert "gs://bk/run/sub" in str(prefix.value)
    assert bucket.store.calls["info"] == 2, bucket.store.calls
    # A failure of the link is not an answer: the next question asks again.
    bucket.store.fail = ConnectionResetError(104, "link reset")
    with pytest.raises(OSError, match="link reset"):
      bucket.stat("gs://bk/run/sub/a")
    assert bucket.stat("gs://bk/run/sub/a")[0] == 3
    assert bucket.store.calls["info"] == 4, bucket.store.calls


def test_a_listing_kept_is_not_changed_by_its_caller(bucket):
  _put(bucket, "run/a", b"abc")
  with bucket_cache.metadata_cache():
    names = bucket.listdir("gs://bk/run")
    names.append("b")
    assert bucket.listdir("gs://bk/run") == ["a"]
    found = bucket.glob("gs://bk/run/*")
    found.clear()
    assert bucket.glob("gs://bk/run/*") == ["gs://bk/run/a"]


def test_answers_are_kept_per_scheme(bucket):
  s3 = MemoryBucket("s3")
  _put(bucket, "run/a", b"abc")  # only on gs://
  with bucket_cache.metadata_cache():
    assert bucket.exists("gs://bk/run/a")
    assert not s3.exists("s3://bk/run/a")
    assert bucket.listdir("gs://bk/run") == ["a"]
    with pytest.raises(FileNotFoundError):
      s3.listdir("s3://bk/run")


def test_kept_methods_keep_their_names_and_documentation():
  for name in ("exists", "isdir", "listdir", "glob", "_asked_info"):
    method = getattr(fsspec_fs.FsspecFileSystem, name)
    assert method.__name__ == name
  assert fsspec_fs.FsspecFileSystem.glob.__doc__.startswith(
      "The objects and prefixes matching `pattern`")


def test_forget_outside_any_block_does_nothing():
  bucket_cache.forget("gs://bk/run/a")
  bucket_cache.forget("gs://bk/run", tree=True)
  bucket_cache.forget()
  assert bucket_cache.cached_object("gs://bk/run/a") is None
  assert not bucket_cache.caching_objects("gs://bk/run/a")


# -- object_cache ------------------------------------------------------------


def test_small_objects_under_the_run_are_downloaded_once(bucket):
  data = bytes(range(256)) * 4
  url = _put(bucket, "run/ckpt-1.index", data)
  with bucket_cache.object_cache("gs://bk/run"):
    assert bucket.read_bytes(url) == data
    # Every range at the object's edges, from the copy kept.
    assert bucket.read_bytes(url, 0, 1) == data[:1]
    assert bucket.read_bytes(url, 1023, 1) == data[1023:]
    assert bucket.read_bytes(url, 1000) == data[1000:]
    assert bucket.read_bytes(url, 5, 1019) == data[5:]
    assert bucket.read_bytes(url, 5, 2000) == data[5:]
    assert bucket.read_bytes(url, 17, 0) == b""
    assert bytes(bucket.map(url)) == data
    spool = bucket.spool(url)
    spool.fill()
    assert bytes(spool.map) == data and spool.requests == 0
    assert bucket.stat(url)[0] == len(data)
    assert bucket_cache.cached_object(url)[1] == data
    assert len(bucket.store.reads) == 1 and bucket.store.calls["info"] == 1, (
        bucket.store.reads, bucket.store.calls)
  bucket.store.reads.clear()
  assert bucket.read_bytes(url, 1, 2) == data[1:3]
  assert bucket.read_bytes(url, 1, 2) == data[1:3]
  assert bucket.store.reads == [("bk/run/ckpt-1.index", 1, 3)] * 2
  assert bucket_cache.cached_object(url) is None


def test_a_write_or_removal_is_never_answered_from_the_copy(bucket):
  url = _put(bucket, "run/ckpt-1.index", b"old bytes")
  with bucket_cache.object_cache("gs://bk/run"):
    assert bucket.read_bytes(url) == b"old bytes"
    with bucket.atomic_writer(url) as write:
      write(b"new")
    assert bucket.read_bytes(url) == b"new"
    assert bucket.read_bytes(url, 1, 5) == b"ew"
    assert bytes(bucket.map(url)) == b"new"
    bucket.remove(url)
    with pytest.raises(FileNotFoundError) as missing:
      bucket.read_bytes(url)
    assert missing.value.filename == url
    bucket.create_exclusive(url, b"again")
    assert bucket.read_bytes(url) == b"again"


def test_removing_a_tree_forgets_its_objects_not_a_siblings(bucket):
  inside = [_put(bucket, name, name.encode()) for name in (
      "run/a/x", "run/a/y/z")]
  sibling = _put(bucket, "run/ab", b"sibling")
  with bucket_cache.object_cache("gs://bk/run"):
    for url in inside + [sibling]:
      bucket.read_bytes(url)
    bucket.remove_tree("gs://bk/run/a/")
    for url in inside:
      with pytest.raises(FileNotFoundError):
        bucket.read_bytes(url)
    bucket.store.reads.clear()
    assert bucket.read_bytes(sibling) == b"sibling"
    assert bucket.store.reads == []  # still kept


def test_only_the_run_and_its_hosts_are_kept_never_the_destination(bucket):
  names = ("run/a", "run-1/a", "run-12/a", "run2/a", "run-x/a", "run/dst/a",
           "run/dst2/a", "other/a")
  urls = {name: _put(bucket, name, name.encode()) for name in names}
  with bucket_cache.object_cache("gs://bk/run/", but_not="gs://bk/run/dst/"):
    for _ in range(2):
      for name, url in urls.items():
        assert bucket.read_bytes(url) == name.encode()
  got = collections.Counter(path for path, _, _ in bucket.store.reads)
  assert got == {"bk/run/a": 1, "bk/run-1/a": 1, "bk/run-12/a": 1,
                 "bk/run/dst2/a": 1, "bk/run2/a": 2, "bk/run-x/a": 2,
                 "bk/run/dst/a": 2, "bk/other/a": 2}, got


def test_prefixes_are_taken_as_given_whatever_they_end_with():
  with bucket_cache.object_cache("gs://bk/runX", but_not="gs://bk/runX/dstX"):
    kept = {key: bucket_cache.caching_objects(key) for key in (
        "gs://bk/runX/a", "gs://bk/runX-1/a", "gs://bk/run/a",
        "gs://bk/runX/dst/a", "gs://bk/runX/dstX/a")}
  assert kept == {"gs://bk/runX/a": True, "gs://bk/runX-1/a": True,
                  "gs://bk/run/a": False, "gs://bk/runX/dst/a": True,
                  "gs://bk/runX/dstX/a": False}
  with bucket_cache.object_cache("gs://bk/run", but_not=""):
    assert bucket_cache.caching_objects("gs://bk/run/a")


def test_passing_through_downloads_nothing_whole_but_serves_what_is_kept(
    bucket):
  kept = _put(bucket, "run/kept", b"kept bytes")
  peeked = _put(bucket, "run/peeked", b"peeked bytes")
  with bucket_cache.object_cache("gs://bk/run"):
    assert bucket.read_bytes(kept) == b"kept bytes"
    with bucket_cache.passing_through():
      assert not bucket_cache.caching_objects(peeked)
      assert bucket.read_bytes(peeked, 0, 6) == b"peeked"
      assert bytes(bucket.map(kept)) == b"kept bytes"  # no request
    assert bucket.store.reads == [("bk/run/kept", None, None),
                                  ("bk/run/peeked", None, 6)]
    assert bucket_cache.cached_object(peeked) is None
    assert bucket_cache.caching_objects(peeked)  # after the block: again
    assert bucket.read_bytes(peeked, 0, 6) == b"peeked"
    assert bucket.read_bytes(peeked, 7) == b"bytes"
    assert bucket.store.reads[2:] == [("bk/run/peeked", None, None)]


def test_a_nested_block_keeps_the_outer_objects_and_adds_its_exclusion(
    bucket):
  source = _put(bucket, "run/ckpt-1.index", b"source")
  lock = _put(bucket, "run/dst/lock", b"one")
  with bucket_cache.object_cache("gs://bk/run"):
    assert bucket.read_bytes(source) == b"source"
    assert bucket.read_bytes(lock) == b"one"
    with bucket_cache.object_cache("gs://bk/elsewhere",
                                   but_not="gs://bk/run/dst/"):
      assert bucket_cache.cached_object(lock) is None  # forgotten
      assert bucket_cache.cached_object(source)[1] == b"source"
      assert bucket_cache.caching_objects(source)  # the outer prefix
      assert not bucket_cache.caching_objects("gs://bk/elsewhere/a")
      _put(bucket, "run/dst/lock", b"two")
      assert bucket.read_bytes(lock) == b"two"
      assert bucket_cache.cached_object(lock) is None
    assert bucket_cache.caching_objects(lock)
    with bucket_cache.object_cache("gs://bk/run", but_not="gs://bk/run/dst"):
      assert not bucket_cache.caching_objects(lock)
      assert bucket_cache.caching_objects("gs://bk/run/dst2/a")  # a sibling
    with bucket_cache.object_cache("gs://bk/run"):  # no exclusion
      assert bucket_cache.cached_object(source)[1] == b"source"
  assert bucket_cache.cached_object(source) is None


def test_the_cache_holds_at_most_its_limit_least_recently_used_dropped(
    monkeypatch):
  monkeypatch.setattr(bucket_cache, "OBJECT_CACHE_BYTES", 10)
  info = {"size": 4}
  with bucket_cache.object_cache("gs://bk/run"):
    bucket_cache.keep_object("gs://bk/run/a", info, b"aaaa")
    bucket_cache.keep_object("gs://bk/run/b", info, b"bbbb")
    assert bucket_cache.cached_object("gs://bk/run/a") == (info, b"aaaa")
    bucket_cache.keep_object("gs://bk/run/c", info, b"cccc")  # 12 > 10
    held = {k: bucket_cache.cached_object(f"gs://bk/run/{k}") for k in "abc"}
    assert held == {"a": (info, b"aaaa"), "b": None, "c": (info, b"cccc")}
    # Kept again (new bytes): counted once.
    bucket_cache.keep_object("gs://bk/run/a", info, b"AAAA")
    bucket_cache.keep_object("gs://bk/run/d", {"size": 2}, b"dd")  # 10
    held = {k: bucket_cache.cached_object(f"gs://bk/run/{k}") for k in "acd"}
    assert held == {"a": (info, b"AAAA"), "c": (info, b"cccc"),
                    "d": ({"size": 2}, b"dd")}
    # Larger than the whole cache: not kept, nothing dropped for it.
    bucket_cache.keep_object("gs://bk/run/e", {}, b"e" * 11)
    assert bucket_cache.cached_object("gs://bk/run/e") is None
    assert all(bucket_cache.cached_object(f"gs://bk/run/{k}") for k in "acd")
    # Exactly the limit: kept, alone.
    bucket_cache.keep_object("gs://bk/run/f", {}, b"f" * 10)
    assert bucket_cache.cached_object("gs://bk/run/f") == ({}, b"f" * 10)
    assert not any(bucket_cache.cached_object(f"gs://bk/run/{k}")
                   for k in "acd")


def test_forgetting_frees_room_and_a_tree_is_its_own_objects_only(
    monkeypatch):
  monkeypatch.setattr(bucket_cache, "OBJECT_CACHE_BYTES", 12)
  keys = ["gs://bk/run/a", "gs://bk/run/a/x", "gs://bk/run/ab"]
  with bucket_cache.object_cache("gs://bk/run"):
    for key in keys:
      bucket_cache.keep_object(key, {}, b"4444")
    bucket_cache.forget("gs://bk/run/a")  # that object only
    assert [bucket_cache.cached_object(k) is not None for k in keys] == [
        False, True, True]
    bucket_cache.forget("")  # metadata only
    assert bucket_cache.cached_object("gs://bk/run/ab") is not None
    bucket_cache.keep_object("gs://bk/run/a", {}, b"4444")
    bucket_cache.forget("gs://bk/run/a", tree=True)
    assert [bucket_cache.cached_object(k) is not None for k in keys] == [
        False, False, True]
    # What was forgotten no longer counts: 3 x 4 bytes fit again.
    bucket_cache.keep_object("gs://bk/run/c", {}, b"4444")
    bucket_cache.keep_object("gs://bk/run/d", {}, b"4444")
    assert all(bucket_cache.cached_object(k) is not None for k in (
        "gs://bk/run/ab", "gs://bk/run/c", "gs://bk/run/d"))
    # ... and no more than that: one more drops the oldest (12 bytes held).
    bucket_cache.forget("gs://bk/run/d")
    bucket_cache.keep_object("gs://bk/run/e", {}, b"4444")
    bucket_cache.keep_object("gs://bk/run/f", {}, b"4444")
    assert [bucket_cache.cached_object(f"gs://bk/run/{k}") is not None
            for k in ("ab", "c", "e", "f")] == [False, True, True, True]


def test_an_object_and_the_objects_under_its_name_are_kept_apart():
  with bucket_cache.object_cache("gs://bk/run"):
    bucket_cache.keep_object("gs://bk/run/a/x", {}, b"under")
    bucket_cache.keep_object("gs://bk/run/a", {}, b"object")
    bucket_cache.forget("gs://bk/run/aX", tree=True)
    bucket_cache.forget("gs://bk/run/a/x/y", tree=True)
    assert bucket_cache.cached_object("gs://bk/run/a/x") == ({}, b"under")
    assert bucket_cache.cached_object("gs://bk/run/a") == ({}, b"object")


def test_only_small_objects_are_kept(monkeypatch):
  monkeypatch.setattr(bucket_cache, "SMALL_OBJECT_BYTES", 4)
  with bucket_cache.object_cache("gs://bk/run"):
    bucket_cache.keep_object("gs://bk/run/a", {}, b"4444")
    bucket_cache.keep_object("gs://bk/run/b", {}, b"55555")
    bucket_cache.keep_object("gs://bk/other/c", {}, b"1")
    assert bucket_cache.cached_object("gs://bk/run/a") == ({}, b"4444")
    assert bucket_cache.cached_object("gs://bk/run/b") is None
    assert bucket_cache.cached_object("gs://bk/other/c") is None
  bucket_cache.keep_object("gs://bk/run/a", {}, b"4444")  # no block: no-op
  assert bucket_cache.cached_object("gs://bk/run/a") is None


def test_a_large_object_is_read_by_ranges_in_a_block(bucket, monkeypatch):
  monkeypatch.setattr(bucket_cache, "SMALL_OBJECT_BYTES", 8)
  url = _put(bucket, "run/ckpt-1.flax", b"0123456789")
  with bucket_cache.object_cache("gs://bk/run"):
    assert bucket.read_bytes(url, 2, 3) == b"234"
    assert bucket.read_bytes(url, 2, 3) == b"234"
  assert bucket.store.reads == [("bk/run/ckpt-1.flax", 2, 5)] * 2


def test_an_empty_object_is_kept_and_a_spool_of_it_asks_nothing(bucket):
  url = _put(bucket, "run/empty", b"")
  with bucket_cache.object_cache("gs://bk/run"):
    spool = bucket.spool(url)  # its size is known: nothing to download
    assert spool.size == 0 and bytes(spool.map) == b""
    assert bucket.store.reads == []
    assert bucket_cache.cached_object(url) is None
    for _ in range(2):  # read whole once, then kept (0 bytes is its size)
      assert bucket.read_bytes(url) == b""
    assert bucket.store.reads == [("bk/run/empty", None, None)]
    assert bucket_cache.cached_object(url)[1] == b""


def test_a_write_or_removal_forgets_that_object_not_those_under_its_name(
    bucket):
  url = _put(bucket, "run/a", b"object")
  _put(bucket, "run/b", b"b")  # the bucket stays when `a` goes
  under = "gs://bk/run/a/x"  # (the memory store cannot hold both: kept only)

  def write():
    with bucket.atomic_writer(url) as write_:
      write_(b"new")
  with bucket_cache.object_cache("gs://bk/run"):
    bucket_cache.keep_object(under, {"size": 5}, b"under")
    for change in (lambda: bucket.remove(url),
                   lambda: bucket.create_exclusive(url, b"again"), write):
      if bucket.exists(url):
        assert bucket.read_bytes(url)
        assert bucket_cache.cached_object(url) is not None
      change()
      assert bucket_cache.cached_object(url) is None
      assert bucket_cache.cached_object(under) == ({"size": 5}, b"under")


@pytest.mark.parametrize("failure", ["removed", "unavailable"])
def test_a_whole_download_that_fails_names_the_object(bucket, failure):
  url = _put(bucket, "run/a", b"abc")

  class HttpError(Exception):  # what gcsfs raises for a 5xx after retries
    code = 503
  HttpError.__module__ = "gcsfs.retry"
  with bucket_cache.metadata_cache(), bucket_cache.object_cache("gs://bk/run"):
    assert bucket.stat(url)[0] == 3  # the metadata kept: the next is the read
    if failure == "removed":  # by another process, after its size was taken
      memory.MemoryFileSystem.rm_file(bucket.store, "bk/run/a")
    else:
      bucket.store.fail = HttpError("Service Unavailable")
    with pytest.raises(OSError) as raised:
      bucket.read_bytes(url)
  assert raised.value.filename == url
  assert type(raised.value) is (
      FileNotFoundError if failure == "removed" else OSError)
  assert bucket.store.reads == [("bk/run/a", None, None)]


def test_each_object_has_its_own_copy_whatever_it_ends_with(bucket):
  names = ("run/a", "run/aX", "run/a ", "run/a\t", "run/XaX")
  urls = {name: _put(bucket, name, name.encode()) for name in names}
  with bucket_cache.object_cache("gs://bk/run"):
    for _ in range(2):
      for name, url in urls.items():
        assert bucket.read_bytes(url) == name.encode(), url
        assert bucket_cache.cached_object(url)[1] == name.encode(), url
  assert len(bucket.store.reads) == len(names)  # each downloaded once


def test_removing_a_tree_named_with_a_slash_forgets_its_placeholder(bucket):
  url = _put(bucket, "run/a", b"placeholder")  # an object named like the tree
  _put(bucket, "run/b", b"b")
  with bucket_cache.object_cache("gs://bk/run"):
    assert bucket.read_bytes(url) == b"placeholder"
    bucket.remove_tree("gs://bk/run/a/")
    with pytest.raises(FileNotFoundError) as missing:
      bucket.read_bytes(url)
    assert missing.value.filename == url
    _put(bucket, "run/a", b"new")  # another process writes it again
    assert bucket.read_bytes(url) == b"new"  # kept
    with bucket.atomic_writer("gs://bk/run/a/") as write:  # spelt with a /
      write(b"ours")
    assert bucket.read_bytes(url) == b"ours"


def test_a_large_objects_ranges_are_fetched_without_asking_for_it_whole(
    bucket, monkeypatch, tmp_path):
  monkeypatch.setattr(bucket_cache, "SMALL_OBJECT_BYTES", 8)
  url = _put(bucket, "run/ckpt-1.flax", b"0123456789")
  with bucket_cache.object_cache("gs://bk/run"), open(
      tmp_path / "copy", "w+b") as f:
    f.truncate(10)
    assert bucket.fetch_into(url, f.fileno(), [(2, 5)], 10) == 1
    assert os.pread(f.fileno(), 3, 2) == b"234"
  # One ranged read: neither its metadata nor the whole object asked for.
  assert bucket.store.calls == {"cat_file": 1}, bucket.store.calls
  assert bucket.store.reads == [("bk/run/ckpt-1.flax", 2, 5)]


class _Unavailable(Exception):  # what gcsfs raises for a 5xx after retries
  code = 503


_Unavailable.__module__ = "gcsfs.retry"


def test_a_ranged_fetch_or_a_time_asked_that_fails_names_the_object(
    bucket, tmp_path, monkeypatch):
  url = _put(bucket, "run/ckpt-1.flax", b"0123456789")
  bucket.store.fail = _Unavailable("Service Unavailable")
  with open(tmp_path / "copy", "w+b") as f, pytest.raises(OSError) as raised:
    f.truncate(10)
    bucket.fetch_into(url, f.fileno(), [(2, 5)], 10)
  assert (type(raised.value), raised.value.filename) == (OSError, url)
  # The memory store's metadata has no time: stat asks for it separately.
  with bucket_cache.metadata_cache():
    assert bucket.stat(url)[0] == 10
    asked = []

    def modified(path):
      asked.append(path)
      raise _Unavailable("Service Unavailable")
    monkeypatch.setattr(bucket.store, "modified", modified)
    with pytest.raises(OSError) as raised:
      bucket.stat(url)  # the metadata kept: the time is what is asked
  assert (type(raised.value), raised.value.filename) == (OSError, url)
  assert asked == ["bk/run/ckpt-1.flax"]


# -- a run's metadata, kept for an object_cache block --------------------------


def test_a_runs_metadata_is_kept_whatever_is_written_elsewhere(bucket):
  for name in ("run/a", "run/b", "run/dst/x", "other/y"):
    _put(bucket, name, b"0123456789")
  with bucket_cache.object_cache("gs://bk/run", but_not="gs://bk/run/dst"):
    assert bucket.listdir("gs://bk/run") == ["a", "b", "dst"]
    # The listing answers for what it lists, and for what it does not.
    assert bucket.stat("gs://bk/run/a")[0] == 10
    assert bucket.exists("gs://bk/run/b") and not bucket.isdir("gs://bk/run/b")
    assert not bucket.exists("gs://bk/run/c")
    assert bucket.glob("gs://bk/run/*") == [
        "gs://bk/run/a", "gs://bk/run/b", "gs://bk/run/dst"]
    assert bucket.store.calls == {"ls": 1}, bucket.store.calls
    bucket.store.calls.clear()
    # Writes elsewhere (the destination, even inside the run) keep them.
    with bucket.atomic_writer("gs://bk/run/dst/z") as write:
      write(b"z")
    bucket.create_exclusive("gs://bk/other/lock", b"l")
    bucket.store.calls.clear()  # (the writes' own calls)
    assert bucket.listdir("gs://bk/run") == ["a", "b", "dst"]
    assert bucket.exists("gs://bk/run/a")
    assert not bucket.store.calls, bucket.store.calls
    # The destination is asked each time: others write there.
    for _ in range(2):
      assert bucket.exists("gs://bk/run/dst/z")
      assert bucket.exists("gs://bk/run/dst")
    assert bucket.store.calls["info"] == 4, bucket.store.calls
    # A write under the run forgets what was kept of it.
    with bucket.atomic_writer("gs://bk/run/c") as write:
      write(b"c")
    bucket.store.calls.clear()
    assert bucket.exists("gs://bk/run/c")
    assert bucket.listdir("gs://bk/run") == ["a", "b", "c", "dst"]
    assert bucket.store.calls == {"info": 1, "ls": 1}, bucket.store.calls
  bucket.store.calls.clear()
  assert bucket.exists("gs://bk/run/a")  # outside the block: asked again
  assert bucket.store.calls == {"info": 1}, bucket.store.calls


def test_a_listing_answers_a_name_in_its_directory_only_in_its_own_block(
    bucket):
  _put(bucket, "run/a", b"a")
  with bucket_cache.metadata_cache():
    assert bucket.listdir("gs://bk/run") == ["a"]
    assert not bucket.exists("gs://bk/run/new")  # from the listing
    assert bucket.store.calls == {"ls": 1}, bucket.store.calls
  _put(bucket, "run/new", b"n")  # another process writes it meanwhile
  with bucket_cache.metadata_cache():
    assert bucket.exists("gs://bk/run/new")  # a new block asks afresh
  assert bucket.store.calls["info"] == 1, bucket.store.calls


def test_a_listing_answers_for_its_prefixes(bucket):
  # A step directory of a listed root is known to be one without asking
  # (an object and a prefix of one name: test_fsspec_fs, on the emulators).
  for name in ("root/7/a", "root/8/a", "root/9"):
    _put(bucket, name, b"x")
  with bucket_cache.metadata_cache():
    assert bucket.listdir("gs://bk/root") == ["7", "8", "9"]
    bucket.store.calls.clear()
    assert bucket.isdir("gs://bk/root/7") and bucket.exists("gs://bk/root/8")
    assert not bucket.isdir("gs://bk/root/9")
    assert not bucket.store.calls, bucket.store.calls
