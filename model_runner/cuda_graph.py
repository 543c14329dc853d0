"""Fixed-shape decode steps: replayed as CUDA graphs on a GPU, run eagerly anywhere else.

A decode step of B sequences (one new token each) is padded to the smallest captured batch size
``bs >= B`` and its row tables to a context bucket ``C`` (a power of two >= the longest
sequence, at least ``MIN_CONTEXT``, at most the bucket of ``max_context``).  One graph per
(bs, C), all captured at start-up, largest first, into one memory pool, so serving never
stalls on a capture or grows the pool late; a step past the largest bucket or batch runs
eagerly.  Off CUDA (or with graphs off) the very same ``_forward`` runs eagerly, so CPU tests
exercise exactly what a graph replays.  Attention gathers all C rows of every padded sequence,
so its cost and memory grow with C: ``max_context`` bounds both (MLA reads its latent rows as
they are, absorbed, never expanded into K and V).  The MoE layers read only the routed experts'
weights while the batch is small (``model_runner.layers.mlp.uses_gathered_experts``).

Static inputs, allocated once outside the graph pool (a graph reads them by address):
    inputs     [3, max_bs] int64: rows TOKEN, POSITION, SLOT
    slot_rows  [num_state_slots, top bucket] int64: KV row of position j of the sequence that
               state slot s holds, written only when that changes (``_sync_rows``: a new
               table, or positions past those written), so a step uploads O(batch), not
               O(batch x context); the step gathers its [bs, C] table from it by slot
Columns [0, B) of ``inputs`` are the real sequences.  A sequence's KV length is its position
+ 1 and its write row ``slot_rows[slot, position]``, both derived on the device.  Padding
sequences [B, bs) decode token 0 at position 0 from state slot 0 (reserved, zeroed at the start
of every step, its rows all the KV pool's scratch row), so they write and read only that row.
Columns past a sequence's length hold the scratch row or an earlier occupant's rows: masked out,
always a valid gather index.
"""

from __future__ import annotations

import torch

from model_runner.batch import ForwardBatch, SeqInput, kv_rows
from model_runner.models.common import HybridForCausalLM, StepContext
from model_runner.rank_memory import KVPool, StatePool

