"""Store points inside a prefill chunk (scheduler/step_planner.py): the chunk of a prompt that
prefills alone runs through them, snapshotting the state at each into a scratch slot, unless it
runs out of scratch slots or of free checkpoint slots, and then it ends at the first point it
cannot cut; prompts that prefill together advance point by point.  Every plan runs on
the FakeRanks of tests/support/fake_ranks.py, which checks each stored state against its prefix."""

from __future__ import annotations

from support.scheduler_helpers import Loop, assert_drained, make, prompt_of, random_tokens, run_one


def test_a_chunk_runs_through_its_interior_store_points():
    """--checkpoint-interval 8 and a budget that holds the whole prompt: one step computes it,
    cuts it at 8, 16, 24 and 29 (the end minus one), samples the first token and stores all
    four checkpoints from four distinct scratch slots (the stand-in ranks check each stored
    state against its prefix)."""
    s = make(chunked_prefill_size=64, cache_finished=False, park_finished=False)
    loop = Loop(s, random_tokens())
    prompt = prompt_of(30)
    plan = run_one(loop, "a", prompt, 1)
    assert len([p for p in loop.plans if p.seqs]) == 1
    (q,) = plan.seqs
    assert len(q.token_ids) == 30 and q.sample is not None
    assert [c for c, _ in q.snapshots] == [8, 16, 24, 29]
    slots = [x for _, x in q.snapshots]
    assert len(set(slots)) == 4 and min(slots) >= s.cfg.scratch_slot_base
    assert sorted(a for a, _ in plan.stores_after) == sorted(slots)
    assert all(s.cache.ckpt_at(prompt[:end]) is not None for end in (8, 16, 24, 29))
    assert s.stats.checkpoints_stored == 4
    assert_drained(s)


def test_a_chunk_ends_at_the_first_cut_without_a_scratch_slot():
    """Two active slots give two scratch slots: of a prompt's five store points (8, 16, 24,
    32, 40) the first chunk cuts two (its own scratch slot, then the idle one it borrows) and
    ends at the third, which it stores from its active slot; the next chunk runs through the
    other two to the end."""
    s = make(max_running_requests=2, chunked_prefill_size=64, cache_finished=False,
             park_finished=False)
    loop = Loop(s, random_tokens())
    prompt = prompt_of(41)
    run_one(loop, "a", prompt, 1)
    first, second = [p for p in loop.plans if p.seqs]
    (q,) = first.seqs
    assert (q.prefix_len, len(q.token_ids), q.sample) == (0, 24, None)
    assert [c for c, _ in q.snapshots] == [8, 16]
    assert q.state_slot in [a for a, _ in first.stores_after]
    (q,) = second.seqs
    assert (q.prefix_len, len(q.token_ids)) == (24, 17) and q.sample is not None
    assert [c for c, _ in q.snapshots] == [8, 16]
    assert all(s.cache.ckpt_at(prompt[:end]) is not None for end in (8, 16, 24, 32, 40))
    assert_drained(s)


def test_cuts_inside_a_prompt_take_only_free_checkpoint_slots():
    """Three checkpoint slots: the first chunk keeps one for its end store and cuts at the two
    store points the other two free slots cover (8, 16), then ends at the third (24).  With the
    pool full, the next chunk ends at the next point (32) rather than evict for a cut, and the
    last runs to the end; its prompt-end store may evict, as before."""
    s = make(num_checkpoint_slots=3, chunked_prefill_size=64, cache_finished=False,
             park_finished=False)
    loop = Loop(s, random_tokens())
    run_one(loop, "a", prompt_of(41), 1)
    chunks = [q for p in loop.plans for q in p.seqs]
    assert [(q.prefix_len, len(q.token_ids)) for q in chunks] == [(0, 24), (24, 8), (32, 9)]
    assert [[c for c, _ in q.snapshots] for q in chunks] == [[8, 16], [], [8]]
    assert chunks[-1].sample is not None
    assert s.cache.num_cached_ckpts == 3
    assert_drained(s)


