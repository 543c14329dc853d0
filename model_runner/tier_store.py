"""One rank's side of the second cache tier (``scheduler/cache_tier.py`` keeps the index): each
entry's file holds this rank's KV rows of the prefix and its checkpoint slot, byte for byte
(with ``--host-tier-bytes``, the same tensors stay in this process's memory instead).

A spill copies the rows and the slot out at the start of the step (they may be reused by the
step itself) and a writer thread writes the file: ``<id>.tmp``, fsync, renamed to
``<id>.entry``, so a file under its final name is whole.  At the end of each step the ranks
agree (one all-reduce while writes are pending) on which entries every rank has written or
failed; rank 0 reports them.  A fetch reads the file, checks it all, then copies it into the
rows and the slot the plan names; the ranks agree on which fetches failed.

File format, version 1 (little-endian):

    b"DASCTIER" | u32 n | header: n bytes of JSON | sections | u32 CRC-32 of header + sections

The header: ``{"version", "fingerprint", "entry", "tokens", "sections": [[name, dtype,
shape], ...]}``; the sections, in that order: ``kv.<i>`` for each full-attention layer
([tokens, *entry] in the KV dtype), then the slot's ``temporal`` payload, ``scale`` (INT8
only) and ``conv``, as ``CheckpointPool`` holds them.  A file whose header or size differs
from what this rank would write, or whose checksum fails, is refused before anything is copied.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import queue
import struct
import sys
import threading
import time
import zlib
from pathlib import Path

import torch

from kernels import prefill_attention
from kernels.delta_rule import cpu_chunk
from model_runner.model_files import weight_files
from scheduler.wire.rank_messages import TierMove
from scheduler.wire.serve_config import ServeConfig

MAGIC = b"DASCTIER"
VERSION = 1
SAMPLE_BYTES = 2**20  # of each weight file's head and tail, in the fingerprint
MAX_QUEUED_BYTES = 2**30  # copies waiting for the writer; a spill past this fails


def fingerprint(config: ServeConfig, runner, tp_size: int) -> str:
    """What an entry's bytes depend on: config.json, the weight files (header, size, first
    and last MiB), the decay weights, the plan, the checkpoint format, dtypes, the TP degree,
    the device type, the CPU weight forms, whether the delta rule's products and the prefill
    attention run on AMX, and the rank's threads (oneDNN's GEMMs split their sums by them):
    each changes the bits a step computes."""
    model = Path(config.model)
    files = []
    for path in weight_files(model):
        h = hashlib.sha256()
        size = path.stat().st_size
        with open(path, "rb") as f:
            h.update(f.read(SAMPLE_BYTES))
            f.seek(max(0, size - SAMPLE_BYTES))
            h.update(f.read(SAMPLE_BYTES))
        files.append([path.name, size, h.hexdigest()])
    pool = runner.checkpoints
    plan = pool.plan
    parts = {
        "version": VERSION,
        "config": hashlib.sha256((model / "config.json").read_bytes()).hexdigest(),
        "weights": files,
        "decay": plan.identity.decay_sha256,
        "plan": [plan.selector, plan.w_max, plan.retained, plan.seed, plan.gate_input, plan.eps],
        "format": [pool.fmt.layout, pool.fmt.payload, pool.fmt.placement],
        "kv": [str(c.dtype) for c in runner.kv.caches[:1]],
        "conv": str(pool.conv_slots.dtype),
        "tp": tp_size,
        "device": runner.device.type,
        "ranks": [str(config.ranks.dtype), str(config.ranks.cpu_fp32_weights),
                  config.ranks.cpu_packed_weights,
                  cpu_chunk.amx_runs(*runner.state.temporal.shape[-2:]),
                  bool(runner.kv.caches)
                  and prefill_attention.amx_runs(runner.kv.caches[0].shape[-1]),
                  config.ranks.cpu_threads],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def kv_bytes_per_token(runner) -> int:
    return sum(c[0].nbytes for c in runner.kv.caches)


class TierStore:
    def __init__(self, root: Path | None, fingerprint: str, runner):
        """``root`` None: entries stay in this process's memory (``--host-tier-bytes``),
        pinned when the runner is on CUDA; no file, no thread."""
        self.dir = (root / f"tier-{fingerprint[:16]}" / f"rank-{runner.tp.rank}"
                    if root is not None else None)
        self.memory: dict[int, list[torch.Tensor]] | None = {} if root is None else None
        self.fingerprint, self.runner, self.tp = fingerprint, runner, runner.tp
        self._issued: list[int] = []  # spilled entries not yet agreed on, in order
        self._done: dict[int, bool] = {}  # written (True) or failed, by the writer thread
        self._queued = 0  # bytes waiting for the writer
        self._lock = threading.Lock()
        self._told: set[str] = set()
        self._jobs: queue.Queue = queue.Queue()
        if self.memory is None:
            threading.Thread(target=self._writer, name="tier-writer", daemon=True).start()

    # ---- layout -------------------------------------------------------------------------------
    def _slot_tensors(self, slot: int) -> list[tuple[str, torch.Tensor]]:
        pool = self.runner.checkpoints
        parts = [("temporal", pool.temporal[slot])]
        if pool.scale is not None:
            parts.append(("scale", pool.scale[slot]))
        parts.append(("conv", pool.conv_slots[slot]))
        return parts

    def _layout(self, num_tokens: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, shape) of an entry's parts, in file order: KV rows per layer, then the
        slot's tensors."""
        kv = [(f"kv.{i}", c.dtype, (num_tokens, *c.shape[1:]))
              for i, c in enumerate(self.runner.kv.caches)]
        return kv + [(name, t.dtype, tuple(t.shape)) for name, t in self._slot_tensors(0)]

    def _sections(self, num_tokens: int) -> list[list]:
        return [[name, str(dtype), list(shape)] for name, dtype, shape in
                self._layout(num_tokens)]

    def _header(self, entry: int, num_tokens: int) -> bytes:
        return json.dumps({"version": VERSION, "fingerprint": self.fingerprint, "entry": entry,
                           "tokens": num_tokens,
                           "sections": self._sections(num_tokens)}).encode()

    def path(self, entry: int) -> Path:
        return self.dir / f"{entry:016x}.entry"

    # ---- spills -------------------------------------------------------------------------------
    def free(self, entries: list[int]) -> None:
        """Drop host-memory entries the tier evicted."""
        for entry in entries:
            self.memory.pop(entry, None)

    def spill(self, moves: list[TierMove]) -> None:
        """Copy each entry's rows and slot out now; the writer thread writes them (a
        host-memory tier keeps the copies)."""
        for move in moves:
            self._issued.append(move.entry)
            rows = torch.tensor(move.rows, dtype=torch.long, device=self.runner.device)
            if self.memory is not None:
                self.memory[move.entry] = self._copy_out(move, rows, pin=True)
                self._done[move.entry] = True
                continue
            parts = self._copy_out(move, rows, pin=False)
            nbytes = sum(p.nbytes for p in parts)
            with self._lock:
                full = self._queued + nbytes > MAX_QUEUED_BYTES
                if not full:
                    self._queued += nbytes
            if full:
                self._tell("queue", "the write queue is full (the disk is slower than the "
                           "evictions); entries that do not fit are dropped")
                with self._lock:
                    self._done[move.entry] = False
                continue
            self._jobs.put((move.entry, len(move.rows), parts, nbytes))

    def _copy_out(self, move: TierMove, rows: torch.Tensor, pin: bool) -> list[torch.Tensor]:
        """An entry's parts (its KV rows per layer, then its slot's tensors) copied straight
        into one host buffer, pinned on CUDA if ``pin`` (the host-memory tier keeps it)."""
        caches, slot = self.runner.kv.caches, self._slot_tensors(move.slot)
        layout = self._layout(len(move.rows))
        sizes = [-(-_nbytes(dtype, shape) // 64) * 64 for _, dtype, shape in layout]
        flat = torch.empty(sum(sizes), dtype=torch.uint8,
                           pin_memory=pin and self.runner.device.type == "cuda")
        parts, offset = [], 0
        for (_, dtype, shape), size in zip(layout, sizes):
            parts.append(flat[offset : offset + _nbytes(dtype, shape)].view(dtype).view(shape))
            offset += size
        for cache, part in zip(caches, parts):
            if cache.device.type == "cpu":
                torch.index_select(cache, 0, rows, out=part)
            else:
                part.copy_(cache.index_select(0, rows))
        for (_, t), part in zip(slot, parts[len(caches):]):
            part.copy_(t)
        return parts

    def _writer(self) -> None:
        while True:
            entry, num_tokens, parts, nbytes = self._jobs.get()
            ok = self._write(entry, num_tokens, parts)
            with self._lock:
                self._done[entry] = ok
                self._queued -= nbytes
            self._jobs.task_done()

    def _write(self, entry: int, num_tokens: int, parts: list[torch.Tensor]) -> bool:
        path = self.path(entry)
        tmp = path.with_suffix(".tmp")
        header = self._header(entry, num_tokens)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<I", len(header)) + header)
                crc = zlib.crc32(header)
                for p in parts:
                    data = p.contiguous().view(-1).view(torch.uint8).numpy()
                    crc = zlib.crc32(data, crc)
                    f.write(data)
                f.write(struct.pack("<I", crc))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            return True
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self._tell(f"write {e.errno}", f"cannot write {tmp}: {e.strerror or e}; entries that "
                       f"fail to write are dropped, the tier keeps serving what it holds")
            return False

    def collect(self, wait: bool) -> tuple[list[int], list[int]]:
        """(written, failed): spilled entries every rank has now written, or one has failed
        (the same lists on every rank).  ``wait``: until every spill so far is settled."""
        if not self._issued:
            return [], []
        if wait:
            self._jobs.join()
        with self._lock:
            done = [self._done.get(e) for e in self._issued]
        local = [[int(d is not None) for d in done], [int(d is False) for d in done]]
        settled, failed = self._agree(local)
        written, bad, left = [], [], []
        for e, n, f in zip(self._issued, settled, failed):
            if n < self.tp.size:
                left.append(e)
            else:
                (bad if f else written).append(e)
                with self._lock:
                    self._done.pop(e, None)
        self._issued = left
        return written, bad

    # ---- fetches ------------------------------------------------------------------------------
    def fetch(self, moves: list[TierMove]) -> tuple[list[int], float]:
        """Read each entry into its rows and slot; (entries that failed on any rank, seconds)."""
        started = time.perf_counter()
        failed_here = [int(not self._read(m)) for m in moves]
        failed = self._agree([failed_here])[0]
        return [m.entry for m, f in zip(moves, failed) if f], time.perf_counter() - started

    def _read(self, move: TierMove) -> bool:
        if self.memory is not None:
            parts = self.memory.get(move.entry)
            if parts is None:
                return self._refuse(move, "memory", "the entry is not in host memory")
            self._copy_in(move, parts)
            return True
        path = self.path(move.entry)
        try:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(data)
        except OSError as e:
            return self._refuse(move, "read", f"cannot read {path}: {e.strerror or e}")
        want = self._header(move.entry, len(move.rows))
        start = len(MAGIC) + 4
        if (len(data) < start or data[: len(MAGIC)] != MAGIC
                or struct.unpack_from("<I", data, len(MAGIC))[0] != len(want)
                or data[start : start + len(want)] != want):
            return self._refuse(move, "header", f"{path} is not this entry's file (header)")
        layout = self._layout(len(move.rows))
        body = start + len(want)
        if len(data) != body + sum(_nbytes(dtype, shape) for _, dtype, shape in layout) + 4:
            return self._refuse(move, "size", f"{path} is truncated or too long")
        if zlib.crc32(memoryview(data)[len(MAGIC) + 4 : -4]) != struct.unpack_from(
                "<I", data, len(data) - 4)[0]:
            return self._refuse(move, "checksum", f"{path} fails its checksum")
        offset, sources = body, []
        for _, dtype, shape in layout:
            size = _nbytes(dtype, shape)
            raw = torch.frombuffer(data, dtype=torch.uint8, count=size, offset=offset)
            sources.append(raw.view(dtype).view(shape))
            offset += size
        self._copy_in(move, sources)
        return True

    def _copy_in(self, move: TierMove, sources: list[torch.Tensor]) -> None:
        """An entry's parts (as ``spill`` lists them) into the move's KV rows and slot."""
        caches = self.runner.kv.caches
        rows = torch.tensor(move.rows, dtype=torch.long, device=self.runner.device)
        for cache, src in zip(caches, sources):
            cache.index_copy_(0, rows, src.to(cache.device, non_blocking=True))
        for (_, dest), src in zip(self._slot_tensors(move.slot), sources[len(caches):]):
            dest.copy_(src, non_blocking=True)

    def _refuse(self, move: TierMove, kind: str, why: str) -> bool:
        self._tell(kind, f"{why}; entry {move.entry} dropped, its request prefills instead")
        return False

    # ---- helpers ------------------------------------------------------------------------------
    def _agree(self, flags: list[list[int]]) -> list[list[int]]:
        """Sum each list over the ranks (one all-reduce)."""
        if self.tp.size == 1:
            return flags
        n = len(flags[0])
        t = torch.tensor([x for f in flags for x in f], dtype=torch.float32,
                         device=self.runner.device)
        summed = self.tp.all_reduce(t).long().tolist()
        return [summed[i * n : (i + 1) * n] for i in range(len(flags))]

    def _tell(self, kind: str, message: str) -> None:
        """Each kind of trouble once."""
        if kind in self._told:
            return
        self._told.add(kind)
        print(f"cache tier: rank {self.tp.rank}: {message}", file=sys.stderr, flush=True)
