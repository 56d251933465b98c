"""`clu_ckpt.checkpoint` on gs:// and s3:// directories, against real emulators.

Every test runs on fake-gcs-server and on moto's S3 server (`bucket_store`,
tests/emulators.py, 127.0.0.1 only); the S3 variants only with `--thorough`
(this module's code paths are the same on both stores; test_fsspec_fs.py
runs both stores' own behaviour in the quick run). The oracles: the golden directories
written by clu 0.0.12 (uploaded as they are), their MANIFEST.json (the
iterator's next batch), `flax.serialization.msgpack_restore` of the same
local file (bit for bit), and the real `clu` restoring what clu_ckpt saved
to a bucket once it is downloaded. Reads that must not need TensorFlow run
in a child process where `import tensorflow` fails.
"""

import contextlib
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
from typing import Any

from clu import checkpoint as clu_checkpoint
import flax
from flax import serialization
import numpy as np
import pytest
import tensorflow as tf

from clu_ckpt import checkpoint
from clu_ckpt import errors
from clu_ckpt import storage

from conftest import golden_case  # pylint: disable=g-bad-import-order
import digests  # pylint: disable=g-bad-import-order
from conftest import read_manifest

pytestmark = pytest.mark.thorough("s3")


@flax.struct.dataclass
class TrainState:
  params: Any
  step: Any


def make_state(step: int) -> TrainState:
  rng = np.random.default_rng(step)
  return TrainState(
      params={"w": rng.normal(size=(3, 4)).astype(np.float32),
              "b": np.full((4,), step, np.float16), "name": "dense",
              "extra": [1.5, None, True]},
      step=step)


def dataset_iterator():
  return iter(tf.data.Dataset.range(10000).batch(4))


def batch(it) -> list[int]:
  return next(it).numpy().tolist()


def digest(tree: Any) -> dict[str, list]:
  """See `digests.digest`; `tree` may be a dataclass (a state dict is made)."""
  return digests.digest(serialization.to_state_dict(tree))


def oracle(path: pathlib.Path) -> dict[str, list]:
  return digest(serialization.msgpack_restore(path.read_bytes()))


def listing(url: str) -> list[str]:
  """The names in a bucket directory, sorted."""
  return storage.listdir(url)


# What a child without TensorFlow runs first (see `run_without_tf`).
_NO_TF = f"""
import json, sys
sys.modules["tensorflow"] = None   # `import tensorflow` raises ImportError
sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
import numpy as np
from clu_ckpt import checkpoint
from digests import digest
"""


def run_child(store, code: str, *, tf_blocked: bool = True,
              timeout: float = 120) -> Any:
  """Runs `code` in a fresh Python on the emulator; returns its last JSON."""
  prelude = _NO_TF if tf_blocked else ""
  proc = subprocess.run(
      [sys.executable, "-c", prelude + textwrap.dedent(code)],
      capture_output=True, text=True, timeout=timeout,
      env=store.child_env(TF_CPP_MIN_LOG_LEVEL="3"))
  assert proc.returncode == 0, proc.stderr[-5000:]
  return json.loads(proc.stdout.splitlines()[-1])


_UPLOADED: dict[tuple[str, str], str] = {}


@pytest.fixture
def uploaded(bucket_store):
  """Returns `upload(case)`: the URL of golden `case`, uploaded as it is.

  Uploaded once per store and session: tests only read these.
  """

  def upload(case: str) -> str:
    key = (bucket_store.url, case)
    if key not in _UPLOADED:
      _UPLOADED[key] = bucket_store.upload(golden_case(case), case)
    return _UPLOADED[key]

  return upload


# ---------------------------------------------------------------------------
# (a) Reads: golden directories written by clu, uploaded.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", [None, "ckpt-3"])
def test_restore_single_host_with_iterator(uploaded, name):
  url = uploaded("single_host")
  manifest = read_manifest("single_host")["checkpoints"]
  before = listing(url)
  it = dataset_iterator()
  ck = checkpoint.Checkpoint(url, dict(ds_iter=it), max_to_keep=3)
  assert ck.latest_checkpoint == f"{url}/ckpt-5"
  state = ck.restore(None, None if name is None else f"{url}/{name}")
  name = name or "ckpt-5"
  # The temporary copy TensorFlow read is gone: the iterator was restored.
  assert batch(it) == manifest[name]["next_batch"]
  assert digest(state) == oracle(golden_case("single_host") / f"{name}.flax")
  assert ck.restored_from == ck.current_checkpoint == f"{url}/{name}"
  assert listing(url) == before


