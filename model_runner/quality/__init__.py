"""The quality study (torch): the RULER-style task suite, the evaluation arms, `dasc-eval` offline
and through a server, the paper's tables, paired statistics and Table 1(b)."""
