"""Verifiable tasks for GRPO: seeded problem generators, each with a pure reward.

Every task is generated locally (no downloads) and reproducibly: ``problems(n, seed)``
returns the same list for the same seed in any process, and ``reward`` is a pure function
of the completion and the problem, in [0, 1], that never raises on any string.

Train / held-out split: each task names a *partition key* for every problem it draws
(the operands of an arithmetic problem, the word of a letter count, the prompt of an
answer-format or char-frequency problem). A fixed hash of the task
name and the key puts one key in ``HELD_OUT_SHARE`` on the held-out side. ``problems``
never returns a held-out problem and ``held_out`` returns nothing else, so the two are
disjoint for every pair of seeds by construction, not merely by luck; a held-out word of
letter_count is never seen in training at all.

Numeric answers are graded GSM8K-style: the LAST number in the completion is the answer
(see ``last_integer``), so a model may show its working as long as it ends on the result.
"""

from __future__ import annotations

import hashlib
import random
import re
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass

HELD_OUT_SHARE = 8  # one partition key in 8 is held out
_MAX_MISSES = 50_000  # held_out gives up after this many draws in a row add nothing


@dataclass(frozen=True)
class Problem:
    """One prompt of a task. Frozen and compared by value, so problems can be hashed,
    deduplicated and compared across calls and processes."""

    task: str  # the task's name
    prompt: str  # the user message; the driver applies the model's chat template
    answer: str  # what the reward checks against; "" for open tasks


class Task(ABC):
    """A seeded problem distribution with a reward.

    Subclasses set ``name`` and ``description`` and implement ``draw`` and ``reward``;
    ``problems`` and ``held_out`` build on ``draw`` and the partition of its keys.
    """

    name: str
    description: str  # one line, shown in --help and errors

    @abstractmethod
    def draw(self, rng: random.Random) -> tuple[str, Problem]:
        """One problem from the task's distribution, with its partition key.

        Problems with the same key always fall on the same side of the train / held-out
        split. Uses only ``rng`` for randomness, so a seeded rng gives a seeded problem.
        """

    @abstractmethod
    def reward(self, completion: str, problem: Problem) -> float:
        """Score ``completion`` against ``problem``: pure, in [0, 1], never raises on any string."""

    def is_held_out(self, key: str) -> bool:
        """Whether problems with partition ``key`` belong to the held-out side (stable across runs)."""
        digest = hashlib.sha256(f"{self.name}\0{key}".encode()).digest()
        return int.from_bytes(digest[:8], "big") % HELD_OUT_SHARE == 0

    def problems(self, n: int, seed: int) -> list[Problem]:
        """``n`` training problems, the same for the same seed; other seeds give other lists.

        Drawn independently, so a list may repeat a problem (likely only when ``n`` is a
        sizeable share of the task's problem space). Never returns a held-out problem.
        """
        _check_n(n)
        rng = random.Random(f"radixray.rl/{self.name}/train/{seed}")
        out: list[Problem] = []
        while len(out) < n:
            key, problem = self.draw(rng)
            if not self.is_held_out(key):
                out.append(problem)
        return out

    def __repr__(self) -> str:
        return f"<Task {self.name}>"


def held_out(task: Task, n: int, seed: int) -> list[Problem]:
    """``n`` distinct problems that no training seed of ``task`` ever produces.

    They come from the held-out side of the task's key partition (see the module
    docstring), so disjointness from ``task.problems(m, s)`` holds for every ``m`` and
    ``s``; a separate seed stream makes the list deterministic in ``seed``. Raises
    ValueError if the held-out side cannot supply ``n`` distinct problems.
    """
    _check_n(n)
    rng = random.Random(f"radixray.rl/{task.name}/held_out/{seed}")
    out: dict[Problem, None] = {}  # insertion-ordered set
    misses = 0  # draws in a row that found nothing new: the held-out side is used up
    while len(out) < n and misses < _MAX_MISSES:
        key, problem = task.draw(rng)
        if task.is_held_out(key) and problem not in out:
            out[problem] = None
            misses = 0
        else:
            misses += 1
    if len(out) < n:
        raise ValueError(f"task {task.name!r} has only about {len(out)} distinct held-out "
                         f"problems; asked for {n}")
    return list(out)


def _check_n(n: int) -> None:
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")


# ---------------------------------------------------------------------------------------
# Answer extraction
# ---------------------------------------------------------------------------------------

# A number: optional sign (ASCII or Unicode minus), ASCII digits, optional thousands
# groups "1,234" and an optional decimal part. It may not start right after a digit or a
# "." so the "-" in "8-3" is an operator, not a sign, and "3.5" is one number.
_NUMBER = re.compile(r"(?<![0-9.])[-\u2212]?[0-9]+(?:,[0-9]{3}(?![0-9]))*(?:\.[0-9]+)?")
_MAX_DIGITS = 32  # far beyond any answer here; int() of a huge digit string raises


