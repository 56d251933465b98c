"""Tests of clu_ckpt.flax_summary: the leaves of a file, counted, not kept."""

import collections
import glob
import pathlib

import msgpack
import numpy as np
import pytest
from flax import serialization

from clu_ckpt import flax_format
from clu_ckpt import flax_summary

SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared" / "fixtures"
if not SHARED.exists():
  SHARED = pathlib.Path("/work/shared/fixtures")


def _by_top(leaves):
  out = collections.OrderedDict()
  for leaf in leaves:
    top = leaf.path.split("/")[1] if leaf.path.count("/") else ""
    entry = out.setdefault(top, [0, 0])
    entry[0] += 1
    entry[1] += leaf.nbytes
  return out


def _files():
  found = [p for p in glob.glob(str(SHARED / "**" / "*.flax"), recursive=True)
           if "incomplete_save" not in p]
  found += glob.glob(str(SHARED / "old-stacks" / "*" / "flax_training*" /
                         "*_[0-9]*"))
  return sorted(found)


def _assert_summarises(path, sample):
  want = flax_format.inspect_file(path)
  got = flax_summary.summarize_file(path, sample=sample)
  assert got.leaves == len(want), path
  assert got.nbytes == sum(l.nbytes for l in want), path
  assert got.sample == want[:sample], path
  tops = list(_by_top(want).items())
  cap = flax_summary.MAX_SUBTREES
  assert list(got.subtrees.items()) == tops[:cap], path
  rest = [sum(e[i] for _, e in tops[cap:]) for i in (0, 1)]
  assert got.more_subtrees == rest, path


@pytest.mark.parametrize("sample", [0, 1, 5, 1000])
def test_same_leaves_as_inspect_file(sample):
  files = _files()
  assert len(files) > 5
  for path in files:
    _assert_summarises(path, sample)


def test_chunked_arrays_count_once(tmp_path):
  saved = serialization.MAX_CHUNK_SIZE
  serialization.MAX_CHUNK_SIZE = 64
  try:
    data = serialization.to_bytes({"w": np.arange(100, dtype=np.float32),
                                   "n": {"a": None, "b": np.ones(40)},
                                   "step": 3})
  finally:
    serialization.MAX_CHUNK_SIZE = saved
  path = tmp_path / "c.flax"
  path.write_bytes(data)
  assert b"__msgpack_chunked_array__" in data
  for sample in (0, 1, 10):
    _assert_summarises(str(path), sample)
  summary = flax_summary.summarize_file(str(path), sample=0)
  assert summary.leaves == 4 and summary.nbytes == 400 + 320


def test_damaged_files_fail_as_inspect_file_does(tmp_path):
  data = (SHARED / "clu-0.0.12" / "single_host" / "ckpt-5.flax").read_bytes()
  path = tmp_path / "cut.flax"
  for cut in range(1, len(data), 3):
    path.write_bytes(data[:cut])
    errors = []
    for read in (lambda: flax_format.inspect_file(str(path)),
                 lambda: flax_summary.summarize_file(str(path), sample=0)):
      try:
        read()
        errors.append(None)
      except flax_format.FlaxFormatError as e:
        errors.append(str(e))
    assert errors[0] == errors[1], cut


def test_a_wide_map_is_counted_and_its_top_keys_capped(tmp_path,
                                                        monkeypatch):
  monkeypatch.setattr(flax_summary, "MAX_SUBTREES", 10)
  wide = {f"k{i:05d}": None for i in range(5000)}
  wide["params"] = {"w": np.ones(4, np.float32)}
  path = tmp_path / "wide.flax"
  path.write_bytes(serialization.to_bytes(wide))
  summary = flax_summary.summarize_file(str(path), sample=3)
  assert summary.leaves == 5001 and summary.nbytes == 16
  assert [l.path for l in summary.sample] == ["/k00000", "/k00001", "/k00002"]
  assert len(summary.subtrees) == 10
  assert summary.more_subtrees == [4991, 16]


def test_a_map_of_nils_written_by_msgpack(tmp_path):
  path = tmp_path / "nils.flax"
  path.write_bytes(msgpack.packb({f"{i}": None for i in range(3000)}))
  _assert_summarises(str(path), 2)


@pytest.mark.parametrize("step,want", [
    (7, 7), (2**40, 2**40), (np.int64(9), 9), (np.asarray(5, np.int32), 5),
    (np.uint8(3), 3), (1.5, None), (True, None), ("7", None), (None, None),
])
def test_top_level_step(step, want, tmp_path):
  path = tmp_path / "s.flax"
  state = {f"k{i}": None for i in range(50)}
  state["step"] = step
  state["nested"] = {"step": 11}
  path.write_bytes(serialization.to_bytes(state))
  for sample in (0, 1000):
    got = flax_summary.summarize_file(str(path), sample=sample).step
    assert got == want and type(got) is type(want), (sample, got)
