"""Snapshots inside a step (``SeqInput.snapshots``): the state after a sequence's first
``cut`` new tokens, left in a scratch slot by the same forward that runs on past it, equals the
state a forward that stops there leaves; the tokens after the cut get the logits and state of
the step that would have followed.  A cut before the last token lets a prompt-end checkpoint be
stored in the step that samples the first token; cuts at interior store points let a chunk run
through them.

Tolerance: the two ways run the same recurrences on the same inputs, but the projections are
GEMMs over a different number of rows, so a row may round differently: 1e-5 of the compared
tensor's scale (measured: at most 6e-7).  A snapshot taken one token late moves the state by
more than 1e-2 of its scale, which the tests check as well."""

from __future__ import annotations

import pytest
import torch
from support.ckpt_worker import plans
from support.random_checkpoints import make_model
from support.runner_scenarios import make_runner

from model_runner.batch import SeqInput

TOL = 1e-5


@pytest.fixture(scope="module", params=["kda", "gdn", "qwen3_5_vl", "olmo_hybrid"])
def runner(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"snap-{request.param}")
    # OLMo-Hybrid with 8 value heads a layer: enough for a W_max = 32 plan to omit some
    wide = {"linear_num_key_heads": 4, "linear_num_value_heads": 8}
    make_model(request.param, path, **(wide if request.param == "olmo_hybrid" else {}))
    runner = make_runner(str(path))
    runner.attach_checkpoints(plans(str(path))["w32"], num_slots=2)
    return runner


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).abs().max() <= TOL * b.abs().max())


def assert_states_close(got, want) -> None:
    assert close(got.temporal, want.temporal) and close(got.conv, want.conv)


def test_snapshots_in_a_mixed_step_equal_a_step_one_token_short(runner):
    """Three sequences in one step: a fresh prompt with a snapshot, a decode token, and a
    two-token chunk of a started sequence with a snapshot (its one earlier token lies inside
    the conv window, so the conv snapshot keeps part of the carried state)."""
    a, b, c = tokens(40, 1), tokens(10, 2), tokens(12, 3)
    ta, tb, tc = list(range(0, 10)), list(range(10, 13)), list(range(20, 23))
    runner.forward([SeqInput(b[:9], 0, tb, 2), SeqInput(c[:10], 0, tc, 3)])
    b_state, c_state = runner.read_state(2), runner.read_state(3)

    logits = runner.forward([SeqInput(a, 0, ta, 1, [(39, 5)]),
                             SeqInput(b[9:], 9, tb, 2),
                             SeqInput(c[10:], 10, tc, 3, [(1, 6)])])
    got = {slot: runner.read_state(slot) for slot in (1, 2, 3, 5, 6)}

    # the same work, one token short, then the last tokens, from copies of the states before
    # (the KV rows the step wrote are written again, from the same inputs)
    runner.write_state(8, c_state)
    runner.forward([SeqInput(a[:-1], 0, ta, 7), SeqInput(c[10:11], 10, tc, 8)])
    before = {5: runner.read_state(7), 6: runner.read_state(8)}
    ref = runner.forward([SeqInput(a[-1:], 39, ta, 7), SeqInput(c[11:], 11, tc, 8)])
    runner.write_state(9, b_state)
    ref_b = runner.forward([SeqInput(b[9:], 9, tb, 9)])

    for slot, want in before.items():
        assert_states_close(got[slot], want)
    assert close(logits[[0, 2]], ref) and close(logits[1:2], ref_b)
    assert_states_close(got[1], runner.read_state(7))
    assert_states_close(got[3], runner.read_state(8))
    assert_states_close(got[2], runner.read_state(9))
    late = (got[1].temporal - got[5].temporal).abs().max()
    assert late > 1e-2 * got[5].temporal.abs().max(), "the last token must move the state"