def test_restore_or_initialize_from_bucket(uploaded):
  url = uploaded("single_host")
  manifest = read_manifest("single_host")["checkpoints"]["ckpt-5"]
  before = listing(url)
  it = dataset_iterator()
  ck = checkpoint.Checkpoint(url, dict(ds_iter=it))
  template = serialization.msgpack_restore(
      (golden_case("single_host") / "ckpt-3.flax").read_bytes())
  state = ck.restore_or_initialize(template)
  assert batch(it) == manifest["next_batch"]
  assert digest(state) == oracle(golden_case("single_host") / "ckpt-5.flax")
  it2 = dataset_iterator()
  ck2 = checkpoint.Checkpoint(url, dict(ds_iter=it2))
  assert digest(ck2.restore_dict(f"{url}/ckpt-4")) == oracle(
      golden_case("single_host") / "ckpt-4.flax")
  assert batch(it2) == read_manifest("single_host")["checkpoints"]["ckpt-4"][
      "next_batch"]
  assert listing(url) == before


def test_restore_tf_state_that_does_not_match(uploaded):
  url = uploaded("single_host")
  ck = checkpoint.Checkpoint(url, dict(ds_iter=dataset_iterator(),
                                       other=tf.Variable(3)))
  with pytest.raises(errors.InvalidCheckpointError, match="ckpt-5"):
    ck.restore_dict()


def test_restore_multihost_with_iterators(uploaded):
  root = uploaded("multihost")
  manifest = read_manifest("multihost")
  base = f"{root}/{manifest['base']}"
  for host in range(manifest["hosts"]):
    it = dataset_iterator()
    ck = checkpoint.MultihostCheckpoint(base, dict(ds_iter=it), host_id=host)
    common = f"{base}-{host}/{manifest['common_latest']}"
    assert ck.get_latest_checkpoint_to_restore_from() == common
    state = ck.restore(None)
    assert state["step"] == manifest["restored_step"]
    assert batch(it) == manifest["next_batch_after_restore"][str(host)]
    assert digest(state) == oracle(
        golden_case("multihost") / f"{manifest['base']}-{host}" /
        f"{manifest['common_latest']}.flax")


def test_reads_without_tensorflow(uploaded, bucket_store):
  single = uploaded("single_host")
  multihost = f"{uploaded('multihost')}/checkpoints"
  incomplete = uploaded("incomplete_save")
  got = run_child(bucket_store, f"""
      from clu_ckpt import checkpoint
      out = {{}}
      out["load_state_dict"] = digest(checkpoint.load_state_dict({single!r}))
      out["params"] = digest(checkpoint.load_state_dict(
          {single!r}, subtree="params"))
      ck = checkpoint.Checkpoint({single!r})
      out["restore_dict"] = digest(ck.restore_dict())
      out["restored_from"] = ck.restored_from
      out["load_state_3"] = digest(ck.load_state(None, {single!r} + "/ckpt-3"))
      out["multihost"] = digest(checkpoint.load_state_dict({multihost!r}))
      host = checkpoint.MultihostCheckpoint({multihost!r}, host_id=1)
      out["multihost_1"] = digest(host.restore_dict())
      out["multihost_1_from"] = host.restored_from
      ck = checkpoint.Checkpoint({incomplete!r})
      out["incomplete"] = digest(ck.restore_dict())
      out["incomplete_from"] = ck.restored_from
      print(json.dumps(out))
  """)
  golden = golden_case("single_host")
  assert got["load_state_dict"] == oracle(golden / "ckpt-5.flax")
  assert got["restore_dict"] == oracle(golden / "ckpt-5.flax")
  assert got["restored_from"] == f"{single}/ckpt-5"
  assert got["params"] == {
      k[len("/params"):]: v for k, v in oracle(golden / "ckpt-5.flax").items()
      if k.startswith("/params/")}
  assert got["load_state_3"] == oracle(golden / "ckpt-3.flax")
  hosts = golden_case("multihost")
  assert got["multihost"] == oracle(hosts / "checkpoints-0" / "ckpt-2.flax")
  assert got["multihost_1"] == oracle(hosts / "checkpoints-1" / "ckpt-2.flax")
  assert got["multihost_1_from"] == f"{multihost}-1/ckpt-2"
  incomplete_golden = golden_case("incomplete_save")
  assert got["incomplete"] == oracle(incomplete_golden / "ckpt-1.flax")
  assert got["incomplete_from"] == (
      f"{incomplete}/{read_manifest('incomplete_save')['latest_committed']}")


