#!/usr/bin/env bash
# Every test, as the README's test command runs them (from the main suite's activated environment):
#   1. the Mosaic GPU kernel lane (tests/mosaic_gpu/lane.sh: its own Python 3.12 environment, made or
#      checked first) in the background, beside
#   2. the main suite's tests on two pytest-xdist workers (`-m "not serial"`);
#   3. then, the lane done and the machine quiet, the timing-sensitive files alone (`-m serial`).
# The lane overlaps the parallel part because neither times anything: together they keep both cores
# busy through the parallel part's idle tail and the lane's install (the suite's wall time in
# benchmarks/RESULTS.md). Every part runs whatever another's outcome; the exit status is 0 only when
# all three passed.
set -uo pipefail
cd "$(dirname "$0")/.."
# The run starts many Python processes (servers, probes, worker ranks, the lane's parts), each
# importing JAX, transformers and paxserve: with PYTHONDONTWRITEBYTECODE set (as on these machines)
# and packages installed with --no-compile, every one compiled all of that source again (4.1 of a
# server's 9-11 s start). Bytecode is cached once per run instead, under .pytest_cache, outside the
# source tree.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-$PWD/.pytest_cache/pycache}"
lane_log="$(mktemp -t paxserve-mosaic-lane.XXXXXX)"
bash tests/mosaic_gpu/lane.sh > "$lane_log" 2>&1 &
lane_pid=$!
trap 'kill -- "$lane_pid" 2>/dev/null' INT TERM
python -m pytest -n 2 --dist loadfile -m "not serial"
parallel=$?
echo "==== waiting for the Mosaic GPU lane (tests/mosaic_gpu/lane.sh) ===="
wait "$lane_pid"
lane=$?
cat "$lane_log"
rm -f "$lane_log"
python -m pytest -m serial
serial=$?
echo "==== parallel part: exit $parallel; Mosaic GPU lane: exit $lane; serial part: exit $serial ===="
[[ $parallel == 0 && $lane == 0 && $serial == 0 ]]
