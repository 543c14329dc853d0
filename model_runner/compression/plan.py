"""Selection plans: which units of each linear layer a checkpoint keeps, and for which model.

A plan is small, immutable and JSON-serialisable; the scheduler and every TP rank load the same
file. `retained[l]` lists the kept (global) unit ids of linear layer l in increasing order; unit
numbering is the one of `horizons.py`. Per layer l of n units, r_l = len(retained[l]) and the
omitted (local) units are [0, n) minus retained[l]. In JSON each layer is one hex integer whose
bit u is set iff unit u is kept ("retained_bits"), so a Kimi-Linear plan stays around 20 KB.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from model_runner.compression.defaults import DEFAULT_EPS, DEFAULT_GATE_INPUT
from model_runner.config import ModelConfig

if TYPE_CHECKING:  # plans, their JSON and their accounting import without torch
    import torch

    from model_runner.compression.horizons import DecayParams

PLAN_FORMAT = "dasc-plan/1"
SELECTORS = ("dense", "dasc", "random")


class PlanError(ValueError):
    """A plan, threshold or TP degree that does not fit the model; raised before allocation."""


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """What a plan depends on: linear geometry and (when known) a digest of the decay weights."""

    architecture: str
    linear_kind: str
    linear_layer_ids: tuple[int, ...]
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    decay_sha256: str | None = None

    @classmethod
    def of(cls, cfg: ModelConfig, params: DecayParams | None = None) -> ModelIdentity:
        return cls(
            architecture=cfg.architecture,
            linear_kind=cfg.linear_kind,
            linear_layer_ids=tuple(cfg.linear_layer_ids),
            num_key_heads=cfg.linear_num_key_heads,
            num_value_heads=cfg.linear_num_value_heads,
            key_head_dim=cfg.linear_key_head_dim,
            value_head_dim=cfg.linear_value_head_dim,
            decay_sha256=params.sha256() if params is not None else None,
        )

    @property
    def num_units(self) -> int:
        """Units per linear layer (n_l, equal for all layers)."""
        per_head = self.key_head_dim if self.linear_kind == "kda" else 1
        return self.num_value_heads * per_head


@dataclass(frozen=True, slots=True)
class SelectionPlan:
    identity: ModelIdentity
    selector: str  # "dense" | "dasc" | "random"
    w_max: float  # threshold; 0 for dense
    retained: tuple[tuple[int, ...], ...]  # per linear layer, sorted unit ids
    refresh_window: int  # dasc-wr replay length W_wr; 0 when nothing is omitted
    gate_input: float = DEFAULT_GATE_INPUT
    eps: float = DEFAULT_EPS
    seed: int | None = None  # random selector only

    def __post_init__(self) -> None:
        if self.selector not in SELECTORS:
            raise PlanError(f"unknown selector {self.selector!r} (known: {', '.join(SELECTORS)})")
        check_w_max(self.w_max)
        n = self.identity.num_units
        if len(self.retained) != len(self.identity.linear_layer_ids):
            raise PlanError(
                f"plan lists {len(self.retained)} layers for "
                f"{len(self.identity.linear_layer_ids)} linear layers"
            )
        for l, units in enumerate(self.retained):
            if list(units) != sorted(set(units)) or (units and not 0 <= units[0] <= units[-1] < n):
                raise PlanError(f"layer {l}: retained units must be sorted, unique, in [0, {n})")

    # ---- counts -----------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.retained)

    @property
    def num_units(self) -> int:
        return self.identity.num_units

    @property
    def retained_counts(self) -> list[int]:
        """r_l per linear layer."""
        return [len(u) for u in self.retained]

    @property
    def r_max(self) -> int:
        return max(self.retained_counts, default=0)

    @property
    def r_bar(self) -> float:
        return sum(self.retained_counts) / max(self.num_layers, 1)

    @property
    def retained_fraction(self) -> float:
        return sum(self.retained_counts) / max(self.num_layers * self.num_units, 1)

    def mask(self) -> torch.Tensor:
        """Global-unit mask, bool [L, n_units]."""
        import torch

        m = torch.zeros(self.num_layers, self.num_units, dtype=torch.bool)
        for l, units in enumerate(self.retained):
            m[l, list(units)] = True
        return m

    # ---- identity checks --------------------------------------------------------------------
    def check_matches(self, identity: ModelIdentity) -> None:
        """Raise PlanError naming every field where this plan and the model disagree.

        The decay digest is compared whenever the plan carries one: a selective plan built from
        weights cannot be verified against a config-only identity and is rejected.
        """
        diffs = _geometry_diffs(self.identity, identity)
        want = self.identity.decay_sha256
        if want is not None and identity.decay_sha256 is None:
            diffs.append("decay_sha256: the plan needs the model's decay weights to be verified")
        elif want is not None and want != identity.decay_sha256:
            diffs.append(
                f"decay_sha256: plan {want[:12]}... vs model {identity.decay_sha256[:12]}..."
            )
        if diffs:
            raise PlanError("selection plan does not match the model: " + "; ".join(diffs))

    def check_config(self, cfg: ModelConfig) -> None:
        """Geometry-only check for callers without the weights: all but the decay digest."""
        diffs = _geometry_diffs(self.identity, ModelIdentity.of(cfg))
        if diffs:
            raise PlanError("selection plan does not match the model: " + "; ".join(diffs))

    # ---- serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d["identity"]["linear_layer_ids"] = list(self.identity.linear_layer_ids)
        del d["retained"]
        d["retained_bits"] = [format(sum(1 << u for u in units), "x") for units in self.retained]
        return {"format": PLAN_FORMAT, **d}

    @classmethod
    def from_dict(cls, raw: dict) -> SelectionPlan:
        if not isinstance(raw, dict) or raw.get("format") != PLAN_FORMAT:
            raise PlanError(f"not a {PLAN_FORMAT} plan")
        try:
            ident = dict(raw["identity"])
            ident["linear_layer_ids"] = tuple(ident["linear_layer_ids"])
            return cls(
                identity=ModelIdentity(**ident),
                selector=raw["selector"],
                w_max=float(raw["w_max"]),
                retained=tuple(_bits_to_units(b) for b in raw["retained_bits"]),
                refresh_window=int(raw["refresh_window"]),
                gate_input=float(raw["gate_input"]),
                eps=float(raw["eps"]),
                seed=raw.get("seed"),
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, PlanError):
                raise
            raise PlanError(f"malformed plan: {e!r}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), separators=(",", ":")) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> SelectionPlan:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise PlanError(f"{path}: cannot read plan ({e})") from None
        return cls.from_dict(raw)


def _bits_to_units(bits: str) -> tuple[int, ...]:
    value = int(bits, 16)
    return tuple(u for u in range(value.bit_length()) if value >> u & 1)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _geometry_only(identity: ModelIdentity) -> ModelIdentity:
    return replace(identity, decay_sha256=None)


def _geometry_diffs(plan_id: ModelIdentity, model_id: ModelIdentity) -> list[str]:
    diffs = []
    for f in fields(ModelIdentity):
        mine, theirs = getattr(plan_id, f.name), getattr(model_id, f.name)
        if f.name != "decay_sha256" and mine != theirs:
            diffs.append(f"{f.name}: plan {_short(mine)} vs model {_short(theirs)}")
    return diffs


def check_w_max(w_max: float) -> None:
    if not isinstance(w_max, int | float) or math.isnan(w_max) or w_max < 0 or w_max == math.inf:
        raise PlanError(f"W_max must be a finite number >= 0, got {w_max!r}")


def refresh_window(horizons: torch.Tensor, omitted: torch.Tensor, w_max: float) -> int:
    """W_wr = max over omitted units of clamp(next_pow2(ceil(H_s)), 4, floor(W_max)); 0 if none.

    horizons: fp32 [L, n]; omitted: bool [L, n]. The clamp is monotone, so the max over units
    is the clamp of the longest omitted horizon. The upper bound wins when W_max < 4.
    """
    h = horizons[omitted]
    if h.numel() == 0:
        return 0
    longest = float(h.max())
    upper = int(math.floor(w_max))
    if not math.isfinite(longest):
        return upper
    window = _next_pow2(math.ceil(longest))
    return min(max(window, 4), upper)


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def dense_plan(
    identity: ModelIdentity, gate_input: float = DEFAULT_GATE_INPUT, eps: float = DEFAULT_EPS
) -> SelectionPlan:
    """W_max = 0: every unit retained. Valid for any weights of this geometry (no digest)."""
    identity = _geometry_only(identity)
    n = identity.num_units
    layers = tuple(tuple(range(n)) for _ in identity.linear_layer_ids)
    return SelectionPlan(identity, "dense", 0.0, layers, 0, gate_input, eps)


def dasc_plan(
    identity: ModelIdentity,
    horizons: torch.Tensor,
    w_max: float,
    gate_input: float = DEFAULT_GATE_INPUT,
    eps: float = DEFAULT_EPS,
) -> SelectionPlan:
    """Keep unit u of layer l iff H_s[l, u] > W_max.  horizons: fp32 [L, n_units]."""
    check_w_max(w_max)
    _check_horizons(identity, horizons)
    if w_max == 0:
        return dense_plan(identity, gate_input, eps)
    keep = horizons > w_max  # [L, n]
    retained = tuple(tuple(row.nonzero().flatten().tolist()) for row in keep)
    window = refresh_window(horizons, ~keep, w_max)
    return SelectionPlan(identity, "dasc", float(w_max), retained, window, gate_input, eps)


def random_plan(like: SelectionPlan, horizons: torch.Tensor, seed: int) -> SelectionPlan:
    """Count-matched control: per layer, r_l units drawn uniformly (seeded), same W_max."""
    _check_horizons(like.identity, horizons)
    rng = random.Random(seed)
    n = like.num_units
    retained = tuple(tuple(sorted(rng.sample(range(n), r))) for r in like.retained_counts)
    keep = SelectionPlan(like.identity, "random", like.w_max, retained, 0).mask()
    window = refresh_window(horizons, ~keep, like.w_max) if like.w_max > 0 else 0
    return SelectionPlan(like.identity, "random", like.w_max, retained, window,
                         like.gate_input, like.eps, seed)


def _check_horizons(identity: ModelIdentity, horizons: torch.Tensor) -> None:
    want = (len(identity.linear_layer_ids), identity.num_units)
    if tuple(horizons.shape) != want:
        raise PlanError(f"horizons have shape {tuple(horizons.shape)}, the model needs {want}")
