"""The package's one dtype codec: dtype <-> name.

`.flax` files name array dtypes by `dtype.name` ("float32", "bfloat16",
"str128"); the `metadata` item of migrated steps records `dtype_name(dtype)`
(numpy's `.str`, "<f4", byte order included, or the ml_dtypes name).
`dtype_from_name` reads both. `flax_format` re-exports all of it.

Synopsis::

  from clu_ckpt import flax_format

  name = flax_format.dtype_name(np.dtype(">i8"))      # ">i8"
  assert flax_format.dtype_from_name(name) == np.dtype(">i8")
  assert flax_format.dtype_from_name("bfloat16") == ml_dtypes.bfloat16
"""

from __future__ import annotations

import re
from typing import Any, Optional, Union

import numpy as np


def dtype_name(dtype: Any) -> str:
  """A name of `dtype` that `dtype_from_name` turns back into it exactly.

  numpy's own dtypes are named by their `.str` ("<f4", "<U3", ">i8": byte
  order included); ml_dtypes ones (whose `.str` is an anonymous "<V1") by
  their `.name` ("bfloat16", "int4"). These are the names the `metadata` item
  of migrated steps records. (`.flax` files name dtypes by `dtype.name`,
  which `dtype_from_name` reads too.)
  """
  dtype = np.dtype(dtype)
  if dtype.type.__module__.startswith("ml_dtypes"):
    return dtype.name
  return dtype.str


def dtype_from_name(name: Union[str, bytes]) -> np.dtype:
  """The numpy dtype of a Flax dtype name or of a `dtype_name` name.

  Accepts `dtype.name` forms as `.flax` files hold them ("float32",
  "bfloat16", "float8_e4m3fn", "str128", "bytes8") and `.str` forms ("<f4",
  "|S2", "<U3", "<M8[s]").

  Raises:
    ValueError: Not a dtype name.
  """
  raw = name.encode("ascii", "replace") if isinstance(name, str) else bytes(
      name)
  dtype = _dtype_from_name(raw)
  if dtype is None and 2 <= len(raw) <= 32 and raw[:1] in (b"<", b">", b"|",
                                                           b"="):
    try:
      dtype = _numpy_dtype(raw.decode("ascii"))
    except (TypeError, ValueError, UnicodeDecodeError):
      dtype = None
  if dtype is None:
    raise ValueError(f"unknown dtype name {name!r}")
  return dtype


_DTYPE_CACHE: dict[bytes, Optional[np.dtype]] = {}
# The cache holds at most this many names (hostile files may hold many).
_DTYPE_CACHE_SIZE = 256


def _dtype_from_name(raw: bytes) -> Optional[np.dtype]:
  """numpy dtype for a Flax dtype name (`dtype.name`), or None.

  The reader's half of the codec (bytes in, None for unknown names); kept
  under this name for callers outside the module. See `dtype_from_name`.

  Handles the ml_dtypes names (bfloat16, float8_*, int4, ...) and the names
  numpy gives flexible dtypes ("str128", "bytes8") but cannot parse back.
  """
  if raw in _DTYPE_CACHE:
    return _DTYPE_CACHE[raw]
  dtype = None
  try:
    name = raw.decode("ascii")
  except UnicodeDecodeError:
    name = ""
  if name and len(name) <= 32 and all(c.isalnum() or c in "_[]" for c in name):
    try:
      dtype = _parse_dtype_name(name)
    except (TypeError, ValueError, OverflowError):
      dtype = None
  # Only names that parse are cached (hostile ones stay out), and only so
  # many (a file may name a million distinct void or str dtypes).
  if dtype is not None and len(_DTYPE_CACHE) < _DTYPE_CACHE_SIZE:
    _DTYPE_CACHE[raw] = dtype
  return dtype


# NumPy 2 deprecates the type code "a" (bytes; "S" is its name), with a
# DeprecationWarning at each use.
_DEPRECATED_ALIAS = re.compile(r"^[<>|=]?a\d*$")


def _numpy_dtype(text: str) -> np.dtype:
  """`np.dtype(text)`, refusing the aliases NumPy deprecates ("a", "|a5").

  numpy never writes them (`.name` and `.str` say "bytes40", "|S5"), so a
  file naming one was not written by numpy or Flax: an unknown name, not a
  warning. (Checked by name, not by turning the warning into an error:
  `warnings.catch_warnings` is not safe in the reading threads.)

  Raises:
    TypeError: Not a dtype, or a deprecated alias of one.
  """
  if _DEPRECATED_ALIAS.match(text):
    raise TypeError(f"deprecated dtype alias {text!r}")
  return np.dtype(text)


def _parse_dtype_name(name: str) -> Optional[np.dtype]:
  for prefix, code, bits in (("str", "U", 32), ("bytes", "S", 8),
                             ("void", "V", 8)):
    if name.startswith(prefix) and name[len(prefix):].isdigit():
      size = int(name[len(prefix):])
      return np.dtype(f"{code}{size // bits}") if size % bits == 0 else None
  try:
    return _numpy_dtype(name)
  except TypeError:
    pass
  try:
    import ml_dtypes  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  kind = getattr(ml_dtypes, name, None)
  try:
    return np.dtype(kind) if isinstance(kind, type) else None
  except TypeError:
    return None
