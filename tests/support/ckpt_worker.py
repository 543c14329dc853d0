"""Checkpoint store -> load through the model runner, run in-process or on every torchrun rank.

``python -m torch.distributed.run --nproc-per-node N tests/support/ckpt_worker.py MODEL_DIR
OUT_DIR`` runs every (layout, payload, placement) with a dense plan and a W_max = 32 plan and
saves, on rank 0, the suffix logits after a cache hit next to the no-cache logits.
"""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)

import torch  # noqa: E402

from model_runner.batch import SeqInput  # noqa: E402
from model_runner.checkpoints.pool import CheckpointFormat  # noqa: E402
from model_runner.compression.horizons import static_horizons  # noqa: E402
from model_runner.compression.placement import placement_head_order  # noqa: E402
from model_runner.compression.plan import dasc_plan, dense_plan  # noqa: E402
from model_runner.compression.weights import load_decay_params  # noqa: E402
from model_runner.config import ModelConfig  # noqa: E402
from model_runner.parallel import TPGroup, init_tp_group, shutdown_tp_group  # noqa: E402
from model_runner.runner import ModelRunner, RunnerConfig  # noqa: E402

FORMATS = [CheckpointFormat(layout, payload, placement)
           for layout in ("ragged", "padded") for payload in ("fp32", "int8")
           for placement in ("off", "storage", "hybrid")]


def plans(model_dir: str):
    cfg = ModelConfig.from_dir(model_dir)
    params = load_decay_params(model_dir, cfg)
    from model_runner.compression.plan import ModelIdentity

    identity = ModelIdentity.of(cfg, params)
    return {"dense": dense_plan(identity),
            "w32": dasc_plan(identity, static_horizons(cfg, params), 32.0)}


def hit_logits(model_dir: str, tp: TPGroup, plan, fmt: CheckpointFormat, prompt: list[int],
               cut: int) -> dict:
    """Prefill prompt[:cut] in slot 1, store it, load it into slot 2 over junk, continue; also
    continue from an exact copy of slot 1 (no checkpoint) and from one pass (no cache)."""
    cfg = ModelConfig.from_dir(model_dir)
    order = placement_head_order(plan, cfg, tp.size, fmt.placement)
    runner = ModelRunner(RunnerConfig(model_dir, num_pages=32, page_size=4, num_state_slots=4),
                         tp, order)
    runner.attach_checkpoints(plan, num_slots=3, fmt=fmt)
    table = list(range(-(-len(prompt) // 4)))
    no_cache = runner.forward([SeqInput(prompt, 0, table, 3)], all_logits=True)[cut:]
    runner.forward([SeqInput(prompt[:cut], 0, table, 1)])
    before = runner.read_state(1)
    runner.state.copy(1, 3)
    direct = runner.forward([SeqInput(prompt[cut:], cut, table, 3)], all_logits=True)
    runner.store_checkpoints([1], [2])
    runner.state.temporal[:, 2].normal_()  # junk in the target slot
    runner.load_checkpoints([2], [2])
    after = runner.read_state(2)
    hit = runner.forward([SeqInput(prompt[cut:], cut, table, 2)], all_logits=True)
    return {"no_cache": no_cache, "direct": direct, "hit": hit, "before": before.temporal,
            "after": after.temporal, "conv_equal": torch.equal(before.conv, after.conv)}


def main() -> None:
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    tp = init_tp_group(torch.device("cpu"))
    prompt = torch.randint(3, 96, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    results = {}
    for name, plan in plans(model_dir).items():
        for fmt in FORMATS:
            results[name, fmt.layout, fmt.payload, fmt.placement] = hit_logits(
                model_dir, tp, plan, fmt, prompt, cut=17)
    if tp.rank == 0:
        torch.save(results, f"{out_dir}/ckpt.pt")
    shutdown_tp_group(tp)


if __name__ == "__main__":
    main()
