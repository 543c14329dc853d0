"""The serving config: one frozen ``ServeConfig`` that ``dasc-serve`` builds from its flags
(``dasc_server.flags``) and hands to the scheduler and to every rank as one JSON argument, so all
processes run from the same values and no list of flags is kept in step by hand.

Only what crosses a process boundary is here; the launcher's own settings (HTTP, torchrun, the
API key, timeouts) stay in the launcher.  Every default lives on these dataclasses and the flags
read it from them; each field has its flag's name (``--decode-interleave`` is
``SchedulingConfig.decode_interleave``), every choice is an enum, configs are built by keyword
and check their values when built.  Standard library only, importing nothing of the project:
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


class LmHeadScreen(StrEnum):
    """``--cpu-lm-head-screen`` (``RunnerConfig.lm_head_screen``)."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


FLAGS = {"w_max": "--wmax", "payload": "--int8-checkpoints"}  # fields named unlike their flag


def _coerce(config: Any) -> None:
    """A frozen config's enum fields from their values ("lpm" -> SchedulePolicyName.LPM);
    raises ValueError naming the flag and the choices."""
    for f in fields(config):
        kind, value = _enum_of(f.type), getattr(config, f.name)
        if kind is not None and not isinstance(value, kind):
            try:
                object.__setattr__(config, f.name, kind(value))
            except ValueError:
                flag = FLAGS.get(f.name, "--" + f.name.replace("_", "-"))
                raise ValueError(f"{flag} must be one of {', '.join(k.value for k in kind)}, "
                                 f"got {value!r}") from None


def _enum_of(annotation: Any) -> type[Enum] | None:
    kind = globals().get(annotation) if isinstance(annotation, str) else annotation
    return kind if isinstance(kind, type) and issubclass(kind, Enum) else None


