#!/usr/bin/env bash
# One-command GPU validation (~5 minutes on one GPU once Triton's cache (~/.triton) is warm; a
# first run also compiles and autotunes fla's and the project's Triton kernels and captures the
# CUDA graphs: the timeouts below, ~45 minutes in all, are sized for that):
#   bash tests/gpu/validate.sh [OUT_DIR]
# (pytest is stopped with SIGINT at its limit, so it still prints which tests passed and failed)
# 0. a CUDA build of torch and a visible device,
# 1. CUDA parity tests against the CPU reference (runner, Triton checkpoint kernels, serving)
#    and CUDA-graph replay against eager CUDA decode, token for token, fla's kernels fed bf16
#    q/k/v/beta (prefill and decode) against the CPU path, with fp32 dots in full
#    fp32 (TRITON_F32_DEFAULT=ieee: fla's TF32 default is ~5e-3 off the fp32 CPU path, the
#    tests compare at 1e-3; the benchmarks below keep the product's default),
# 2. checkpoint store/load bandwidth next to a torch copy of the same bytes,
# 3. prefill tokens/s and decode step time of the runner, eager and with CUDA graphs,
# 4. serving TTFT hit vs miss and the scheduler's share of a decode step.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-${OUT:-out/gpu}}
mkdir -p "$out"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
python - <<'PY' || exit 2
import sys
import torch
if torch.version.cuda is None:
    sys.exit(f"torch {torch.__version__} is a CPU build. Install the CUDA build of the same "
             "release (PyPI's torch 2.13.0 wheel is built for CUDA 13.0, NVIDIA driver >= 580;\n"
             "--isolated skips a pip config that points at a local CPU wheel):\n"
             "  python -m pip --isolated install --force-reinstall torch==2.13.0")
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
PY
status=0
TRITON_F32_DEFAULT=ieee timeout -s INT -k 30 1200 python -m pytest -q -rfEs tests/model_runner/test_cuda_path.py tests/model_runner/test_decode_graphs.py \
    tests/kernels/test_kernels_ragged.py tests/kernels/test_kernels_int8.py tests/dasc_server/test_cuda_serving.py \
    tests/model_runner/test_cuda_bf16_operands.py 2>&1 | tee "$out/tests.txt" | tail -n 25 || status=1
timeout 240 python -m model_runner.bench.checkpoint_speed --device cuda --repeats 20 > "$out/checkpoint.txt" 2>&1 || status=1
for graph in "" --cuda-graph; do
    timeout 450 python -m model_runner.bench.runner_speed --device cuda --dtype bfloat16 --prompt-len 2048 \
        --decode-batch 1 8 32 $graph > "$out/runner${graph:+_graph}.txt" 2>&1 || status=1
done
timeout 450 python -m loadgen.bench.serve_latency --tp 1 --reps 3 --serve-args "--device cuda --dtype bfloat16" > "$out/serving.txt" 2>&1 || status=1
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
