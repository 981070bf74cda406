#!/usr/bin/env bash
# The Mosaic GPU kernel lane of the README's test command: Python 3.12 + JAX 0.11.2 (the GPU image's
# versions, CPU wheel), where `plgpu.InterpretGPUParams` can run Hopper kernels on this CPU. It makes
# its own virtual environment (.venv-mosaic, reused when already right) and fails, never skips, when
# it cannot: no Python 3.12, no JAX 0.11.2, or any test failing.
set -euo pipefail
cd "$(dirname "$0")/../.."
JAX_VERSION=0.11.2
PY=.venv-mosaic/bin/python
if ! "$PY" -c "import jax, flax, transformers, paxserve.kernels, ml_dtypes, pytest, xdist, sys; sys.exit(jax.__version__ != '$JAX_VERSION')" 2>/dev/null; then
    if ! PYENV_VERSION=3.12.1 python3.12 -c "" 2>/dev/null; then
        echo "mosaic lane: Python 3.12 is needed (PYENV_VERSION=3.12.1 python3.12) and was not found" >&2
        exit 1
    fi
    rm -rf .venv-mosaic
    PYENV_VERSION=3.12.1 python3.12 -m venv .venv-mosaic
    # The package with its runtime dependencies (the engine test runs a model; no torch), on the pinned JAX.
    .venv-mosaic/bin/pip install -q --no-compile -e . "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION" ml_dtypes \
        absl-py pytest pytest-xdist
fi
# --confcutdir: the main suite's conftest (Python 3.11 engine tests) is not this lane's.
exec "$PY" -m pytest -p no:cacheprovider -n 2 --confcutdir=tests/mosaic_gpu tests/mosaic_gpu "$@"
