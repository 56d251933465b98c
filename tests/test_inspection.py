"""Tests for clu_ckpt.inspection: header-only inspect and verify."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from clu_ckpt import flax_format
from clu_ckpt import inspection

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "clu-0.0.12"

pytestmark = pytest.mark.skipif(not FIXTURES.is_dir(),
                                reason="shared fixtures not present")


def _copy(name, tmp_path):
  dst = tmp_path / name
  shutil.copytree(FIXTURES / name, dst)
  for root, dirs, files in os.walk(dst):
    for entry in dirs + files:
      os.chmod(os.path.join(root, entry), 0o755 if entry in dirs else 0o644)
  os.chmod(dst, 0o755)
  return dst


def _manifest(name):
  return json.loads((FIXTURES / name / "MANIFEST.json").read_text())


def test_inspect_single_host_lists_kept_checkpoints_with_steps():
  report = inspection.inspect_path(str(FIXTURES / "single_host"))
  manifest = _manifest("single_host")["checkpoints"]
  assert report["kind"] == "checkpoint_dir"
  assert [f"ckpt-{r['number']}" for r in report["checkpoints"]] == sorted(
      manifest)
  for row in report["checkpoints"]:
    assert row["committed"]
    assert row["step"] == manifest[f"ckpt-{row['number']}"]["step"]
    files = list((FIXTURES / "single_host").glob(f"ckpt-{row['number']}.*"))
    assert row["bytes"] == sum(f.stat().st_size for f in files)


def test_inspect_tree_matches_manifest_from_headers():
  report = inspection.inspect_path(str(FIXTURES / "single_host"))
  tree = report["tree"]
  assert tree["number"] == 5
  expected = _manifest("single_host")["checkpoints"]["ckpt-5"]["tree"]
  arrays = {l["path"]: l for l in tree["leaves"] if l["shape"] is not None}
  for path, info in expected.items():
    if "python" in info or info.get("dtype", "").startswith("<U"):
      continue
    if path in arrays:
      assert arrays[path]["dtype"] == info["dtype"], path
      assert arrays[path]["shape"] == info["shape"], path
      itemsize = np.dtype(flax_format._dtype_from_name(
          info["dtype"].encode())).itemsize
      assert arrays[path]["bytes"] == itemsize * int(np.prod(info["shape"]))
  assert tree["subtrees"]["params"]["leaves"] == 4
  assert tree["total_bytes"] == sum(l["bytes"] for l in tree["leaves"])


def test_inspect_marks_torn_save():
  report = inspection.inspect_path(str(FIXTURES / "incomplete_save"))
  by_number = {r["number"]: r for r in report["checkpoints"]}
  assert by_number[1]["committed"]
  assert not by_number[2]["committed"] and by_number[2]["torn_hosts"]
  assert report["tree"]["number"] == 1
  assert "torn" in inspection.format_inspect(report)


def test_inspect_multihost_reports_hosts_per_checkpoint():
  base = FIXTURES / "multihost" / "checkpoints"
  report = inspection.inspect_path(str(base))
  assert report["kind"] == "multihost" and report["hosts"] == [0, 1]
  by_number = {r["number"]: r for r in report["checkpoints"]}
  assert by_number[2]["hosts"] == [0, 1] and by_number[2]["committed"]
  assert by_number[3]["hosts"] == [1] and not by_number[3]["committed"]
  assert report["tree"]["number"] == 2


def test_inspect_single_flax_file():
  report = inspection.inspect_path(str(FIXTURES / "flax_only" / "model-2.flax"))
  assert report["kind"] == "flax_file"
  paths = [l["path"] for l in report["tree"]["leaves"]]
  assert "/params/Embed_0/embedding" in paths


def test_inspect_missing_path_raises(tmp_path):
  with pytest.raises(FileNotFoundError, match="nothing"):
    inspection.inspect_path(str(tmp_path / "nothing"))


def test_verify_fixtures_are_sound():
  for name in ("single_host", "flax_only", "legacy_optimizer_tree",
               "incomplete_save"):
    result = inspection.verify_path(str(FIXTURES / name))
    assert result["ok"], (name, result["problems"])
    assert result["checked"] >= 1
  result = inspection.verify_path(str(FIXTURES / "multihost" / "checkpoints"))
  assert result["ok"] and result["checked"] == 5


def test_verify_names_a_truncated_flax(tmp_path):
  d = _copy("single_host", tmp_path)
  victim = d / "ckpt-4.flax"
  victim.write_bytes(victim.read_bytes()[:-10])
  result = inspection.verify_path(str(d))
  assert not result["ok"]
  assert any(str(victim) in p for p in result["problems"])


def test_verify_names_a_missing_tf_shard(tmp_path):
  d = _copy("single_host", tmp_path)
  (d / "ckpt-3.data-00000-of-00001").unlink()
  result = inspection.verify_path(str(d))
  assert not result["ok"]
  assert any(str(d / "ckpt-3.data") in p for p in result["problems"])


def test_verify_multihost_tree_mismatch(tmp_path):
  d = _copy("multihost", tmp_path)
  other = flax_format.load_file(str(d / "checkpoints-1" / "ckpt-2.flax"),
                                writable=True)
  other["params"]["extra"] = np.zeros(3, np.float32)
  flax_format.save_file(other, str(d / "checkpoints-1" / "ckpt-2.flax"))
  result = inspection.verify_path(str(d / "checkpoints"))
  assert not result["ok"]
  assert any("checkpoint 2" in p and "checkpoints-1" in p
             for p in result["problems"])


def test_verify_empty_directory_is_not_ok(tmp_path):
  result = inspection.verify_path(str(tmp_path))
  assert result["ok"] is False and result["checked"] == 0
  assert any("no checkpoint here" in p and "looked for" in p and
             "flax.training" in p for p in result["problems"])


def test_neither_imports_tensorflow_nor_jax():
  code = (
      "import sys, clu_ckpt.inspection as i\n"
      f"i.format_inspect(i.inspect_path({str(FIXTURES / 'single_host')!r}))\n"
      f"assert i.verify_path({str(FIXTURES / 'multihost' / 'checkpoints')!r})['ok']\n"
      "bad = [m for m in ('tensorflow', 'jax', 'flax', 'orbax') if m in sys.modules]\n"
      "assert not bad, bad\n")
  subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------
# Damaged checkpoints, multihost sources (written by the real clu).
# --------------------------------------------------------------------------


def _clu_dir(tmp_path):
  from migration_helpers import clu_save, example_state
  d = tmp_path / "ckpts"
  clu_save(d, [example_state(s) for s in (1, 2, 3, 4)], max_to_keep=10)
  return d


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "clu_ckpt", *map(str, args)],
                        capture_output=True, text=True)


def test_inspect_lists_every_checkpoint_and_names_each_damage(tmp_path):
  d = _clu_dir(tmp_path)
  data = (d / "ckpt-2.flax").read_bytes()
  (d / "ckpt-2.flax").write_bytes(data[:40])
  (d / "ckpt-3.flax").write_bytes(b"\xc1" + data[1:])
  (d / "ckpt-4.flax").write_text("oid sha256:abc\nsize 12\n")
  report = inspection.inspect_path(str(d))
  rows = {r["number"]: r for r in report["checkpoints"]}
  assert sorted(rows) == [1, 2, 3, 4] and rows[1]["damage"] == []
  assert "truncated at byte 40" in rows[2]["damage"][0]
  assert "not msgpack at byte 0" in rows[3]["damage"][0]
  assert rows[4]["damage"] == [
      f"{d / 'ckpt-4.flax'}: not a Flax checkpoint: starts with text "
      "'oid sha256:abc\\nsize 12\\n' (a text file, not msgpack)"]
  assert report["problems"] == [rows[n]["damage"][0] for n in (2, 3, 4)]
  assert report["tree"]["number"] == 1  # the latest sound one
  done = _cli("inspect", d)
  assert done.returncode == 1 and "Traceback" not in done.stderr
  assert done.stdout.count("damaged") >= 3
  assert done.stderr.strip() == (
      f"clu-ckpt inspect: error: {d}: 3 problems (see above)")
  assert any("starts with text" in p
             for p in inspection.verify_path(str(d))["problems"])


def test_inspect_of_a_damaged_chosen_checkpoint_has_no_tree(tmp_path):
  d = _clu_dir(tmp_path)
  (d / "ckpt-4.flax").write_bytes(b"")
  report = inspection.inspect_path(str(d), checkpoint=4)
  assert report["tree"] is None
  assert report["problems"] and "ckpt-4.flax" in report["problems"][0]


@pytest.mark.orbax  # migrates
def test_verify_a_migrated_root_against_every_host(tmp_path):
  from migration_helpers import example_state, multihost_save
  from clu_ckpt import migration
  base = tmp_path / "mh" / "ckpts"
  multihost_save(base, [[example_state(1), example_state(2)]] * 2)
  migration.migrate(str(base), str(tmp_path / "dst"))
  done = _cli("verify", tmp_path / "dst", "--source", base)
  assert done.returncode == 0, done.stdout + done.stderr
  # A difference on host 1 (not the state host) is found.
  victim = tmp_path / "mh" / "ckpts-1" / "ckpt-2.flax"
  other = flax_format.load_file(str(victim), writable=True)
  other["params"]["extra"] = np.zeros(2, np.float32)
  flax_format.save_file(other, str(victim))
  result = inspection.verify_orbax_root(str(tmp_path / "dst"), str(base))
  assert not result["ok"]
  assert [p for p in result["problems"] if str(victim) in p]
  done = _cli("verify", tmp_path / "dst", "--source", tmp_path / "nowhere")
  assert done.returncode == 1 and "Traceback" not in done.stderr
  assert "cannot be read as a CLU source" in done.stdout


# ---------------------------------------------------------------------------
# Every layout; nothing there; wide files; recorded times; verify's lines.
# ---------------------------------------------------------------------------


def _flax_training_dir(directory, steps, prefix="checkpoint_"):
  """Real `flax.training.checkpoints.save_checkpoint` files, Orbax off."""
  import warnings  # pylint: disable=g-import-not-at-top
  import flax  # pylint: disable=g-import-not-at-top
  from flax.training import checkpoints  # pylint: disable=g-import-not-at-top
  flax.config.update("flax_use_orbax_checkpointing", False)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    for step in steps:
      checkpoints.save_checkpoint(
          str(directory), {"step": step, "w": np.ones(5, np.float32) * step},
          step, prefix=prefix, keep=2)
  return directory


def _cli(*args, cwd=None):
  return subprocess.run([sys.executable, "-m", "clu_ckpt", *args],
                        capture_output=True, text=True, timeout=120, cwd=cwd,
                        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))


def test_inspect_and_verify_flax_training_files(tmp_path):
  d = _flax_training_dir(tmp_path / "run", [5, 10, 15])
  report = inspection.inspect_path(str(d))
  assert report["kind"] == "flax_training"
  assert [(r["name"], r["number"], r["step"]) for r in report["checkpoints"]
          ] == [("checkpoint_10", 10, 10), ("checkpoint_15", 15, 15)]
  assert report["tree"]["number"] == 15
  assert [l["path"] for l in report["tree"]["leaves"]] == ["/step", "/w"]
  text = inspection.format_inspect(report)
  assert "flax.training.checkpoints files checkpoint_<step>" in text
  assert inspection.verify_path(str(d)) == dict(ok=True, checked=2,
                                                problems=[])
  with open(d / "checkpoint_10", "r+b") as f:
    f.truncate(30)
  result = inspection.verify_path(str(d))
  assert not result["ok"] and "checkpoint_10" in result["problems"][0]
  assert inspection.inspect_path(str(d))["checkpoints"][0]["damage"]


def test_inspect_of_nothing_exits_1_with_one_line(tmp_path):
  (tmp_path / "empty").mkdir()
  (tmp_path / "work").mkdir()
  (tmp_path / "work" / "notes.txt").write_text("no checkpoints\n")
  for name in ("empty", "work"):
    done = _cli("inspect", str(tmp_path / name))
    assert done.returncode == 1, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and done.stdout == ""
    for words in ("Orbax", "CLU Checkpoint", "MultihostCheckpoint",
                  "flax.training.checkpoints"):
      assert words in lines[0]


def test_inspect_of_a_wide_file_lists_the_first_leaves(tmp_path):
  path = tmp_path / "wide.flax"
  flax_format.save_file({f"k{i:06d}": None for i in range(5000)}, str(path))
  report = inspection.inspect_path(str(path))
  tree = report["tree"]
  assert tree["leaf_count"] == 5000
  assert len(tree["leaves"]) == inspection.LEAVES_SHOWN
  text = inspection.format_inspect(report)
  assert f"and {5000 - inspection.LEAVES_SHOWN} more leaves" in text
  assert "\ntotal" in text and "5000" in text.splitlines()[-1]


def test_saved_column_is_the_time_tensorflow_recorded(tmp_path):
  d = _copy("single_host", tmp_path)
  for name in os.listdir(d):
    os.utime(d / name, (1e9, 1e9))  # a copy resets the files' times
  report = inspection.inspect_path(str(d))
  from clu_ckpt import layout  # pylint: disable=g-import-not-at-top
  state = layout.read_checkpoint_state(str(d))
  recorded = dict(zip(state.all_model_checkpoint_paths,
                      state.all_model_checkpoint_timestamps))
  for row in report["checkpoints"]:
    stamp = recorded[str(d / f"ckpt-{row['number']}")]
    assert row["time"] == inspection._iso(stamp)
    assert row["time_source"] == "recorded"
  assert "2001-09-09" not in inspection.format_inspect(report)


def test_verify_of_a_multihost_base_names_each_host(tmp_path):
  d = _copy("multihost", tmp_path)
  calls = []
  inspection.verify_path(str(d / "checkpoints"),
                         progress=lambda *a: calls.append(a))
  names = [c[2] for c in calls]
  assert len(set(names)) == len(names)
  assert all(n.startswith(("checkpoints-0/", "checkpoints-1/"))
             for n in names)
  report = inspection.inspect_path(str(d / "checkpoints"))
  assert calls[-1][4] == sum(r["bytes"] for r in report["checkpoints"]
                             if r["committed"] or r["torn_hosts"] == [])


# ---------------------------------------------------------------------------
# What a damaged file is called: inspect's `damage`, verify's problem.
# ---------------------------------------------------------------------------


def _sound_bytes(tmp_path):
  flax_format.save_file({"a": np.arange(3, dtype=np.float32), "step": 3},
                        str(tmp_path / "sound.flax"))
  return (tmp_path / "sound.flax").read_bytes()


def _damaged_cases(tmp_path):
  """(file content, inspect's damage, verify's problem), `{p}` the path."""
  import msgpack  # pylint: disable=g-import-not-at-top
  sound = _sound_bytes(tmp_path)
  bad_dtype = msgpack.packb({"a": msgpack.ExtType(1, msgpack.packb(
      [[3], "float99", b"xxxx"]))})
  long_text = "checkpoint files were moved to the bucket: see notes"
  return [
      (sound[:20],
       "{p}: damaged: truncated at byte 6 (truncated: 25 bytes declared, 14 "
       "left in the file)",
       "{p} at byte 6: truncated: 25 bytes declared, 14 left in the file"),
      (b"",
       "{p}: damaged: truncated at byte 0 (empty file)",
       "{p} at byte 0: empty file"),
      (b"\xc1" + sound[1:],
       "{p}: damaged: not msgpack at byte 0 (invalid msgpack type byte 0xc1)",
       "{p} at byte 0: invalid msgpack type byte 0xc1"),
      (msgpack.packb({"a": msgpack.ExtType(5, b"xx")}),
       "{p}: damaged: not msgpack at byte 3 (unknown msgpack ext type 5)",
       "{p} at byte 3: unknown msgpack ext type 5"),
      (bad_dtype,
       "{p}: damaged at byte 9: unknown dtype name b'float99'",
       "{p} at byte 9: unknown dtype name b'float99'"),
      (b"\x01\x02\x03",
       "{p}: damaged at byte 1: 2 bytes of extra data after the checkpoint",
       "{p} at byte 1: 2 bytes of extra data after the checkpoint"),
      # Text: short, with every allowed control, cut at the probe (48
      # bytes), and cut inside a character of 2 and of 4 bytes.
      (b"hello world", *["{p}: not a Flax checkpoint: starts with text "
                         "'hello world' (a text file, not msgpack)"] * 2),
      (b"a\tb\r\nc", *["{p}: not a Flax checkpoint: starts with text "
                       "'a\\tb\\r\\nc' (a text file, not msgpack)"] * 2),
      (long_text.encode(), *["{p}: not a Flax checkpoint: starts with text "
                             f"'{long_text[:48]}...' (a text file, not "
                             "msgpack)"] * 2),
      (("x" * 47).encode(), *["{p}: not a Flax checkpoint: starts with text "
                              f"'{'x' * 47}' (a text file, not msgpack)"] * 2),
      (("x" * 48).encode(), *["{p}: not a Flax checkpoint: starts with text "
                              f"'{'x' * 48}' (a text file, not msgpack)"] * 2),
      (("x" * 49).encode(), *["{p}: not a Flax checkpoint: starts with text "
                              f"'{'x' * 48}...' (a text file, not msgpack)"] * 2),
      (("x" * 47 + "\u00e9").encode(), *[
          "{p}: not a Flax checkpoint: starts with text "
          f"'{'x' * 47}...' (a text file, not msgpack)"] * 2),
      (("x" * 45 + "\U0001F600").encode(), *[
          "{p}: not a Flax checkpoint: starts with text "
          f"'{'x' * 45}...' (a text file, not msgpack)"] * 2),
      # Not text: a control character, or bytes no cut makes UTF-8.
      (b"hello\x01world",
       "{p}: damaged at byte 1: 10 bytes of extra data after the checkpoint",
       "{p} at byte 1: 10 bytes of extra data after the checkpoint"),
      (b"A" * 44 + b"\xff" * 4 + b"more",
       "{p}: damaged at byte 1: 51 bytes of extra data after the checkpoint",
       "{p} at byte 1: 51 bytes of extra data after the checkpoint"),
  ]


def test_damage_and_verify_name_what_is_wrong_with_a_file(tmp_path,
                                                         golden_copy):
  d = golden_copy("single_host")
  victim = d / "ckpt-4.flax"
  for content, damage, problem in _damaged_cases(tmp_path):
    victim.write_bytes(content)
    rows = {r["number"]: r for r in inspection.inspect_path(str(d))[
        "checkpoints"]}
    assert rows[4]["damage"] == [damage.format(p=victim)], content
    assert rows[3]["damage"] == rows[5]["damage"] == []
    assert inspection.verify_path(str(d))["problems"] == [
        problem.format(p=victim)], content


def test_damage_of_a_sound_file_is_none(tmp_path):
  path = tmp_path / "sound.flax"
  path.write_bytes(_sound_bytes(tmp_path))
  assert inspection._damage(str(path)) is None  # pylint: disable=protected-access
  cache = {}
  assert inspection._damage(str(path), cache) is None  # pylint: disable=protected-access
  assert list(cache) == [str(path)]  # summarised once, for the tree


def test_verify_flax_training_files_reports_progress_and_problems(tmp_path):
  d = _flax_training_dir(tmp_path / "my run", [5, 10, 15])  # a space in it
  sizes = {n: (d / n).stat().st_size for n in ("checkpoint_10",
                                               "checkpoint_15")}
  calls = []
  result = inspection.verify_path(str(d), progress=lambda *a: calls.append(a))
  assert result == dict(ok=True, checked=2, problems=[])
  total = sum(sizes.values())
  assert calls == [(1, 2, "checkpoint_10", sizes["checkpoint_10"], total),
                   (2, 2, "checkpoint_15", sizes["checkpoint_15"], total)]
  # A step leading out of the directory is named, not read; a dangling one
  # counts no bytes.
  outside = tmp_path / "elsewhere"
  (d / "checkpoint_15").rename(outside)
  (d / "checkpoint_15").symlink_to(outside)
  (d / "checkpoint_20").symlink_to(tmp_path / "gone")
  calls = []
  result = inspection.verify_path(str(d), progress=lambda *a: calls.append(a))
  assert result["ok"] is False and result["checked"] == 3
  assert [c[:4] for c in calls] == [
      (1, 3, "checkpoint_10", sizes["checkpoint_10"]),
      (2, 3, "checkpoint_15", sizes["checkpoint_15"]),
      (3, 3, "checkpoint_20", 0)]
  assert len(result["problems"]) == 2
  assert str(d / "checkpoint_15") in result["problems"][0]
  assert "outside" in result["problems"][0]
  assert str(d / "checkpoint_20") in result["problems"][1]
  # Nothing under the prefix asked for (what detection never hands it).
  assert inspection._verify_flax_training(str(d), "model_", None) == dict(  # pylint: disable=protected-access
      ok=False, checked=0, problems=[f"{d}: no model_<step> file"])
