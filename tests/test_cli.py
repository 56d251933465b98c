"""Tests for the `clu-ckpt` command (clu_ckpt.cli)."""

import io
import json
import os
import shutil
import subprocess
import sys
import textwrap

import orbax.checkpoint as ocp
import pytest

from clu_ckpt import cli
from clu_ckpt import migration


def _steps(directory):
  with ocp.CheckpointManager(directory) as mngr:
    return list(mngr.all_steps())


@pytest.mark.orbax  # migrates
def test_migrate_json_summary(tmp_path, capsys, golden_copy):
  src = golden_copy("single_host")
  code = cli.main(["migrate", str(src), str(tmp_path / "dst"), "--json",
                   "--verify"])
  out, err = capsys.readouterr()
  assert code == 0
  summary = json.loads(out)
  assert summary["ok"] is True
  assert summary["step_naming"] == "state"
  assert [(s["number"], s["step"], s["status"], s["verified"])
          for s in summary["steps"]] == [(3, 300, "migrated", True),
                                         (4, 400, "migrated", True),
                                         (5, 500, "migrated", True)]
  # Not a terminal: one line per event, no carriage returns.
  assert "migrated ckpt-3 -> step 300" in err
  assert "\r" not in err
  assert _steps(tmp_path / "dst") == [300, 400, 500]


@pytest.mark.orbax  # migrates
def test_human_summary_and_rerun(tmp_path, capsys, golden_copy):
  src = golden_copy("single_host")
  assert cli.main(["migrate", str(src), str(tmp_path / "dst"),
                   "--latest"]) == 0
  out, _ = capsys.readouterr()
  assert "ckpt-5 -> step 500: migrated" in out
  assert _steps(tmp_path / "dst") == [500]
  assert cli.main(["migrate", str(src), str(tmp_path / "dst")]) == 0
  out, err = capsys.readouterr()
  assert "ckpt-5 -> step 500: skipped" in out
  assert "ckpt-3 -> step 300: migrated" in out
  assert "skipped ckpt-5 -> step 500" in err


@pytest.mark.orbax  # migrates
def test_number_and_step_naming_options(tmp_path, capsys, golden_copy):
  src = golden_copy("single_host")
  code = cli.main(["migrate", str(src), str(tmp_path / "dst"), "--number",
                   "3", "--number", "4", "--step-naming", "number",
                   "--compression", "none", "--json"])
  assert code == 0
  summary = json.loads(capsys.readouterr()[0])
  assert summary["step_naming"] == "number"
  assert [(s["number"], s["step"]) for s in summary["steps"]] == [(3, 3),
                                                                  (4, 4)]
  assert migration.read_metadata(str(tmp_path / "dst"), 4)[
      "compression"] == "none"


def test_dry_run(tmp_path, capsys, golden_copy):
  src = golden_copy("multihost")
  code = cli.main(["migrate", str(src / "checkpoints"), str(tmp_path / "dst"),
                   "--dry-run"])
  out, _ = capsys.readouterr()
  assert code == 0
  assert "ckpt-2 -> step 2: planned" in out
  assert "not on every host (not migrated): [3]" in out
  assert not (tmp_path / "dst").exists()


def test_missing_source_exits_1_with_a_message(tmp_path, capsys):
  code = cli.main(["migrate", str(tmp_path / "none"), str(tmp_path / "dst"),
                   "--json"])
  out, err = capsys.readouterr()
  assert code == 1
  assert "no CLU checkpoint" in err
  assert json.loads(out)["ok"] is False


@pytest.mark.parametrize("version", ["0.11.24", None])
def test_migrate_with_too_old_orbax_is_one_line_and_writes_nothing(
    tmp_path, capsys, golden_copy, monkeypatch, version):
  from clu_ckpt.migration import orbax_target  # pylint: disable=g-import-not-at-top
  # Only the version number is simulated.
  monkeypatch.setattr(orbax_target, "installed_orbax_version",
                      lambda: version)
  src = golden_copy("single_host")
  done = _in_process(capsys, "migrate", src, tmp_path / "dst")
  _assert_one_line_error(done, 1, "orbax-checkpoint >= ",
                         version or "not installed", "pip install")
  assert len(done.stderr.strip().splitlines()) == 1, done.stderr
  assert not (tmp_path / "dst").exists()


