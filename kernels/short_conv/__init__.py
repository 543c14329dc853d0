"""The short causal convolution of the linear-attention layers: the torch forms (``naive.py``:
prefill over packed sequences, decode in the state slots, C where it is built) and the C
kernels (``cpu.py`` over ``cpu.c``) with their bits."""
