#!/usr/bin/env bash
# One-command GPU validation (at most ~5 minutes on one GPU):
#   bash tests/gpu/validate.sh [OUT_DIR]
# 1. CUDA parity tests against the CPU reference (runner, Triton checkpoint kernels, serving)
#    and CUDA-graph replay against eager CUDA decode, token for token,
# 2. checkpoint store/load bandwidth next to a torch copy of the same bytes,
# 3. prefill tokens/s and decode step time of the runner, eager and with CUDA graphs,
# 4. serving TTFT hit vs miss and the scheduler's share of a decode step.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-${OUT:-out/gpu}}
mkdir -p "$out"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
python -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name(0))' || exit 2
status=0
timeout 210 python -m pytest -q -rs tests/test_cuda_path.py tests/test_decode_graphs.py \
    tests/test_kernels_ragged.py tests/test_kernels_int8.py tests/test_cuda_serving.py 2>&1 | tee "$out/tests.txt" | tail -n 25 || status=1
timeout 60 python bench/checkpoint_speed.py --device cuda --repeats 20 > "$out/checkpoint.txt" 2>&1 || status=1
for graph in "" --cuda-graph; do
    timeout 60 python bench/runner_speed.py --device cuda --dtype bfloat16 --prompt-len 2048 \
        --decode-batch 1 8 32 $graph > "$out/runner${graph:+_graph}.txt" 2>&1 || status=1
done
timeout 120 python bench/serve_latency.py --tp 1 --reps 3 --serve-args "--device cuda --dtype bfloat16" > "$out/serving.txt" 2>&1 || status=1
echo; echo "== checkpoint store/load vs copy (GPU) =="; grep '^|' "$out/checkpoint.txt"
echo; echo "== runner (GPU, bf16) =="; grep prefill "$out/runner.txt"
echo; echo "== decode step time (GPU, bf16): eager vs CUDA graph =="
python - "$out"/runner.txt "$out"/runner_graph.txt <<'PY'
import json, sys
ms = {}
for path in sys.argv[1:]:
    for line in open(path):
        if line.startswith("{") and '"decode"' in line:
            r = json.loads(line)
            ms.setdefault(r["batch"], {})[r["decode_path"]] = r["step_ms"]
print("| batch | eager ms | graph ms | speed-up |")
for b, m in sorted(ms.items()):
    e, g = m.get("eager"), m.get("cuda-graph")
    cell = lambda x: f"{x:.2f}" if x else "-"
    print(f"| {b} | {cell(e)} | {cell(g)} | {f'{e / g:.2f}x' if e and g else '-'} |")
PY
echo; echo "== serving (GPU, TP=1) =="; tail -n 3 "$out/serving.txt"
exit $status