def test_migrate_of_a_run_with_an_iterator_imports_no_tensorflow(
    tmp_path, golden_copy):
  # The iterator's files are copied and checked (checksums, framing) without
  # TensorFlow, which would cost seconds of every `clu-ckpt migrate`.
  src = golden_copy("single_host")
  script = ("import sys\n"
            "from clu_ckpt import cli\n"
            "code = cli.main(['migrate', sys.argv[1], sys.argv[2]])\n"
            "assert code == 0, code\n"
            "print(sorted(m for m in sys.modules\n"
            "             if m.split('.')[0] == 'tensorflow'))\n")
  done = subprocess.run([sys.executable, "-c", script, str(src),
                         str(tmp_path / "dst")], capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0, done.stderr
  assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
  with ocp.CheckpointManager(str(tmp_path / "dst"), item_handlers=(
      migration.item_handlers())) as mngr:
    restored = mngr.restore(mngr.latest_step())
  assert "ds_iter" in json.dumps(restored["metadata"]["dataset"])


def test_usage_errors_exit_2(tmp_path):
  with pytest.raises(SystemExit) as e:
    cli.main(["migrate", str(tmp_path), str(tmp_path / "d"), "--latest",
              "--number", "3"])
  assert e.value.code == 2
  assert cli.main([]) == 2


@pytest.mark.thorough
def test_corrupt_source_in_a_real_process(tmp_path, golden_copy):
  src = golden_copy("single_host")
  flax = src / "ckpt-5.flax"
  flax.write_bytes(flax.read_bytes()[:50])
  run = subprocess.run(
      [sys.executable, "-m", "clu_ckpt", "migrate", str(src),
       str(tmp_path / "dst")], capture_output=True, text=True, cwd=tmp_path)
  assert run.returncode == 1
  assert "Traceback" not in run.stderr + run.stdout
  assert f"FAILED ckpt-5" in run.stderr and str(flax) in run.stderr
  assert "ckpt-5 -> step ?: failed" in run.stdout
  assert _steps(tmp_path / "dst") == [300, 400]


def test_console_script(tmp_path):
  exe = shutil.which("clu-ckpt")
  if exe is None:
    pytest.skip("clu-ckpt is not installed on PATH")
  run = subprocess.run([exe, "migrate", "--help"], capture_output=True,
                       text=True)
  assert run.returncode == 0
  assert "--step-naming" in run.stdout and "DESTINATION" in run.stdout


class _Progress:
  """Stands in for `migration.Progress` (the report only reads attributes)."""

  def __init__(self, event, number=3, step=300, nbytes=0, message="",
               count=2, total_nbytes=0):
    self.event, self.number, self.step = event, number, step
    self.nbytes, self.message, self.count = nbytes, message, count
    self.total_nbytes = total_nbytes


def test_progress_bar_on_a_terminal():
  out = io.StringIO()
  # pylint: disable-next=protected-access
  report = cli._ProgressReport(out, tty=True)
  report(_Progress("start", nbytes=4 * 2**20, total_nbytes=8 * 2**20))
  report(_Progress("bytes", nbytes=2**20))
  report(_Progress("done", nbytes=4 * 2**20))
  report.close()
  text = out.getvalue()
  assert "[1/2] ckpt-3 -> step 300" in text
  assert "migrated ckpt-3 -> step 300: 4.0 MiB in" in text
  assert "of 8.0 MiB" in text, text


def test_progress_lines_off_a_terminal():
  out = io.StringIO()
  now = [0.0]
  # pylint: disable-next=protected-access
  report = cli._ProgressReport(out, tty=False, clock=lambda: now[0])
  report(_Progress("start", nbytes=3 * 2**30, total_nbytes=4 * 2**30))
  report(_Progress("bytes", nbytes=2**30))
  now[0] = 3.0
  report(_Progress("done", nbytes=3 * 2**30))
  report(_Progress("failed", number=4, step=400, message="boom"))
  assert out.getvalue().splitlines() == [
      "migrating ckpt-3 -> step 300 (3.00 GiB) [1/2]",
      "migrated ckpt-3 -> step 300: 3.00 GiB in 3.0 s (1.00 GiB/s) "
      "[1/2, 3.00 GiB of 4.00 GiB, ETA 1 s]",
      "FAILED ckpt-4 -> step 400: boom"]


def test_version():
  done = _clu_ckpt("--version")
  assert done.returncode == 0, done.stderr
  from clu_ckpt import __version__  # pylint: disable=g-import-not-at-top
  assert done.stdout.strip() == f"clu-ckpt {__version__}"


# ---------------------------------------------------------------------------
# Hostile or broken inputs: one line naming the path, exit 1 (2 for usage),
# never a traceback (unless --verbose), never a hang. Run as a real process.
# ---------------------------------------------------------------------------


def _clu_ckpt(*argv, timeout=120):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  return subprocess.run([sys.executable, "-m", "clu_ckpt", *map(str, argv)],
                        capture_output=True, text=True, timeout=timeout,
                        env=env)


def _in_process(capsys, *argv):
  """`clu-ckpt argv` in this process: an exception escaping `main` (which a
  terminal would show as a traceback) fails the test."""
  code = cli.main([str(a) for a in argv])
  out, err = capsys.readouterr()
  return subprocess.CompletedProcess(argv, code, out, err)


def _assert_one_line_error(done, code, *needles):
  assert done.returncode == code, done.stdout + done.stderr
  assert "Traceback" not in done.stderr, done.stderr
  last = done.stderr.strip().splitlines()[-1]
  assert last.startswith("clu-ckpt "), done.stderr
  for needle in needles:
    assert str(needle) in last, last


def _clu_dir(tmp_path, golden_copy):
  return golden_copy("single_host")


@pytest.mark.parametrize("command", ["inspect", "verify", "migrate"])
def test_symlink_loop_flax(capsys, tmp_path, golden_copy, command):
  src = golden_copy("single_host")
  (src / "ckpt-5.flax").unlink()
  os.symlink("ckpt-5.flax", src / "ckpt-5.flax")
  extra = [tmp_path / "dst"] if command == "migrate" else []
  done = _in_process(capsys, command, src, *extra)
  assert done.returncode == 1, done.stdout + done.stderr
  assert "Traceback" not in done.stderr
  assert "ckpt-5.flax" in done.stdout + done.stderr


@pytest.mark.parametrize("command", ["inspect", "verify", "migrate"])
def test_empty_model_checkpoint_path(capsys, tmp_path, golden_copy, command):
  src = golden_copy("single_host")
  (src / "checkpoint").write_text('model_checkpoint_path: ""\n')
  extra = [tmp_path / "dst"] if command == "migrate" else []
  done = _in_process(capsys, command, src, *extra)
  assert done.returncode == 1, done.stdout + done.stderr
  assert "Traceback" not in done.stderr
  assert str(src) in done.stdout + done.stderr


@pytest.mark.parametrize("content", [b"model_checkpoint_path: \"ckpt-5\xff\"\n",
                                     b"garbage {{{\n"])
def test_unparsable_state_file_is_an_error_not_nothing_to_migrate(
    capsys, tmp_path, golden_copy, content):
  src = golden_copy("single_host")
  (src / "checkpoint").write_bytes(content)
  done = _in_process(capsys, "migrate", src, tmp_path / "dst")
  _assert_one_line_error(done, 1, src / "checkpoint")
  assert "nothing to migrate" not in done.stdout
  done = _in_process(capsys, "verify", src)
  assert done.returncode == 1 and str(src / "checkpoint") in done.stdout


@pytest.mark.parametrize("argv", [["migrate", "SRC", ""],
                                  ["migrate", "", "DST"],
                                  ["inspect", ""], ["verify", ""]])
def test_empty_path_is_bad_usage(capsys, tmp_path, golden_copy, argv):
  src = golden_copy("single_host")
  argv = [str(src) if a == "SRC" else str(tmp_path / "d") if a == "DST" else a
          for a in argv]
  done = _in_process(capsys, *argv)
  _assert_one_line_error(done, 2, "is empty")
  assert sorted(os.listdir(tmp_path)) == ["golden"]


@pytest.mark.parametrize("command", ["inspect", "verify", "migrate"])
def test_latest_outside_the_directory_is_refused(capsys, tmp_path, golden_copy,
                                                 command):
  src = golden_copy("single_host")
  outside = tmp_path / "outside"
  outside.mkdir()
  for name in os.listdir(src):
    if name.startswith("ckpt-5."):
      shutil.copy(src / name, outside / name)
  text = (src / "checkpoint").read_text().replace('"ckpt-5"',
                                                  f'"{outside}/ckpt-5"')
  (src / "checkpoint").write_text(text)
  extra = [tmp_path / "dst"] if command == "migrate" else []
  done = _in_process(capsys, command, src, *extra)
  assert done.returncode == 1, done.stdout + done.stderr
  assert "Traceback" not in done.stderr
  assert f"{outside}/ckpt-5" in done.stdout + done.stderr
  assert "outside" in done.stdout + done.stderr


@pytest.mark.parametrize("command", ["inspect", "verify", "migrate"])
def test_symlink_out_of_the_directory_is_refused(capsys, tmp_path, golden_copy,
                                                 command):
  src = golden_copy("single_host")
  outside = tmp_path / "outside"
  outside.mkdir()
  shutil.move(src / "ckpt-5.flax", outside / "ckpt-5.flax")
  os.symlink(outside / "ckpt-5.flax", src / "ckpt-5.flax")
  extra = [tmp_path / "dst"] if command == "migrate" else []
  done = _in_process(capsys, command, src, *extra)
  assert done.returncode == 1, done.stdout + done.stderr
  assert "Traceback" not in done.stderr
  assert "ckpt-5.flax" in done.stdout + done.stderr
  assert "symlink" in done.stdout + done.stderr


@pytest.mark.thorough("migrate")
@pytest.mark.parametrize("command", ["inspect", "verify", "migrate"])
@pytest.mark.parametrize("name", ["ckpt-5.flax", "checkpoint",
                                  "ckpt-5.index"])
def test_named_pipe_is_an_error_within_seconds(tmp_path, golden_copy, command,
                                               name):
  src = golden_copy("single_host")
  (src / name).unlink()
  os.mkfifo(src / name)
  extra = [tmp_path / "dst"] if command == "migrate" else []
  done = _clu_ckpt(command, src, *extra, timeout=60)
  assert done.returncode == 1, done.stdout + done.stderr
  assert "Traceback" not in done.stderr
  assert name in done.stdout + done.stderr
  assert "named pipe" in done.stdout + done.stderr


def test_verbose_shows_the_traceback(tmp_path, golden_copy):
  done = _clu_ckpt("inspect", tmp_path / "nothing")
  _assert_one_line_error(done, 1, tmp_path / "nothing")
  done = _clu_ckpt("--verbose", "inspect", tmp_path / "nothing")
  assert done.returncode == 1
  assert "Traceback" in done.stderr


def _mount_tmpfs(target, size):
  if os.geteuid() != 0 or shutil.which("mount") is None:
    return False
  target.mkdir()
  return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}",
                         "tmpfs", str(target)],
                        capture_output=True).returncode == 0