def test_a_full_pool_evicts_for_cuts_up_to_a_quarter_of_its_slots():
    """A 16-slot pool filled by an earlier prompt's 17 store points: the next prompt's first
    chunk still cuts through its points, evicting a checkpoint for each, while the step's
    evictions stay within a quarter of the pool (three cuts, 8, 16, 24, and the end store at
    32); the next chunk runs to the end.  Every point is stored."""
    s = make(num_checkpoint_slots=16, chunked_prefill_size=256, cache_finished=False,
             park_finished=False)
    loop = Loop(s, random_tokens())
    run_one(loop, "x", prompt_of(130, seed=1), 1)
    assert s.cache.ckpt_pool.num_free == 0
    prompt = prompt_of(41, seed=2)
    loop.plans.clear()
    run_one(loop, "a", prompt, 1)
    assert _chunks(loop) == [[("a", 0, 32, [8, 16, 24])], [("a", 32, 9, [8])]]
    assert all(s.cache.ckpt_at(prompt[:end]) is not None for end in (8, 16, 24, 32, 40))
    assert_drained(s)


def _chunks(loop: Loop) -> list[list[tuple[str, int, int, list[int]]]]:
    """Each step's sequences: (request, start, tokens, cuts)."""
    return [[(q.rid, q.prefix_len, len(q.token_ids), [c for c, _ in q.snapshots])
             for q in p.seqs] for p in loop.plans if p.seqs]


def _sent_together(sizes: tuple[int, int], max_tokens: int = 1, **kw):
    """Prompts "a" and "b" of these sizes sent at once to a scheduler of 16 checkpoint slots
    (``kw``: its other settings), run to the end; returns (scheduler, loop, a, b)."""
    s = make(num_checkpoint_slots=16, chunked_prefill_size=64, cache_finished=False,
             park_finished=False, **kw)
    loop = Loop(s, random_tokens())
    a, b = prompt_of(sizes[0], seed=1), prompt_of(sizes[1], seed=2)
    assert loop.add("a", a, max_tokens) is None and loop.add("b", b, max_tokens) is None
    loop.run()
    return s, loop, a, b


def test_a_shorter_first_prefill_runs_through_its_points_the_others_advance_point_by_point():
    """A 20-token and a 40-token prompt at once with room in the pool: the first in the
    policy's order (the shorter) runs through its store point (8, 16) and the end minus one
    (19) in one step, on scratch slots nobody else uses in that step; the other's chunk ends at
    its next point, and its 32 tokens left, more than the first's chunk, run on."""
    s, loop, a, b = _sent_together((20, 40))
    steps = _chunks(loop)
    assert steps == [[("a", 0, 20, [8, 16, 19]), ("b", 0, 8, [])],
                     [("b", 8, 32, [8, 16, 24, 31])]]
    assert all(s.cache.ckpt_at(a[:end]) is not None for end in (8, 16, 19))
    assert all(s.cache.ckpt_at(b[:end]) is not None for end in (8, 16, 24, 32, 39))
    assert_drained(s)


def test_prompts_of_a_size_that_prefill_together_finish_in_the_same_step():
    """Two 40-token prompts at once with room in the pool: had the first run through its
    points to its end, the other's 32 tokens left would have filled the first one's first
    decode step.  So they share the step's 64 tokens, each cutting through its points on
    scratch slots of its own (8, 16, 24, and the chunk's end at 32 stores from its active
    slot), finish in the same step, each storing every point, then decode together."""
    s, loop, a, b = _sent_together((40, 40), max_tokens=3, max_running_requests=8)
    steps = _chunks(loop)
    assert steps == [[("a", 0, 32, [8, 16, 24]), ("b", 0, 32, [8, 16, 24])],
                     [("a", 32, 8, [7]), ("b", 32, 8, [7])],
                     [("a", 40, 1, []), ("b", 40, 1, [])], [("a", 41, 1, []), ("b", 41, 1, [])]]
    first = [p for p in loop.plans if p.seqs][0]
    slots = [x for q in first.seqs for _, x in q.snapshots]
    assert len(set(slots)) == 6 and min(slots) >= s.cfg.scratch_slot_base
    assert all(s.cache.ckpt_at(p[:end]) is not None for p in (a, b)
               for end in (8, 16, 24, 32, 39))
    assert_drained(s)


