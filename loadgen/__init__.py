"""Load generator reproducing the paper's matched-budget TTFT protocol."""
