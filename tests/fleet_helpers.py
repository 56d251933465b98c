"""Directory trees for the fleet's tests: CLU runs as names only.

The fleet's plan reads names, not contents: a CLU `Checkpoint` directory is
one holding a `checkpoint` file or a `<name>-<N>.flax`, so empty files named
so stand for runs (tests/test_migration_fleet.py, test_migrate_runs.py).
"""

import pathlib


def touch(root: pathlib.Path, *names: str) -> None:
  """Empty files (and their directories) under `root`."""
  for name in names:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")


def clu_dir(root: pathlib.Path, name: str) -> None:
  """A directory CLU's `Checkpoint` would leave (names only)."""
  touch(root, f"{name}/checkpoint", f"{name}/ckpt-1.flax",
        f"{name}/ckpt-1.index")


def make_tree(root: pathlib.Path) -> None:
  """runs/{a,b}: CLU dirs; runs/m: a multihost base (hosts only); runs/e:
  empty; runs/o: other files; runs/f: Flax's checkpoints layout."""
  for run in ("a", "b"):
    clu_dir(root, f"runs/{run}/checkpoints")
  for host in (0, 1):
    clu_dir(root, f"runs/m/checkpoints-{host}")
  (root / "runs/e/checkpoints").mkdir(parents=True)
  touch(root, "runs/o/checkpoints/notes.txt",
        "runs/f/checkpoints/checkpoint_100")
