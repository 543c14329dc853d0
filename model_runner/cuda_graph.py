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
    inputs  [5, max_bs] int64: rows TOKEN, POSITION, SLOT, WRITE_ROW, KV_LEN
    tables  {C: [max_bs, C] int64}: KV row of position j of sequence i, j in [0, C)
Columns [0, B) of ``inputs`` and rows [0, B) of a table are the real sequences.  Padding
sequences [B, bs) decode token 0 at position 0 from state slot 0 (reserved, zeroed at the
start of every step) and write and read only the KV pool's scratch row; table columns past a
sequence's length hold the scratch row too (masked out, but always a valid gather index).
"""

from __future__ import annotations

import torch

from model_runner.batch import ForwardBatch, SeqInput, kv_rows
from model_runner.models.common import HybridForCausalLM, StepContext
from model_runner.pools import KVPool, StatePool

MIN_CONTEXT = 256
TOKEN, POSITION, SLOT, WRITE_ROW, KV_LEN = range(5)


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
        self.inputs = torch.zeros(5, max_bs, dtype=torch.long, device=self.device)
        self.tables: dict[int, torch.Tensor] = {}
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
        rows = [kv_rows(s, self.kv.page_size) for s in seqs]
        width = context_bucket(max(len(r) for r in rows))
        inputs, table = self._host_inputs(seqs, rows, bs, width)
        if not self.use_graphs:
            self._load(inputs, table)
            return self._forward(bs, width)[:num_seqs]
        graph, logits = self.graphs[bs, width]
        self._load(inputs, table)
        graph.replay()
        return logits[:num_seqs].clone()  # the output buffer is overwritten by the next replay

    def _host_inputs(self, seqs: list[SeqInput], rows: list[torch.Tensor], bs: int, width: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The padded step on the host: inputs [5, bs] and the row table [bs, width]."""
        scratch = self.kv.scratch_row
        inputs = torch.zeros(5, bs, dtype=torch.long)
        inputs[WRITE_ROW], inputs[KV_LEN] = scratch, 1
        table = torch.full((bs, width), scratch, dtype=torch.long)
        for i, (s, r) in enumerate(zip(seqs, rows)):
            inputs[:, i] = torch.tensor([s.token_ids[0], s.prefix_len, s.state_slot, r[-1],
                                         len(r)])
            table[i, : len(r)] = r
        written = inputs[WRITE_ROW, : len(seqs)]
        if written.unique().numel() != written.numel():
            raise ValueError("two tokens of the step would write the same KV row")
        return inputs, table

    def _load(self, inputs: torch.Tensor, table: torch.Tensor) -> None:
        bs, width = table.shape
        self.inputs[:, :bs].copy_(inputs)
        self._table(width)[:bs].copy_(table)

    def _table(self, width: int) -> torch.Tensor:
        if width not in self.tables:
            self.tables[width] = torch.full((self.max_bs, width), self.kv.scratch_row,
                                            dtype=torch.long, device=self.device)
        return self.tables[width]

    def _forward(self, bs: int, width: int) -> torch.Tensor:
        """The step a graph records: reads only the static inputs, no host sync."""
        self.state.conv[:, 0].zero_()  # padding sequences start from a zero state every step
        self.state.temporal[:, 0].zero_()
        inputs = self.inputs[:, :bs]
        batch = ForwardBatch(
            token_ids=inputs[TOKEN], positions=inputs[POSITION], seq_lens=[1] * bs,
            prefix_lens=[], cu_seqlens=list(range(bs + 1)), state_slots=inputs[SLOT],
            kv_write_index=inputs[WRITE_ROW], kv_read_index=[], is_decode=True,
            kv_table=self._table(width)[:bs], kv_lens=inputs[KV_LEN])
        return self.model(StepContext(batch, self.kv, self.state))

    def _capture(self, bs: int, width: int) -> None:
        # Capture with every sequence padding: the warm-up run (allocator, Triton autotuning,
        # lazy device moves) then touches only slot 0 and the scratch row.
        self.inputs.zero_()
        self.inputs[WRITE_ROW], self.inputs[KV_LEN] = self.kv.scratch_row, 1
        self._table(width).fill_(self.kv.scratch_row)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(bs, width)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(bs, width)
        self.graphs[bs, width] = (graph, logits)
