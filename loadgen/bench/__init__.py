"""Serving experiments and benchmarks, each run as ``python -m loadgen.bench.<name>``.

``dasc-bench`` (``cli``, ``matched``, ``refresh``, ``arms``, ``report``, ``plots``) runs the
matched-budget and refresh-cost experiments on real dasc-serve arms; the other modules are
single benchmarks (runner speed, serving latency, checkpoint bandwidth, step cost, ...) and
``real_shape_models``, which writes random-weight models with the real models' layer shapes."""
