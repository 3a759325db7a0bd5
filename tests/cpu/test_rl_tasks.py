"""Verifiable RL tasks: seeded problems, answers checked independently, rewards graded as
documented, and held-out problems disjoint from every training seed."""

import operator
import os
import random
import re
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixray.rl.registry import get_task
from radixray.rl.tasks import (
    HELD_OUT_SHARE,
    QUESTIONS,
    TASKS,
    WORDS,
    Problem,
    held_out,
    last_integer,
)

NAMES = ["arithmetic", "letter_count", "answer_format", "char_frequency"]
ARITH = re.compile(r"What is (\d+) ([-+*]) (\d+)\? Reply with the number only\.")
COUNT = re.compile(r"How many times does the letter '([a-z])' appear in the word '([a-z]+)'\? "
                   r"Reply with the number only\.")


def test_registry_holds_the_four_tasks():
    assert list(TASKS) == NAMES
    for name, task in TASKS.items():
        assert task.name == name and get_task(name) is task
        assert task.description and "\n" not in task.description


def test_unknown_task_names_the_known_ones():
    with pytest.raises(ValueError) as err:
        get_task("nope")
    assert "'nope'" in str(err.value)
    assert all(name in str(err.value) for name in NAMES)


# --- problems ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_problems_are_deterministic_and_differ_across_seeds(name):
    task = get_task(name)
    lists = [task.problems(20, seed) for seed in range(30)]
    assert lists == [task.problems(20, seed) for seed in range(30)]
    assert len({tuple(ps) for ps in lists}) == len(lists)
    assert all(len(ps) == 20 and all(p.task == name for p in ps) for ps in lists)
    assert task.problems(0, 1) == []
    with pytest.raises(ValueError):
        task.problems(-1, 0)


def test_problems_are_the_same_in_another_process():
    """No dependence on the process's hash seed (str hashing, set order)."""
    code = ("from radixray.rl.tasks import TASKS, held_out\n"
            "print(repr([(t.problems(30, 7), held_out(t, 10, 7)) for t in TASKS.values()]))")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}, check=True).stdout
            for seed in ("1", "2")]
    here = repr([(t.problems(30, 7), held_out(t, 10, 7)) for t in TASKS.values()])
    assert runs[0] == runs[1] == here + "\n"


def test_arithmetic_answers_are_correct():
    ops = {"+": operator.add, "-": operator.sub, "*": operator.mul}
    seen = set()
    for p in get_task("arithmetic").problems(2000, 3):
        a, op, b = ARITH.fullmatch(p.prompt).groups()
        a, b = int(a), int(b)
        assert p.answer == str(ops[op](a, b))
        assert int(p.answer) >= 0
        assert (2 <= a <= 9 and 2 <= b <= 9) if op == "*" else (1 <= a <= 99 and 1 <= b <= 99)
        seen.add(op)
    assert seen == set(ops)


def test_letter_count_answers_are_correct():
    counts = set()
    for p in get_task("letter_count").problems(2000, 3):
        letter, word = COUNT.fullmatch(p.prompt).groups()
        assert word in WORDS
        assert p.answer == str(word.count(letter))
        counts.add(int(p.answer))
    assert 0 in counts and 1 in counts and max(counts) >= 3  # absent, single and repeated


def test_word_list_is_clean():
    assert len(WORDS) >= 300 and len(set(WORDS)) == len(WORDS)
    assert all(w.isascii() and w.isalpha() and w.islower() for w in WORDS)


def test_answer_format_and_char_frequency_prompts():
    for p in get_task("answer_format").problems(200, 0):
        assert p.answer == "" and "'Answer: <one word>'" in p.prompt
        assert any(p.prompt.startswith(q) for q in QUESTIONS)
    for p in get_task("char_frequency").problems(200, 0):
        assert p.answer == "a"
        assert p.prompt.endswith("Write anything, using the letter 'a' as often as you can.")


# --- rewards ----------------------------------------------------------------------------

