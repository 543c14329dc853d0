"""Benchmarks that need torch, each run as ``python -m model_runner.bench.<name>``: the runner's
and kernels' speed (``runner_speed``, ``decode_paths``, ``gemm_forms``, ``moe_forms``,
``checkpoint_speed``, ``step_cost``, ...), ``real_shape_models`` (random-weight models with the
real models' layer shapes), and ``dasc-bench`` (``bench_cli``: the matched-budget and
refresh-cost experiments on real dasc-serve arms, whose plans come from the weights).  The
HTTP-only experiments they drive live in ``loadgen.bench``."""
