"""Serving experiments that drive servers over HTTP, torch-free, each run as
``python -m loadgen.bench.<name>`` (serving latency, client cost, chat parking, structured
output, the eviction simulation) or through ``dasc-bench`` (``report``, ``plots``).  Benchmarks
that need torch live in ``model_runner.bench``."""
