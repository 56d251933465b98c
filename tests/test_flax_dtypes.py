"""Tests of clu_ckpt.flax_dtypes beyond the round trips in test_flax_format."""

import warnings

import numpy as np
import pytest

from clu_ckpt import flax_dtypes


@pytest.mark.parametrize("name", ["a", "a5", "|a5", "<a3"])
def test_numpys_deprecated_bytes_alias_is_unknown_not_a_warning(name):
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    with pytest.raises(ValueError, match="unknown dtype name"):
      flax_dtypes.dtype_from_name(name)


def test_the_bytes_names_numpy_writes_still_parse():
  assert flax_dtypes.dtype_from_name("bytes40") == np.dtype("S5")
  assert flax_dtypes.dtype_from_name("|S5") == np.dtype("S5")