@pytest.mark.thorough
def test_full_disk_during_migrate(tmp_path):
  from clu import checkpoint as clu_checkpoint  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  src = tmp_path / "src"
  ckpt = clu_checkpoint.Checkpoint(
      str(src), dict(ds=iter(tf.data.Dataset.range(10))), max_to_keep=2)
  ckpt.save({"w": np.random.default_rng(0).random((512, 1024), np.float32),
             "step": 1})
  disk = tmp_path / "disk"
  if not _mount_tmpfs(disk, "1m"):
    pytest.skip("cannot mount a small tmpfs here (needs root)")
  try:
    done = _clu_ckpt("migrate", src, disk / "orbax", "--compression", "none")
  finally:
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)
  _assert_one_line_error(done, 1, "No space left on device")
  assert len(done.stderr.strip().splitlines()) <= 5, done.stderr
  assert str(disk) in done.stderr


# --------------------------------------------------------------------------
# migrate: a locked destination, --template.
# --------------------------------------------------------------------------


@pytest.mark.thorough
def test_migrate_into_a_locked_destination_is_one_line_naming_the_holder(
    tmp_path, golden_copy):
  from clu_ckpt.migration import destination  # pylint: disable=g-import-not-at-top
  src, dst = golden_copy("single_host"), tmp_path / "dst"
  with destination.lock(str(dst)):
    done = _clu_ckpt("migrate", src, dst)
  assert done.returncode == 1, done.stdout + done.stderr
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1, done.stderr
  assert lines[0].startswith("clu-ckpt migrate: error: ")
  assert f"pid {os.getpid()}" in lines[0], lines[0]
  assert _steps(dst) == []


