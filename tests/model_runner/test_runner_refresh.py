"""dasc-wr through the runner: replay a suffix of the cached prefix from a zero scratch state over
read-only KV and refresh only the omitted units."""

from __future__ import annotations

import pytest
import torch
from support.ckpt_worker import plans
from support.random_checkpoints import make_model
from support.runner_scenarios import PAGE, make_runner

from model_runner.batch import SeqInput, kv_rows


@pytest.fixture(scope="module", params=["kda", "gdn", "qwen3_5_vl", "olmo_hybrid"])
def setup(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"wr-{request.param}")
    # OLMo-Hybrid with 8 value heads a layer: enough for a W_max = 32 plan to omit some
    wide = {"linear_num_key_heads": 4, "linear_num_value_heads": 8}
    make_model(request.param, path, **(wide if request.param == "olmo_hybrid" else {}))
    runner = make_runner(str(path))
    runner.attach_checkpoints(plans(str(path))["w32"], num_slots=2)
    prompt = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    table = list(range(10))
    runner.forward([SeqInput(prompt, 0, table, 1)])
    return runner, prompt, table


def _restore_nr(runner):
    runner.store_checkpoints([1], [0])
    runner.state.temporal[:, 2].normal_()
    runner.load_checkpoints([0], [2])


def test_full_window_replay_recovers_the_exact_state(setup):
    runner, prompt, table = setup
    dense = runner.read_state(1)
    _restore_nr(runner)
    kv = [c.clone() for c in runner.kv.caches]
    ckpt = runner.checkpoints.temporal.clone()
    runner.refresh_omitted([SeqInput(prompt, 0, table, 2)], scratch_slots=[3])
    assert torch.equal(runner.read_state(2).temporal, dense.temporal)
    assert torch.equal(runner.read_state(2).conv, dense.conv)
    assert all(torch.equal(a, b) for a, b in zip(kv, runner.kv.caches)), "KV must stay read-only"
    assert torch.equal(runner.checkpoints.temporal, ckpt), "the checkpoint must stay read-only"


def test_short_window_refreshes_only_omitted_units(setup):
    runner, prompt, table = setup
    dense = runner.read_state(1).temporal
    _restore_nr(runner)
    nr = runner.read_state(2).temporal
    window = runner.checkpoints.plan.refresh_window
    assert 4 <= window <= 32
    start = len(prompt) - window
    runner.refresh_omitted([SeqInput(prompt[start:], start, table, 2)], scratch_slots=[3])
    wr = runner.read_state(2).temporal
    omitted = runner.checkpoints.index.unit_pos < 0  # [L, U]
    view = runner.checkpoints.unit_view
    d, n, w = view(dense[:, None]), view(nr[:, None]), view(wr[:, None])  # [L, 1, U, D]
    assert torch.equal(w[:, 0][~omitted], d[:, 0][~omitted])
    assert n[:, 0][omitted].abs().sum() == 0
    err_nr = (n[:, 0][omitted] - d[:, 0][omitted]).norm()
    err_wr = (w[:, 0][omitted] - d[:, 0][omitted]).norm()
    assert err_wr < 0.75 * err_nr, (err_wr, err_nr)


def test_checkpoint_calls_need_a_pool(tmp_path):
    make_model("kda", tmp_path)
    runner = make_runner(str(tmp_path))
    with pytest.raises(RuntimeError, match="attach_checkpoints"):
        runner.store_checkpoints([1], [0])


def _hit_state(runner, prompt, table, start):
    """Slot 2 restored nr from slot 1's checkpoint; the replay of prompt[start:] into slot 3."""
    _restore_nr(runner)
    return runner.replays([SeqInput(prompt[start:], start, table, 2)], scratch_slots=[3])


def test_replays_inside_a_step_equal_the_replay_then_the_step(setup):
    """A step that carries the replay ahead of the hit's own suffix and of another request's
    decode token gives what the replay alone, then the step, gives: the hit's suffix already
    reads the refreshed units, layer by layer.  Only GEMM row counts differ between the two, so
    the tolerance is float noise (measured <= 1.2e-6 of the logits' scale); a step that skipped
    the merge moved them by 4e-2 (KDA) and 3e-1 (GDN)."""
    runner, prompt, table = setup
    window = runner.checkpoints.plan.refresh_window
    start = len(prompt) - window
    suffix, table = [7, 8, 9, 10, 11], table + [10, 11]
    other_table = list(range(20, 30))
    written = sorted(kv_rows(SeqInput(suffix, len(prompt), table, 2), PAGE)[len(prompt):].tolist()
                     + kv_rows(SeqInput([5], 9, other_table, 4), PAGE)[9:].tolist())
    runner.forward([SeqInput(prompt[:9], 0, other_table, 4)])
    other_state = runner.read_state(4)

    def step(fused: bool):
        runner.write_state(4, other_state)
        refresh = _hit_state(runner, prompt, table, start)
        seqs = [SeqInput(suffix, len(prompt), table, 2), SeqInput([5], 9, other_table, 4)]
        if not fused:
            runner.forward([], refresh=refresh)
            refresh = None
        for cache in runner.kv.caches:
            cache[written] = 0
        kv = [c.clone() for c in runner.kv.caches]
        logits = runner.forward(seqs, refresh=refresh)
        for before, after in zip(kv, runner.kv.caches):  # the replay writes no KV
            changed = (before != after).flatten(1).any(1).nonzero()[:, 0].tolist()
            assert changed == written
        return logits, runner.read_state(2).temporal

    serial, serial_state = step(fused=False)
    fused, fused_state = step(fused=True)
    scale = serial.abs().max()
    assert (fused - serial).abs().max() <= 1e-5 * scale
    assert (fused_state - serial_state).abs().max() <= 1e-5 * serial_state.abs().max()
    _restore_nr(runner)
    nr = runner.forward([SeqInput(suffix, len(prompt), table, 2)])
    assert (nr - serial[:1]).abs().max() > 1e-3 * scale, "the refresh must change the suffix"


def test_replays_leave_the_step_after_the_last_linear_mixer(setup):
    """Past the last linear layer's mixer nothing reads a replay, so its MLP and every later
    layer see only the step's own tokens; earlier MLPs see the replayed window too."""
    runner, prompt, table = setup
    window = runner.checkpoints.plan.refresh_window
    table = table + [10, 11]
    refresh = _hit_state(runner, prompt, table, len(prompt) - window)
    layers = runner.model.model.layers
    rows: dict[int, int] = {}
    hooks = [layer.mlp.register_forward_pre_hook(
        lambda module, args, i=i: rows.__setitem__(i, args[0].shape[0]))
        for i, layer in enumerate(layers)]
    try:
        logits = runner.forward([SeqInput([7, 8, 9], len(prompt), table, 2)], refresh=refresh)
    finally:
        for h in hooks:
            h.remove()
    last = runner.cfg.linear_layer_ids[-1]
    assert logits.shape[0] == 1
    assert rows == {i: 3 + (window if i < last else 0) for i in range(len(layers))}
