"""The policy trainer: a torch model with the workers' weights, trained with the GRPO loss.

It holds the same Hugging Face checkpoint the workers load (transformers' model class
for that architecture: the workers' own model is inference-only), AdamW, and optionally
a frozen copy of the initial weights for the KL term. One :meth:`PolicyTrainer.train_step`
is one optimizer step over every sample of a rollout, in micro-batches whose gradients
accumulate to the full batch's (token-level mean over the whole batch).

The rollout's logprobs (the engine's, unscaled) are the "old policy" of the ratio. The
first forward of a step runs under the very weights that produced the rollout, so its
logprobs are compared with the engine's on every token: the step reports the largest
and the mean absolute difference (a kernel or conversion mismatch shows there first).

In deterministic mode (``deterministic=True``, with workers started deterministic) the
values of the trainer's logprobs come from :class:`~radixray.engine.executor.scoring.SequenceScorer`:
the workers' own model class and batch-invariant kernels over the trainer's current
weights, so they equal the rollout's to the bit and the difference is exactly 0. The
gradient flows through the transformers forward of the same weights (its values differ
from the scorer's only by rounding; :class:`_ExactValues` puts the scorer's numbers in its
place), since the workers' model is inference-only.

MoE models replay the rollout's routing (:mod:`radixray.rl.routing_replay`): when samples
carry ``routed_experts`` (and the option ``routing_replay`` is not False) the policy's
forward uses the experts the rollout chose for each token (the reference model for the
KL keeps its own routing); the step reports ``routing_flip_frac``, the share of replayed
(token, MoE layer) routes the trainer's own router would have chosen otherwise.

Weights leave through :meth:`write_shared` (colocated: a reused shared-memory file the
workers read in place) or :meth:`broadcast` (separate: torch.distributed, rank 0).
fp32 on CPU, bf16 on GPU. Use it directly or as a Ray actor (:func:`trainer_actor_class`).

A step is :meth:`PolicyTrainer._accumulate` (forward and backward over the micro-batches,
returning this process's part of the statistics), :meth:`PolicyTrainer._clip_and_step`
and :func:`step_stats` (the parts merged). A sharded trainer
(:mod:`radixray.rl.trainer_group`) runs the same three over N FSDP ranks, each rank a
PolicyTrainer whose ``_shard`` hook wraps the model (:mod:`radixray.rl.fsdp`).
"""

from __future__ import annotations

import copy
import logging
import time

import torch

from radixray.engine.faults import FaultInjector
from radixray.rl.grpo_loss import grpo_loss, merge_stats, sequence_logprobs
from radixray.rl.routing_replay import RoutingReplay, batch_routes

logger = logging.getLogger("radixray.rl")


def loss_mask(sample: dict) -> list[int]:
    """Which output tokens a sample trains on: its ``loss_mask`` (a tool episode's model
    tokens), else all of them."""
    mask = sample.get("loss_mask")
    return [1] * len(sample["output_ids"]) if mask is None else mask


def trained_tokens(samples: list[dict]) -> int:
    """The masked-token count of ``samples`` (the token-level mean's denominator)."""
    return sum(sum(loss_mask(s)) for s in samples)


def pad_batch(samples: list[dict], device) -> dict[str, torch.Tensor]:
    """Right-pad ``prompt_ids + output_ids`` of each sample: ``tokens`` [B, L], ``attention``
    [B, L], and over the predicted positions (``tokens[:, 1:]``) ``mask`` [B, L-1] (the
    sample's loss mask on its output tokens, 0 elsewhere), ``old`` [B, L-1] (the rollout's
    logprobs there) and ``advantages`` [B]."""
    seqs = [s["prompt_ids"] + s["output_ids"] for s in samples]
    length = max(len(x) for x in seqs)
    b = len(samples)
    tokens = torch.zeros(b, length, dtype=torch.long)
    attention = torch.zeros(b, length, dtype=torch.long)
    mask = torch.zeros(b, length - 1)
    old = torch.zeros(b, length - 1)
    for i, (s, seq) in enumerate(zip(samples, seqs)):
        tokens[i, :len(seq)] = torch.tensor(seq)
        attention[i, :len(seq)] = 1
        start, n = len(s["prompt_ids"]) - 1, len(s["output_ids"])
        mask[i, start:start + n] = torch.tensor(loss_mask(s), dtype=torch.float32)
        old[i, start:start + n] = torch.tensor(s["logprobs"], dtype=torch.float32)
    advantages = torch.tensor([s["advantage"] for s in samples], dtype=torch.float32)
    out = {"tokens": tokens, "attention": attention, "mask": mask, "old": old,
           "advantages": advantages}
    return {k: v.to(device) for k, v in out.items()}


