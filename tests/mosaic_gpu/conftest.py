"""The Mosaic GPU lane (`lane.sh`): Python 3.12 + JAX 0.11.2, kernels in GPU interpret mode.

Not collected by the main suite (see `tests/conftest.py`); every test here needs JAX 0.11.2's
`plgpu.InterpretGPUParams`, and the session fails at once without it rather than skip.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

LANE_JAX = "0.11.2"


def pytest_sessionstart(session: pytest.Session) -> None:
    import jax
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if jax.__version__ != LANE_JAX or not hasattr(plgpu, "InterpretGPUParams"):
        raise pytest.UsageError(f"the Mosaic GPU lane needs JAX {LANE_JAX} with plgpu.InterpretGPUParams, "
                                f"found JAX {jax.__version__}; run it with tests/mosaic_gpu/lane.sh")
