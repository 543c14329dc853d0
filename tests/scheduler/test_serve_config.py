"""The one serving config and the typed seams: every dasc-serve flag
lands in the ``ServeConfig`` the children receive (or is the launcher's own), the config
survives its JSON trip and refuses malformed input by name, the IPC unpickler builds the new
types and nothing else, the scheduler process sends one ``TokenBatch`` per step carrying every
request's new tokens, and the front end splits each batch into its requests' streams."""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import threading
from dataclasses import replace
from multiprocessing import Pipe

import pytest
from support.serving import KIMI, ipc_pair

from dasc_server.engine_client import EngineClient
from dasc_server.flags import (
    build_parser,
    byte_size,
    parse_args,
    serve_config,
    threads_flag,
    validate,
)
from scheduler.__main__ import SchedulerProcess
from scheduler.limits import RankLimits
from scheduler.scheduler import Scheduler
from scheduler.wire import ipc
from scheduler.wire.messages import (
    Counters,
    GenerateReq,
    SamplingParams,
    ServerInfo,
    Shutdown,
    Stats,
    StatsReq,
    TokenBatch,
    TokenOut,
)
from scheduler.wire.rank_messages import BatchPlan, RankInfo, StepResult
from scheduler.wire.serve_config import LoadPolicy, Payload, SchedulingConfig, ServeConfig

# the launcher's own flags: HTTP, torchrun, timeouts, the key; every other flag is config
LAUNCHER_ONLY = {"--served-model-name", "--tp", "--host", "--port", "--startup-timeout",
                 "--shutdown-timeout", "--api-key", "--max-request-bytes",
                 "--max-queued-requests", "--nnodes", "--node-rank", "--master-addr",
                 "--master-port",
                 "--target-slots"}  # resolved into W_max by serve_config(): tested below
RANK = RankInfo("kimi_linear", 1, 264, 258, 8192, 8, 1000, 4000, 0)


def other_value(action: argparse.Action) -> list[str]:
    """Arguments that set ``action`` to something other than its default."""
    flag = action.option_strings[0]
    if action.nargs == 0:
        return [flag]
    if action.choices:  # the last other choice (--dtype's first, float32, is what auto picks
        # for the built-in model)
        return [flag, [str(c) for c in action.choices if c != action.default][-1]]
    kind = action.type or str
    if kind is threads_flag:  # "auto" resolves to a count that depends on the machine
        return [flag, str(serve_config(parse_args([])).ranks.cpu_threads + 1)]
    value = {int: "7", float: "3.5", str: "elsewhere", byte_size: "7M"}[kind]
    assert str(action.default) != value
    return [flag, value]