# ---------------------------------------------------------------------------
# (b) Saves: TensorFlow serializes the iterator, clu_ckpt uploads and commits.
# ---------------------------------------------------------------------------


def normalized_state_text(text: str) -> str:
  """The `checkpoint` file with its timestamps replaced by `T`."""
  return re.sub(r"(timestamps?: )[0-9.e+-]+", r"\1T", text)


@pytest.fixture
def run_url(bucket_store):
  return f"{bucket_store.scheme}://{bucket_store.bucket()}/run"


@pytest.mark.thorough
def test_save_like_clu(run_url, bucket_store, tmp_path):
  clu_dir = tmp_path / "clu"
  ours_it, clu_it = dataset_iterator(), dataset_iterator()
  ours = checkpoint.Checkpoint(run_url, dict(ds_iter=ours_it), max_to_keep=2)
  clu = clu_checkpoint.Checkpoint(str(clu_dir), dict(ds_iter=clu_it),
                                  max_to_keep=2)
  for step in range(1, 5):
    for _ in range(step):
      next(ours_it), next(clu_it)
    assert ours.save(make_state(step)) == f"{run_url}/ckpt-{step}"
    assert clu.save(make_state(step)) == f"{clu_dir}/ckpt-{step}"
    assert listing(run_url) == sorted(os.listdir(clu_dir))
  assert listing(run_url) == [
      "checkpoint", "ckpt-3.data-00000-of-00001", "ckpt-3.flax",
      "ckpt-3.index", "ckpt-4.data-00000-of-00001", "ckpt-4.flax",
      "ckpt-4.index"]
  for n in (3, 4):
    assert storage.read_bytes(f"{run_url}/ckpt-{n}.flax") == (
        clu_dir / f"ckpt-{n}.flax").read_bytes()
  ours_text = storage.read_bytes(f"{run_url}/checkpoint").decode()
  clu_text = (clu_dir / "checkpoint").read_text()
  assert 'model_checkpoint_path: "ckpt-4"' in ours_text  # relative paths
  assert normalized_state_text(ours_text) == normalized_state_text(clu_text)
  # TensorFlow's own parser reads it as it reads clu's.
  from google.protobuf import text_format  # pylint: disable=g-import-not-at-top
  from tensorflow.python.checkpoint import checkpoint_management  # pylint: disable=g-import-not-at-top
  proto = text_format.Parse(ours_text,
                            checkpoint_management.CheckpointState())
  assert list(proto.all_model_checkpoint_paths) == ["ckpt-3", "ckpt-4"]
  assert len(proto.all_model_checkpoint_timestamps) == 2
  assert (proto.last_preserved_timestamp <
          proto.all_model_checkpoint_timestamps[0] <
          proto.all_model_checkpoint_timestamps[1])
  # A fresh process restores the iterator: 1+2+3+4 batches were consumed.
  got = run_child(bucket_store, f"""
      import json
      import tensorflow as tf
      from clu_ckpt import checkpoint
      it = iter(tf.data.Dataset.range(10000).batch(4))
      ck = checkpoint.Checkpoint({run_url!r}, dict(ds_iter=it))
      state = ck.restore_dict()
      print(json.dumps([int(state["step"]), next(it).numpy().tolist(),
                        ck.restored_from]))
  """, tf_blocked=False)
  assert got == [4, [40, 41, 42, 43], f"{run_url}/ckpt-4"]
  assert batch(clu_it) == [40, 41, 42, 43]
  # The real clu restores what clu_ckpt saved to the bucket, once downloaded.
  downloaded = tmp_path / "downloaded"
  downloaded.mkdir()
  for name in listing(run_url):
    (downloaded / name).write_bytes(storage.read_bytes(f"{run_url}/{name}"))
  it = dataset_iterator()
  again = clu_checkpoint.Checkpoint(str(downloaded), dict(ds_iter=it))
  assert again.latest_checkpoint == f"{downloaded}/ckpt-4"
  restored = again.restore(make_state(0))
  assert digest(restored) == digest(make_state(4))
  assert batch(it) == [40, 41, 42, 43]


