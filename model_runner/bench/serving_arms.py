"""Arms of the serving experiments: the dasc-serve flags of each, and their slot counts.

Slot counts are predicted with the same accounting the ranks use (``report_plan`` over the
plan ``serve_rank.build_plan`` builds) so the phase workload can be sized before any arm runs;
every arm's live ``/server_info`` must then report exactly the predicted count.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from model_runner.compression.accounting import dense_budget, report_plan, slots_at_budget
from model_runner.compression.horizons import static_horizons
from model_runner.compression.plan import ModelIdentity, dasc_plan
from model_runner.compression.weights import load_decay_params
from model_runner.config import ModelConfig


@dataclass(frozen=True, slots=True)
class Arm:
    w_max: float  # 0 = dense
    placement: str = "off"
    policy: str = "nr"
    int8: bool = False

    @property
    def is_dense(self) -> bool:
        return self.w_max == 0

    @property
    def name(self) -> str:
        if self.is_dense:
            return "dense"
        payload = "-int8" if self.int8 else ""
        return f"dasc-{self.policy}{payload} W={self.w_max:g} {self.placement}"

    def server_flags(self) -> list[str]:
        if self.is_dense:
            return ["--wmax", "0"]
        flags = ["--wmax", f"{self.w_max:g}", "--placement", self.placement,
                 "--load-policy", self.policy]
        return flags + (["--int8-checkpoints"] if self.int8 else [])


class SlotPlanner:
    """Predicted slots and worst-rank bytes per slot of any arm at one budget."""

    def __init__(self, model: str | Path, tp_size: int, budget_bytes: int | None = None,
                 dense_slots: int | None = None):
        self.cfg = ModelConfig.from_dir(model)
        self.tp_size = tp_size
        if budget_bytes is None:
            budget_bytes = dense_budget(self.cfg, tp_size, dense_slots)
        self.budget_bytes = budget_bytes
        params = load_decay_params(str(model), self.cfg)
        self._identity = ModelIdentity.of(self.cfg, params)
        self._horizons = static_horizons(self.cfg, params)

    def slot_bytes(self, arm: Arm) -> int:
        plan = dasc_plan(self._identity, self._horizons, arm.w_max)
        report = report_plan(plan, self.cfg, self.tp_size, self.budget_bytes, int8=arm.int8,
                             placements=(arm.placement,))
        return report.placements[0].slot_bytes

    def slots(self, arm: Arm) -> int:
        return slots_at_budget(self.budget_bytes, self.slot_bytes(arm))

    def boundaries(self, wmaxes: list[float], int8: bool = False) -> list[tuple[str, int]]:
        """The phase workload's capacity boundaries: dense, then each W_max with no TP
        balancing (the paper's N_off(W))."""
        out = [("dense", self.slots(Arm(0)))]
        return out + [(f"W{w:g}", self.slots(Arm(w, "off", "nr", int8))) for w in wmaxes]


def check_live_slots(arm: Arm, info: dict, expected: int) -> None:
    live = int(info["num_checkpoint_slots"])
    if live != expected:
        raise RuntimeError(f"arm {arm.name}: the server reports {live} checkpoint slots, the "
                           f"accounting predicted {expected}; the phase sizes would be wrong")
