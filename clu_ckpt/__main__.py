"""`python -m clu_ckpt`: the `clu-ckpt` command (see `clu_ckpt.cli`)."""

import sys

from clu_ckpt.cli import main

if __name__ == "__main__":
  sys.exit(main())