LONG = "hello world " * 100_000  # 1.2 million characters, no digit, no "a"

ADD = Problem("arithmetic", "What is 17 + 25? Reply with the number only.", "42")


@pytest.mark.parametrize("completion, expected", [
    ("42", 1.0), ("  42\n", 1.0), ("42.", 1.0), ("The answer is 42.", 1.0),
    ("17 + 25 = 42", 1.0), ("**42**", 1.0), ("42.0", 1.0), ("$42!", 1.0),
    ("40? No, 41... no: 42", 1.0), ("🤔 ¿42?", 1.0), (LONG + "42", 1.0), ("42 " + LONG, 1.0),
    ("41", 0.0), ("42 (17 + 25)", 0.0), ("forty-two", 0.0), ("", 0.0), ("-42", 0.0),
    ("42.5", 0.0), ("420", 0.0), ("４２", 0.0), ("9" * 100_000, 0.0), (LONG, 0.0),
])
def test_arithmetic_reward(completion, expected):
    assert get_task("arithmetic").reward(completion, ADD) == expected


def test_subtraction_signs():
    sub = Problem("arithmetic", "What is 8 - 3? Reply with the number only.", "5")
    reward = get_task("arithmetic").reward
    assert reward("8-3=5", sub) == 1.0
    assert reward("8 - 3", sub) == 0.0  # the last number is 3, not -3 nor 5
    assert reward("-5", sub) == 0.0


@pytest.mark.parametrize("text, value", [
    ("8-3", 3), ("x = -8", -8), ("x = \u22128", -8), ("1,234 apples", 1234), ("1, 2, 3", 3),
    ("1,2345", 2345), ("8.0", 8), ("8.5", None), ("v1.2.3", None), ("none", None), ("", None),
    ("9" * 40, None), ("-0", 0), ("007", 7),
])
def test_last_integer(text, value):
    assert last_integer(text) == value


STRAWBERRY = Problem("letter_count", "How many times does the letter 'r' appear in the word "
                     "'strawberry'? Reply with the number only.", "3")


@pytest.mark.parametrize("completion, expected", [
    ("3", 1.0), ("3.", 1.0), ("There are 3 r's in 'strawberry'.", 1.0),
    ("The word has 10 letters, and 3 of them are r.", 1.0), ("Answer: 3\n", 1.0),
    ("2", 0.0), ("three", 0.0), ("3 r's out of 10 letters", 0.0), ("", 0.0), (LONG, 0.0),
])
def test_letter_count_reward(completion, expected):
    assert get_task("letter_count").reward(completion, STRAWBERRY) == expected


COLOR = Problem("answer_format", "Name a color. End your reply with a line 'Answer: <one word>'.", "")


@pytest.mark.parametrize("completion, expected", [
    ("Answer: Blue", 1.0), ("Blue is calm.\nAnswer: Blue", 1.0), ("Answer: blue.", 1.0),
    ("answer:blue", 1.0), ("ANSWER : Blue \n\n   \n", 1.0), ("Answer: sea-lion", 1.0),
    ("Answer: Zürich", 1.0), ("Answer: O'Neill", 1.0), (LONG + "\nAnswer: Blue", 1.0),
    ("Answer: ice cream", 0.0), ("Answer: 7", 0.0), ("**Answer:** Blue", 0.0),
    ("'Answer: Blue'", 0.0), ("Answer: Blue\nThanks!", 0.0), ("Answer:", 0.0),
    ("Answer: Blue!", 0.0), ("Answer: Blue..", 0.0), ("Blue", 0.0), ("", 0.0), ("\n\n", 0.0),
    ("The answer: Blue", 0.0), (LONG, 0.0),
])
def test_answer_format_reward(completion, expected):
    assert get_task("answer_format").reward(completion, COLOR) == expected


LETTER_A = Problem("char_frequency", "Write anything, using the letter 'a' as often as you can.",
                   "a")