_TEMPLATE_MODULE = '''
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state


class Mlp(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(2)(nn.Dense(3)(x))


def create(seed=0):
  model = Mlp()
  params = model.init(jax.random.PRNGKey(seed), jnp.ones((1, 2)))
  return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                       tx=optax.adam(1e-3))


def template():
  return jax.eval_shape(create)


def broken():
  raise RuntimeError("no such device")
'''


def _template_module(tmp_path, name):
  """Writes the template module as tmp_path/<name>.py and imports it."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  path = tmp_path / f"{name}.py"
  path.write_text(_TEMPLATE_MODULE)
  spec = importlib.util.spec_from_file_location(f"{name}_in_test", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.thorough
def test_migrate_with_a_template_module(tmp_path):
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from clu import checkpoint as clu_checkpoint  # pylint: disable=g-import-not-at-top
  from flax.training import train_state  # pylint: disable=g-import-not-at-top
  module = _template_module(tmp_path, "my_template")
  state = module.create(seed=3).replace(step=4)
  clu_checkpoint.Checkpoint(str(tmp_path / "src")).save(state)
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=os.pathsep.join(
      [repo] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  done = subprocess.run(
      [sys.executable, "-m", "clu_ckpt", "migrate", "src", "dst", "--json",
       "--verify", "--template", "my_template:template"],
      capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
  assert done.returncode == 0, done.stderr[-3000:]
  summary = json.loads(done.stdout)
  assert summary["steps"][0]["verified"] and summary["steps"][0]["step"] == 4
  abstract = module.template()
  with ocp.CheckpointManager(str(tmp_path / "dst")) as mngr:
    restored = mngr.restore(4, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract)))["state"]
  assert isinstance(restored, train_state.TrainState)
  kernel = restored.params["params"]["Dense_0"]["kernel"]
  want = np.asarray(state.params["params"]["Dense_0"]["kernel"])
  assert np.asarray(kernel).tobytes() == want.tobytes()
  assert int(restored.step) == 4
  assert len(jax.tree.leaves(restored)) == len(jax.tree.leaves(state))


@pytest.mark.parametrize("spec", ["my_template", "my_template:", ":template",
                                  "my template:template", "a:b:c"])
def test_template_spec_that_is_not_module_function_exits_2(
    capsys, tmp_path, golden_copy, spec):
  done = _in_process(capsys, "migrate", golden_copy("single_host"),
                     tmp_path / "dst", "--template", spec)
  _assert_one_line_error(done, 2, "--template", "MODULE:FUNCTION")
  assert len(done.stderr.strip().splitlines()) == 1, done.stderr
  assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("spec, needle", [
    ("no_such_template_module:template", "ModuleNotFoundError"),
    ("{name}:broken", "RuntimeError: no such device"),
    ("{name}:missing", "AttributeError"),
])
def test_template_that_cannot_be_imported_or_called_exits_1(
    capsys, tmp_path, golden_copy, monkeypatch, spec, needle):
  name = f"cli_template_{abs(hash(spec)) % 10**6}"
  _template_module(tmp_path, name)
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", list(sys.path))
  spec = spec.format(name=name)
  done = _in_process(capsys, "migrate", golden_copy("single_host"),
                     tmp_path / "dst", "--template", spec)
  _assert_one_line_error(done, 1, f"--template {spec}", needle)
  assert len(done.stderr.strip().splitlines()) == 1, done.stderr
  assert not (tmp_path / "dst").exists()
  sys.modules.pop(name, None)


# --------------------------------------------------------------------------
# Ctrl-C: a real process, a real SIGINT.
# --------------------------------------------------------------------------


def _big_source(directory, checkpoints=4):
  """CLU checkpoints of many arrays, each taking a while to migrate."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, os.path.dirname(__file__))
  from migration_helpers import clu_save  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  clu_save(directory, [
      {"step": np.int64(10 * i),
       "p": {f"a{j}": rng.random(2**16, np.float32) for j in range(300)}}
      for i in range(1, checkpoints + 1)], max_to_keep=10)


