"""Synthetic workloads for ``radixray bench serve``: random, shared-prefix and multi-turn.

Every workload is a list of :class:`Conversation`; single-turn datasets have one
turn per conversation. Builders are pure and seedable: the same tokenizer, the
same arguments and the same seed give the same texts. Prompts are random token
ids decoded to text and nudged until the text re-tokenizes to the requested
length (``add_special_tokens=False``), so lengths are exact whenever the
tokenizer allows it; the real count is always recorded.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass, field

DATASETS = ("random", "shared-prefix", "multi-turn", "interference")
_FIT_ATTEMPTS = 12


@dataclass
class Conversation:
    """One workload item: ``turns`` are user texts sent one after another.

    ``system`` (shared-prefix only) goes first: as a system message on the chat
    API, concatenated in front of the first turn on the completions API.
    ``prompt_len`` is the real token count of the first request's prompt text
    (system + first turn); later turns of a multi-turn conversation grow with the
    server's replies, so their length is only known at run time.
    ``think_times[k]`` (multi-turn) is how long the user waits after the reply to
    turn k before sending turn k+1.
    """

    index: int
    turns: list[str]
    output_len: int
    prompt_len: int
    system: str | None = None
    session_id: str | None = None
    group: int | None = None
    turn_lens: list[int] = field(default_factory=list)
    think_times: list[float] = field(default_factory=list)


def count_tokens(tokenizer, text: str) -> int:
    """Token count of ``text`` as a prompt body (no BOS or other special tokens)."""
    return len(tokenizer.encode(text, add_special_tokens=False))


class TokenSampler:
    """Makes random texts of an exact token length for one tokenizer.

    Draws only "clean" ids: ones that decode to text without replacement
    characters and re-encode to themselves, so decoded texts re-tokenize to
    nearly the same length and the fitting loop converges in a step or two.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        ids = [i for i in range(len(tokenizer)) if i not in special]
        texts = tokenizer.batch_decode([[i] for i in ids])
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
        self.clean_ids = [i for i, t, e in zip(ids, texts, encoded)
                          if t.strip() and "\ufffd" not in t and e == [i]]
        if not self.clean_ids:
            self.clean_ids = ids

    def random_text(self, n: int, rng: random.Random) -> tuple[str, int]:
        """A random text of ``n`` tokens and its real token count (``n`` unless fitting failed)."""
        if n <= 0:
            return "", 0
        ids = rng.choices(self.clean_ids, k=n)
        best: tuple[int, str, int] | None = None
        for _ in range(_FIT_ATTEMPTS):
            text = self.tokenizer.decode(ids)
            again = self.tokenizer.encode(text, add_special_tokens=False)
            if len(again) == n:
                return text, n
            if best is None or abs(len(again) - n) < best[0]:
                best = (abs(len(again) - n), text, len(again))
            # Trim or pad the re-encoded ids and try again: merges across token
            # boundaries shift the count by a few tokens at a time.
            ids = again[:n] if len(again) > n else again + rng.choices(self.clean_ids, k=n - len(again))
        return best[1], best[2]


_SAMPLERS: dict[int, TokenSampler] = {}


def sampler_for(tokenizer) -> TokenSampler:
    """The cached :class:`TokenSampler` of ``tokenizer`` (building one scans the vocabulary)."""
    s = _SAMPLERS.get(id(tokenizer))
    if s is None or s.tokenizer is not tokenizer:
        s = _SAMPLERS[id(tokenizer)] = TokenSampler(tokenizer)
    return s


def sample_lengths(rng: random.Random, n: int, length: int, range_ratio: float) -> list[int]:
    """``n`` integers uniform in ``[max(int(length * range_ratio), 1), length]`` (SGLang's rule)."""
    low = max(int(length * range_ratio), 1)
    return [rng.randint(low, max(length, low)) for _ in range(n)]


