#!/bin/bash
# usage: MODEL=DIR run.sh OUTDIR TAG PORT "dasc flags" workloads...
# tags here: A24 no tier and 24 slots, A8 no tier, B8 tier, R8 restart on B8's tier, Cd/Cn/Cl 1 GiB tier (dense reuse,
# nr@128 reuse, dense lru), An nr@128 without a tier; A8a/B8a the agent load; B8e/H8e files
# and host memory at a later commit
set -u
out=$1; tag=$2; port=$3; flags=$4; shift 4
M=${MODEL:?the Qwen3.5-0.8B-shape folder: python -m model_runner.bench.real_shape_models qwen3.5-0.8b}
mkdir -p $out
OMP_NUM_THREADS=1 setsid dasc-serve --model $M --port $port $flags > $out/$tag-server.log 2>&1 &
pid=$!
for i in $(seq 300); do curl -s 127.0.0.1:$port/health >/dev/null && break; sleep 1; done
for w in "$@"; do
  case $w in
    agent) args="--workload multi-turn --num-groups 16 --prompts-per-group 3 --system-len 2000 --prefix-len 0 --suffix-len 100 --max-tokens 32 --concurrency 4";;
    mt16) args="--workload multi-turn --num-groups 16 --prompts-per-group 3 --prefix-len 1000 --suffix-len 100 --max-tokens 16 --concurrency 4";;
  esac
  dasc-loadgen --base-url http://127.0.0.1:$port $args --seed 0 --token-range 3 256 --no-progress --timeout 1200 --output $out/$tag-$w.jsonl > $out/$tag-$w.txt 2>&1
  curl -s 127.0.0.1:$port/v1/stats > $out/$tag-$w-stats.json
done
kill -TERM $pid
for i in $(seq 300); do kill -0 $pid 2>/dev/null || break; sleep 1; done
pkill -9 -f "dasc-serve --model"; true
