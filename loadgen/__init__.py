"""The HTTP load generator (torch-free): workloads, timed streaming requests, the paper's
matched-budget protocol, and `spawn`, which starts a real dasc-serve for the tests and the
experiments; `bench/` the serving experiments and benchmarks; `quality/` the quality
study (torch)."""
