"""Two dasc-serve replicas behind the real SGLang model gateway (``smg``, pip sglang-router, an
optional test dependency): it registers them, routes OpenAI and native
requests, and its cache-aware policy hits the prefix caches more often than round-robin."""

from __future__ import annotations

import os
import shutil
from contextlib import ExitStack

import httpx
import pytest
from support.serving import running_server

from loadgen.gateway import hit_rate, running_gateway, workload

SMG = os.environ.get("DASC_SMG") or shutil.which("smg")
pytestmark = pytest.mark.skipif(
    SMG is None, reason="the SGLang model gateway (smg, pip sglang-router==0.3.2) is not "
                        "installed; set DASC_SMG to its binary")


def test_cache_aware_routing_beats_round_robin():
    prompts = workload(groups=3, per_group=3)
    with ExitStack() as stack:
        replicas = [stack.enter_context(running_server()) for _ in range(2)]
        model = httpx.get(f"{replicas[0].base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        rates = {}
        for policy in ("cache_aware", "round_robin"):
            with running_gateway(SMG, [r.base_url for r in replicas], policy) as gateway:
                rates[policy] = hit_rate(gateway, replicas, prompts, model)
                native = httpx.post(f"{gateway}/generate", timeout=60, json={
                    "text": prompts[0], "sampling_params": {"max_new_tokens": 2}}).json()
                assert native["meta_info"]["completion_tokens"] == 2
        logs = "".join(r.log() for r in replicas)
    assert rates["round_robin"]["prompt_tokens_per_replica"][0] > 0
    assert rates["round_robin"]["prompt_tokens_per_replica"][1] > 0
    assert rates["cache_aware"]["hit_rate"] > rates["round_robin"]["hit_rate"] > 0, rates
    # (uvicorn may log "Invalid HTTP request received" for the gateway's HTTP/2 gRPC probes:
    # the gateway's side, see dasc_server/app.py)
    assert "Traceback" not in logs