def test_prompts_of_a_size_share_what_scratch_slots_there_are():
    """Two 30-token prompts with four active slots, so four scratch slots for eight cuts: the
    first chunk takes its own and the two nobody owns and ends at its fourth cut (29), the
    other takes its own and ends at its second (16).  No scratch slot serves two cuts of a
    step, and every point is stored."""
    s, loop, a, b = _sent_together((30, 30), max_running_requests=4)
    assert _chunks(loop)[0] == [("a", 0, 29, [8, 16, 24]), ("b", 0, 16, [8])]
    for plan in loop.plans:
        slots = [x for q in plan.seqs for _, x in q.snapshots]
        assert len(set(slots)) == len(slots)
    assert all(s.cache.ckpt_at(p[:end]) is not None for p in (a, b) for end in (8, 16, 24, 29))
    assert_drained(s)


def test_under_pressure_prompts_that_prefill_together_advance_point_by_point():
    """With no checkpoint slot to spare for a cut (a pool of one), each chunk ends at the next
    store point (8, 16, 24), both prompts in every step, and a full pool evicts for one store
    at a time; in the last step the one slot goes to the first prompt's cut at the end minus
    one (29), and the other's cut is dropped."""
    s = make(chunked_prefill_size=64, num_checkpoint_slots=1, cache_finished=False,
             park_finished=False)
    loop = Loop(s, random_tokens())
    a, b = prompt_of(30, seed=1), prompt_of(30, seed=2)
    assert loop.add("a", a, 1) is None and loop.add("b", b, 1) is None
    loop.run()
    steps = _chunks(loop)
    assert steps == [[(r, start, 8, []) for r in "ab"] for start in (0, 8, 16)] + [
        [("a", 24, 6, [5]), ("b", 24, 6, [])]]
    assert_drained(s)


def test_a_short_next_turn_runs_past_an_interval_point_just_below_its_end():
    """Two conversations' next turns prefill together, each 7 tokens past its hit (the end
    checkpoint at 20 of its 21-token first turn) with the interval point 24 two tokens below
    its end store (26).  The first in the policy's order cuts there (free slots); the other does
    not stop for it, which would cost it a step: it finishes in the same step, storing only its
    end, and its next prompt that reaches 24 hits at 26 or at most one interval earlier."""
    s = make(chunked_prefill_size=64, num_checkpoint_slots=16, cache_finished=False,
             park_finished=False)
    loop = Loop(s, random_tokens())
    a, b = prompt_of(27, seed=1), prompt_of(27, seed=2)
    run_one(loop, "a0", a[:21], 1)
    run_one(loop, "b0", b[:21], 1)
    first = len(loop.plans)
    assert loop.add("a1", a, 1) is None and loop.add("b1", b, 1) is None
    loop.run()
    steps = [[(q.rid, q.prefix_len, len(q.token_ids), [c for c, _ in q.snapshots])
              for q in p.seqs] for p in loop.plans[first:] if p.seqs]
    assert steps == [[("a1", 20, 7, [4, 6]), ("b1", 20, 7, [6])]]
    assert s.cache.ckpt_at(a[:24]) is not None and s.cache.ckpt_at(b[:24]) is None
    assert s.cache.ckpt_at(a[:26]) is not None and s.cache.ckpt_at(b[:26]) is not None
    assert_drained(s)


def test_a_cold_prompt_still_stops_at_a_point_just_below_its_end():
    """The rule above is for short remainders only: a cold 27-token prompt that prefills beside
    another stops at 24 as at every point (a first prompt's points may be the prefix later
    requests share), and stores it."""
    s = make(chunked_prefill_size=64, cache_finished=False, park_finished=False)
    loop = Loop(s, random_tokens())
    a, b = prompt_of(27, seed=1), prompt_of(27, seed=2)
    run_one(loop, "a0", a[:21], 1)
    first = len(loop.plans)
    assert loop.add("a1", a, 1) is None and loop.add("b", b, 1) is None
    loop.run()
    b_chunks = [(q.prefix_len, len(q.token_ids)) for p in loop.plans[first:] for q in p.seqs
                if q.rid == "b"]
    assert any(start + n == 24 for start, n in b_chunks)  # a chunk of b ends at 24
    assert s.cache.ckpt_at(b[:24]) is not None
    assert_drained(s)