def test_save_resumes_from_bucket_and_rejoins(run_url):
  it = dataset_iterator()
  ck = checkpoint.Checkpoint(run_url, dict(ds_iter=it), max_to_keep=3)
  for step in range(1, 4):
    next(it)
    ck.save(make_state(step))
  # A new process restores ckpt-1 and saves: ckpt-2 is rewritten, 3 goes.
  it = dataset_iterator()
  ck = checkpoint.Checkpoint(run_url, dict(ds_iter=it), max_to_keep=3)
  ck.restore(None, f"{run_url}/ckpt-1")
  assert batch(it) == [4, 5, 6, 7]
  assert ck.save(make_state(20)) == f"{run_url}/ckpt-2"
  assert listing(run_url) == [
      "checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.flax",
      "ckpt-1.index", "ckpt-2.data-00000-of-00001", "ckpt-2.flax",
      "ckpt-2.index"]
  it = dataset_iterator()
  fresh = checkpoint.Checkpoint(run_url, dict(ds_iter=it))
  assert fresh.restore_dict()["step"] == 20
  assert batch(it) == [8, 9, 10, 11]


def test_multihost_save_to_bucket(run_url):
  base = f"{run_url}/checkpoints"
  iterators = {h: dataset_iterator() for h in (0, 1)}
  hosts = {h: checkpoint.MultihostCheckpoint(base, dict(ds_iter=iterators[h]),
                                             host_id=h, max_to_keep=2)
           for h in (0, 1)}
  for step in (1, 2):
    for h in (0, 1):
      next(iterators[h])
      hosts[h].save(make_state(step))
  next(iterators[1])
  hosts[1].save(make_state(3))   # host 0 is preempted before its ckpt-3
  assert checkpoint.load_state_dict(base)["step"] == 2
  it = dataset_iterator()
  host1 = checkpoint.MultihostCheckpoint(base, dict(ds_iter=it), host_id=1)
  assert host1.restore_dict()["step"] == 2
  assert batch(it) == [8, 9, 10, 11]
  assert host1.save(make_state(3)) == f"{base}-1/ckpt-3"


class Killed(BaseException):
  """Stands for SIGKILL: nothing in the save may catch or clean up after it."""


def test_killed_anywhere_in_a_save(run_url, monkeypatch):
  """A kill at each write or delete of a save leaves the run restorable.

  Each kill point gets its own directory: two checkpoints, then the third
  save dies there; a new `Checkpoint` (a restarted process) restores the
  newest committed one with its iterator and the next save succeeds.
  """
  real_writer, real_remove = storage.atomic_writer, storage.remove
  plan = {"ops": [], "kill_at": None}

  def step_op(name: str) -> bool:
    plan["ops"].append(name)
    return len(plan["ops"]) - 1 == plan["kill_at"]

  @contextlib.contextmanager
  def writer(path):
    kill = step_op("write " + path.rsplit("/", 1)[-1])
    with real_writer(path) as write:
      if kill:
        write(b"torn")
        raise Killed(path)
      yield write

  def remove(path):
    if step_op("remove " + path.rsplit("/", 1)[-1]):
      raise Killed(path)
    real_remove(path)

  monkeypatch.setattr(storage, "atomic_writer", writer)
  monkeypatch.setattr(storage, "remove", remove)
  kill_at, seen = 0, []
  while True:
    url = f"{run_url}/k{kill_at}"
    it = dataset_iterator()
    ck = checkpoint.Checkpoint(url, dict(ds_iter=it), max_to_keep=2)
    for step in (1, 2):
      next(it)
      ck.save(make_state(step))
    next(it)
    plan["ops"], plan["kill_at"] = [], kill_at
    try:
      ck.save(make_state(3))
      killed = None
    except Killed:
      killed = plan["ops"][-1]
    plan["kill_at"] = None
    if killed is None:
      break
    seen.append(killed)
    it = dataset_iterator()
    restart = checkpoint.Checkpoint(url, dict(ds_iter=it), max_to_keep=2)
    state = restart.restore_dict()
    want = 3 if killed.startswith("remove") else 2
    assert state["step"] == want, killed
    assert batch(it) == ([12, 13, 14, 15] if want == 3 else [8, 9, 10, 11])
    assert restart.save(make_state(9)) == f"{url}/ckpt-{want + 1}", killed
    it = dataset_iterator()
    again = checkpoint.Checkpoint(url, dict(ds_iter=it))
    assert again.restore_dict()["step"] == 9, killed
    assert batch(it) == ([16, 17, 18, 19] if want == 3 else [12, 13, 14, 15])
    names = listing(url)
    want_names = {f"ckpt-{n}{ext}" for n in (want, want + 1)
                  for ext in (".flax", ".index", ".data-00000-of-00001")}
    assert want_names | {"checkpoint"} <= set(names), killed
    assert set(names) == want_names | {"checkpoint"}, killed
    kill_at += 1
  assert seen == [
      "write ckpt-3.flax", "write ckpt-3.data-00000-of-00001",
      "write ckpt-3.index", "write clu_ckpt-pruning.json", "write checkpoint",
      "remove ckpt-1.index", "remove ckpt-1.data-00000-of-00001",
      "remove clu_ckpt-pruning.json", "remove ckpt-1.flax"]


