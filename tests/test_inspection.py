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
  assert any("no committed checkpoint" in p for p in result["problems"])


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