def _at_least(config: Any, low: int, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value is not None and value < low:
            what = "at least 1" if low == 1 else f">= {low}"
            raise ValueError(f"--{name.replace('_', '-')} must be {what} (got {value})")


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointSpec:
    """What a checkpoint slot holds, and what a hit on it restores."""

    w_max: float = 0.0  # the selection plan's threshold; 0: dense checkpoints (exact)
    selection: Selection = Selection.DASC
    mask_seed: int = 1234  # of Selection.RANDOM
    payload: Payload = Payload.FP32
    placement: Placement = Placement.OFF
    load_policy: LoadPolicy = LoadPolicy.NR

    def __post_init__(self):
        _coerce(self)
        if self.w_max < 0:
            raise ValueError(f"--wmax must be >= 0 (got {self.w_max})")

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


@dataclass(frozen=True, slots=True, kw_only=True)
class RankConfig:
    """How every rank builds its runner and sizes its checkpoint pool."""

    dtype: Dtype  # the flag's "auto" resolves per model and device (model_files.resolve_dtype)
    device: Device = Device.CPU
    cpu_fp32_weights: Fp32Weights = Fp32Weights.AUTO
    cpu_packed_weights: bool = True
    cpu_huge_pages: bool = True  # the weights a CPU decode step streams in huge pages
    cpu_coded_weights: bool = True  # the decode GEMV streams coded copies (kernels/gemv)
    cpu_amx_delta_rule: bool = True  # a bf16 model's chunked delta rule's products on AMX
    cpu_amx_attention: bool = True  # a bf16 model's prefill attention on AMX
    cpu_lm_head_screen: LmHeadScreen = LmHeadScreen.AUTO  # greedy rows' int8-screened LM head
    cpu_threads: int = 1  # each rank's compute threads (the flag's "auto" resolves per node)
    cpu_bind: bool = False  # each CPU rank on CPUs of its own (model_runner/cpu_affinity.py)
    cuda_graph: bool = True  # on cuda: replay decode steps as CUDA graphs
    cuda_graph_max_bs: int = 32
    cuda_graph_max_context: int = 4096
    state_budget_bytes: int | None = None  # checkpoint slots from a per-rank byte budget, or
    checkpoint_slots: int | None = None  # a count (neither: DEFAULT_CHECKPOINT_SLOTS)

    def __post_init__(self):
        _coerce(self)
        _at_least(self, 1, "cpu_threads", "cuda_graph_max_bs", "cuda_graph_max_context",
                  "state_budget_bytes", "checkpoint_slots")


DEFAULT_CHECKPOINT_SLOTS = 64  # neither --checkpoint-slots nor --state-budget-bytes
DEFAULT_CHUNKED_PREFILL = 2048  # --chunked-prefill-size without --step-target-ms


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulingConfig:
    """The scheduler's one config: its pools' sizes (the ranks size their KV and state pools
    from the first two) and its policy.  The defaults were chosen by measurement
    (docs/benchmarks.md, docs/results/serving.md)."""

    max_total_tokens: int = 65536  # KV pool rows (page size 1)
    max_running_requests: int = 16  # requests decoded together (active state slots)
    # new tokens per step, decodes included; None: DEFAULT_CHUNKED_PREFILL, or what
    # step_target_ms derives from the ranks' measured prefill rate (scheduler.__main__)
    chunked_prefill_size: int | None = None
    step_target_ms: float | None = None  # the ranks time a prefill at start-up; None: off
    checkpoint_interval: int = 256  # prompt tokens between stored checkpoints; 0: prompt end only
    schedule_policy: SchedulePolicyName = SchedulePolicyName.LPM  # scheduler.policy
    schedule_max_passes: int = 32  # lpm's fairness bound
    prefill_mix_ratio: float = 8.0  # lpm: defer a chunk this many times the longest; 0: never
    decode_interleave: int = 0  # decode-only steps before a step may carry prefill; 0: every one
    decode_first: DecodeFirst = DecodeFirst.OFF  # COST: defer prefill by the step costs
    # a step that would only start prompts waits this long for more (from the end of the step
    # before when it finished requests, else from the first prompt); 0: never waits
    batch_wait_ms: float = 10.0
    checkpoint_eviction: CheckpointEviction = CheckpointEviction.REUSE
    checkpoint_admission: CheckpointAdmission = CheckpointAdmission.BRANCH
    prefix_cache: bool = True  # False: never match nor store
    cache_finished: bool = True  # cache prompt + output when a request finishes
    park_finished: bool = True  # a finished request's slot stays in the tree until needed
    step_log: str | None = None  # a file the scheduler appends a line per step to (--step-log)

    def __post_init__(self):
        _coerce(self)
        _at_least(self, 1, "max_total_tokens", "max_running_requests", "chunked_prefill_size")
        if self.step_target_ms is not None and not self.step_target_ms > 0:
            raise ValueError(f"--step-target-ms must be > 0 (got {self.step_target_ms})")
        _at_least(self, 0, "checkpoint_interval", "schedule_max_passes", "prefill_mix_ratio",
                  "decode_interleave", "batch_wait_ms")

    @property
    def chunk_tokens(self) -> int:
        """New tokens per step: ``chunked_prefill_size``, or the default when unset."""
        return self.chunked_prefill_size or DEFAULT_CHUNKED_PREFILL

    @property
    def scratch_slot_base(self) -> int:
        """Active slots: 0 reserved, [1, 1 + R) requests, [1 + R, 1 + 2R) wr scratch."""
        return 1 + self.max_running_requests

    @property
    def num_state_slots(self) -> int:
        """The ranks' active state pool: slot 0 reserved, one per request, one wr scratch each."""
        return 1 + 2 * self.max_running_requests


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheTierConfig:
    """The second cache tier behind the checkpoint pool (``scheduler/cache_tier.py``)."""

    cache_tier_dir: str | None = None  # files here; None: no file tier
    cache_tier_bytes: int = 16 * 2**30  # every rank's entry files together
    cache_tier_eviction: TierEviction = TierEviction.REUSE
    host_tier_bytes: int | None = None  # instead of files: host memory (pinned on CUDA), all ranks

    def __post_init__(self):
        _coerce(self)
        _at_least(self, 1, "cache_tier_bytes", "host_tier_bytes")
        if self.cache_tier_dir is not None and self.host_tier_bytes is not None:
            raise ValueError("--host-tier-bytes and --cache-tier-dir: one second tier at a time")

    @property
    def enabled(self) -> bool:
        return self.cache_tier_dir is not None or self.host_tier_bytes is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeConfig:
    """Everything the scheduler and the ranks run from, as ``dasc-serve`` parsed it."""

    model: str  # the model folder
    ranks: RankConfig
    scheduling: SchedulingConfig = SchedulingConfig()
    checkpoints: CheckpointSpec = CheckpointSpec()
    tier: CacheTierConfig = CacheTierConfig()

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
                Fp32Weights, LmHeadScreen)
