"""What one forward step computes: typed inputs from the driver, tensors derived for the layers.

A step is a list of sequences; sequence i brings ``len(token_ids)`` new tokens at positions
``[prefix_len, prefix_len + n)``.  Its KV pages must already cover ``[0, prefix_len + n)`` and
its active state slot must hold the recurrent state after ``prefix_len`` tokens (a slot is zeroed
by the runner when ``prefix_len == 0``).  Flattened token order is sequence-major:
sequence i occupies ``[cu_seqlens[i], cu_seqlens[i+1])``.

A *static* decode batch (``kv_table`` set, built by ``model_runner.cuda_graph``) has one token per
sequence, fixed shapes and only device tensors on its read path, so a CUDA graph can replay it;
the host lists (``seq_lens``, ``prefix_lens``, ``cu_seqlens``, ``kv_read_index``) are then
placeholders that no layer reads.

A step may carry dasc-wr *replays* ahead of its sequences (``Refresh``): the batch's first
``num_replays`` sequences replay windows of cached tokens from zeroed scratch slots over the
read-only KV.  They write no KV and return no logits; in every linear layer their recurrence
runs first and ``Refresh.merge`` then copies the omitted units into the restored slots, so a
hit's own tokens in the same step already read the refreshed state.

A sequence with ``snapshots`` also leaves, for each ``(cut, slot)``, the recurrent state after
its first ``cut`` new tokens in ``slot``: checkpoints the scheduler stores after the step, at
store points inside the chunk (the prompt's end minus one, so the first token is sampled in the
same step; a ``--checkpoint-interval`` point, so the chunk need not end there).  In every linear
layer the recurrence runs in rounds (``Snapshots``): round j runs each sequence's j-th segment
between cuts, and after it the states of the sequences cut there are copied out.  A snapshot
slot may be a replay's scratch slot: a layer writes snapshots after its merge, the last read of
the replay's state there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class SeqInput:
    token_ids: list[int]
    prefix_len: int
    page_table: list[int] | torch.Tensor  # KV page ids in position order (may run past the end)
    state_slot: int
    # (cut, slot): also the state after the first ``cut`` new tokens, in ``slot``; cuts rise,
    # each in [1, len(token_ids))
    snapshots: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class Refresh:
    """dasc-wr replays for one step: ``seqs[i]`` replays a window of a hit's cached prefix into
    its (scratch) ``state_slot``; ``merge(layer)`` copies, in linear layer ``layer``, the units
    the plan omits from each scratch slot into the hit's slot."""

    seqs: list[SeqInput]
    merge: Callable[[int], None]


@dataclass(slots=True)
class SnapshotRound:
    """One round of a step with snapshots: the segments it runs, then the states it copies."""

    seqs: torch.Tensor  # sequences with a segment in this round
    rows: torch.Tensor  # their segments' rows, sequence-major
    cu_seqlens: list[int]  # over those segments
    copy_seqs: torch.Tensor  # sequences whose state is copied out after this round (maybe none)
    copy_slots: torch.Tensor  # into these slots
    spans: list[tuple[int, int]]  # each segment's rows [start, end), as ``rows`` lists them


@dataclass(slots=True)
class Snapshots:
    """A step's snapshots, derived once for every linear layer: round j runs every sequence's
    segment j (the tokens between its cuts j and j + 1; a sequence without cuts runs whole in
    round 0), then copies the states of the sequences cut after it.  Indices count the step's
    own sequences and their rows (those after the replays), so they hold with or without them."""

    rounds: list[SnapshotRound]
    cuts: list[list[tuple[int, int]]]  # each sequence's (cut, slot) pairs

    @classmethod
    def of(cls, seqs: list[SeqInput], device: torch.device) -> Snapshots | None:
        if not any(s.snapshots for s in seqs):
            return None
        starts = [0]
        for s in seqs:
            starts.append(starts[-1] + len(s.token_ids))

        def index(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=device)

        rounds = []
        for j in range(1 + max(len(s.snapshots) for s in seqs)):
            members, rows, cu, copy_seqs, copy_slots, spans = [], [], [0], [], [], []
            for i, s in enumerate(seqs):
                bounds = [0] + [c for c, _ in s.snapshots] + [len(s.token_ids)]
                if j + 1 >= len(bounds):
                    continue
                members.append(i)
                spans.append((starts[i] + bounds[j], starts[i] + bounds[j + 1]))
                rows.extend(range(*spans[-1]))
                cu.append(cu[-1] + bounds[j + 1] - bounds[j])
                if j < len(s.snapshots):
                    copy_seqs.append(i)
                    copy_slots.append(s.snapshots[j][1])
            rounds.append(SnapshotRound(index(members), index(rows), cu, index(copy_seqs),
                                        index(copy_slots), spans))
        return cls(rounds, [s.snapshots for s in seqs])