def last_integer(text: str) -> int | None:
    """The value of the last number in ``text`` if it is an integer, else None.

    The last match of ``_NUMBER`` is taken (a sentence's trailing period is not part of
    it). Digits are ASCII only ("４２" is no number); a "-" right after a digit is an
    operator ("8-3" ends on 3), elsewhere a sign ("x = -8" ends on -8); thousands commas
    are dropped, "8.0" counts as 8, "8.5" as no integer. None when there is no number or
    the last one has more than 32 digits.
    """
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None
    whole, _, frac = numbers[-1].replace(",", "").replace("\u2212", "-").partition(".")
    if frac.strip("0") or len(whole.lstrip("-")) > _MAX_DIGITS:
        return None
    return int(whole)


def _integer_reward(completion: str, answer: str) -> float:
    return 1.0 if last_integer(completion) == int(answer) else 0.0


# ---------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------


class Arithmetic(Task):
    """Two-operand integer arithmetic: "What is 17 + 25? Reply with the number only."

    Operations: addition of two numbers in 1..99 (40%), subtraction of two numbers in 1..99
    with the larger first so the answer is >= 0 (40%), multiplication of two digits in 2..9
    (20%). The partition key ignores operand order for + and *, so "25 + 17" is never in
    training when "17 + 25" is held out.
    """

    name = "arithmetic"
    description = "add, subtract or multiply small integers; reward 1 if the last number is right"

    def draw(self, rng: random.Random) -> tuple[str, Problem]:
        op = rng.choices("+-*", weights=(2, 2, 1))[0]
        if op == "*":
            a, b = rng.randint(2, 9), rng.randint(2, 9)
        else:
            a, b = rng.randint(1, 99), rng.randint(1, 99)
        if op == "-":
            a, b = max(a, b), min(a, b)
        result = {"+": a + b, "-": a - b, "*": a * b}[op]
        key = f"{a}{op}{b}" if op == "-" else f"{min(a, b)}{op}{max(a, b)}"
        prompt = f"What is {a} {op} {b}? Reply with the number only."
        return key, Problem(self.name, prompt, str(result))

    def reward(self, completion: str, problem: Problem) -> float:
        """1.0 if the last number in the completion is the integer ``problem.answer``, else 0.0.

        The rule is ``last_integer``: "42", " 42.", "17 + 25 = 42", "The answer is 42.0"
        score 1; "42 (17 + 25)" scores 0 (its last number is 25), as do "forty-two", "",
        and a last number with a fractional part.
        """
        return _integer_reward(completion, problem.answer)


# Common English words, lowercase letters only; doubled letters are over-represented on
# purpose, since counting repeats is what small models get wrong.
WORDS: tuple[str, ...] = tuple(dict.fromkeys("""
    strawberry raspberry blueberry banana apple cherry orange lemon grape melon peach pear
    mango papaya coconut tomato potato carrot pepper onion garlic cabbage lettuce broccoli
    bread butter cheese coffee tea water juice sugar salt pizza pasta noodle cookie muffin
    mississippi bookkeeper committee balloon letter address success necessary occasion
    parallel assessment possession tomorrow embarrass accommodate millennium tennessee
    bottle kitten puppy rabbit giraffe elephant hippopotamus alligator crocodile kangaroo
    penguin dolphin whale shark octopus squirrel mosquito butterfly caterpillar beetle
    turtle parrot sparrow eagle falcon owl pigeon chicken goose sheep goat horse donkey
    zebra tiger lion leopard cheetah monkey gorilla panda koala raccoon hamster mouse
    house window door floor ceiling kitchen bedroom bathroom garden garage street bridge
    village city country mountain valley river ocean island desert forest jungle meadow
    umbrella pillow blanket mirror ladder hammer scissors needle pencil paper notebook
    library school teacher student doctor nurse engineer lawyer farmer baker butcher
    summer winter spring autumn morning evening afternoon midnight yesterday weekend
    happiness sadness excellent beautiful wonderful terrible horrible possible difficult
    different important interesting comfortable vegetable chocolate vanilla cinnamon
    computer keyboard internet program function variable language grammar sentence
    question answer problem solution example exercise balance pattern picture painting
    guitar piano violin trumpet drummer orchestra concert theatre cinema festival
    football baseball basketball volleyball swimming running skipping jogging dribble
    bubble puzzle giggle wiggle apple tunnel funnel barrel kennel flannel channel
    yellow purple silver golden scarlet emerald crimson magenta turquoise lavender
    planet galaxy universe comet rocket satellite astronaut telescope gravity eclipse
    freedom kingdom wisdom random seldom bottom button cotton mitten written rotten
    assistant occurrence referral recommend millionaire questionnaire programming
    cooperation opportunity responsibility communication organization information
    government environment development management equipment experiment instrument
    banner dinner winner runner summit hobbit rabbit carrot arrow barrow narrow sorrow
    coffee toffee goggles giggles marshmallow pineapple watermelon grapefruit tangerine
    engineer pioneer volunteer career deer cheer steer queen green screen between
    moon spoon noon balloon raccoon cartoon afternoon typhoon bamboo shampoo kangaroo
    success access excess process address express possess assess dress stress
    character chemistry christmas rhythm syllable symphony mystery physics psychology
    banana cabana bandana savanna alabama canada panama sahara nevada jamaica
    reference different coffee efficient sufficient difficult traffic offer effort
    happy sunny funny bunny penny jelly belly silly billy hobby lobby daddy mummy
    zigzag jazz pizzazz buzz fizz fuzzy dizzy puzzle blizzard quizzical
    """.split()))


