"""RL test helpers: a tool task for random-weight models and a user reward function, both
plugged into jobs by import path (``rl_helpers:Echo``, ``rl_helpers:length_reward``)."""

from __future__ import annotations

import random

from radixray.rl.tasks import Problem
from radixray.rl.tool_tasks import Environment, Step, ToolTask

# ChatML: the generation prompt and a rendered assistant message agree, so a conversation can
# be continued token in, token out (the tiny tokenizer's plain template cannot).
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class EchoEpisode(Environment):
    """Answers every turn with a tool message; the episode ends at the turn limit."""

    def __init__(self, problem: Problem):
        super().__init__((), max_turns=3)
        self.problem = problem

    def reset(self) -> list[dict]:
        return [{"role": "user", "content": self.problem.prompt}]

    def step(self, turn_text: str) -> Step:
        return Step([{"role": "tool", "content": f"you wrote {len(turn_text)} characters"}])


class Echo(ToolTask):
    """A tool task for random-weight models: three turns, whatever they say; reward: the
    share of the letter 'a' (learnable from random weights, as char_frequency)."""

    name = "echo"
    description = "three turns with a tool that counts characters"
    max_turns = 3

    def draw(self, rng: random.Random) -> tuple[str, Problem]:
        n = rng.randint(0, 10 ** 6)
        return str(n), Problem(self.name, f"Say {n}.", str(n))

    def environment(self, problem: Problem) -> Environment:
        return EchoEpisode(problem)

    def reward(self, completion: str, problem: Problem) -> float:
        return min(1.0, completion.count("a") / max(len(completion), 1))


def length_reward(completion: str, problem: Problem) -> float:
    """A user reward function."""
    return min(1.0, len(completion) / 100)


def chatml_copy(model_dir: str, folder: str) -> str:
    """A copy of ``model_dir`` whose tokenizer has the ChatML template."""
    import shutil

    from transformers import AutoTokenizer
    shutil.copytree(model_dir, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = CHATML
    tok.save_pretrained(folder)
    return folder