def build_random(tokenizer, num_prompts: int, input_len: int, output_len: int,
                 range_ratio: float = 0.0, seed: int = 1) -> list[Conversation]:
    """``num_prompts`` single-turn random prompts; input and output lengths follow :func:`sample_lengths`."""
    rng = random.Random(seed)
    sampler = sampler_for(tokenizer)
    in_lens = sample_lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = sample_lengths(rng, num_prompts, output_len, range_ratio)
    items = []
    for i, (n_in, n_out) in enumerate(zip(in_lens, out_lens)):
        text, real = sampler.random_text(n_in, rng)
        items.append(Conversation(index=i, turns=[text], output_len=n_out, prompt_len=real,
                                  turn_lens=[real]))
    return items


def build_shared_prefix(tokenizer, num_groups: int, prompts_per_group: int, system_len: int,
                        question_len: int, output_len: int, seed: int = 1,
                        shuffle: bool = True) -> list[Conversation]:
    """``num_groups`` x ``prompts_per_group`` prompts; a group's prompts share its system prompt.

    Each prompt's own question is random. ``prompt_len`` counts the concatenated
    system prompt + question. With ``shuffle`` the order is shuffled by ``seed``;
    ``index`` always numbers the final order.
    """
    rng = random.Random(seed)
    sampler = sampler_for(tokenizer)
    items = []
    for g in range(num_groups):
        system, _ = sampler.random_text(system_len, rng)
        for _ in range(prompts_per_group):
            question, q_len = sampler.random_text(question_len, rng)
            items.append(Conversation(index=0, turns=[question], output_len=output_len,
                                      prompt_len=count_tokens(tokenizer, system + question),
                                      system=system, group=g, turn_lens=[q_len]))
    if shuffle:
        rng.shuffle(items)
    for i, item in enumerate(items):
        item.index = i
    return items


def build_multi_turn(tokenizer, users: int, turns: int, turn_len: int, output_len: int,
                     seed: int = 1, think_time: float = 0.0) -> list[Conversation]:
    """``users`` conversations of ``turns`` random user messages of ``turn_len`` tokens each.

    Session ids are ``user-<i>``. The runner builds each turn's prompt from the
    history (earlier user messages and the server's actual replies). With
    ``think_time`` > 0 each user pauses an exponentially distributed time with
    that mean (seconds, seeded) between a reply and their next turn, which keeps
    the offered load independent of how fast the server answers.
    """
    rng = random.Random(seed)
    sampler = sampler_for(tokenizer)
    items = []
    for u in range(users):
        texts, lens = zip(*(sampler.random_text(turn_len, rng) for _ in range(turns)))
        thinks = [rng.expovariate(1.0 / think_time) if think_time > 0 else 0.0
                  for _ in range(turns - 1)]
        items.append(Conversation(index=u, turns=list(texts), output_len=output_len,
                                  prompt_len=lens[0], session_id=f"user-{u}", turn_lens=list(lens),
                                  think_times=thinks))
    return items


