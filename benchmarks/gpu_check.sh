#!/usr/bin/env bash
# One-shot GPU check on one H200 (finishes in about 8 minutes or less); prints a summary table.
#
#   bash benchmarks/gpu_check.sh            # the full check (needs a CUDA GPU and jax[cuda])
#   bash benchmarks/gpu_check.sh --smoke    # tiny shapes; runs anywhere (CPU: kernels interpreted)
#
# (m) GPU memory planning numbers, (a) Mosaic GPU and Triton kernels vs their XLA references on random inputs, (b) decode-kernel time and bandwidth
# at Llama-3-8B shapes vs a measured copy bandwidth and vs JAX's own Pallas paged attention,
# (c) end-to-end offline throughput of a random-weight Llama-3-8B-shaped model vs the
# memory-bandwidth bound. Uses only this repository; exits non-zero if a check fails or errors.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${VIRTUAL_ENV:-}" && -f .venv/bin/activate ]]; then
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
PYTHON="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
# The Python script keeps its own 450 s budget; the hard limit is a backstop.
exec timeout --signal=INT --kill-after=15 500 "$PYTHON" benchmarks/gpu_check.py "$@"
