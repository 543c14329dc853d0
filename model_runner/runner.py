"""ModelRunner: one TP rank's model, KV pool and state pool; executes steps it is given.

The runner decides no policy.  A driver (the offline engine, or ``serve_rank`` on the
scheduler's plans) hands it ``SeqInput`` lists whose page tables and state slots it has
allocated, and reads back logits.  All ranks must run the same steps in the same order (SPMD);
every rank ends a step with the full logits, and the driver samples on one rank (rank 0 when
serving) or on every rank with a shared seed (the offline engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.gemv import simd_available as gemv_simd_available
from kernels.lm_head import ScreenedHead
from kernels.lm_head import simd_available as screen_simd_available
from model_runner.batch import Refresh, SeqInput, build_batch
from model_runner.checkpoints.pool import CheckpointFormat, CheckpointPool
from model_runner.compression.plan import ModelIdentity, SelectionPlan
from model_runner.compression.weights import load_decay_params
from model_runner.config import ModelConfig
from model_runner.cuda_graph import DecodeGraphs
from model_runner.host_memory import (
    decode_streamed,
    huge_page_bytes,
    huge_pages_enabled,
    keep_freed_memory,
    move_to_huge_pages,
    return_freed_memory,
)
from model_runner.layers.linear import (
    code_gemms,
    hold_fp32,
    pack_gemms,
    release_weights,
    should_hold_fp32,
)
from model_runner.loader import build_model, load_weights
from model_runner.model_files import check_tp
from model_runner.models.common import StepContext
from model_runner.parallel import TPGroup
from model_runner.rank_memory import KVPool, RequestState, StatePool

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ``lm_head_screen`` "auto": heads this large (Qwen3.5's 248,320 x 1,024 is 254 M); at the
# Qwen3-Next-shape bench model's byte vocabulary (264 rows) the full head costs nothing
SCREEN_MIN_ELEMENTS = 2**24


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    model_dir: str
    dtype: str = "float32"
    device: str = "cpu"
    num_pages: int = 256
    page_size: int = 16
    num_state_slots: int = 16  # including the reserved slot 0
    # > 0: decode steps of up to this many sequences take the fixed-shape path of
    # ``cuda_graph.DecodeGraphs`` (CUDA graphs on cuda, the same code eagerly elsewhere)
    cuda_graph_max_bs: int = 0
    cuda_graph_max_context: int = 4096  # longer decode contexts run eagerly
    # bf16 GEMM weights held in fp32 (``linear.hold_fp32``); None: where the CPU emulates bf16
    fp32_weights: bool | None = None
    packed_weights: bool = True  # oneDNN-packed copies of large CPU weights (linear.pack_weight)
    huge_pages: bool = True  # CPU: the weights a decode step streams in huge pages (host_memory)
    coded_weights: bool = True  # CPU: the decode GEMV streams coded copies (linear.code_gemms)
    # CPU, bf16, one rank: an int8 screen of the LM head for greedy rows (``greedy``); "auto":
    # where the head has at least ``SCREEN_MIN_ELEMENTS`` weights, "on": wherever it runs
    lm_head_screen: str = "auto"

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not in {sorted(DTYPES)}")
        return DTYPES[self.dtype]


class ModelRunner:
    # Built outside inference mode even when the caller is in it (a serving rank is): an
    # inference tensor has no version counter, so ``kernels.derived`` cannot keep a copy made
    # from such a weight and would make it on every call (the MoE shared expert's input-major
    # copies: 12-15 ms of a ~36 ms Qwen3-Next-shape decode step on the 2-core VM).
    @torch.inference_mode(False)
    def __init__(self, rc: RunnerConfig, tp: TPGroup | None = None,
                 head_order: list[list[int]] | None = None):
        self.rc, self.tp, self.head_order = rc, tp or TPGroup(), head_order
        self.checkpoints: CheckpointPool | None = None
        self.tier = None  # serving only: the rank's TierStore (model_runner/tier_store.py)
        self._omitted_units: list[torch.Tensor] | None = None  # ``replays``, once per pool
        self.device = torch.device(rc.device)
        model_dir = Path(rc.model_dir)
        self.cfg = cfg = ModelConfig.from_dir(model_dir)
        check_tp(cfg, self.tp.size, str(model_dir / "config.json"))
        dtype = rc.torch_dtype
        self.model = build_model(cfg, self.tp, dtype, head_order)
        load_weights(self.model, model_dir)
        self.model.to(self.device)
        loaded = sum(p.nbytes for p in self.model.parameters())
        # extra weight memory the CPU GEMM forms take (packed copies, bf16 held as fp32, the LM
        # head's int8 screen), less the weights those copies stand in for
        self.gemm_weight_bytes = pack_gemms(self.model) if rc.packed_weights else 0
        hold = rc.fp32_weights
        if hold is None:
            hold = should_hold_fp32(dtype, self.device)
        self.gemm_weight_bytes += hold_fp32(self.model) if hold else 0
        coded = code_gemms(self.model) if rc.coded_weights else []
        self.gemm_weight_bytes += sum(c.nbytes for c in coded)
        huge_pages = rc.huge_pages and self.device.type == "cpu"
        # from the head's weight, before it may be dropped; its int8 copy is written straight
        # into huge pages of its own
        self.screened_head = self._screened_head(huge_pages)
        self.gemm_weight_bytes += self.screened_head.nbytes if self.screened_head else 0
        # a linear with both copies drops its weight: neither path reads it
        self.gemm_weight_bytes -= release_weights(self.model,
                                                  fixed_shapes=rc.cuda_graph_max_bs > 0)
        if huge_pages:
            move_to_huge_pages(decode_streamed(self.model, self.model.model.embed_tokens,
                                               [t for c in coded for t in c.tensors()]))
        self.weight_bytes = loaded + self.gemm_weight_bytes  # the weights in every form held
        self.screened_tokens = 0  # tokens ``greedy`` gave
        self.kv = KVPool([type(self.model).kv_entry_shape(cfg, self.tp)] * len(cfg.full_layer_ids),
                         rc.num_pages, rc.page_size, dtype, self.device)
        mixer = self._first_linear_mixer()
        heads_local = cfg.linear_num_value_heads // self.tp.size
        self.state = StatePool(cfg.num_linear_layers, rc.num_state_slots, heads_local,
                               cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                               mixer.conv1d.weight.shape[0], cfg.linear_conv_kernel_dim,
                               dtype, self.device)
        self.decode_graphs: DecodeGraphs | None = None
        if rc.cuda_graph_max_bs > 0:
            self.decode_graphs = DecodeGraphs(self.model, self.kv, self.state,
                                              rc.cuda_graph_max_bs,
                                              use_graphs=self.device.type == "cuda",
                                              max_context=rc.cuda_graph_max_context)
            self.decode_graphs.capture_all()
        if self.device.type == "cpu":  # after the weights and pools: they keep their own pages
            keep_freed_memory()
            return_freed_memory()  # what start-up freed: moved or released weights

    def _screened_head(self, huge_pages: bool) -> ScreenedHead | None:
        """``RunnerConfig.lm_head_screen``'s screen, where it gives the full head's tokens: a
        bf16 head on one CPU rank whose few rows take the C GEMV, a hidden size of a multiple
        of 64, the AVX-512 VNNI form."""
        weight, mode = self.model.lm_head.weight, self.rc.lm_head_screen
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"lm_head_screen {mode!r} not in auto, on, off")
        if (mode == "off" or (mode == "auto" and weight.numel() < SCREEN_MIN_ELEMENTS)
                or self.device.type != "cpu" or self.tp.size != 1
                or weight.dtype != torch.bfloat16 or weight.shape[1] % 64
                or not weight.is_contiguous()
                or not (screen_simd_available() and gemv_simd_available())):
            return None
        out = (huge_page_bytes(weight.numel()).view(torch.int8).view(weight.shape)
               if huge_pages and huge_pages_enabled() else None)
        return ScreenedHead(weight, out, rows=self.model.lm_head.rows)

    def _first_linear_mixer(self):
        layer = self.model.model.layers[self.cfg.linear_layer_ids[0]]
        return getattr(layer, layer.mixer_name)

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def check_tokens(self, token_ids: list[int]) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {self.cfg.vocab_size})")

    def check_page_table(self, page_table: list[int] | torch.Tensor) -> torch.Tensor:
        """A page table as the int64 tensor ``forward`` reads, every page id in the KV pool.
        O(table): run it once where a table enters (``forward`` does; a serving rank checks
        each row table when the plan that carries it arrives)."""
        pages = torch.as_tensor(page_table, dtype=torch.long)
        if pages.dim() != 1:
            raise ValueError(f"a page table is a list of page ids, not shape {list(pages.shape)}")
        if pages.numel() and not 0 <= int(pages.min()) <= int(pages.max()) < self.rc.num_pages:
            bad = pages[(pages < 0) | (pages >= self.rc.num_pages)][0]
            raise ValueError(f"page id {int(bad)} outside the KV pool [0, {self.rc.num_pages})")
        return pages

    @torch.inference_mode()
    def forward(self, seqs: list[SeqInput], all_logits: bool = False,
                capture: dict | None = None, *, refresh: Refresh | None = None,
                inputs_checked: bool = False, logits_of: list[int] | None = None,
                head: bool = True) -> torch.Tensor:
        """Run one step. Returns logits [num_seqs, vocab] (last token of each sequence), or
        [len(logits_of), vocab] (of the sequences at those indices, ascending), or
        [num_tokens, vocab] with ``all_logits``; without ``head``, the normed hidden states the
        LM head reads, [rows, hidden], for ``greedy`` or ``head_logits``.  Fresh sequences
        (prefix_len 0) start from a zeroed state slot.  ``refresh`` (``replays``): dasc-wr
        replays that run inside this step, ahead of ``seqs``, from zeroed scratch slots
        (``batch.Refresh``); they add no logits.

        Token ids and page tables are checked first unless ``inputs_checked``: the caller
        checked them where they entered (a serving rank: the scheduler checks prompts, the
        sampler only makes ids in the vocabulary, each row table is checked on arrival).
        What is the step's own (state slots, prefix lengths) is checked every time."""
        everything = seqs + (refresh.seqs if refresh is not None else [])
        if not inputs_checked:
            for s in everything:
                self.check_tokens(s.token_ids)
                self.check_page_table(s.page_table)
        self._check_step(seqs, everything)
        fresh = [s.state_slot for s in seqs if s.prefix_len == 0]
        if refresh is not None:
            fresh += [s.state_slot for s in refresh.seqs]
        if fresh:
            self.state.zero(torch.tensor(fresh, device=self.device))
            self._new_occupants(fresh)
        graphs = self.decode_graphs
        if logits_of is not None and (all_logits or len(logits_of) == len(seqs)):
            logits_of = None  # every sequence's (the indices ascend)
        if graphs is not None and refresh is None and graphs.fits(seqs) and capture is None \
                and not all_logits and logits_of is None and head:
            return graphs.run(seqs)
        batch = build_batch(seqs, self.rc.page_size, self.device, refresh)
        ctx = StepContext(batch, self.kv, self.state, capture)
        return self.model(ctx, all_logits=all_logits, logits_of=logits_of, head=head)

    @torch.inference_mode()
    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over ``forward(head=False)``'s hidden states: its logits."""
        return self.model.lm_head(hidden).float()

    @torch.inference_mode()
    def greedy(self, hidden: torch.Tensor) -> list[int] | None:
        """The greedy token of each of ``forward(head=False)``'s rows, as the full LM head's
        logits would give it, by the screened head (``kernels.lm_head``); None where it does
        not run (no screened head, or a step it declines)."""
        tokens = None if self.screened_head is None else self.screened_head.argmax(hidden)
        self.screened_tokens += len(tokens) if tokens is not None else 0
        return tokens

    def _check_step(self, seqs: list[SeqInput], everything: list[SeqInput]) -> None:
        """Reject a step that would read or write outside the state pool or let two sequences
        (``everything``: ``seqs`` and the replays) share a state slot, which would silently mix
        their states, or a snapshot land in a slot of ``seqs`` or another snapshot's (a
        replay's scratch slot is allowed: ``batch``); O(num_seqs).  Whether the step's KV rows
        lie in the tables and write distinct rows ``build_batch`` checks."""
        slots = [s.state_slot for s in everything]
        snapshots = [slot for s in seqs for _, slot in s.snapshots]
        if len(set(slots)) != len(slots):
            raise ValueError(f"two sequences in one step share a state slot: {slots}")
        if len(set(snapshots)) != len(snapshots) or {s.state_slot for s in seqs} & set(snapshots):
            raise ValueError(f"snapshot slots {snapshots} repeat or hold a sequence of the step")
        for slot in slots + snapshots:
            if not 0 < slot < self.rc.num_state_slots:
                raise ValueError(f"state slot {slot} outside [1, {self.rc.num_state_slots})")
        for s in everything:
            if s.snapshots:
                cuts = [0] + [c for c, _ in s.snapshots] + [len(s.token_ids)]
                if any(a >= b for a, b in zip(cuts, cuts[1:])):
                    raise ValueError(f"snapshot cuts {cuts[1:-1]} must rise inside [1, "
                                     f"{len(s.token_ids)}), the sequence's new tokens")
            if s.prefix_len < 0:
                raise ValueError(f"negative prefix length {s.prefix_len}")

    def _new_occupants(self, slots: list[int]) -> None:
        """A fresh, written or loaded state slot holds a new sequence: the decode graphs'
        per-slot row tables must not be reused for it."""
        if self.decode_graphs is not None:
            self.decode_graphs.forget(slots)

    # State API used by the prefix cache: a request's per-layer (conv, temporal) state.
    def read_state(self, slot: int) -> RequestState:
        return self.state.read(slot)

    def write_state(self, slot: int, state: RequestState) -> None:
        self.state.write(slot, state)
        self._new_occupants([slot])

    def zero_state(self, slot: int) -> None:
        self.state.zero(slot)

    def zero_state_slots(self, slots: list[int]) -> None:
        self.state.zero(torch.tensor(slots, device=self.device))

    # Compressed checkpoints (dasc): a plan checked against these weights, a pool of slots.
    def identity(self) -> ModelIdentity:
        return ModelIdentity.of(self.cfg, load_decay_params(self.rc.model_dir, self.cfg))

    def attach_checkpoints(self, plan: SelectionPlan, num_slots: int,
                           fmt: CheckpointFormat | None = None) -> CheckpointPool:
        """Allocate the checkpoint pool; the plan must match this model (checked first)."""
        self._omitted_units = None
        self.checkpoints = CheckpointPool(
            self.cfg, plan, num_slots, fmt, tp_rank=self.tp.rank, tp_size=self.tp.size,
            head_order=self.head_order, conv_dtype=self.state.conv.dtype, device=self.device,
            identity=self.identity())
        return self.checkpoints

    def _pool(self) -> CheckpointPool:
        if self.checkpoints is None:
            raise RuntimeError("no checkpoint pool: call attach_checkpoints(plan, ...) first")
        return self.checkpoints

    def store_checkpoints(self, active_slots: list[int], ckpt_slots: list[int]) -> None:
        """Active state -> checkpoint slots (select, pack, quantise, balance)."""
        self._pool().store(self.state.temporal, self.state.conv,
                               torch.tensor(active_slots), torch.tensor(ckpt_slots))

    def replays(self, seqs: list[SeqInput], scratch_slots: list[int]) -> Refresh:
        """dasc-wr for ``forward(..., refresh=)``: each sequence replays its window
        (``token_ids`` at ``prefix_len``) from a zero scratch slot over the read-only cached KV;
        in every linear layer only the units the plan omits are then copied from the scratch
        slot into the sequence's ``state_slot``.  Conv state and retained units keep their
        restored values."""
        pool = self._pool()
        if self._omitted_units is None:  # per linear layer: local units the plan omits
            self._omitted_units = [(row < 0).nonzero()[:, 0].to(self.device)
                                   for row in pool.index.unit_pos]
        omitted = self._omitted_units
        dst = torch.tensor([s.state_slot for s in seqs], device=self.device)[:, None]
        src = torch.tensor(scratch_slots, device=self.device)[:, None]

        def merge(layer: int) -> None:
            units = pool.unit_view(self.state.temporal)[layer]  # [S, U_loc, D], a view
            units[dst, omitted[layer]] = units[src, omitted[layer]]

        replay = [SeqInput(s.token_ids, s.prefix_len, s.page_table, scratch)
                  for s, scratch in zip(seqs, scratch_slots)]
        return Refresh(replay, merge)

    def refresh_omitted(self, seqs: list[SeqInput], scratch_slots: list[int], *,
                        inputs_checked: bool = False) -> None:
        """``replays`` on their own, as a step with no other sequences."""
        self.forward([], refresh=self.replays(seqs, scratch_slots),
                     inputs_checked=inputs_checked)

    def load_checkpoints(self, ckpt_slots: list[int], active_slots: list[int]) -> None:
        """Checkpoint slots -> active state; omitted units are zero-filled (dasc-nr)."""
        self._new_occupants(active_slots)
        self._pool().load(self.state.temporal, self.state.conv,
                              torch.tensor(ckpt_slots), torch.tensor(active_slots))
