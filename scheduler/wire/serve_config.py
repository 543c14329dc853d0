"""The serving config: one frozen ``ServeConfig`` that ``dasc-serve`` builds from its flags
(``dasc_server.flags``) and hands to the scheduler and to every rank as one JSON argument, so all
processes run from the same values and no list of flags is kept in step by hand.

Only what crosses a process boundary is here; the launcher's own settings (HTTP, torchrun, the
API key, timeouts) stay in the launcher.  No field has a default: the flags own the defaults,
and a config is always built whole.  Standard library only, importing nothing of the project:
the front end, the torch-free scheduler and the ranks all import it, and ``ServerInfo``
(``scheduler.wire.messages``) carries it back to the front end.
"""

from __future__ import annotations

import json
import types
from dataclasses import asdict, dataclass, fields, is_dataclass
from enum import Enum, StrEnum
from typing import Any, get_args, get_type_hints


class LoadPolicy(StrEnum):
    """What a checkpoint hit does with the state units the selection plan omitted."""

    NR = "nr"  # zero-fill them
    WR = "wr"  # refresh them by replaying the last W_wr cached tokens (dasc-wr)


class Selection(StrEnum):
    DASC = "dasc"  # decay-aware: keep the units whose retention horizon exceeds W_max
    RANDOM = "random"  # the count-matched random control


class Payload(StrEnum):
    FP32 = "fp32"
    INT8 = "int8"


class Placement(StrEnum):
    """TP-balanced placement of the stored units (``model_runner.compression.placement``)."""

    OFF = "off"
    STORAGE = "storage"
    HYBRID = "hybrid"


class SchedulePolicyName(StrEnum):
    """``--schedule-policy`` (scheduler.policy)."""

    FCFS = "fcfs"
    LPM = "lpm"


class DecodeFirst(StrEnum):
    """``--decode-first`` (scheduler.step_costs)."""

    OFF = "off"
    COST = "cost"  # defer prefill while the running decodes should finish first


class CheckpointEviction(StrEnum):
    """``--checkpoint-eviction`` (scheduler.checkpoint_eviction)."""

    LRU = "lru"
    REUSE = "reuse"


class CheckpointAdmission(StrEnum):
    """``--checkpoint-admission`` (scheduler.admission)."""

    BRANCH = "branch"
    ALL = "all"
    REUSE = "reuse"


class TierEviction(StrEnum):
    """``--cache-tier-eviction`` (scheduler.cache_tier)."""

    LRU = "lru"
    REUSE = "reuse"