def _interrupt_after_first_step(argv, dst):
  """Runs `clu-ckpt argv`, sends SIGINT once a step is migrated and the next
  one is being written; returns (exit status, stderr lines after it)."""
  import signal  # pylint: disable=g-import-not-at-top
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  proc = subprocess.Popen([sys.executable, "-m", "clu_ckpt", *map(str, argv)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env)
  for line in proc.stderr:
    if line.startswith("migrating ckpt-2"):
      break
  proc.send_signal(signal.SIGINT)
  rest = proc.stderr.read()
  proc.wait(timeout=120)
  return proc.returncode, rest.strip().splitlines()


# A soak (run with --soak: 300 MiB migrated twice); the quick Ctrl-C test is
# the next one.
@pytest.mark.soak
def test_ctrl_c_abandons_the_step_and_a_rerun_resumes(tmp_path):
  from clu_ckpt import flax_format  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, os.path.dirname(__file__))
  from migration_helpers import same_tree  # pylint: disable=g-import-not-at-top
  src, dst = tmp_path / "src", tmp_path / "dst"
  _big_source(src)
  code, lines = _interrupt_after_first_step(["migrate", src, dst], dst)
  assert code == 130, lines
  assert len(lines) == 1, lines
  assert lines[0].startswith("clu-ckpt migrate: interrupted: "), lines
  assert "re-run to resume" in lines[0]
  assert not [p for p in os.listdir(dst) if "orbax-checkpoint-tmp" in p]
  steps = _steps(dst)
  assert steps and steps == [10 * n for n in range(1, len(steps) + 1)]
  assert f"{len(steps)} of 4 checkpoints migrated" in lines[0], lines
  for step in steps:
    source = flax_format.load_file(str(src / f"ckpt-{step // 10}.flax"))
    assert same_tree(migration.restore_state(str(dst), step), source)
  done = _clu_ckpt("migrate", src, dst)
  assert done.returncode == 0, done.stderr
  assert _steps(dst) == [10, 20, 30, 40]
  assert f"ckpt-{len(steps) + 1} -> step {10 * len(steps) + 10}: migrated" \
      in done.stdout, done.stdout


def test_ctrl_c_during_verify_is_one_line(tmp_path):
  # A real process whose verify gets SIGINT while it reads the first
  # checkpoint (deterministically: the signal is sent from inside it).
  src = tmp_path / "src"
  _big_source(src, checkpoints=2)
  code = textwrap.dedent("""
      import os, signal, sys
      from clu_ckpt import cli, flax_format
      opened = flax_format.FlaxFile.__init__
      def interrupted(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        opened(self, *args, **kwargs)
      flax_format.FlaxFile.__init__ = interrupted
      sys.exit(cli.main(["verify", sys.argv[1]]))
  """)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  proc = subprocess.run([sys.executable, "-c", code, str(src)],
                        capture_output=True, text=True, env=env, timeout=120)
  assert proc.returncode == 130, proc.stdout + proc.stderr
  assert proc.stderr.strip().splitlines() == [
      f"clu-ckpt verify: interrupted: {src} not finished"], proc.stderr


def test_verify_with_the_wrong_source_names_the_recorded_one(
    tmp_path, capsys, golden_copy):
  src = golden_copy("single_host")
  assert cli.main(["migrate", str(src), str(tmp_path / "dst")]) == 0
  other = tmp_path / "other"
  other.mkdir()
  capsys.readouterr()
  done = _in_process(capsys, "verify", tmp_path / "dst", "--source", other)
  assert done.returncode == 1
  first = done.stdout.splitlines()[0]
  assert first.startswith(f"PROBLEM: {other}: not the source"), done.stdout
  assert f"--source {src}" in first
  # The right source: no such line, and it verifies.
  done = _in_process(capsys, "verify", tmp_path / "dst", "--source", src)
  assert done.returncode == 0, done.stdout
  assert "not the source" not in done.stdout