def flag_actions() -> list[argparse.Action]:
    return [a for a in build_parser()._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("action", flag_actions(), ids=lambda a: a.option_strings[0])
def test_every_flag_reaches_the_config_or_is_the_launchers(action):
    default = serve_config(parse_args([]))
    changed = serve_config(parse_args(other_value(action)))
    if action.option_strings[0] in LAUNCHER_ONLY:
        assert changed == default
    else:
        assert changed != default, f"{action.option_strings[0]} does not reach the config"
        assert ServeConfig.from_json(changed.to_json()) == changed


@pytest.mark.parametrize("cpus,flags,threads", [
    (8, [], 8), (8, ["--tp", "2"], 4), (8, ["--tp", "4", "--nnodes", "2"], 4), (2, [], 2),
    (3, ["--tp", "2"], 1), (2, ["--tp", "4"], 1), (8, ["--cpu-threads", "2"], 2),
])
def test_cpu_threads_default_to_the_cpus_shared_among_the_nodes_ranks(
        monkeypatch, cpus, flags, threads):
    """The CPUs this process may use, shared among this node's ranks, at least one each; an
    explicit count wins."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cpus)))
    assert serve_config(parse_args(flags)).ranks.cpu_threads == threads


def test_cpu_threads_take_omp_num_threads_where_set_and_one_on_cuda(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert serve_config(parse_args([])).ranks.cpu_threads == 3
    assert serve_config(parse_args(["--cpu-threads", "5"])).ranks.cpu_threads == 5
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")
    assert serve_config(parse_args([])).ranks.cpu_threads == 8
    monkeypatch.delenv("OMP_NUM_THREADS")
    args = parse_args([])
    args.device = "cuda"  # (parse_args would check for the GPUs)
    assert serve_config(args).ranks.cpu_threads == 1


@pytest.mark.parametrize("bad", ["0", "-2", "two", ""])
def test_a_bad_thread_count_is_refused(bad, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--cpu-threads", bad])
    assert "expected a thread count of at least 1 or auto" in capsys.readouterr().err


def test_the_model_path_is_absolute_whatever_the_working_directory(monkeypatch):
    monkeypatch.chdir(KIMI.parent)
    cfg = serve_config(parse_args(["--model", KIMI.name]))
    assert cfg.model == str(KIMI) and KIMI.is_absolute()
    info = ServerInfo(cfg, RANK, 2048)
    assert info.config.model == str(KIMI)


def test_the_config_keeps_its_types_through_json():
    cfg = serve_config(parse_args(["--wmax", "16", "--load-policy", "wr", "--int8-checkpoints",
                                   "--selection", "random", "--checkpoint-slots", "3"]))
    back = ServeConfig.from_json(cfg.to_json())
    assert back == cfg and back.checkpoints.load_policy is LoadPolicy.WR
    assert back.checkpoints.payload is Payload.INT8 and back.ranks.checkpoint_slots == 3
    assert isinstance(back.checkpoints.w_max, float) and back.ranks.state_budget_bytes is None


@pytest.mark.parametrize("edit,message", [
    (lambda raw: raw["ranks"].pop("dtype"), r"config\.ranks: unknown fields \[\], missing "
                                            r"fields \['dtype'\]"),
    (lambda raw: raw["scheduling"].update(max_batch=4), r"unknown fields \['max_batch'\]"),
    (lambda raw: raw["scheduling"].update(max_total_tokens="64"),
     r"config\.scheduling\.max_total_tokens must be int, got '64'"),
    (lambda raw: raw["scheduling"].update(prefix_cache=1),
     r"config\.scheduling\.prefix_cache must be bool"),
    (lambda raw: raw["checkpoints"].update(load_policy="xr"),
     r"config\.checkpoints\.load_policy must be one of \['nr', 'wr'\], got 'xr'"),
    (lambda raw: raw.update(ranks=[]), r"config\.ranks must be an object, got list"),
])
def test_a_malformed_config_is_refused_by_name(edit, message):
    raw = json.loads(serve_config(parse_args([])).to_json())
    edit(raw)
    with pytest.raises(ValueError, match=message):
        ServeConfig.from_json(json.dumps(raw))


def test_a_config_that_is_not_json_is_refused():
    with pytest.raises(ValueError, match="the serving config is not JSON"):
        ServeConfig.from_json("{")


@pytest.mark.parametrize("flags,arm", [
    ([], "dense"), (["--wmax", "16"], "nr@16"), (["--wmax", "128", "--load-policy", "wr"],
                                                 "wr@128"),
    (["--wmax", "16", "--int8-checkpoints"], "nr-int8@16"),
    (["--wmax", "16", "--int8-checkpoints", "--load-policy", "wr"], "wr@16"),
    (["--wmax", "16", "--selection", "random", "--int8-checkpoints"], "random@16"),
])
def test_server_info_names_the_arm_and_keeps_its_json_keys(flags, arm):
    info = ServerInfo(serve_config(parse_args(flags)), RANK, 2048)
    body = info.as_json()
    assert info.arm == body["arm"] == arm
    assert set(body) == {
        "model", "model_type", "tp_size", "vocab_size", "eos_token_id", "max_total_tokens",
        "max_context_len", "max_running_requests", "num_checkpoint_slots",
        "checkpoint_bytes_per_slot", "dense_bytes_per_slot", "w_max", "load_policy",
        "refresh_window", "prefix_cache", "park_finished", "checkpoint_format",
        "chunked_prefill_size", "arm", "prefill_tokens_per_s", "tier_fingerprint",
        "kv_bytes_per_token", "tier_slot_bytes", "cache_tier_dir", "weight_bytes"}
    assert body["park_finished"] is True
    ckpt = info.config.checkpoints
    assert body["checkpoint_format"] == f"{ckpt.selection.value} {ckpt.payload.value} off"
    assert json.loads(json.dumps(body)) == body  # plain JSON values


def test_the_unpickler_builds_the_typed_messages_and_nothing_else():
    a, b = Pipe()
    info = ServerInfo(serve_config(parse_args(["--wmax", "8", "--selection", "random"])), RANK,
                      512)
    stats = Stats(1, 1, 0, 2, 2, 0, 0, 0, Counters(prompt_tokens=5, loads_wr=2), 3, 0.1, 0.0,
                  "ok")
    batch = TokenBatch([TokenOut("r0", [1], [-0.5]), TokenOut("r1", [2], [-0.1], finished=True,
                                                              finish_reason="length")])
    for msg in (info, stats, batch):
        ipc.send(a, msg)
        got = ipc.recv(b)
        assert got == msg and type(got) is type(msg)
    # a callable; an allowed name from another module; another name from an allowed module
    crafted = [pickle.dumps(print), pickle.dumps(argparse.Namespace(x=1)),
               b"cbuiltins\nServeConfig\n.", b"cscheduler.serve_config\njson\n."]
    for data in crafted:
        a.send_bytes(data)
        with pytest.raises(pickle.UnpicklingError, match="refusing to decode"):
            ipc.recv(b)


def test_the_scheduler_sends_one_token_batch_per_step():
    """The real scheduler loop over pipes, rank 0 played by a thread that samples token
    ``step_id`` for every row: each step that samples sends exactly one frame to the front
    end, naming every request that sampled in it, in plan order."""
    front_end, front = Pipe()
    rank_end, rank = Pipe()
    sched = Scheduler(SchedulingConfig(max_total_tokens=400, max_running_requests=4),
                      RankLimits(num_checkpoint_slots=8, max_context_len=4096, vocab_size=64))
    sampled_by_step: list[list[str]] = []

    def rank0() -> None:
        while not isinstance(plan := ipc.recv(rank_end), Shutdown):
            assert isinstance(plan, BatchPlan)
            rids = [q.rid for q in plan.seqs if q.sample is not None]
            if rids:
                sampled_by_step.append(rids)
            ipc.send(rank_end, StepResult(plan.step_id, [plan.step_id % 64] * len(rids), 0.0,
                                          [-1.0] * len(rids)))

    lengths = {"a": 4, "b": 4, "c": 2}
    for rid, n in lengths.items():
        ipc.send(front_end, GenerateReq(rid, [1, 2, 3], SamplingParams(max_tokens=n)))
    ipc.send(front_end, GenerateReq("bad", [], SamplingParams()))
    rank_thread = threading.Thread(target=rank0, daemon=True)
    sched_thread = threading.Thread(target=SchedulerProcess(sched, rank, front).run, daemon=True)
    rank_thread.start()
    sched_thread.start()
    frames, finished = [], set()
    while finished != {*lengths, "bad"}:
        assert front_end.poll(20), "the scheduler sent nothing"
        frames.append(ipc.recv(front_end))
        assert isinstance(frames[-1], TokenBatch)
        finished |= {o.rid for o in frames[-1].outs if o.finished}
    ipc.send(front_end, StatsReq())
    stats = ipc.recv(front_end)
    ipc.send(front_end, Shutdown())
    sched_thread.join(20)
    ipc.send(rank, Shutdown())  # as the scheduler process's main does on its way out
    rank_thread.join(20)
    assert not sched_thread.is_alive() and not rank_thread.is_alive()
    refusal, steps = frames[0], frames[1:]
    assert [(o.rid, o.finish_reason) for o in refusal.outs] == [("bad", "error")]
    assert [[o.rid for o in f.outs] for f in steps] == sampled_by_step
    assert max(len(f.outs) for f in steps) == 3  # one frame for three requests' tokens
    for rid, n in lengths.items():
        outs = [o for f in steps for o in f.outs if o.rid == rid]
        assert len(outs) == n and [o.finished for o in outs] == [False] * (n - 1) + [True]
    assert isinstance(stats.counters, Counters) and stats.counters.prompt_tokens == 9


def test_the_front_end_splits_a_batch_into_its_requests(monkeypatch):
    conn, scheduler_end = ipc_pair(monkeypatch)
    engine = EngineClient(conn, ServerInfo(serve_config(parse_args(["--model", str(KIMI)])),
                                           RANK, 2048))

    async def main() -> dict[str, list[TokenOut]]:
        engine.start(asyncio.get_running_loop())
        got: dict[str, list[TokenOut]] = {}

        async def collect(rid: str) -> None:
            async for out in engine.generate(rid, [1, 2], SamplingParams(max_tokens=2)):
                got.setdefault(rid, []).append(out)

        tasks = [asyncio.create_task(collect(rid)) for rid in ("r0", "r1")]
        for _ in range(2):  # both GenerateReqs reach the scheduler end
            assert await asyncio.to_thread(scheduler_end.poll, 10)
            assert isinstance(ipc.recv(scheduler_end), GenerateReq)
        first = TokenOut("r0", [5], [-0.5], top_ids=[[5, 6]], top_logprobs=[[-0.5, -1.0]])
        ipc.send(scheduler_end, TokenBatch([first, TokenOut("r1", [7], [-0.2]),
                                            TokenOut("gone", [1], [-1.0])]))
        last = [replace(first, token_ids=[6], finished=True, finish_reason="length"),
                TokenOut("r1", [8], [-0.3], finished=True, finish_reason="stop")]
        ipc.send(scheduler_end, TokenBatch(last))
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        return got

    try:
        got = asyncio.run(main())
    finally:
        scheduler_end.close()
        conn.close()
    assert [o.token_ids for o in got["r0"]] == [[5], [6]] and got["r0"][0].top_ids == [[5, 6]]
    assert [(o.token_ids, o.finish_reason) for o in got["r1"]] == [([7], None), ([8], "stop")]
    assert set(got) == {"r0", "r1"} and engine.num_active == 0


def test_target_slots_choose_w_max_before_anything_starts(capsys):
    from model_runner.compression.accounting import dense_budget
    from model_runner.compression.horizons import static_horizons
    from model_runner.compression.plan import ModelIdentity, PlanError
    from model_runner.compression.target import plan_for_slots
    from model_runner.compression.weights import load_decay_params
    from model_runner.config import ModelConfig

    model = ModelConfig.from_dir(KIMI)
    budget = dense_budget(model, 1, 32)
    params = load_decay_params(KIMI, model)
    want = plan_for_slots(ModelIdentity.of(model, params), static_horizons(model, params),
                          model, 1, 48, budget)
    assert want.plan.w_max > 0
    args = parse_args(["--target-slots", "48", "--state-budget-bytes", str(budget)])
    validate(args)
    cfg = serve_config(args)
    assert cfg.checkpoints.w_max == want.plan.w_max and cfg.ranks.state_budget_bytes == budget
    assert args.wmax == 0  # the flags are read, never written
    assert f"W_max {want.plan.w_max:.9g}, {want.slots} slots" in capsys.readouterr().err
    for argv, message in ((["--target-slots", "48"], "needs --state-budget-bytes"),
                          (["--target-slots", "48", "--state-budget-bytes", str(budget),
                            "--wmax", "16"], "drop --wmax"),
                          (["--target-slots", "100000", "--state-budget-bytes", str(budget)],
                           "do not fit")):
        args = parse_args(argv)
        with pytest.raises((ValueError, PlanError), match=message):
            validate(args)
            serve_config(args)


def test_a_step_log_in_a_missing_folder_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="--step-log .*: its folder does not exist"):
        validate(parse_args(["--step-log", str(tmp_path / "missing" / "steps.log")]))
    validate(parse_args(["--step-log", str(tmp_path / "steps.log")]))
    assert not (tmp_path / "steps.log").exists()  # nothing is written before the server runs


@pytest.mark.parametrize("flags,parks", [([], True), (["--no-park-finished"], False),
                                         (["--no-cache-finished"], False),
                                         (["--no-prefix-cache"], False)])
def test_server_info_says_whether_finished_slots_are_parked(flags, parks):
    """``dasc-eval --base-url`` reads it: a parked hit restores no checkpoint."""
    assert ServerInfo(serve_config(parse_args(flags)), RANK, 2048).as_json()["park_finished"] \
        is parks


def test_one_second_tier_at_a_time():
    args = parse_args(["--cache-tier-dir", "/tmp/t", "--host-tier-bytes", "1G"])
    with pytest.raises(ValueError, match="one second tier at a time"):
        serve_config(args)
    assert parse_args(["--host-tier-bytes", "1.5G"]).host_tier_bytes == 3 * 2**29


def test_cpu_bind_splits_the_cpus_among_the_ranks_and_refuses_what_does_not_go_round(
        monkeypatch):
    """--cpu-bind on: each local rank its --cpu-threads CPUs in order, the rest to the scheduler
    and front end; too few CPUs, or CUDA ranks, are refused before anything starts."""
    from model_runner.cpu_affinity import split_cpus

    assert split_cpus([2, 3, 5, 7, 8], 2, 2) == ([[2, 3], [5, 7]], [8])
    assert split_cpus([0, 1], 2, 1) == ([[0], [1]], [])
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2})
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    validate(parse_args(["--cpu-bind", "on", "--tp", "2"]))
    with pytest.raises(ValueError, match="2 rank\\(s\\) x 2 thread\\(s\\) need 4 CPUs, this "
                                         "process may use 3 \\(0,1,2\\)"):
        validate(parse_args(["--cpu-bind", "on", "--tp", "2", "--cpu-threads", "2"]))
    args = parse_args(["--cpu-bind", "on"])
    args.device = "cuda"  # (parse_args would check for the GPUs)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)  # as if it had one
    with pytest.raises(ValueError, match="--cpu-bind on binds CPU ranks"):
        validate(args)
