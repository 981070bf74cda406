#!/usr/bin/env bash
# The GPU check on one H200 in about 7 minutes (see benchmarks/gpu_check.py for the parts and the
# time each is expected to take). Results go to $OUT (the device tool's folder that comes back) or
# to a new temporary folder: rows.jsonl as they are measured, gpu_check.log, summary.md.
#
#   bash benchmarks/gpu_check.sh              # the real check: the CUDA backend or nothing
#   bash benchmarks/gpu_check.sh --smoke      # tiny shapes; runs anywhere (CPU: kernels interpreted)
#   bash benchmarks/gpu_check.sh --only t,c   # some parts only
#
# Uses only this checkout and the machine's own Python (the GPU image reaches no package registry);
# exits 0 when nothing failed, 1 when a row failed or errored, 3 when no GPU backend started.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${VIRTUAL_ENV:-}" && -f .venv/bin/activate && " $* " != *" --smoke "* && -z "${PYTHON:-}" ]]; then
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
PYTHON="${PYTHON:-python3}"
# This checkout's code under its installed names (paxserve.models, paxserve.kernels, ...), installed or
# not: the GPU image has no paxserve installed and no registry to install it from.
PYTHONPATH="$("$PYTHON" benchmarks/checkout.py)${PYTHONPATH:+:$PYTHONPATH}" || exit 1
export PYTHONPATH
if [[ " $* " != *" --smoke "* ]]; then
  export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader \
    || echo "nvidia-smi: not available"
fi
# The orchestrator keeps its own budget and kills each part at its limit; this is the backstop.
exec timeout --signal=INT --kill-after=20 "${GPU_CHECK_HARD_LIMIT:-480}" "$PYTHON" benchmarks/gpu_check.py "$@"
