"""The HTTP load generator (torch-free): workloads, timed streaming requests, the paper's
matched-budget protocol; `bench/` the serving experiments and benchmarks; `quality/` the quality
study (torch)."""