def step_stats(parts: list[dict], grad_norm: float, tokens: int, train_s: float,
               tis: bool = False) -> dict:
    """The step's statistics from the parts :meth:`PolicyTrainer._accumulate` returned (one
    per process that took part): losses summed (each is already divided by the step's
    token count), loss statistics merged token-weighted, the logprob difference's maximum
    and mean over every masked token; with routing replay the share of replayed routes the
    trainer's router would have chosen otherwise; with ``tis`` the TIS statistics."""
    stats = [st for p in parts for st in p["stats"]]
    merged = merge_stats(stats) if stats else None
    count = sum(p["diff_count"] for p in parts)
    replayed = sum(p.get("replayed", 0) for p in parts)
    extra = {"routing_flip_frac": sum(p.get("flips", 0) for p in parts) / replayed} \
        if replayed else {}
    if merged:
        extra["mismatch_kl"] = merged.mismatch_kl
    if tis and merged:
        extra["tis_clip_frac"] = merged.tis_clip_frac
    return {**extra, "loss": sum(p["loss"] for p in parts), "grad_norm": grad_norm,
            "clip_frac": merged.clip_frac if merged else 0.0,
            "kl": merged.kl if merged else 0.0,
            "ratio_max": merged.ratio_max if merged else 1.0, "tokens": tokens,
            "logprob_abs_diff_max": max(p["diff_max"] for p in parts),
            "logprob_abs_diff_mean": sum(p["diff_sum"] for p in parts) / count if count else 0.0,
            "train_s": train_s}