@pytest.mark.orbax  # migrates
def test_verify_with_its_source_names_checkpoints_never_migrated(
    tmp_path, capsys):
  """`verify ROOT --source SRC` is what an operator runs before deleting
  SRC: it must not say OK while SRC keeps checkpoints ROOT never got."""
  from migration_helpers import example_state  # pylint: disable=g-import-not-at-top
  from clu_ckpt import checkpoint  # pylint: disable=g-import-not-at-top
  src, dst = tmp_path / "run", tmp_path / "dst"
  ckpt = checkpoint.Checkpoint(str(src))
  for step in (1, 2, 3):
    ckpt.save(example_state(step))
  assert cli.main(["migrate", str(src), str(dst), "--latest"]) == 0
  capsys.readouterr()
  done = _in_process(capsys, "verify", dst, "--source", src)
  assert done.returncode == 1, done.stdout
  assert done.stdout.splitlines()[0] == (
      f"PROBLEM: {src}: 2 of 3 checkpoint(s) not migrated into {dst} "
      f"(ckpt-1, ckpt-2): deleting the source would lose them; "
      f"`clu-ckpt migrate {src} {dst}` migrates them")
  assert cli.main(["migrate", str(src), str(dst)]) == 0
  capsys.readouterr()
  assert _in_process(capsys, "verify", dst, "--source", src).returncode == 0
  # Training went on after the migration.
  ckpt.save(example_state(4))
  done = _in_process(capsys, "verify", dst, "--source", src)
  assert done.returncode == 1 and "1 of 4 checkpoint(s) not migrated" in (
      done.stdout) and "(ckpt-4)" in done.stdout, done.stdout
  assert cli.main(["migrate", str(src), str(dst)]) == 0
  # A step removed from the root since (Orbax's max_to_keep, a hand): the
  # manifest says it was migrated, and a re-run does not write it again, so
  # the source holds its only copy.
  shutil.rmtree(dst / "1")
  capsys.readouterr()
  for _ in range(2):
    done = _in_process(capsys, "verify", dst, "--source", src)
    assert done.returncode == 1, done.stdout
    assert done.stdout.splitlines()[0] == (
        f"PROBLEM: {src}: 1 checkpoint(s) migrated into {dst} whose step it "
        "no longer holds (ckpt-1 (step 1); removed since, by a "
        "CheckpointManager's max_to_keep or by hand): the source holds their "
        "only copy and deleting it would lose them"), done.stdout
    assert cli.main(["migrate", str(src), str(dst)]) == 0
    assert not (dst / "1").exists()
    capsys.readouterr()
  # A root migrated before manifests: the steps' own metadata say.
  (dst / "clu_ckpt_manifest.json").unlink()
  done = _in_process(capsys, "verify", dst, "--source", src)
  assert done.returncode == 1 and "1 of 4 checkpoint(s) not migrated" in (
      done.stdout) and "(ckpt-1)" in done.stdout, done.stdout