@dataclass(slots=True)
class SingleQueries:
    """A step's one-token sequences (a decode step that is not static, the decodes and one-token
    hits of a mixed step) and, where padding stays cheap, the padded row table over which they
    attend as one batch."""

    seqs: list[int]
    rows: torch.Tensor  # [S] their query rows
    # [S, C] KV rows of positions [0, C), columns [lens, C) repeating row 0; None where padding
    # would cost too much (each sequence then attends alone)
    table: torch.Tensor | None
    lens: torch.Tensor  # [S] the rows each reads
    reads: list[torch.Tensor]  # each one's KV rows (``ForwardBatch.kv_read_index``)
    _flat: tuple[torch.Tensor, torch.Tensor] | None = None

    # padding a short context to the longest one costs what attention over it costs: pad only
    # while the table holds at most this many times the rows it must read
    MAX_PADDING = 2.0

    @classmethod
    def of(cls, batch: ForwardBatch) -> SingleQueries | None:
        cu = batch.cu_seqlens
        seqs = [i for i in range(batch.num_seqs) if cu[i + 1] - cu[i] == 1]
        if not seqs:
            return None
        reads = [batch.kv_read_index[i] for i in seqs]
        device = reads[0].device
        rows = torch.tensor([cu[i] for i in seqs], dtype=torch.long, device=device)
        lens = [len(r) for r in reads]
        lens_t = torch.tensor(lens, dtype=torch.long, device=device)
        if len(seqs) * max(lens) > cls.MAX_PADDING * sum(lens):
            return cls(seqs, rows, None, lens_t, reads)
        table = torch.nn.utils.rnn.pad_sequence(reads, batch_first=True, padding_value=0)
        return cls(seqs, rows, table, lens_t, reads)

    def flat_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(every one's rows back to back, where each one's start), built once a step for the
        layers that read the pool in place: sequence i reads ``rows[starts[i]:][:lens[i]]``."""
        if self._flat is None:
            self._flat = (torch.cat(self.reads), self.lens.cumsum(0) - self.lens)
        return self._flat


@dataclass(slots=True)
class ForwardBatch:
    token_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    seq_lens: list[int]  # new tokens per sequence
    prefix_lens: list[int]
    cu_seqlens: list[int]  # [B + 1]
    state_slots: torch.Tensor  # [B] int64
    kv_write_index: torch.Tensor  # [N - replay_tokens] KV-pool row of each written token
    kv_read_index: list[torch.Tensor]  # per sequence: flat rows of positions [0, prefix + n)
    is_decode: bool  # every sequence brings exactly one token (never with replays)
    refresh: Refresh | None = None  # its seqs lead the batch (module docstring)
    kv_table: torch.Tensor | None = None  # [B, C] static decode: KV rows of positions [0, C)
    kv_lens: torch.Tensor | None = None  # [B] static decode: valid table columns [0, len)
    snapshots: Snapshots | None = None  # over the sequences after the replays
    # [B - num_replays] row of each (non-replay) sequence's last token
    last_token_index: torch.Tensor = field(init=False)
    _singles: SingleQueries | None | bool = field(init=False, default=False)  # False: not yet
    _rotary: dict = field(init=False, default_factory=dict)  # ``rotary_angles``, by settings

    def __post_init__(self) -> None:
        self.last_token_index = torch.tensor(self.cu_seqlens[self.num_replays + 1 :],
                                             dtype=torch.long) - 1

    def without_replays(self) -> ForwardBatch:
        """The step with its replays' sequences and rows dropped, for the layers after the last
        linear one: nothing there reads a replay (they write no KV and get no logits).  The
        remaining sequences keep the paths they took with the replays (never decode)."""
        r, t = self.num_replays, self.replay_tokens
        return ForwardBatch(self.token_ids[t:], self.positions[t:], self.seq_lens[r:],
                            self.prefix_lens[r:], [c - t for c in self.cu_seqlens[r:]],
                            self.state_slots[r:], self.kv_write_index, self.kv_read_index[r:],
                            is_decode=False, snapshots=self.snapshots)

    def rotary_angles(self, key: tuple, make: Callable[[torch.Tensor], tuple]) -> tuple:
        """``make(positions)`` for the rotary settings ``key`` (``PartialRotary``'s cos and
        sin), built once a step: every layer's queries and keys share them."""
        if key not in self._rotary:
            self._rotary[key] = make(self.positions)
        return self._rotary[key]

    @property
    def single_queries(self) -> SingleQueries | None:
        """The one-token sequences (``SingleQueries``), built once a step; None where there
        are none."""
        if self._singles is False:
            self._singles = SingleQueries.of(self)
        return self._singles

    @property
    def num_replays(self) -> int:
        return len(self.refresh.seqs) if self.refresh is not None else 0

    @property
    def replay_tokens(self) -> int:
        """Rows [0, replay_tokens) are the replays' tokens."""
        return self.cu_seqlens[self.num_replays]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def is_static(self) -> bool:
        """Fixed-shape decode: layers take their graph-safe paths (no host syncs)."""
        return self.kv_table is not None