def test_several_cuts_per_sequence_equal_forwards_that_stop_there(runner):
    """A step in which one prompt is cut three times (two interior store points and its end
    minus one), another once, and a third sequence decodes: the rounds run segments of
    different sequences side by side.  Each snapshot equals the state of a forward over the
    prompt up to its cut; the logits and final states equal whole forwards."""
    a, b, c = tokens(40, 6), tokens(20, 7), tokens(8, 8)
    ta, tb, tc = list(range(0, 10)), list(range(10, 15)), list(range(20, 23))
    runner.forward([SeqInput(c[:7], 0, tc, 3)])
    c_state = runner.read_state(3)
    logits = runner.forward([SeqInput(a, 0, ta, 1, [(8, 4), (16, 5), (39, 6)]),
                             SeqInput(c[7:], 7, tc, 3),
                             SeqInput(b, 0, tb, 2, [(10, 7)])])
    got = {slot: runner.read_state(slot) for slot in range(1, 8)}

    for slot, (prompt, cut, table) in {4: (a, 8, ta), 5: (a, 16, ta), 6: (a, 39, ta),
                                       7: (b, 10, tb)}.items():
        runner.forward([SeqInput(prompt[:cut], 0, table, 8)])
        assert_states_close(got[slot], runner.read_state(8))
    ref = runner.forward([SeqInput(a, 0, ta, 8), SeqInput(b, 0, tb, 9)])
    assert close(logits[[0, 2]], ref)
    assert_states_close(got[1], runner.read_state(8))
    assert_states_close(got[2], runner.read_state(9))
    runner.write_state(8, c_state)
    assert close(logits[1:2], runner.forward([SeqInput(c[7:], 7, tc, 8)]))
    assert_states_close(got[3], runner.read_state(8))
    moved = (got[5].temporal - got[4].temporal).abs().max()
    assert moved > 1e-2 * got[5].temporal.abs().max(), "each cut holds its own state"


def _restore_nr(runner, prompt, table) -> None:
    runner.forward([SeqInput(prompt, 0, table, 1)])
    runner.store_checkpoints([1], [0])
    runner.load_checkpoints([0], [2])


def test_a_snapshot_in_the_replays_scratch_slot_follows_the_refresh(runner):
    """dasc-wr: the hit's replay and its snapshot share scratch slot 3.  The snapshot holds
    the refreshed state before the suffix's last token: what the replay alone, then the suffix
    one token short, leaves."""
    prompt, suffix = tokens(40, 4), tokens(6, 5)
    table = list(range(50, 62))
    window = runner.checkpoints.plan.refresh_window
    start = len(prompt) - window
    replay = [SeqInput(prompt[start:], start, table, 2)]

    _restore_nr(runner, prompt, table)
    runner.refresh_omitted(replay, scratch_slots=[3])
    runner.forward([SeqInput(suffix[:-1], len(prompt), table, 2)])
    want_snapshot = runner.read_state(2)
    want_logits = runner.forward([SeqInput(suffix[-1:], len(prompt) + 5, table, 2)])
    want_final = runner.read_state(2)

    _restore_nr(runner, prompt, table)
    logits = runner.forward([SeqInput(suffix, len(prompt), table, 2, [(5, 3)])],
                            refresh=runner.replays(replay, scratch_slots=[3]))
    assert_states_close(runner.read_state(3), want_snapshot)
    assert_states_close(runner.read_state(2), want_final)
    assert close(logits, want_logits)


@pytest.mark.parametrize("bad, match", [
    ([SeqInput([5, 6], 0, [0], 1, [(1, 1)])], "snapshot slots"),
    ([SeqInput([5, 6], 0, [0], 1, [(1, 2)]), SeqInput([7], 0, [1], 2)], "snapshot slots"),
    ([SeqInput([5, 6], 0, [0], 1, [(1, 3)]),
      SeqInput([7, 8], 0, [1], 2, [(1, 3)])], "snapshot slots"),
    ([SeqInput([5, 6, 7], 0, [0], 1, [(1, 3), (2, 3)])], "snapshot slots"),
    ([SeqInput([5], 0, [0], 1, [(1, 3)])], "must rise"),
    ([SeqInput([5, 6], 0, [0], 1, [(0, 3)])], "must rise"),
    ([SeqInput([5, 6, 7], 0, [0], 1, [(2, 3), (1, 4)])], "must rise"),
    ([SeqInput([5, 6, 7], 0, [0], 1, [(1, 3), (1, 4)])], "must rise"),
    ([SeqInput([5, 6], 0, [0], 1, [(1, 12)])], "outside"),
])
def test_bad_snapshots_are_refused_before_any_state_changes(runner, bad, match):
    before = runner.state.temporal.clone(), runner.state.conv.clone()
    with pytest.raises(ValueError, match=match):
        runner.forward(bad)
    assert torch.equal(runner.state.temporal, before[0])
    assert torch.equal(runner.state.conv, before[1])


