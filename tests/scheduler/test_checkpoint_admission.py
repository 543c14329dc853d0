"""Checkpoint admission (``--checkpoint-admission``, scheduler/admission.py): ``all`` stores at
every interval multiple and the prompt end; ``reuse`` stores at the ends of a turn always, at a
branch point of the tree, and nowhere a request is the first to reach; ``branch`` (the default)
stores ``all``'s points and the branch point.  The scheduler runs against the symbolic ranks
of tests/support/fake_ranks.py, with the integrity check after every operation."""

from __future__ import annotations

import pytest
from support.fake_ranks import boundaries, tree_ckpts
from support.scheduler_helpers import Loop, make, random_tokens

from scheduler.admission import MIN_BRANCH_GAIN, store_points
from scheduler.index_pool import IndexPool
from scheduler.radix_cache import RadixCache
from scheduler.wire.serve_config import CheckpointAdmission

INTERVAL = 16
MAX_TOKENS = 4  # a finished request's checkpoint lies at len(prompt) + MAX_TOKENS - 1


def scheduler(admission: str, interval: int = INTERVAL):
    return make(max_total_tokens=2000, num_checkpoint_slots=32, chunked_prefill_size=256,
                checkpoint_interval=interval, checkpoint_admission=admission)


def ckpt_depths(s) -> set[int]:
    return {len(path) for path, _ in tree_ckpts(s).values()}


def serve(loop: Loop, rid: str, prompt: list[int]) -> int:
    """Run one request to its end; returns the prompt tokens it restored from the cache."""
    assert loop.add(rid, prompt, MAX_TOKENS) is None
    loop.run()
    return loop.final(rid).cached_tokens


def tokens(first: int, n: int) -> list[int]:
    return [1 + (first + i) % 63 for i in range(n)]


def cache_with(path: list[int], ckpt_at: list[int]) -> RadixCache:
    """A tree holding ``path`` with checkpoints after each prefix length in ``ckpt_at``."""
    cache = RadixCache(IndexPool(256), IndexPool(8))
    assert max(ckpt_at) == len(path)
    for end in sorted(ckpt_at, reverse=True):
        rows = cache.alloc_rows(end) if end == len(path) else [0] * end  # the tree keeps its own
        assert cache.insert(path[:end], rows, cache.alloc_ckpt()).ckpt_taken
    return cache