@pytest.mark.orbax  # migrates
def test_verify_with_its_source_names_what_the_migration_did_not_read(
    tmp_path, capsys):
  """A run switched to `layout="orbax"` keeps Orbax steps in its CLU
  directory; a run can hold another run, or Flax files: none of them is
  migrated, so deleting the source would lose them, and `verify --source`
  must say so (it said OK)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from migration_helpers import example_state  # pylint: disable=g-import-not-at-top
  from clu_ckpt import checkpoint  # pylint: disable=g-import-not-at-top
  src, dst = tmp_path / "run", tmp_path / "dst"
  ds = iter(tf.data.Dataset.range(100))
  ckpt = checkpoint.Checkpoint(str(src), dict(ds_iter=ds))
  for step in (1, 2):
    ckpt.save(example_state(step))
  assert cli.main(["migrate", str(src), str(dst)]) == 0
  capsys.readouterr()
  assert _in_process(capsys, "verify", dst, "--source", src).returncode == 0
  # The run goes on in Orbax's layout, in the same directory.
  switched = checkpoint.Checkpoint(str(src), dict(ds_iter=ds),
                                   layout="orbax")
  switched.restore_or_initialize(example_state(0))
  switched.save(example_state(3))
  steps = sorted(n for n in os.listdir(src) if n.isdigit())
  assert steps, os.listdir(src)
  done = _in_process(capsys, "verify", dst, "--source", src)
  assert done.returncode == 1, done.stdout
  assert done.stdout.splitlines()[0] == (
      f"PROBLEM: {src}: also holds {', '.join(s + '/' for s in steps)}, "
      "which the migration did not read (Orbax steps, other runs, Flax "
      "files, directories): deleting the source would delete them; move or "
      "migrate them first"), done.stdout
  for n in steps:
    shutil.rmtree(src / n)
  assert _in_process(capsys, "verify", dst, "--source", src).returncode == 0
  # A run inside the run, and a Flax file beside it.
  (src / "finetune").mkdir()
  (src / "ema_10").write_bytes(b"\x80")
  (src / "notes.txt").write_text("not a checkpoint")
  (src / "v2.json").write_text("{}")  # not named like a Flax checkpoint
  (src / "ckpt-9_temp").mkdir()  # TensorFlow's debris of a killed save
  done = _in_process(capsys, "verify", dst, "--source", src)
  assert done.returncode == 1
  assert f"PROBLEM: {src}: also holds ema_10, finetune/, which" in (
      done.stdout), done.stdout


def test_inspect_a_missing_step_of_a_migrated_root_hints_at_the_mapping(
    tmp_path, capsys, golden_copy):
  src = golden_copy("single_host")
  assert cli.main(["migrate", str(src), str(tmp_path / "dst"), "--json"]) == 0
  mapping = {s["number"]: s["step"] for s in json.loads(
      capsys.readouterr().out)["steps"]}
  number = max(mapping)
  assert number not in mapping.values()
  done = _in_process(capsys, "inspect", tmp_path / "dst", "--checkpoint",
                     number)
  _assert_one_line_error(done, 1, f"No step {number}",
                         f"migrated to step {mapping[number]}",
                         f"--checkpoint {mapping[number]}")
  missing = 10**9 + 7
  done = _in_process(capsys, "inspect", tmp_path / "dst", "--checkpoint",
                     missing)
  _assert_one_line_error(done, 1, f"No step {missing}", "not a CLU "
                         "checkpoint number", *[f"-> {s}" for s in
                                                mapping.values()])
  assert _in_process(capsys, "inspect", tmp_path / "dst", "--checkpoint",
                     mapping[number]).returncode == 0


def _verify_source_problems(capsys, dst, src):
  done = _in_process(capsys, "verify", dst, "--source", src)
  return done.returncode, [l for l in done.stdout.splitlines()
                           if l.startswith("PROBLEM: ")], done.stdout


@pytest.mark.orbax  # migrates
def test_verify_with_its_source_names_steps_saved_in_a_multihost_base(
    tmp_path, capsys):
  """A MultihostCheckpoint switched to `layout="orbax"` saves its steps in
  the base directory itself, which holds no host's files: deleting the
  source would lose them, and `verify --source` must say so (it said OK)."""
  from clu_ckpt import checkpoint  # pylint: disable=g-import-not-at-top
  from migration_helpers import example_state  # pylint: disable=g-import-not-at-top
  from migration_helpers import multihost_save  # pylint: disable=g-import-not-at-top
  base, dst = tmp_path / "mh" / "checkpoints", tmp_path / "dst"
  multihost_save(base, [[example_state(1), example_state(2)]] * 2)
  assert cli.main(["migrate", str(base), str(dst)]) == 0
  code, problems, out = _verify_source_problems(capsys, dst, base)
  assert code == 0, out
  ckpt = checkpoint.MultihostCheckpoint(str(base), host_id=0, layout="orbax")
  ckpt.save(ckpt.restore_or_initialize(example_state(0)))
  steps = sorted(p.name for p in base.iterdir())
  assert steps, "the Orbax layout saved nothing in the base"
  code, problems, out = _verify_source_problems(capsys, dst, base)
  assert code == 1 and len(problems) == 1, out
  assert all(f"checkpoints/{s}" in problems[0] for s in steps), problems
  assert "deleting the source would delete them" in problems[0]


@pytest.mark.orbax  # migrates
def test_verify_with_its_source_names_checkpoints_hosts_kept_training_past(
    tmp_path, capsys, golden_copy):
  """A job resumed on fewer hosts: the hosts that went on keep checkpoints
  the others never had. The one number after the newest common checkpoint
  may be a save the others never finished (not counted); later ones are
  training, and `verify --source` names them."""
  from migration_helpers import example_state  # pylint: disable=g-import-not-at-top
  from migration_helpers import multihost_save  # pylint: disable=g-import-not-at-top
  base, dst = tmp_path / "mh" / "ckpts", tmp_path / "dst"
  multihost_save(base, [[example_state(i) for i in (1, 2, 3, 4)]] * 2 +
                 [[example_state(1)]] * 2)
  assert cli.main(["migrate", str(base), str(dst)]) == 0
  code, problems, out = _verify_source_problems(capsys, dst, base)
  assert code == 1 and len(problems) == 1, out
  assert "ckpt-3 (kept by some hosts only" in problems[0], problems
  assert "ckpt-4 (kept by some hosts only" in problems[0], problems
  assert "ckpt-2 " not in problems[0], problems
  # A save one host finished and the other did not: no noise.
  golden = golden_copy("multihost") / "checkpoints"
  dst2 = tmp_path / "dst2"
  assert cli.main(["migrate", str(golden), str(dst2)]) == 0
  code, problems, out = _verify_source_problems(capsys, dst2, golden)
  assert code == 0, out


@pytest.mark.orbax  # migrates
def test_verify_with_its_source_names_a_save_in_progress(tmp_path, capsys):
  """CLU writes a checkpoint's `.flax` before TensorFlow's commit: a save
  in progress (or a torn one) is not in the state file, and deleting the
  source would lose it."""
  from migration_helpers import clu_save  # pylint: disable=g-import-not-at-top
  from migration_helpers import example_state  # pylint: disable=g-import-not-at-top
  src, dst = tmp_path / "run", tmp_path / "dst"
  clu_save(src, [example_state(1), example_state(2)])
  assert cli.main(["migrate", str(src), str(dst)]) == 0
  shutil.copyfile(src / "ckpt-2.flax", src / "ckpt-3.flax")
  code, problems, out = _verify_source_problems(capsys, dst, src)
  assert code == 1 and len(problems) == 1, out
  assert "ckpt-3.flax (not committed: a save in progress, or a torn one)" in (
      problems[0]), problems
  # Debris of an older torn save is not a checkpoint to keep.
  (src / "ckpt-3.flax").rename(src / "ckpt-1.flax.tmp-9")
  code, problems, out = _verify_source_problems(capsys, dst, src)
  assert code == 0, out
  # States saved by hand, or a checkpoint the state file no longer lists.
  shutil.copyfile(src / "ckpt-2.flax", src / "best.flax")
  shutil.copyfile(src / "ckpt-2.flax", src / "ckpt-0.flax")
  code, problems, out = _verify_source_problems(capsys, dst, src)
  assert code == 1 and len(problems) == 1, out
  assert "best.flax, ckpt-0.flax (not a checkpoint the `checkpoint` file " in (
      problems[0]), problems


@pytest.mark.orbax  # migrates
def test_a_host_directory_that_is_a_broken_link_is_refused(
    tmp_path, capsys, golden_copy):
  """A host directory on a disk not mounted (a broken link) was dropped
  unseen: the run migrated as one host, verify said OK, and deleting the
  source orphaned the other host's iterator."""
  base = golden_copy("multihost") / "checkpoints"
  host1 = base.parent / "checkpoints-1"
  shutil.rmtree(host1)
  host1.symlink_to(tmp_path / "not-mounted" / "host1")
  done = _in_process(capsys, "migrate", base, tmp_path / "dst")
  _assert_one_line_error(done, 1, str(host1), "not a directory one can read")
  assert not (tmp_path / "dst").exists() or not any(
      p.name.isdigit() for p in (tmp_path / "dst").iterdir())


