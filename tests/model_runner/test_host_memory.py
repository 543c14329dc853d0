"""Huge pages for the memory a CPU decode step streams (model_runner/host_memory.py): the moved
tensors keep their bits, views and shared storages, and sit in memory advised MADV_HUGEPAGE;
a runner's pools are allocated there and its forward gives the same bits either way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.random_checkpoints import make_model
from support.runner_scenarios import make_runner

from model_runner.batch import SeqInput
from model_runner.host_memory import (
    HUGE_PAGE,
    host_zeros,
    huge_pages_enabled,
    module_tensors,
    move_to_huge_pages,
)

SMAPS = Path("/proc/self/smaps")
pytestmark = pytest.mark.skipif(not SMAPS.exists() or not huge_pages_enabled(),
                                reason="needs Linux and mmap.MADV_HUGEPAGE")


def advised_huge(t: torch.Tensor) -> bool:
    """Whether the mapping holding t's first byte carries the huge-page advice (VmFlags hg)."""
    addr, inside = t.data_ptr(), False
    for line in SMAPS.read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return "hg" in line.split()[1:]
    raise AssertionError(f"address {addr:#x} is in no mapping")


def test_moved_tensors_keep_bits_views_and_sharing():
    base = torch.randn(1024, 1024)  # 4 MiB
    tied = base  # a second holder of the same tensor
    transposed, rows = base.t(), base[100:200]
    other = torch.arange(10, dtype=torch.int64)  # too small: stays where it is
    expected, old_ptr, other_ptr = base.clone(), base.data_ptr(), other.data_ptr()

    moved = move_to_huge_pages([base, transposed, rows, tied, other])

    assert moved == expected.numel() * expected.element_size()
    assert base.data_ptr() != old_ptr and base.data_ptr() % HUGE_PAGE == 0
    assert other.data_ptr() == other_ptr
    assert advised_huge(base) and not advised_huge(other)
    assert torch.equal(base, expected) and torch.equal(rows, expected[100:200])
    assert torch.equal(transposed, expected.t()) and transposed.stride() == (1, 1024)
    base[150, 7] = 42.0  # the views still alias the moved storage
    assert rows[50, 7] == 42.0 and transposed[7, 150] == 42.0


def test_module_tensors_finds_attributes_in_lists():
    layer = torch.nn.Linear(8, 8)
    layer.experts = [(torch.zeros(3), torch.ones(2))]  # as a MoE layer keeps its experts
    found = {t.data_ptr() for t in module_tensors(layer)}
    assert {layer.weight.data_ptr(), layer.bias.data_ptr()} <= found
    assert {t.data_ptr() for t in layer.experts[0]} <= found


def test_host_zeros(monkeypatch):
    z = host_zeros(3, 5, dtype=torch.bfloat16)
    assert z.shape == (3, 5) and z.dtype == torch.bfloat16 and not z.any()
    assert advised_huge(z)
    monkeypatch.setenv("DASC_HUGE_PAGES", "0")
    plain = host_zeros(3, 5, dtype=torch.bfloat16)
    assert not plain.any() and not advised_huge(plain)


def test_runner_pools_in_huge_pages_and_same_bits(monkeypatch, tmp_path):
    make_model("gdn", tmp_path)
    prompt = list(range(3, 40))
    runner = make_runner(str(tmp_path))
    assert all(advised_huge(t) for t in (runner.state.temporal, runner.state.conv,
                                         *runner.kv.caches))
    move_to_huge_pages(module_tensors(runner.model), min_bytes=0)  # the tiny model's too
    assert advised_huge(runner.model.model.embed_tokens.weight)
    with torch.inference_mode():
        got = runner.forward([SeqInput(prompt, 0, list(range(12)), 1)])
    monkeypatch.setenv("DASC_HUGE_PAGES", "0")
    plain = make_runner(str(tmp_path))
    assert not advised_huge(plain.state.temporal)
    with torch.inference_mode():
        want = plain.forward([SeqInput(prompt, 0, list(range(12)), 1)])
    assert torch.equal(got, want)