class LetterCount(Task):
    """Count a letter in a word: "How many times does the letter 'r' appear in the word
    'strawberry'? Reply with the number only."

    The word comes from ``WORDS``; three problems in four ask about a letter in the word,
    one in four about a letter not in it (answer 0). The partition key is the word, so no
    held-out word is ever seen in training.
    """

    name = "letter_count"
    description = "count a letter in a word; reward 1 if the last number is the count"

    def draw(self, rng: random.Random) -> tuple[str, Problem]:
        word = rng.choice(WORDS)
        present = sorted(set(word))
        absent = sorted(set("abcdefghijklmnopqrstuvwxyz") - set(word))
        letter = rng.choice(present if rng.random() < 0.75 else absent)
        prompt = (f"How many times does the letter '{letter}' appear in the word '{word}'? "
                  "Reply with the number only.")
        return word, Problem(self.name, prompt, str(word.count(letter)))

    def reward(self, completion: str, problem: Problem) -> float:
        """1.0 if the last number in the completion is the count ``problem.answer``, else 0.0.

        Same rule as ``Arithmetic.reward`` (``last_integer``): "3", "3.", "There are 3 r's"
        score 1 when the count is 3; "three", "" and "3 (of 10 letters)" score 0.
        """
        return _integer_reward(completion, problem.answer)


QUESTIONS: tuple[str, ...] = (
    "Name a color.", "Name an animal.", "Name a fruit.", "Name a vegetable.",
    "Name a country in Europe.", "Name a planet in the solar system.",
    "Name a musical instrument.", "Name a sport.", "Name a metal.",
    "Name a month of the year.", "Name a day of the week.", "Name a season.", "Name a bird.",
    "Name a flower.", "Name a tree.", "Name a kind of weather.", "Name a piece of furniture.",
    "Name a kitchen utensil.", "Name a vehicle.", "Name an emotion.",
    "Name a chemical element.", "Name a geometric shape.", "Name a profession.",
    "Name a drink.", "Name a spice.", "Name a dog breed.", "Name a gemstone.",
    "Name a fabric.", "Name a dance.", "Name an insect.", "Name a fish.", "Name a reptile.",
    "Name a continent.", "Name a capital city.", "Name a language spoken in Europe.",
    "Name a board game.", "Name a tool you might find in a garage.", "Name a body part.",
    "Name a kind of cheese.", "Name a type of bread.", "Name a dessert.",
    "Name a breakfast food.", "Name an ocean.", "Name a river.", "Name a mountain range.",
    "Name a famous scientist.", "Name a famous painter.", "Name a composer.",
    "Name a mythical creature.", "Name a farm animal.", "Name a pet.", "Name a nut.",
    "Name a herb.", "Name a berry.", "Name a citrus fruit.", "Name a tree that sheds its leaves.",
    "Name a school subject.", "Name a unit of length.",
    "Name a unit of time.", "Name a currency.", "Name a mammal that lives in the sea.",
    "Name a desert animal.", "Name an item of clothing.", "Name a kind of shoe.",
    "Name something you find at the beach.", "Name a room in a house.",
    "Name a kitchen appliance.", "Name a holiday.", "Name a primary color.",
    "Name a word that rhymes with 'cat'.", "Name a word that means 'happy'.",
    "Name the opposite of 'cold'.", "Which is larger, a mouse or an elephant?",
    "Which season comes after winter?", "What do bees make?",
    "What is frozen water called?", "What color is the sky on a clear day?",
    "What animal says 'moo'?", "Which planet is known as the red planet?",
    "What is the largest ocean on Earth?", "Which do you prefer, tea or coffee?",
    "What is your favourite number word, like 'seven'?", "Name a vegetable that is green.",
    "Name something that is cold.", "Name something that is soft.", "Name a yellow fruit.",
    "Name a sea creature.", "Name a wild cat.", "Name a kind of boat.", "Name a game.",
    "Name a hobby.", "Name a kind of music.", "Name something you can read.",
    "Name a planet with rings.", "Name an animal with stripes.", "Name a kind of pasta.",
    "Name a kind of soup.", "Name a snack.", "Name a cereal grain.", "Name a weekday.",
    "Name a winter sport.", "Name something that flies.", "Name a word for a young dog.",
    "What do cows drink?", "What do you use to write on paper?",
    "What is the opposite of 'up'?",
)
_FORMATS = (
    "{q} End your reply with a line 'Answer: <one word>'.",
    "{q} Explain your choice in one sentence, then end your reply with a line "
    "'Answer: <one word>'.",
    "{q} Give a short reason first. The last line of your reply must be "
    "'Answer: <one word>'.",
    "{q} Think about it briefly, and finish with a line of the form 'Answer: <one word>'.",
    "{q} Reply in any way you like, but the final line must read 'Answer: <one word>'.",
    "{q} After your answer, add a last line 'Answer: <one word>' with your choice.",
)
# The keyword (any case), a colon, one word of letters (hyphens and apostrophes inside it
# allowed), an optional period; spaces around any part.
_ANSWER_LINE = re.compile(r"answer\s*:\s*[^\W\d_]+(?:[-'\u2019][^\W\d_]+)*\s*\.?",
                          re.IGNORECASE)


