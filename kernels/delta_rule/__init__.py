"""The gated delta rule's compiled forms (``cpu_chunk``: CPU prefill in C).  The torch forms and
references are ``model_runner/ops/delta_rule.py`` (chunked) and ``delta_rule_decode.py``."""
