"""Huge pages for the weights a CPU decode step streams (model_runner/host_memory.py): the moved
tensors keep their bits, views and shared storages and sit in memory advised MADV_HUGEPAGE; a
runner moves every weight but an untied input embedding, and its forward gives the same bits
either way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.random_checkpoints import make_model
from support.runner_scenarios import PAGE, make_runner

from model_runner import host_memory
from model_runner.batch import SeqInput
from model_runner.host_memory import (
    HUGE_PAGE,
    decode_streamed,
    huge_pages_enabled,
    module_tensors,
    move_to_huge_pages,
)
from model_runner.runner import ModelRunner, RunnerConfig

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


@pytest.mark.parametrize("shifted", [False, True])
def test_moved_tensors_keep_bits_views_and_sharing(monkeypatch, shifted):
    if shifted:  # a copy that starts 4 KiB into its mapping, as where mappings are not aligned
        real = host_memory.huge_page_bytes
        monkeypatch.setattr(host_memory, "huge_page_bytes", lambda n: real(n + 4096)[4096:])
    base = torch.randn(1024, 1024)  # 4 MiB
    tied = base  # a second holder of the same tensor
    transposed, rows, as_bytes = base.t(), base[100:200], base[1].view(torch.uint8)
    other = torch.arange(10, dtype=torch.int64)  # too small: stays where it is
    expected, old_ptr, other_ptr = base.clone(), base.data_ptr(), other.data_ptr()

    # other: under 2 MiB; base: listed twice
    moved = move_to_huge_pages([base, transposed, rows, as_bytes, tied, other, base])

    assert moved == expected.numel() * expected.element_size()
    assert base.data_ptr() != old_ptr and base.data_ptr() % HUGE_PAGE == 4096 * shifted
    assert other.data_ptr() == other_ptr
    assert advised_huge(base)  # other: the same address, so not moved
    assert torch.equal(base, expected) and torch.equal(rows, expected[100:200])
    assert torch.equal(transposed, expected.t()) and transposed.stride() == (1, 1024)
    assert torch.equal(as_bytes, expected[1].view(torch.uint8))  # another element size
    base[150, 7] = 42.0  # the views still alias the moved storage
    assert rows[50, 7] == 42.0 and transposed[7, 150] == 42.0
    assert as_bytes.data_ptr() == base[1].data_ptr()


def test_module_tensors_finds_attributes_in_lists():
    layer = torch.nn.Linear(8, 8)
    layer.experts = [(torch.zeros(3), torch.ones(2))]  # as a MoE layer keeps its experts
    found = {t.data_ptr() for t in module_tensors(layer)}
    assert {layer.weight.data_ptr(), layer.bias.data_ptr()} <= found
    assert {t.data_ptr() for t in layer.experts[0]} <= found


def test_decode_streamed_leaves_an_untied_embedding():
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(10, 4)
    model.head = torch.nn.Linear(4, 10, bias=False)
    ids = lambda ts: {id(t) for t in ts}  # noqa: E731
    assert ids(decode_streamed(model, model.embed)) == {id(model.head.weight)}
    model.head.weight = model.embed.weight  # tied: both move, or the storage would be kept twice
    assert ids(decode_streamed(model, model.embed)) == {id(model.embed.weight)}
    model.head.tied_view = model.embed.weight[2:]
    assert id(model.embed.weight) in ids(decode_streamed(model, model.embed))


def test_decode_streamed_takes_a_coded_copy_for_its_weight():
    """A module whose decode steps stream a coded copy of its weight (``linear.code_gemms``)
    leaves the weight where it is; the copy's tensors move instead."""
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(10, 4)
    model.head = torch.nn.Linear(4, 10, bias=False)
    model.head.CODED_WEIGHTS, model.head.coded = ("weight",), object()  # any copy will do
    copy = torch.zeros(3)
    ids = lambda ts: {id(t) for t in ts}  # noqa: E731
    assert ids(decode_streamed(model, model.embed, [copy])) == {id(copy)}


def test_runner_weights_in_huge_pages_same_bits(monkeypatch, tmp_path):
    make_model("gdn", tmp_path)
    prompt = list(range(3, 40))
    monkeypatch.setattr(host_memory, "MIN_MOVE_BYTES", 0)  # the tiny model's weights too
    areas: list[range] = []  # the address ranges huge_page_bytes handed out

    def recorded(nbytes: int) -> torch.Tensor:
        area = real(nbytes)
        areas.append(range(area.data_ptr(), area.data_ptr() + nbytes))
        return area

    real = host_memory.huge_page_bytes
    monkeypatch.setattr(host_memory, "huge_page_bytes", recorded)
    moved = lambda t: any(t.data_ptr() in a for a in areas)  # noqa: E731
    runner = make_runner(str(tmp_path))
    layer = runner.model.model.layers[0].linear_attn
    assert moved(layer.in_proj_qkvz.weight) and moved(runner.model.lm_head.weight)
    assert advised_huge(layer.in_proj_qkvz.weight) and advised_huge(runner.model.lm_head.weight)
    # untied here: it stays where the loader put it (checked by address: smaps has been seen to
    # show the advice on heap memory no one advised)
    assert not moved(runner.model.model.embed_tokens.weight)
    with torch.inference_mode():
        got = runner.forward([SeqInput(prompt, 0, list(range(12)), 1)])
    areas.clear()
    plain = ModelRunner(RunnerConfig(str(tmp_path), num_pages=256, page_size=PAGE,
                                     num_state_slots=12, huge_pages=False))
    assert not areas and not moved(plain.model.lm_head.weight)
    with torch.inference_mode():
        want = plain.forward([SeqInput(prompt, 0, list(range(12)), 1)])
    assert torch.equal(got, want)
