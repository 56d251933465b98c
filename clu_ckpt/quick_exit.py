"""A command that imported JAX and Orbax exits without collecting them.

When the interpreter shuts down it runs a last garbage collection over every
object still alive: after `import orbax.checkpoint` (JAX, TensorStore, absl,
numpy: about a million objects) that pass alone costs about 0.25 s of CPU
on the 2-core machine, a sixth of a tiny `clu-ckpt migrate` process and more
than all of its migration work (measured with `benchmarks/bench_migration.py
--tiny`: `python -c 'import orbax.checkpoint'` 1.77 s CPU, the same with
`gc.freeze()` at exit 1.52 s, with `os._exit(0)` 1.50 s). The collection
frees nothing the operating system would not take back at exit anyway.

`skip_final_collection()` registers, once per process, an `atexit` handler
that moves every live object into the collector's permanent generation
(`gc.freeze()`), which the shutdown collection does not walk. It runs at
exit only, after the command's work and its output are done: non-daemon
threads have been joined and the other `atexit` handlers (logging's flush,
JAX's backend clean-up) still run. What is given up: objects in reference
cycles that are alive at exit are not finalized (their `__del__` does not
run), which Python never promises at exit either; the migration closes its
files and flushes its writes before it returns, so nothing depends on it.

It is for processes that end when the command does (the `clu-ckpt migrate`
command): a library call (`migration.migrate`) does not call
it, so an application's own shutdown is left as it is.

Synopsis::

  from clu_ckpt import quick_exit

  quick_exit.skip_final_collection()   # in a command, before or after work
"""

from __future__ import annotations

import atexit
import gc
import threading

_LOCK = threading.Lock()
_REGISTERED = False


def skip_final_collection() -> bool:
  """Makes this process skip the shutdown's garbage collection.

  Idempotent: the handler is registered once per process.

  Returns:
    True when this call registered the handler, False when it already was.
  """
  global _REGISTERED
  with _LOCK:
    if _REGISTERED:
      return False
    atexit.register(gc.freeze)
    _REGISTERED = True
    return True