@pytest.mark.orbax  # migrates
def test_a_checkpoint_number_saved_again_is_not_taken_as_migrated(
    tmp_path, capsys):
  """A run re-launched at a migrated run's path saves other checkpoints
  under the same numbers. They are not migrated (verify --source says so),
  and `migrate --verify` fails without taking away the steps migrated
  before (the only copy of the first run once its source is gone)."""
  from clu import checkpoint as clu_checkpoint  # pylint: disable=g-import-not-at-top
  from migration_helpers import example_state  # pylint: disable=g-import-not-at-top
  src, dst = tmp_path / "run", tmp_path / "dst"
  ckpt = clu_checkpoint.Checkpoint(str(src))
  for step in (1, 2):
    ckpt.save(example_state(step))
  assert cli.main(["migrate", "--verify", str(src), str(dst)]) == 0
  steps = sorted(p.name for p in dst.iterdir() if p.name.isdigit())
  shutil.rmtree(src)  # the operator deleted the source on a green light
  ckpt = clu_checkpoint.Checkpoint(str(src))
  for step in (1, 2):
    ckpt.save(example_state(step, scale=2.0))  # the same numbers again
  code, problems, out = _verify_source_problems(capsys, dst, src)
  assert code == 1, out
  assert any("ckpt-1 (not the checkpoint migrated under its number" in p and
             "ckpt-2 (not the checkpoint" in p for p in problems), problems
  done = _in_process(capsys, "migrate", "--verify", src, dst)
  assert done.returncode == 1, done.stdout + done.stderr
  assert "another checkpoint under the same number" in (
      done.stdout + done.stderr)
  assert sorted(p.name for p in dst.iterdir() if p.name.isdigit()) == steps


@pytest.mark.orbax  # migrates
def test_verify_of_a_step_migrated_from_a_state_host_compares_that_host(
    tmp_path, capsys):
  """Hosts holding different states are migrated with --state-host; the
  check before deleting (`migrate --verify` as the guide writes it, without
  --state-host) compared the steps with host 0 and took them away."""
  from migration_helpers import example_state  # pylint: disable=g-import-not-at-top
  from migration_helpers import multihost_save  # pylint: disable=g-import-not-at-top
  base, dst = tmp_path / "mh" / "ckpts", tmp_path / "dst"
  multihost_save(base, [[example_state(1)], [example_state(1, scale=2.0)]])
  assert cli.main(["migrate", str(base), str(dst)]) == 1  # hosts differ
  capsys.readouterr()
  assert cli.main(["migrate", "--state-host", "1", str(base), str(dst)]) == 0
  steps = sorted(p.name for p in dst.iterdir() if p.name.isdigit())
  assert steps
  done = _in_process(capsys, "migrate", "--verify", base, dst)
  assert done.returncode == 0, done.stdout + done.stderr
  assert sorted(p.name for p in dst.iterdir() if p.name.isdigit()) == steps