MIN_CONTEXT = 256
TOKEN, POSITION, SLOT = range(3)


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including ``max_bs``."""
    sizes = {b for b in (1, 2, 4, 8, *range(16, max_bs, 16)) if b < max_bs}
    return sorted(sizes | {max_bs})


def context_bucket(ctx_len: int) -> int:
    """Smallest power of two >= ctx_len, at least MIN_CONTEXT."""
    return max(MIN_CONTEXT, 1 << (ctx_len - 1).bit_length())


class DecodeGraphs:
    """Decode steps of up to ``max_bs`` sequences for one runner's model and pools; with
    ``use_graphs`` (CUDA only) each (bs, C) step is captured once and replayed."""

    def __init__(self, model: HybridForCausalLM, kv: KVPool, state: StatePool, max_bs: int,
                 use_graphs: bool, max_context: int = 4096):
        if max_bs < 1 or max_context < 1:
            raise ValueError(f"max batch size {max_bs} or max context {max_context} < 1")
        self.model, self.kv, self.state = model, kv, state
        self.batch_sizes = capture_batch_sizes(max_bs)
        top = context_bucket(max_context)
        self.buckets = [w for w in (MIN_CONTEXT << i for i in range(32)) if w <= top]
        self.device = kv.caches[0].device
        self.use_graphs = use_graphs
        self.inputs = torch.zeros(3, max_bs, dtype=torch.long, device=self.device)
        self.slot_rows = torch.full((state.num_slots, top), kv.scratch_row, dtype=torch.long,
                                    device=self.device)
        self._written: dict[int, tuple[object, int]] = {}  # slot: (its table, positions written)
        self.widths_run: set[int] = set()  # context buckets that ran (tests read it)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None

    @property
    def max_bs(self) -> int:
        return self.batch_sizes[-1]

    def fits(self, seqs: list[SeqInput]) -> bool:
        return (0 < len(seqs) <= self.max_bs and all(len(s.token_ids) == 1 for s in seqs)
                and max(s.prefix_len for s in seqs) < self.buckets[-1])

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every (batch size, bucket), largest first (the largest graph sizes the pool,
        the smaller ones reuse its memory)."""
        if self.use_graphs:
            for width in reversed(self.buckets):
                for bs in reversed(self.batch_sizes):
                    self._capture(bs, width)

    def run(self, seqs: list[SeqInput]) -> torch.Tensor:
        """One decode step; returns logits [len(seqs), vocab] (a fresh tensor)."""
        num_seqs = len(seqs)
        bs = next(b for b in self.batch_sizes if b >= num_seqs)
        width = context_bucket(max(s.prefix_len for s in seqs) + 1)
        _check_write_rows(seqs, self.kv.page_size)
        for s in seqs:
            self._sync_rows(s)
        inputs = torch.zeros(3, bs, dtype=torch.long)
        inputs[:, :num_seqs] = torch.tensor([[s.token_ids[0], s.prefix_len, s.state_slot]
                                             for s in seqs]).T
        self.inputs[:, :bs].copy_(inputs)
        self.widths_run.add(width)
        if not self.use_graphs:
            return self._forward(bs, width)[:num_seqs]
        graph, logits = self.graphs[bs, width]
        graph.replay()
        return logits[:num_seqs].clone()  # the output buffer is overwritten by the next replay

    def forget(self, slots: list[int]) -> None:
        """These slots get new occupants: their rows are written afresh at their next step."""
        for slot in slots:
            self._written.pop(slot, None)

    def _sync_rows(self, s: SeqInput) -> None:
        """Write the rows of positions [0, prefix_len] of ``s`` its slot does not hold yet: all
        of them for a table the slot has not seen, else only the new positions (a table only
        grows while its request runs; a changed table arrives as a new object)."""
        end = s.prefix_len + 1
        table, done = self._written.get(s.state_slot, (None, 0))
        if table is not s.page_table:
            done = 0
        if done < end:
            rows = kv_rows(s, self.kv.page_size, start=done, end=end)
            self.slot_rows[s.state_slot, done:end].copy_(rows)
            self._written[s.state_slot] = (s.page_table, end)

    def _forward(self, bs: int, width: int) -> torch.Tensor:
        """The step a graph records: reads only the static inputs, no host sync."""
        self.state.conv[:, 0].zero_()  # padding sequences start from a zero state every step
        self.state.temporal[:, 0].zero_()
        inputs = self.inputs[:, :bs]
        slots, positions = inputs[SLOT], inputs[POSITION]
        batch = ForwardBatch(
            token_ids=inputs[TOKEN], positions=positions, seq_lens=[1] * bs,
            prefix_lens=[], cu_seqlens=list(range(bs + 1)), state_slots=slots,
            kv_write_index=self.slot_rows[slots, positions], kv_read_index=[], is_decode=True,
            kv_table=self.slot_rows[:, :width].index_select(0, slots), kv_lens=positions + 1)
        return self.model(StepContext(batch, self.kv, self.state))

    def _capture(self, bs: int, width: int) -> None:
        # Capture with every sequence padding: the warm-up run (allocator, Triton autotuning,
        # lazy device moves) then touches only slot 0 and the scratch row.
        self.inputs.zero_()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(bs, width)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(bs, width)
        self.graphs[bs, width] = (graph, logits)


def _check_write_rows(seqs: list[SeqInput], page_size: int) -> None:
    """Two sequences of a step must not write one KV row.  Checked where the tables are on the
    host; tables on a device were checked when they arrived (``row_tables``), and reading them
    back here would cost a sync each step (the scheduler gives each row to one request)."""
    if any(isinstance(s.page_table, torch.Tensor) and s.page_table.device.type != "cpu"
           for s in seqs):
        return
    written = [int(kv_rows(s, page_size, start=s.prefix_len)[0]) for s in seqs]
    if len(set(written)) != len(written):
        raise ValueError("two tokens of the step would write the same KV row")