@pytest.mark.parametrize("completion, expected", [
    ("aaaa", 1.0), ("AaAa", 1.0), ("a b", 1 / 3), ("banana", 0.5), ("", 0.0), ("bbb", 0.0),
    ("日本a", 1 / 3), ("á", 0.0), ("a" * 10**6, 1.0), (LONG, 0.0),
])
def test_char_frequency_reward(completion, expected):
    assert get_task("char_frequency").reward(completion, LETTER_A) == pytest.approx(expected)


def test_char_frequency_uses_the_problems_letter():
    e = Problem("char_frequency", "", "e")
    assert get_task("char_frequency").reward("eEea", e) == 0.75


# Text that hits the parsers' edges more often than uniform unicode would.
MESSY = st.lists(st.one_of(st.characters(), st.sampled_from(
    list("0123456789-.,:\n aA\u2212") + ["Answer:", "answer :", "42", "3", "\r\n", "**"])),
    max_size=100).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(NAMES), seed=st.integers(0, 10**6), completion=MESSY)
def test_reward_never_raises_and_stays_in_unit_interval(name, seed, completion):
    task = get_task(name)
    problem = task.problems(1, seed)[0]
    r = task.reward(completion, problem)
    assert isinstance(r, float) and 0.0 <= r <= 1.0
    assert task.reward(completion, problem) == r  # pure


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(["arithmetic", "letter_count"]), seed=st.integers(0, 10**6),
       prefix=MESSY, suffix=st.text(st.characters(blacklist_characters="0123456789"), max_size=50))
def test_numeric_reward_reads_the_last_number(name, seed, prefix, suffix):
    task = get_task(name)
    problem = task.problems(1, seed)[0]
    assert task.reward(f"{prefix} {problem.answer}{suffix}", problem) == 1.0
    wrong = str(int(problem.answer) + 1)
    assert task.reward(f"{problem.answer} {wrong}{suffix}", problem) == 0.0


@settings(max_examples=200, deadline=None)
@given(completion=MESSY)
def test_char_frequency_reward_is_the_share_of_the_letter(completion):
    expected = sum(c in "aA" for c in completion) / len(completion) if completion else 0.0
    assert get_task("char_frequency").reward(completion, LETTER_A) == pytest.approx(expected)


# --- held out ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_held_out_is_disjoint_from_training(name):
    task = get_task(name)
    train = {p for seed in range(50) for p in task.problems(200, seed)}
    held = [held_out(task, 64, seed) for seed in range(10)]
    for ps in held:
        assert len(set(ps)) == len(ps) == 64
        assert not train & set(ps)
    assert held[0] == held_out(task, 64, 0)
    assert held[0] != held[1]
    # The split is a sizeable minority of the training distribution, not a sliver.
    rng = random.Random(0)
    flagged = sum(task.is_held_out(task.draw(rng)[0]) for _ in range(2000))
    assert 0.5 / HELD_OUT_SHARE < flagged / 2000 < 2 / HELD_OUT_SHARE


def test_held_out_words_never_appear_in_training():
    task = get_task("letter_count")
    train_words = {COUNT.fullmatch(p.prompt)[2] for s in range(50) for p in task.problems(200, s)}
    held_words = {COUNT.fullmatch(p.prompt)[2] for p in held_out(task, 200, 0)}
    assert held_words and not held_words & train_words


@settings(max_examples=50, deadline=None)
@given(name=st.sampled_from(NAMES), train_seed=st.integers(-(2**63), 2**63),
       held_seed=st.integers(-(2**63), 2**63))
def test_held_out_is_disjoint_for_any_seeds(name, train_seed, held_seed):
    task = get_task(name)
    assert not set(task.problems(100, train_seed)) & set(held_out(task, 10, held_seed))


def test_held_out_too_many_raises():
    with pytest.raises(ValueError, match="answer_format.*held-out"):
        held_out(get_task("answer_format"), 10_000, 0)
    assert held_out(get_task("arithmetic"), 0, 0) == []