def build_interference(tokenizer, num_short: int, short_len: int, short_output_len: int,
                       num_long: int, long_len: int, long_output_len: int,
                       seed: int = 1) -> list[Conversation]:
    """Short chats with long prompts spread evenly among them (the long ones at every
    ``(num_short + num_long) // num_long``-th place, first one a quarter of a period in):
    what a long prompt's prefill does to the streams decoding beside it. ``group`` is 1
    for a long prompt, 0 for a short chat."""
    rng = random.Random(seed)
    sampler = sampler_for(tokenizer)
    total = num_short + num_long
    period = total // max(num_long, 1)
    long_at = {period // 4 + k * period for k in range(num_long)}
    items = []
    for i in range(total):
        long = i in long_at
        text, real = sampler.random_text(long_len if long else short_len, rng)
        items.append(Conversation(index=i, turns=[text], prompt_len=real, turn_lens=[real],
                                  output_len=long_output_len if long else short_output_len,
                                  group=int(long)))
    return items


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    """The ``--dataset`` flag and each dataset's own flags."""
    p.add_argument("--dataset", default="random", choices=DATASETS)
    p.add_argument("--num-prompts", type=int, default=None,
                   help="random dataset only (default 1000); other datasets decide their own size")
    g = p.add_argument_group("random dataset")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths are uniform integers in [max(int(len*ratio),1), len]")
    g = p.add_argument_group("shared-prefix dataset")
    g.add_argument("--gsp-num-groups", type=int, default=4)
    g.add_argument("--gsp-prompts-per-group", type=int, default=16)
    g.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    g.add_argument("--gsp-question-len", type=int, default=128)
    g.add_argument("--gsp-output-len", type=int, default=256)
    g.add_argument("--gsp-shuffle", action=argparse.BooleanOptionalAction, default=True,
                   help="shuffle the prompts of all groups together (seeded)")
    g = p.add_argument_group("multi-turn dataset")
    g.add_argument("--multiturn-users", type=int, default=8)
    g.add_argument("--multiturn-turns", type=int, default=4)
    g.add_argument("--multiturn-turn-len", type=int, default=64, help="new user tokens per turn")
    g.add_argument("--multiturn-output-len", type=int, default=64)
    g.add_argument("--multiturn-think-time", type=float, default=0.0,
                   help="mean seconds a user waits between a reply and the next turn "
                   "(exponential, seeded; 0 = send at once)")
    g = p.add_argument_group("interference dataset (long prompts among short chats)")
    g.add_argument("--interference-short", type=int, default=32, help="short chats")
    g.add_argument("--interference-short-len", type=int, default=64)
    g.add_argument("--interference-short-output-len", type=int, default=128)
    g.add_argument("--interference-long", type=int, default=4, help="long prompts")
    g.add_argument("--interference-long-len", type=int, default=2048)
    g.add_argument("--interference-long-output-len", type=int, default=8)


def build_from_args(args: argparse.Namespace, tokenizer) -> list[Conversation]:
    """The workload named by ``args.dataset`` (flags from :func:`add_dataset_args`), seeded by ``args.seed``."""
    if args.dataset == "random":
        n = 1000 if args.num_prompts is None else args.num_prompts
        return build_random(tokenizer, n, args.random_input_len, args.random_output_len,
                            args.random_range_ratio, args.seed)
    if args.num_prompts is not None:
        print(f"note: --num-prompts is ignored for --dataset {args.dataset}", file=sys.stderr)
    if args.dataset == "shared-prefix":
        return build_shared_prefix(tokenizer, args.gsp_num_groups, args.gsp_prompts_per_group,
                                   args.gsp_system_prompt_len, args.gsp_question_len,
                                   args.gsp_output_len, args.seed, args.gsp_shuffle)
    if args.dataset == "multi-turn":
        return build_multi_turn(tokenizer, args.multiturn_users, args.multiturn_turns,
                                args.multiturn_turn_len, args.multiturn_output_len, args.seed,
                                args.multiturn_think_time)
    if args.dataset == "interference":
        return build_interference(tokenizer, args.interference_short, args.interference_short_len,
                                  args.interference_short_output_len, args.interference_long,
                                  args.interference_long_len, args.interference_long_output_len,
                                  args.seed)
    raise ValueError(f"--dataset: unknown dataset {args.dataset!r}")


def sweep_point(args: argparse.Namespace, point: int, num: int | None, tokenizer,
                ) -> tuple[list[Conversation], list[Conversation] | None]:
    """(measured items, warm-up items or None) of sweep point ``point``.

    Each point gets its own prompts (seed + point), so a prefix cache never serves one
    point from another; the random dataset's warm-ups are extra prompts of their own.
    """
    point_args = argparse.Namespace(**{**vars(args), "seed": args.seed + point})
    if args.dataset != "random":
        return build_from_args(point_args, tokenizer), None
    point_args.num_prompts = (1000 if num is None else num) + args.warmup
    items = build_from_args(point_args, tokenizer)
    return items[args.warmup:], items[:args.warmup]


def load_tokenizer(name: str):
    """``"default"`` (the radixray default model's tokenizer), a model folder, or a tokenizer folder/id."""
    import os

    from radixray.engine.weights.loader import resolve_model
    if name in ("default", "") or os.path.isfile(os.path.join(name, "config.json")):
        return resolve_model(name).tokenizer
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(name)