class AnswerFormat(Task):
    """Format following: an open question whose reply must end with "Answer: <one word>".

    The content is not graded (``answer`` is ""); only the format is. The partition key is
    the prompt (question and instruction wording), so a held-out prompt is never seen in
    training, though its question may be, worded differently.
    """

    name = "answer_format"
    description = "answer an open question and end with a line 'Answer: <one word>'"

    def draw(self, rng: random.Random) -> tuple[str, Problem]:
        prompt = rng.choice(_FORMATS).format(q=rng.choice(QUESTIONS))
        return prompt, Problem(self.name, prompt, "")

    def reward(self, completion: str, problem: Problem) -> float:
        """1.0 if the completion's last non-empty line is ``Answer: <one word>``, else 0.0.

        The line, stripped, must fully match: "answer" in any case, optional spaces, ":",
        optional spaces, one word of letters (any script; inner "-" or "'" allowed, so
        "sea-lion" is one word), optional spaces and one optional ".". Scores 0: a
        second word ("Answer: ice cream"), digits ("Answer: 7"), markdown or quotes around
        the line or word ("**Answer:** Blue", "'Answer: Blue'"), text after the line.
        """
        for line in reversed(completion.splitlines()):
            if line.strip():
                return 1.0 if _ANSWER_LINE.fullmatch(line.strip()) else 0.0
        return 0.0


class CharFrequency(Task):
    """A dense toy task: "Topic: garden and moon. Write anything, using the letter 'a' as
    often as you can."

    Meant for smoke and learning tests on tiny random-weight models: any text earns a
    partial reward, and a byte-level BPE vocabulary has many tokens with the letter, so
    the signal is there from the first step. The target letter is fixed per task
    instance (``letter``, "a" for the registered task) and stored in ``answer``; it does
    not change with the seed, because a driver that draws a new seed per step would
    otherwise chase a moving target. The topic (two words from ``WORDS``, the partition
    key) only varies the prompt.
    """

    name = "char_frequency"
    description = "write text using one letter as often as possible; reward is its share of characters"

    def __init__(self, letter: str = "a"):
        if len(letter) != 1 or letter not in string.ascii_letters:
            raise ValueError(f"letter must be one ASCII letter, got {letter!r}")
        self.letter = letter.lower()

    def draw(self, rng: random.Random) -> tuple[str, Problem]:
        topic = f"{rng.choice(WORDS)} and {rng.choice(WORDS)}"
        prompt = (f"Topic: {topic}. Write anything, using the letter '{self.letter}' "
                  "as often as you can.")
        return topic, Problem(self.name, prompt, self.letter)

    def reward(self, completion: str, problem: Problem) -> float:
        """The share of the completion's characters that are the letter ``problem.answer``.

        Either case counts ("a" and "A"); every character counts in the denominator,
        whitespace included, as ``len(completion)`` (code points). "aaaa" scores 1.0,
        "a b" 1/3, "" 0.0.
        """
        if not completion:
            return 0.0
        target = problem.answer
        hits = completion.count(target.lower()) + completion.count(target.upper())
        return min(1.0, hits / len(completion))


TASKS: dict[str, Task] = {
    task.name: task for task in (Arithmetic(), LetterCount(), AnswerFormat(), CharFrequency())
}