class _ExactValues(torch.autograd.Function):
    """``exact``'s values with ``differentiable``'s gradient: forward returns a copy of
    ``exact``, backward hands the incoming gradient to ``differentiable`` unchanged."""

    @staticmethod
    def forward(ctx, differentiable: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
        return exact.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class PolicyTrainer:
    """GRPO on one model; see the module docstring. ``options``: the GRPO config's
    learning_rate, weight_decay, kl_coef, clip_low, clip_high, micro_batch_size, and
    routing_replay (default True: replay samples' ``routed_experts`` on a MoE model)."""

    def __init__(self, model_path: str, options: dict, device: str = "cpu", seed: int = 0,
                 num_threads: int | None = None, deterministic: bool = False):
        """``num_threads``: CPU threads for training (default: every core this process may
        use; Ray starts an actor with one, and colocated the workers are paused while it
        trains). ``deterministic``: logprob values from the engine-exact scorer (CPU only)."""
        import os

        from transformers import AutoModelForCausalLM
        torch.set_num_threads(num_threads or len(os.sched_getaffinity(0)))
        torch.manual_seed(seed)
        self.device = torch.device(device)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self.device)
        model.eval()  # no dropout: the forward must match the engine's
        self.options = options
        self.ref = None
        if options.get("kl_coef", 0.0) > 0:
            self.ref = self._shard(copy.deepcopy(model).requires_grad_(False))
        self.model = self._shard(model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=options["learning_rate"],
                                           weight_decay=options.get("weight_decay", 0.0))
        self._shared = None
        self._broadcaster = None
        self._faults: FaultInjector | None = None  # tests only (attach_fault_injector)
        self.scorer = None
        self._scorer_current = False  # the scorer holds the model's present weights
        if deterministic:
            if self.device.type != "cpu":
                raise ValueError("deterministic mode runs on the CPU (the batch-invariant kernels "
                                 f"are CPU kernels), got device {device!r}")
            from radixray.engine.executor.scoring import SequenceScorer
            self.scorer = SequenceScorer(self.model.config)

    def _shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model as this trainer trains it: unchanged here; a rank of a sharded trainer
        (:mod:`radixray.rl.fsdp`) shards it."""
        return model

    def _prepare_scorer(self, samples: list[dict]) -> None:
        """Make the scorer hold the present weights and fit the step's longest sequence;
        at the start of every step (a sharded trainer's ranks gather the weights together)."""
        from radixray.engine.executor.scoring import SequenceScorer
        longest = max((len(s["prompt_ids"]) + len(s["output_ids"]) for s in samples), default=0)
        if longest > self.scorer.max_tokens:
            size = 1 << (longest - 1).bit_length()
            self.scorer = SequenceScorer(self.model.config, max_tokens=size)
            self._scorer_current = False
        if not self._scorer_current:
            self.scorer.load_weights(self.named_weights().items())
            self._scorer_current = True

    def _exact_logprobs(self, samples: list[dict], like: torch.Tensor) -> torch.Tensor:
        """The scorer's logprobs of ``samples`` laid out as ``like`` ([B, L-1], zero padded)."""
        seqs = [s["prompt_ids"] + s["output_ids"] for s in samples]
        out = torch.zeros_like(like)
        for i, lp in enumerate(self.scorer.logprobs(seqs)):
            out[i, :lp.numel()] = lp
        return out

    def _logprobs(self, model, batch: dict) -> torch.Tensor:
        logits = model(input_ids=batch["tokens"], attention_mask=batch["attention"]).logits
        return sequence_logprobs(logits[:, :-1].float(), batch["tokens"][:, 1:])

    def train_step(self, samples: list[dict]) -> dict:
        """One optimizer step over ``samples`` (each: prompt_ids, output_ids, logprobs of the
        output tokens from the rollout, advantage). Returns the loss statistics and the
        rollout-vs-train logprob difference."""
        t0 = time.perf_counter()
        total = trained_tokens(samples)
        micro_batches = -(-len(samples) // self.options["micro_batch_size"])
        part = self._accumulate(samples, total, micro_batches)
        grad_norm = self._clip_and_step()
        return step_stats([part], grad_norm, total, time.perf_counter() - t0,
                          tis=self.options.get("loss_correction", "none") == "tis")

    def _accumulate(self, samples: list[dict], total: int, micro_batches: int) -> dict:
        """Forward and backward over ``samples`` in ``micro_batches`` micro-batches (those
        past the samples' end are :meth:`_idle_pass` es), the loss divided by ``total``
        masked tokens; the gradients accumulate. Returns this process's part of the step's
        statistics (:func:`step_stats` merges parts)."""
        opts = self.options
        mb = opts["micro_batch_size"]
        diffs, stats, loss_sum = [], [], 0.0
        replayed = flips = 0
        self.optimizer.zero_grad(set_to_none=True)
        if self.scorer is not None:
            self._prepare_scorer(samples)
        for i in range(0, micro_batches * mb, mb):
            chunk = samples[i:i + mb]
            if not chunk:
                self._idle_pass()
                continue
            batch = pad_batch(chunk, self.device)
            routes = None
            if opts.get("routing_replay", True):
                routes = batch_routes(self.model, chunk, batch["tokens"].shape[1], self.device)
            with RoutingReplay(self.model, routes) as replay:
                logprobs = self._logprobs(self.model, batch)
            replayed, flips = replayed + replay.replayed, flips + replay.flips
            if self.scorer is not None:
                exact = self._exact_logprobs(chunk, logprobs.detach())
                logprobs = _ExactValues.apply(logprobs, exact)
            mask = batch["mask"].bool()
            diffs.append((logprobs.detach() - batch["old"])[mask].abs())
            ref = None
            if self.ref is not None:
                with torch.no_grad():
                    ref = self._logprobs(self.ref, batch)
            off_policy = {}
            if opts.get("loss_correction", "none") == "tis":  # decoupled PPO + TIS weight
                off_policy = {"behaviour_logprobs": batch["old"], "tis_cap": opts["tis_cap"]}
            loss, st = grpo_loss(logprobs, logprobs.detach() if off_policy else batch["old"],
                                 batch["advantages"], batch["mask"],
                                 clip_low=opts["clip_low"], clip_high=opts["clip_high"],
                                 ref_logprobs=ref, kl_coef=opts.get("kl_coef", 0.0),
                                 total_tokens=total, **off_policy)
            loss.backward()
            loss_sum += float(loss.detach())
            stats.append(st)
        diff = torch.cat(diffs) if diffs else torch.zeros(0)
        return {"loss": loss_sum, "stats": stats, "diff_count": diff.numel(),
                "diff_max": float(diff.max()) if diff.numel() else 0.0,
                "diff_sum": float(diff.double().sum()), "replayed": replayed, "flips": flips}

    def _idle_pass(self) -> None:
        """A micro-batch without samples: nothing to do in one process (a sharded trainer's
        rank runs a forward and backward that leave the gradients as they are)."""

    def _clip_and_step(self) -> float:
        """Clip the gradients to ``max_grad_norm`` (default 1) and take the AdamW step;
        returns the norm before clipping."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                              self.options.get("max_grad_norm", 1.0))
        self.optimizer.step()
        self._scorer_current = False
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def attach_fault_injector(self, injector: FaultInjector | None) -> None:
        """Tests only: :meth:`write_shared` and :meth:`broadcast` consult ``injector``
        (:class:`~radixray.engine.faults.FailTrainerSend`); None detaches it."""
        self._faults = injector

    def _items(self, phase: str):
        """The named weights in order (cut short when a test armed a fault for ``phase``)."""
        items = list(self.named_weights().items())
        return items if self._faults is None else self._faults.trainer_items(phase, items)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The parameters under their Hugging Face names (tied ones once)."""
        return {name: p.detach() for name, p in self.model.named_parameters()}

    # ---- sending weights ----------------------------------------------------------------
    def write_shared(self, directory: str = "/dev/shm"):
        """Copy the weights into this trainer's shared-memory file (made on first use);
        returns the handle the workers read."""
        from radixray.cluster.shared_weights import SharedWeightsWriter
        if self._shared is None:
            self._shared = SharedWeightsWriter(self.named_weights(), directory)
        return self._shared.write(self._items("write_shared"))

    def put_payload(self):
        """The weights in the object store (an ObjectRef of a ``to_payload`` list): how
        workers on other nodes than the shared-memory file's get them."""
        import ray

        from radixray.cluster.tensor_payload import to_payload
        return ray.put(to_payload(self._items("put_payload")))

    def weight_spec(self) -> tuple[list[str], list[str], list[list[int]]]:
        from radixray.engine.weights.sync import WeightBroadcaster
        return WeightBroadcaster.spec(self.named_weights().items())

    def broadcast_address(self) -> tuple[str, int]:
        """(this trainer's Ray node address, a port free there): where the weight-update
        group's rank 0, this trainer, listens; the workers may be on other nodes."""
        import ray

        from radixray.engine.ep.group import free_tcp_address
        host, port = free_tcp_address(ray.util.get_node_ip_address()).removeprefix(
            "tcp://").rsplit(":", 1)
        return host, int(port)

    def open_broadcast(self, master_address: str, master_port: int, world_size: int,
                       group_name: str = "weight_update_group", backend: str = "gloo") -> None:
        """Join the weight-update group as rank 0 (blocks until every worker joined)."""
        from radixray.engine.weights.sync import WeightBroadcaster
        self._broadcaster = WeightBroadcaster(master_address, master_port, world_size, group_name,
                                              backend)

    def broadcast(self) -> int:
        """Send every weight, in :meth:`weight_spec` order; returns the bytes sent. If sending
        fails the group is closed at once, so the workers' receives fail now (and they keep
        their weights) instead of waiting out the group's timeout."""
        try:
            return self._broadcaster.send(self._items("broadcast"))
        except BaseException:
            self._broadcaster.close()
            self._broadcaster = None
            raise

    def close(self) -> None:
        if self._shared is not None:
            self._shared.close()
            self._shared = None
        if self._broadcaster is not None:
            self._broadcaster.close()
            self._broadcaster = None


def trainer_actor_class():
    import ray
    return ray.remote(PolicyTrainer)