def kv_rows(s: SeqInput, page_size: int, start: int = 0, end: int | None = None
            ) -> torch.Tensor:
    """Flat KV-pool rows of positions [start, end) of ``s`` (end: prefix_len + n; int64, on the
    page table's device; read-only: with page size 1 a view of a tensor page table)."""
    if end is None:
        end = s.prefix_len + len(s.token_ids)
    if len(s.page_table) * page_size < end:
        raise ValueError(f"page table covers {len(s.page_table) * page_size} < {end} tokens")
    pages = torch.as_tensor(s.page_table, dtype=torch.long)
    if page_size == 1:
        return pages[start:end]
    pos = torch.arange(start, end, dtype=torch.long, device=pages.device)
    return pages[pos // page_size] * page_size + pos % page_size


def build_batch(seqs: list[SeqInput], page_size: int, device: torch.device,
                refresh: Refresh | None = None) -> ForwardBatch:
    """The step's tensors; ``refresh``'s replays come first and write no KV."""
    replays = refresh.seqs if refresh is not None else []
    everything = replays + seqs
    if not everything:
        raise ValueError("empty batch")
    tokens, positions, write, read, cu = [], [], [], [], [0]
    for i, s in enumerate(everything):
        n, end = len(s.token_ids), s.prefix_len + len(s.token_ids)
        if n == 0:
            raise ValueError("a sequence in the batch has no new tokens")
        rows = kv_rows(s, page_size)
        tokens.extend(s.token_ids)
        positions.append(torch.arange(s.prefix_len, end, dtype=torch.long))
        if i >= len(replays):
            write.append(rows[s.prefix_len :])
        read.append(rows.to(device))
        cu.append(cu[-1] + n)
    write_rows = torch.cat(write) if write else torch.empty(0, dtype=torch.long)
    if write_rows.unique().numel() != write_rows.numel():
        raise ValueError("two tokens of the step would write the same KV row")
    return ForwardBatch(
        token_ids=torch.tensor(tokens, dtype=torch.long, device=device),
        positions=torch.cat(positions).to(device),
        seq_lens=[len(s.token_ids) for s in everything],
        prefix_lens=[s.prefix_len for s in everything],
        cu_seqlens=cu,
        state_slots=torch.tensor([s.state_slot for s in everything], dtype=torch.long,
                                 device=device),
        kv_write_index=write_rows.to(device),
        kv_read_index=read,
        is_decode=not replays and all(len(s.token_ids) == 1 for s in seqs),
        refresh=refresh,
        snapshots=Snapshots.of(seqs, device),
    )