# ---- store_points ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 33, 64, 100])
@pytest.mark.parametrize("interval", [0, 1, 8, 16])
def test_all_is_every_interval_multiple_and_the_prompt_end(n, interval):
    prompt = tokens(0, n)
    shared = cache_with(prompt[: n // 2] + [0] * 40, [n // 2 + 40])  # all ignores the tree
    for cache in (RadixCache(IndexPool(256), IndexPool(8)), shared):
        points = store_points(prompt, interval, "all", cache)
        assert points == sorted(boundaries(n, interval))


def test_reuse_stores_the_prompt_end_and_the_branch_point():
    prompt = tokens(0, 90)
    empty = RadixCache(IndexPool(256), IndexPool(8))
    assert store_points(prompt, INTERVAL, "reuse", empty) == [89]  # first to reach: the end
    assert store_points(prompt[:1], INTERVAL, "reuse", empty) == []
    # another request's path leaves the prompt after 50 tokens (mid-edge, off the interval)
    other = prompt[:50] + [0] * 20
    assert store_points(prompt, INTERVAL, "reuse", cache_with(other, [70])) == [50, 89]
    # a checkpoint fewer than MIN_BRANCH_GAIN tokens above the branch point covers it
    near = 50 - MIN_BRANCH_GAIN + 1
    assert store_points(prompt, INTERVAL, "reuse", cache_with(other, [near, 70])) == [89]
    far = 50 - MIN_BRANCH_GAIN
    assert store_points(prompt, INTERVAL, "reuse", cache_with(other, [far, 70])) == [50, 89]
    # the whole prompt is cached: only its end
    assert store_points(prompt, INTERVAL, "reuse", cache_with(prompt + [0], [91])) == [89]


def test_cached_len_counts_a_partial_edge():
    path = tokens(0, 40)
    cache = cache_with(path, [40])
    assert cache.cached_len(path) == 40
    assert cache.cached_len(path + [5]) == 40
    assert cache.cached_len(path[:25] + [0, 1]) == 25
    assert cache.cached_len([0] + path) == 0
    assert cache.cached_len([]) == 0


def test_an_unknown_admission_is_refused():
    with pytest.raises(ValueError, match="--checkpoint-admission must be one of branch, all"):
        make(checkpoint_admission="every")


# ---- the scheduler -------------------------------------------------------------------------------


def test_reuse_stores_a_shared_prefix_once_a_second_request_reaches_it():
    prefix = tokens(0, 3 * INTERVAL)  # its interval multiples: 16, 32, 48
    a, b, c = (prefix + tokens(k, 10) for k in (20, 30, 40))
    s = scheduler("reuse")
    loop = Loop(s, random_tokens())
    assert serve(loop, "a", a) == 0
    assert ckpt_depths(s) == {57, 57 + MAX_TOKENS}  # the ends of the turn, nothing inside
    assert serve(loop, "b", b) == 0
    assert 48 in ckpt_depths(s) and not {16, 32} & ckpt_depths(s)  # the branch point
    assert serve(loop, "c", c) == 48
    assert ckpt_depths(s) == {48, 57, 57 + MAX_TOKENS}


def test_all_stores_every_multiple_on_the_first_reach():
    prefix = tokens(0, 3 * INTERVAL)
    s = scheduler("all")
    loop = Loop(s, random_tokens())
    assert serve(loop, "a", prefix + tokens(20, 10)) == 0
    assert ckpt_depths(s) == {16, 32, 48, 57, 57 + MAX_TOKENS}
    assert serve(loop, "b", prefix + tokens(30, 10)) == 48


def test_reuse_hits_at_a_branch_point_off_the_interval():
    prefix = tokens(0, 37)
    hits = {}
    for admission in CheckpointAdmission:
        loop = Loop(scheduler(admission), random_tokens())
        for k in (20, 30, 40):
            hits[admission, k] = serve(loop, f"r{k}", prefix + tokens(k, 12))
    assert [hits["reuse", k] for k in (20, 30, 40)] == [0, 0, 37]
    assert [hits["all", k] for k in (20, 30, 40)] == [0, 32, 32]
    # 5 tokens past the grid's 32: not worth a checkpoint (MIN_BRANCH_GAIN)
    assert [hits["branch", k] for k in (20, 30, 40)] == [0, 32, 32]


def test_branch_stores_the_branch_point_past_the_grid():
    """The first sharer's interval point serves the second, whose branch point (36 tokens
    past it) serves the third."""
    prefix = tokens(0, 100)
    hits = {}
    for admission in ("branch", "all"):
        loop = Loop(scheduler(admission, interval=64), random_tokens())
        hits[admission] = [serve(loop, f"r{k}", prefix + tokens(k, 12)) for k in (20, 30, 40)]
    assert hits == {"branch": [0, 64, 100], "all": [0, 64, 64]}


@pytest.mark.parametrize("n", [20, 45, 64, 100])
def test_branch_is_all_plus_the_branch_point(n):
    prompt = tokens(0, n)
    empty = RadixCache(IndexPool(256), IndexPool(8))
    assert store_points(prompt, INTERVAL, "branch", empty) == store_points(
        prompt, INTERVAL, "all", empty)
    cut = n // 2 + 3  # off the interval grid, at least MIN_BRANCH_GAIN past its checkpoint
    other = cache_with(prompt[:cut] + [0] * 40, [cut + 40])
    if cut - 0 >= MIN_BRANCH_GAIN and cut < n - 1:
        assert store_points(prompt, INTERVAL, "branch", other) == sorted(
            {*store_points(prompt, INTERVAL, "all", other)[:-1], cut}) + [n - 1]


def test_reuse_keeps_the_ends_of_a_turn_and_skips_a_branch_they_cover():
    """The next turn appends new tokens to the last prompt: it branches off the finished path
    one token past the prompt-end checkpoint, which it hits.  A next turn that appends the
    output too hits the finished checkpoint and branches nowhere."""
    s = scheduler("reuse")
    loop = Loop(s, random_tokens(1))
    first = tokens(0, 40)
    assert serve(loop, "t0", first) == 0
    output = loop.output("t0")
    assert ckpt_depths(s) == {39, 39 + MAX_TOKENS}
    turn = first + [t % 63 + 1 for t in output[:1]] + tokens(50, 19)  # new[0] != output[0]
    assert serve(loop, "t1", turn) == 39
    assert 40 not in ckpt_depths(s)
    assert ckpt_depths(s) == {39, 39 + MAX_TOKENS, 59, 59 + MAX_TOKENS}
    chat = first + output + tokens(5, 20)
    assert serve(loop, "t2", chat) == 39 + MAX_TOKENS
    assert ckpt_depths(s) == {39, 39 + MAX_TOKENS, 59, 59 + MAX_TOKENS, 63, 63 + MAX_TOKENS}
    s.check_integrity()


def test_the_flag_reaches_the_scheduler():
    from dasc_server.flags import parse_args, serve_config
    from scheduler.__main__ import scheduler_args
    from scheduler.wire.rank_messages import RankInfo
    from scheduler.wire.serve_config import ServeConfig

    info = RankInfo("kimi_linear", 1, 64, None, 4096, 4, 100, 100, 0)
    for flags, admission in (([], "branch"), (["--checkpoint-admission", "all"], "all"),
                             (["--checkpoint-admission", "reuse"], "reuse")):
        sent = serve_config(parse_args(flags)).to_json()
        cfg, _ = scheduler_args(ServeConfig.from_json(sent), info)
        assert cfg.checkpoint_admission == admission
