"""The gated delta rule: the torch forms and references (``naive.py``: the recurrence and the
chunked form, packed sequences; ``decode.py``: one token in the state slots, C where it is
built) and the compiled CPU forms (``cpu_chunk``: prefill in C; ``cpu_decode``: decode in C).
On CUDA the runner calls fla's Triton kernels (``model_runner/ops/linear_attention.py``)."""
