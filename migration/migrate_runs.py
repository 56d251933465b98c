r"""Migrates many CLU runs to Orbax at once, on one or many machines.

Synopsis::

  python migration/migrate_runs.py \
      --source-glob='/runs/*/checkpoints' \
      --destination-root=/orbax_runs \
      --parallelism=4 --verify --report=/tmp/migration_report.json

  python migration/migrate_runs.py --help

The command itself is `clu_ckpt.migration.fleet` (also run as `python -m
clu_ckpt.migration.fleet`); its docstring and migration/README.md ("Many
runs") describe the flags, the report, the stops and the exit statuses.
Run from a checkout, this script uses the checkout's `clu_ckpt`.
"""

import os
import sys


def _use_this_checkout() -> None:
  """Puts the checkout this script is in first on `sys.path`, if it is one."""
  checkout = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
  if os.path.isfile(os.path.join(checkout, "clu_ckpt", "__init__.py")):
    sys.path.insert(0, checkout)
  # Not this script's own directory: a module there would shadow a library.
  here = os.path.dirname(os.path.realpath(__file__))
  sys.path[:] = [p for p in sys.path
                 if not p or os.path.realpath(p) != here]


if __name__ == "__main__":
  _use_this_checkout()
  from clu_ckpt.migration import fleet  # pylint: disable=g-import-not-at-top
  sys.exit(fleet.main())
