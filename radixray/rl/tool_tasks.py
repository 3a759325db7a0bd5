"""Tasks solved over several turns with a tool: the environment interface and a calculator.

A :class:`ToolTask` is a :class:`~radixray.rl.tasks.Task` (seeded problems, a held-out
split, a pure reward) whose episodes run as a conversation. For each sample the rollout
asks ``task.environment(problem)`` for an :class:`Environment`, and then:

1. ``reset()`` gives the opening chat messages (system prompt, examples, the question);
2. the model writes one turn, which ends at one of ``environment.stop`` (a tool call),
   at the end of its message, or at the token budget;
3. ``step(turn_text)`` runs the tool the turn called and returns the messages to append
   (the tool's result) with ``done=False``, or ``done=True`` when the turn was an answer;
4. after ``max_turns`` model turns the episode ends whatever the last one was.

The reward is the task's ``reward(completion, problem)``, where ``completion`` is the
model's turns joined by newlines (tool output excluded), so the same function scores
a sampled episode and the greedy held-out one.

:class:`Calculator` is the shipped tool task: multiply two two-digit numbers, which
SmolLM2-135M cannot do in its head but can with ``<calc>a * b</calc>``.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from abc import abstractmethod
from dataclasses import dataclass, field

from radixray.rl.tasks import Problem, Task, last_integer


@dataclass
class Step:
    """What the environment answers one model turn with."""

    messages: list[dict] = field(default_factory=list)  # appended to the conversation
    done: bool = False  # the turn was an answer: the episode ends


class Environment:
    """One episode of a :class:`ToolTask` (see the module docstring). Subclasses implement
    :meth:`reset` and :meth:`step`; ``stop`` and ``max_turns`` come from the task."""

    def __init__(self, stop: tuple[str, ...], max_turns: int):
        self.stop = stop
        self.max_turns = max_turns

    @abstractmethod
    def reset(self) -> list[dict]:
        """The opening chat messages, ending with the user's question."""

    @abstractmethod
    def step(self, turn_text: str) -> Step:
        """Act on the model's latest turn (its text as generated, stop string included)."""


class ToolTask(Task):
    """A task whose samples are multi-turn episodes (see the module docstring)."""

    max_turns: int = 4
    stop: tuple[str, ...] = ()

    @abstractmethod
    def environment(self, problem: Problem) -> Environment:
        """A fresh episode of ``problem``."""


# ---------------------------------------------------------------------------------------
# The calculator tool
# ---------------------------------------------------------------------------------------

_CALL = re.compile(r"<calc>([^<>]{1,200})</calc>")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_MAX_VALUE = 10 ** 15


def calculate(expression: str) -> str:
    """The value of an arithmetic ``expression`` (numbers, + - * / // %, parentheses) as
    text, or ``"error: ..."``; never raises and never evaluates anything else."""
    def value(node):
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            result = _OPERATORS[type(node.op)](value(node.left), value(node.right))
            if abs(result) > _MAX_VALUE:
                raise ValueError("result too large")
            return result
        raise ValueError("only numbers, + - * / // % and parentheses are allowed")

    try:
        result = value(ast.parse(expression.strip(), mode="eval"))
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError, RecursionError) as exc:
        return f"error: {exc.msg if isinstance(exc, SyntaxError) else exc}"
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(round(result, 6) if isinstance(result, float) else result)


class CalculatorEpisode(Environment):
    """A calculator conversation: a ``<calc>...</calc>`` turn gets the value back as a
    ``tool`` message; any other turn is the answer."""

    def __init__(self, messages: list[dict], max_turns: int):
        super().__init__(("</calc>",), max_turns)
        self._messages = messages

    def reset(self) -> list[dict]:
        return [dict(m) for m in self._messages]

    def step(self, turn_text: str) -> Step:
        calls = _CALL.findall(turn_text)
        if not calls or not turn_text.rstrip().endswith("</calc>"):
            return Step(done=True)
        return Step([{"role": "tool", "content": calculate(calls[-1])}])


class Calculator(ToolTask):
    """Two-digit multiplication with a calculator tool: "What is 47 * 28?".

    The opening messages show the tool once (a worked example: a call, its result, the
    answer). Reward: 1.0 when the last number of the model's turns is the product; else
    0.2 (a format reward) when some turn made a well-formed ``<calc>`` call; else 0.
    """

    name = "calculator"
    description = ("multiply two-digit numbers with a <calc> tool (multi-turn); reward 1 for "
                   "the right product, 0.2 for a well-formed call")
    max_turns = 3
    stop = ("</calc>",)
    FORMAT_REWARD = 0.2
    SYSTEM = ("You can use a calculator: write <calc>expression</calc> and the result is "
              "shown to you. Then reply with the final number only.")
    EXAMPLE = ({"role": "user", "content": "What is 17 * 23?"},
               {"role": "assistant", "content": "<calc>17 * 23</calc>"},
               {"role": "tool", "content": "391"},
               {"role": "assistant", "content": "391"})

    def draw(self, rng: random.Random) -> tuple[str, Problem]:
        a, b = rng.randint(11, 99), rng.randint(11, 99)
        return f"{min(a, b)}*{max(a, b)}", Problem(self.name, f"What is {a} * {b}?", str(a * b))

    def environment(self, problem: Problem) -> Environment:
        messages = [{"role": "system", "content": self.SYSTEM}, *self.EXAMPLE,
                    {"role": "user", "content": problem.prompt}]
        return CalculatorEpisode(messages, self.max_turns)

    def reward(self, completion: str, problem: Problem) -> float:
        if last_integer(completion) == int(problem.answer):
            return 1.0
        return self.FORMAT_REWARD if _CALL.search(completion) else 0.0


TOOL_TASKS: dict[str, ToolTask] = {task.name: task for task in (Calculator(),)}
