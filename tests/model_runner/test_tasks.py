"""The synthetic task suite: determinism, prompt lengths, answers that the context really
supports (re-derived here by parsing each context), and scorers that reward exactly the gold."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from model_runner.quality.tasks import LENGTHS, MIN_LENGTH, TASKS, make_instances, score_instance
from model_runner.quality.tasks.base import score_exact, score_recall

ALL_LENGTHS = (MIN_LENGTH, 256, *LENGTHS)
NUM = 6
SLACK = 80  # a context is filled to within one filler sentence of its budget
NEEDLE = re.compile(r"(?:^| )([0-9a-z-]+): ([0-9a-f-]+)\.")


def needles(context: str) -> list[tuple[str, str]]:
    return NEEDLE.findall(context)


def test_registry_names_match_the_paper_columns():
    expected = "s1 s2 s3 mk1 mk2 mk3 mq mv cwe fwe qa_h qa_s vt".split()
    assert list(TASKS) == expected
    assert {spec.family for spec in TASKS.values()} == {
        "retrieval", "multi_key", "multi", "aggregation", "qa", "tracking"}


@pytest.mark.parametrize("task", list(TASKS))
def test_deterministic_and_prefix_stable(task):
    a = make_instances(task, 512, 4, seed=3)
    assert a == make_instances(task, 512, 4, seed=3)
    assert make_instances(task, 512, 2, seed=3) == a[:2]
    assert make_instances(task, 512, 4, seed=4) != a
    assert len({x.context for x in a}) == 4  # instances differ from one another


@pytest.mark.parametrize("length", ALL_LENGTHS)
@pytest.mark.parametrize("task", list(TASKS))
def test_prompt_fits_length_and_layout(task, length):
    for inst in make_instances(task, length, NUM, seed=0):
        assert length - SLACK <= len(inst.prompt) <= length
        assert inst.prompt.isascii()  # one character == one byte token
        assert inst.question.startswith("\n") and "\n" not in inst.question[1:]
        assert "\n" not in inst.context
        assert inst.completion == " " + " ".join(inst.answers) + "\n"
        assert all(a and a in inst.context for a in inst.answers)
        assert score_instance(inst, inst.completion) == 1.0


def test_rejects_unknown_task_and_short_length():
    with pytest.raises(KeyError):
        make_instances("niah", 512, 1, 0)
    with pytest.raises(ValueError):
        make_instances("s1", MIN_LENGTH - 1, 1, 0)


@pytest.mark.parametrize("task", ["s1", "s2", "s3", "mk1", "mk2", "mk3"])
def test_single_key_answer_is_the_needle_value(task):
    for length in (256, 2048):
        for inst in make_instances(task, length, NUM, seed=1):
            key = re.fullmatch(r"\nvalue of (\S+):", inst.question).group(1)
            found = [v for k, v in needles(inst.context) if k == key]
            assert found == list(inst.answers)
            count = len(needles(inst.context))
            if task.startswith("s"):
                assert count == 1
            elif task == "mk1":
                assert count == 4
            else:  # the whole haystack is needles with distinct keys
                assert count >= (length - SLACK) // 24
                assert len({k for k, _ in needles(inst.context)}) == count


def test_needle_depth_varies():
    depths = []
    for inst in make_instances("s2", 1024, 30, seed=0):
        depths.append(inst.context.index(inst.answers[0]) / len(inst.context))
    assert min(depths) < 0.25 and max(depths) > 0.75


def test_value_formats():
    s1 = make_instances("s1", 512, NUM, 0)
    s3 = make_instances("s3", 512, NUM, 0)
    assert all(re.fullmatch(r"[1-9]\d{4}", x.answers[0]) for x in s1)
    assert all(re.fullmatch(r"[0-9a-f]{4}-[0-9a-f]{4}", x.answers[0]) for x in s3)
    noise = {"The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
             "There and back again."}
    for inst in s1:  # S1's haystack is the noise cycle and nothing else
        needle = f"{needles(inst.context)[0][0]}: {inst.answers[0]}."
        filler = inst.context.replace(needle, "").replace(". ", ".\n").split("\n")
        assert {s.strip() for s in filler if s.strip()} <= noise


def test_mq_answers_follow_query_order():
    for inst in make_instances("mq", 1024, NUM, seed=2):
        table = dict(needles(inst.context))
        keys = inst.question.removeprefix("\nvalues of ").removesuffix(":").split()
        assert len(keys) == 2 and len(table) == 4
        assert tuple(table[k] for k in keys) == inst.answers


def test_mv_answers_are_all_values_of_the_key_in_order():
    for inst in make_instances("mv", 1024, NUM, seed=2):
        key = inst.question.removeprefix("\nall values of ").removesuffix(":")
        assert tuple(v for k, v in needles(inst.context) if k == key) == inst.answers
        assert len(set(inst.answers)) == 4


def resolve(assign: dict[str, str], name: str) -> str:
    while name in assign:
        name = assign[name]
    return name


def test_vt_answers_are_every_variable_resolving_to_the_value():
    for length in (256, 1024):
        for inst in make_instances("vt", length, NUM, seed=5):
            value = re.fullmatch(r"\nvars equal to (\d+):", inst.question).group(1)
            assign = dict(re.findall(r"VAR (\w+) = (\w+)\.", inst.context))
            assert {n for n in assign if resolve(assign, n) == value} == set(inst.answers)
            assert len(assign) == 6  # the chain and one distractor chain of three


def test_cwe_answers_are_the_strictly_most_common_words():
    for length in ALL_LENGTHS:
        for inst in make_instances("cwe", length, NUM, seed=0):
            counts = Counter(inst.context.split())
            top = min(counts[a] for a in inst.answers)
            rest = max(c for w, c in counts.items() if w not in inst.answers)
            assert top >= 4 and rest <= 2 < top
            first_seen = sorted(inst.answers, key=inst.context.split().index)
            assert list(inst.answers) == first_seen


def test_fwe_answers_are_the_three_most_frequent_in_order():
    for length in ALL_LENGTHS:
        for inst in make_instances("fwe", length, NUM, seed=0):
            ranked = Counter(inst.context.split()).most_common()
            assert tuple(w for w, _ in ranked[:3]) == inst.answers
            assert ranked[0][1] > ranked[1][1] > ranked[2][1] > ranked[3][1]


@pytest.mark.parametrize("task", ["qa_s", "qa_h"])
def test_qa_answer_follows_from_the_facts(task):
    for inst in make_instances(task, 1024, NUM, seed=4):
        lives = dict(re.findall(r"([A-Z][a-z]+) lives in ([A-Z][a-z]+)\.", inst.context))
        located = dict(re.findall(r"([A-Z][a-z]+) is in ([A-Z][a-z]+)\.", inst.context))
        person = re.search(r"does ([A-Z][a-z]+) live", inst.question).group(1)
        answer = lives[person] if task == "qa_s" else located[lives[person]]
        assert (answer,) == inst.answers
        assert len(lives) >= 4  # distractor people


def test_exact_scorer():
    gold = ("48213",)
    assert score_exact(" 48213\n", gold) == 1.0
    assert score_exact("48213.", gold) == 1.0
    assert score_exact(" 48213 and more", gold) == 1.0
    assert score_exact(" 48212\n", gold) == 0.0
    assert score_exact(" 482130", gold) == 0.0  # containment is not a match
    assert score_exact(" 11111 48213", gold) == 0.0  # only the first item counts
    assert score_exact("\n48213", gold) == 0.0  # nothing before the newline
    assert score_exact("", gold) == 0.0
    assert score_exact(" Sacomo", ("sacomo",)) == 1.0


def test_recall_scorer():
    gold = ("abc", "def", "ghi")
    assert score_recall(" abc def ghi\n", gold) == 1.0
    assert score_recall(" ghi, abc, def", gold) == 1.0  # order and commas do not matter
    assert score_recall(" abc def xyz", gold) == pytest.approx(2 / 3)
    assert score_recall(" abc xyz xyz def", gold) == pytest.approx(1 / 3)  # extras not counted
    assert score_recall(" abc abc abc", gold) == pytest.approx(1 / 3)
    assert score_recall(" abc\ndef ghi", gold) == pytest.approx(1 / 3)


@pytest.mark.parametrize("task", list(TASKS))
def test_perturbed_answers_score_below_one(task):
    for inst in make_instances(task, 512, NUM, seed=7):
        first = inst.answers[0]
        flipped = first[:-1] + ("x" if first[-1] != "x" else "y")
        wrong = " " + " ".join((flipped, *inst.answers[1:])) + "\n"
        assert score_instance(inst, wrong) < 1.0
        assert score_instance(inst, " nothing\n") == 0.0