class Dtype(StrEnum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


class Device(StrEnum):
    CPU = "cpu"
    CUDA = "cuda"  # one GPU per rank


class Fp32Weights(StrEnum):
    """``--cpu-fp32-weights`` (model_runner.rank_args.fp32_weights)."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


@dataclass(frozen=True, slots=True)
class CheckpointSpec:
    """What a checkpoint slot holds, and what a hit on it restores."""

    w_max: float  # the selection plan's threshold; 0: dense checkpoints (exact)
    selection: Selection
    mask_seed: int  # of Selection.RANDOM
    payload: Payload
    placement: Placement
    load_policy: LoadPolicy

    @property
    def format(self) -> str:
        """``/server_info``'s ``checkpoint_format``, e.g. "dasc fp32 hybrid"."""
        return f"{self.selection} {self.payload} {self.placement}"

    @property
    def arm(self) -> str:
        """The evaluation arm this server restores, in dasc-eval's names (dense, nr@16,
        wr@128, nr-int8@16, random@16)."""
        if self.w_max == 0:
            return "dense"
        if self.selection is Selection.RANDOM:
            kind = "random"
        elif self.payload is Payload.INT8 and self.load_policy is LoadPolicy.NR:
            kind = "nr-int8"
        else:
            kind = str(self.load_policy)
        return f"{kind}@{self.w_max:g}"


@dataclass(frozen=True, slots=True)
class RankConfig:
    """How every rank builds its runner and sizes its checkpoint pool."""

    dtype: Dtype
    device: Device
    cpu_fp32_weights: Fp32Weights
    cpu_packed_weights: bool
    cuda_graph: bool  # on cuda: replay decode steps as CUDA graphs
    cuda_graph_max_bs: int
    cuda_graph_max_context: int
    state_budget_bytes: int | None  # checkpoint slots from a per-rank byte budget, or
    checkpoint_slots: int | None  # a count (neither: 64)


@dataclass(frozen=True, slots=True)
class SchedulingConfig:
    """The scheduler's policy; the ranks size their KV and state pools from the first two."""

    max_total_tokens: int  # KV pool rows (page size 1)
    max_running_requests: int  # requests decoded together (active state slots)
    chunked_prefill_size: int | None  # new tokens per step; None: DEFAULT_CHUNKED_PREFILL
    # (scheduler_config.py), or from step_target_ms
    step_target_ms: float | None  # the ranks time a prefill at start-up; None: off
    checkpoint_interval: int  # prompt tokens between stored checkpoints; 0: prompt end only
    schedule_policy: SchedulePolicyName
    schedule_max_passes: int
    prefill_mix_ratio: float
    decode_interleave: int
    checkpoint_eviction: CheckpointEviction
    checkpoint_admission: CheckpointAdmission
    prefix_cache: bool
    cache_finished: bool
    park_finished: bool = True
    decode_first: DecodeFirst = DecodeFirst.OFF


@dataclass(frozen=True, slots=True)
class CacheTierConfig:
    """The second cache tier behind the checkpoint pool (``scheduler/cache_tier.py``)."""

    directory: str | None  # files here; None: no file tier
    budget_bytes: int  # every rank's entry files together
    eviction: TierEviction
    host_bytes: int | None  # instead of files: host memory (pinned on CUDA), every rank's

    @property
    def enabled(self) -> bool:
        return self.directory is not None or self.host_bytes is not None


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """Everything the scheduler and the ranks run from, as ``dasc-serve`` parsed it."""

    model: str  # the model folder
    ranks: RankConfig
    scheduling: SchedulingConfig
    checkpoints: CheckpointSpec
    tier: CacheTierConfig

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> ServeConfig:
        """The config ``to_json`` wrote; raises ValueError naming the first field that is
        missing, unknown or of the wrong type."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"the serving config is not JSON: {e}") from None
        return _decode(cls, raw, "config")


def _decode(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be an object, got {type(raw).__name__}")
    names = [f.name for f in fields(cls)]
    unknown, missing = sorted(set(raw) - set(names)), [n for n in names if n not in raw]
    if unknown or missing:
        raise ValueError(f"{where}: unknown fields {unknown}, missing fields {missing}")
    hints = get_type_hints(cls)
    return cls(**{n: _value(hints[n], raw[n], f"{where}.{n}") for n in names})


def _value(kind: Any, value: Any, where: str) -> Any:
    if isinstance(kind, types.UnionType):  # X | None
        if value is None and type(None) in get_args(kind):
            return None
        kind = next(k for k in get_args(kind) if k is not type(None))
    if is_dataclass(kind):
        return _decode(kind, value, where)
    if isinstance(kind, type) and issubclass(kind, Enum):
        try:
            return kind(value)
        except ValueError:
            raise ValueError(f"{where} must be one of {[str(k) for k in kind]}, got {value!r}"
                             ) from None
    if kind is float and type(value) is int:
        return float(value)
    if type(value) is not kind:
        raise ValueError(f"{where} must be {kind.__name__}, got {value!r}")
    return value


# every class a serialised ServeConfig holds, for the IPC allow-list (scheduler.wire.messages)
CONFIG_TYPES = (ServeConfig, RankConfig, SchedulingConfig, CheckpointSpec, CacheTierConfig,
                LoadPolicy, Selection, Payload, Placement, SchedulePolicyName, DecodeFirst,
                CheckpointEviction, CheckpointAdmission, TierEviction, Dtype, Device,
                Fp32Weights)