@pytest.mark.thorough
def test_sigkill_while_committing(run_url, bucket_store):
  """A real kill (os._exit) halfway through the state file's upload."""
  code = f"""
      import contextlib, os
      import numpy as np
      import tensorflow as tf
      from clu_ckpt import checkpoint, storage
      it = iter(tf.data.Dataset.range(10000).batch(4))
      ck = checkpoint.Checkpoint({run_url!r}, dict(ds_iter=it), max_to_keep=2)
      for step in (1, 2):
        next(it)
        ck.save({{"step": np.int64(step)}})
      real = storage.atomic_writer

      @contextlib.contextmanager
      def dying(path):
        with real(path) as write:
          if path.endswith("/checkpoint"):
            write(b"model_checkpoint_path: ")
            os._exit(9)
          yield write

      storage.atomic_writer = dying
      next(it)
      ck.save({{"step": np.int64(3)}})
  """
  proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                        capture_output=True, text=True, timeout=120,
                        env=bucket_store.child_env(TF_CPP_MIN_LOG_LEVEL="3"))
  assert proc.returncode == 9, proc.stderr[-3000:]
  assert "ckpt-3.index" in listing(run_url)  # written, never committed
  assert 'model_checkpoint_path: "ckpt-2"' in storage.read_bytes(
      f"{run_url}/checkpoint").decode()
  it = dataset_iterator()
  ck = checkpoint.Checkpoint(run_url, dict(ds_iter=it), max_to_keep=2)
  assert ck.restore_dict()["step"] == 2
  assert batch(it) == [8, 9, 10, 11]
  assert ck.save({"step": np.int64(30)}) == f"{run_url}/ckpt-3"
  assert listing(run_url) == [
      "checkpoint", "ckpt-2.data-00000-of-00001", "ckpt-2.flax",
      "ckpt-2.index", "ckpt-3.data-00000-of-00001", "ckpt-3.flax",
      "ckpt-3.index"]
  it = dataset_iterator()
  assert checkpoint.Checkpoint(run_url, dict(ds_iter=it)).restore_dict()[
      "step"] == 30
  assert batch(it) == [12, 13, 14, 15]


def test_failed_upload_is_undone(run_url, monkeypatch):
  it = dataset_iterator()
  ck = checkpoint.Checkpoint(run_url, dict(ds_iter=it), max_to_keep=2)
  ck.save(make_state(1))
  before = listing(run_url)
  real = storage.atomic_writer

  def failing(path):
    if path.endswith(".index"):
      raise OSError(28, "No space left on device", path)
    return real(path)

  monkeypatch.setattr(storage, "atomic_writer", failing)
  with pytest.raises(OSError, match="ckpt-2") as raised:
    ck.save(make_state(2))
  assert isinstance(raised.value, errors.CheckpointWriteError)
  assert listing(run_url) == before
  monkeypatch.setattr(storage, "atomic_writer", real)
  assert ck.save(make_state(2)) == f"{run_url}/ckpt-2"
  assert checkpoint.load_state_dict(run_url)["step"] == 2