def test_the_snapshot_step_bench_times_both_forms_on_the_same_logits(capsys):
    """``model_runner.bench.snapshot_step`` (a hit's suffix, a miss, a chunk with interior store
    points) reports both forms and checks they agree."""
    import json

    from model_runner.bench import snapshot_step

    snapshot_step.main(["--reps", "1", "--prefix", "20", "--chunks", "2", "9"])
    snapshot_step.main(["--reps", "1", "--prefix", "0", "--chunks", "12"])
    snapshot_step.main(["--reps", "1", "--prefix", "5", "--chunks", "20", "--interval", "8"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["prefix"], r["chunk"], r["cuts"]) for r in rows] == [
        (20, 2, 1), (20, 9, 1), (0, 12, 1), (5, 20, 3)]  # 5 + 20: cuts at 8, 16 and 24
    for r in rows:
        assert r["split_ms"] > 0 and r["fused_ms"] > 0 and r["logits_rel_diff"] < TOL
    with pytest.raises(SystemExit):
        snapshot_step.main(["--chunks", "1"])


def test_the_runner_bench_reports_time_inside_each_kernel(tmp_path):
    """``runner_speed --kernel-times``: each prefill and decode line carries the milliseconds
    spent inside the CPU kernels the model called, the chunked delta rule and the conv's sums
    in the prefill, the decode attention and the recurrent update in a decode step."""
    import json
    import subprocess
    import sys

    from support.random_checkpoints import make_model

    make_model("gdn", tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "model_runner.bench.runner_speed", "--model", str(tmp_path),
         "--prompt-len", "40", "--decode-batch", "2", "--decode-steps", "2", "--repeats", "1",
         "--decode-context", "24", "--kernel-times"],
        capture_output=True, text=True, timeout=300, check=True).stdout
    rows = {r["kind"]: r for r in map(json.loads, out.splitlines()) if r["kind"] != "machine"}
    assert {"delta_rule_chunk", "conv_prefill_sums"} <= set(rows["prefill"]["kernel_ms"])
    assert {"attention_decode", "delta_rule_decode"} <= set(rows["decode"]["kernel_ms"])
    assert all(ms >= 0 for r in rows.values() for ms in r["kernel_ms"].values())
    assert 0 < sum(rows["prefill"]["kernel_ms"].values()) < 1000 * rows["prefill"]["seconds"]


def test_the_runner_bench_times_the_delta_rule_with_and_without_amx(tmp_path):
    """``runner_speed --delta-rule-amx alternate``: the prefills alternate the chunked delta
    rule's AMX form off and on, and the prefill line reports both medians."""
    import json
    import subprocess
    import sys

    from support.random_checkpoints import make_model

    make_model("gdn", tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "model_runner.bench.runner_speed", "--model", str(tmp_path),
         "--prompt-len", "40", "--decode-batch", "1", "--decode-steps", "1", "--repeats", "2",
         "--decode-context", "24", "--dtype", "bfloat16", "--delta-rule-amx", "alternate"],
        capture_output=True, text=True, timeout=300, check=True).stdout
    prefill = next(r for r in map(json.loads, out.splitlines()) if r["kind"] == "prefill")
    assert prefill["seconds"] > 0 and prefill["seconds_amx_off"] > 0


def test_the_runner_bench_alternates_the_prefill_attention(tmp_path):
    """``runner_speed --attention-amx alternate`` reports both prefill medians; both AMX forms
    may not alternate at once; ``hit_step`` times a step of hits with the attention's AMX form
    off and on."""
    import json
    import subprocess
    import sys

    from support.random_checkpoints import make_model

    make_model("gdn", tmp_path)
    run = [sys.executable, "-m", "model_runner.bench.runner_speed", "--model", str(tmp_path),
           "--prompt-len", "40", "--decode-batch", "1", "--decode-steps", "1", "--repeats", "2",
           "--decode-context", "24", "--dtype", "bfloat16", "--attention-amx", "alternate"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=300, check=True).stdout
    prefill = next(r for r in map(json.loads, out.splitlines()) if r["kind"] == "prefill")
    assert prefill["seconds"] > 0 and prefill["seconds_amx_off"] > 0
    both = subprocess.run([*run, "--delta-rule-amx", "alternate"], capture_output=True,
                          text=True, timeout=300)
    assert both.returncode == 2 and "only one of" in both.stderr
    out = subprocess.run(
        [sys.executable, "-m", "model_runner.bench.hit_step", "--model", str(tmp_path),
         "--seqs", "2", "--prefix", "30", "--new", "9", "--reps", "2"],
        capture_output=True, text=True, timeout=300, check=True).stdout
    row = json.loads(out.splitlines()[-1])
    assert (row["seqs"], row["prefix"], row["new"]) == (2, 30, 9)
    assert row["step_ms"] > 0 and row["step_ms_amx_off"] > 0
