#!/usr/bin/env bash
# A/B serving throughput: the same load against a fresh server from commit $1 (default: HEAD~1) and
# from this working tree, one after the other on the same machine.
#   bash benchmarks/ab_serving.sh 8a1ce94 "--concurrency 64,64,64"
# Prints each side's serving.py table; JSON under /tmp/ab_{old,new}.json, server logs /tmp/ab_*.log.
set -euo pipefail
old_commit=${1:-HEAD~1}
load=${2:-"--concurrency 64,64,64"}
here=$(cd "$(dirname "$0")/.." && pwd)
old_tree=$(mktemp -d /tmp/paxserve-ab-XXXX)
git -C "$here" worktree add -q --detach "$old_tree" "$old_commit"
trap 'git -C "$here" worktree remove --force "$old_tree"' EXIT
port=8125
for tag in old new; do
  tree=$here; [ "$tag" = old ] && tree=$old_tree
  # Each side runs its own tree's code (benchmarks/checkout.py: its import root; the CLI's module moved
  # into the server in issue 30).
  root=$(python "$here/benchmarks/checkout.py" "$tree")
  cli=paxserve.server.cli; [ -f "$tree/paxserve/cli.py" ] && cli=paxserve.cli
  (cd "$root" && PYTHONPATH="$root" exec python -m $cli serve --port $port --max-model-len 1024) > /tmp/ab_$tag.log 2>&1 &
  pid=$!
  for _ in $(seq 240); do grep -q "paxserve listening" /tmp/ab_$tag.log && break; sleep 1; done
  echo "== $tag ($([ "$tag" = old ] && echo "$old_commit" || echo "working tree"))"
  # shellcheck disable=SC2086
  python "$here/benchmarks/serving.py" --base-url http://127.0.0.1:$port --num-prompts 32 $load \
    --json /tmp/ab_$tag.json | tail -n +1
  kill $pid; wait $pid || true
done
