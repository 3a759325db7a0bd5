"""The GRPO job's configuration: one pydantic model, read from YAML, errors naming the field.

The ``fleet`` section is a serve configuration (:class:`~radixray.cluster.config.ServeConfig`:
engine options, number of workers, router), validated as one: the job starts that fleet on
the Ray cluster, or joins it when an app with the same configuration already runs there
(``radixray serve`` started elsewhere), in which case user traffic and rollouts share the
workers. A problem inside it is reported as the serve config reports it, under ``invalid
fleet section:``.
"""

from __future__ import annotations

import json
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from radixray.cluster.config import (
    ConfigError,
    ServeConfig,
    merge,
    read_yaml_mapping,
)
from radixray.engine.control import PauseMode

PLACEMENTS = ("colocated", "separate")


class GRPOConfig(BaseModel):
    """One GRPO run: what to train on, how to sample, how to optimise, where things run."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model: str = Field("default", description="'default' (SmolLM2-135M-Instruct), a Hugging "
                       "Face folder, or a .gguf file; the workers and the trainer load the same")
    task: str = Field("arithmetic", description="a registered task (radixray.rl.tasks, "
                      "radixray.rl.tool_tasks) or a Task subclass by import path "
                      "('package.module:MyTask')")
    reward_function: str | None = Field(
        None, description="import path of fn(completion: str, problem) -> float in [0, 1] "
        "that replaces the task's reward (slime's --custom-rm-path)")
    rollout_function: str | None = Field(
        None, description="import path of async fn(ctx, problem, n, params) -> list[Sample] "
        "that samples one group on ctx's worker (slime's --rollout-function-path); default: "
        "one turn, or multi-turn episodes for a tool task")
    steps: int = Field(30, ge=1, description="training steps (rollout -> train -> weight sync)")
    prompts_per_step: int = Field(8, ge=1, le=4096)
    group_size: int = Field(8, description="samples per prompt (n); GRPO needs >= 2")
    max_new_tokens: int = Field(64, ge=1, le=32768)
    temperature: float = Field(1.0, gt=0, le=4.0)
    top_p: float = Field(1.0, gt=0, le=1.0)
    learning_rate: float = Field(1e-5, gt=0, le=1.0)
    weight_decay: float = Field(0.0, ge=0, le=1.0)
    kl_coef: float = Field(0.0, ge=0, description="k3 KL to the initial policy; 0 turns it off")
    clip_low: float = Field(0.2, ge=0, lt=1.0)
    clip_high: float = Field(0.2, ge=0, le=10.0)
    micro_batch_size: int = Field(16, ge=1, description="sequences per forward/backward "
                                  "(gradient accumulation over the step's samples)")
    scale_advantages: bool = Field(True, description="divide by the group's std (False: Dr. GRPO)")
    placement: Literal["colocated", "separate"] = "colocated"
    trainer_ranks: int = Field(1, ge=1, le=64, description="trainer processes: above 1, an "
                               "FSDP2 group (each rank holds 1/N of the weights, gradients "
                               "and AdamW state; the step's samples are split among them); "
                               "one placement-group bundle each")
    deterministic: bool = Field(False, description="batch-invariant workers and an engine-exact "
                                "trainer forward: rollout and train logprobs equal to the bit "
                                "(CPU, float32)")
    routing_replay: bool = Field(True, description="MoE models: rollouts return each token's "
                                 "routed experts and the trainer's forward uses them (routing "
                                 "replay, docs/rl.md); for a MoE model folder the fleet's "
                                 "engine.enable_return_routed_experts defaults to true")
    pause_mode: PauseMode | None = Field(
        None, description="what a weight update does to requests in flight (user requests on "
        "a shared fleet; with async, the rollouts too): retract, in_place or abort (async: "
        "the rollout resubmits it from its tokens); default in_place with async, else retract")
    async_training: bool = Field(False, alias="async", description="rollouts keep sampling "
                                 "with the newest weights while the trainer trains (needs "
                                 "placement: separate)")
    max_staleness: int = Field(1, ge=0, le=64, description="async: the oldest trained token "
                               "may come from weights this many versions behind the trainer's")
    loss_correction: Literal["none", "tis"] | None = Field(
        None, description="tis: decoupled PPO with a truncated importance weight against the "
        "rollout's logprobs (docs/rl.md); none: plain GRPO ratio to them. Default: tis with "
        "async, else none")
    tis_cap: float = Field(2.0, ge=1.0, le=1e4, description="the importance weight's cap C")
    dynamic_sampling: bool = Field(False, description="drop groups whose rewards are all equal "
                                   "and sample more to refill the batch (DAPO)")
    dynamic_sampling_max_rounds: int = Field(4, ge=1, le=64, description="sampling rounds per "
                                             "step (async: batches' worth of flat groups "
                                             "dropped) before flat groups are trained on")
    rollout_priority: int = Field(-1, description="rollouts' scheduling priority (user "
                                  "requests default to 0; needs enable_priority_scheduling)")
    held_out_prompts: int = Field(32, ge=0, description="held-out problems scored greedily "
                                  "before and after training (0: skip)")
    seed: int = Field(0, ge=0)
    fleet: ServeConfig = Field(default_factory=ServeConfig, description="the fleet the "
                               "rollouts run on, as a serve config (engine, server, fleet, "
                               "router sections); engine.model defaults to ``model``, "
                               "engine.deterministic to ``deterministic``; a fleet the job "
                               "starts itself runs engine.exact: true unless the section "
                               "sets exact or quantization")

    @model_validator(mode="before")
    @classmethod
    def _fleet_defaults(cls, data):
        """Fill the fleet's engine.model and engine.deterministic from the job's before the
        fleet section is validated (its served model name and its engine checks use them)."""
        if not isinstance(data, dict) or not isinstance(data.get("fleet", {}), dict):
            return data  # a ServeConfig already, or a type error pydantic reports
        fields = cls.model_fields
        job = {"model": data.get("model", fields["model"].default),
               "deterministic": data.get("deterministic", fields["deterministic"].default)}
        if data.get("routing_replay", True) and _is_moe_folder(job["model"]):
            job["enable_return_routed_experts"] = True  # the cached prefix's routes too
        return {**data, "fleet": merge({"engine": job}, data.get("fleet", {}))}

    @model_validator(mode="after")
    def _fleet_fits_the_job(self) -> GRPOConfig:
        if self.deterministic and not self.fleet.engine.deterministic:
            raise ValueError("deterministic: true needs a deterministic fleet, but "
                             "fleet.engine.deterministic is false: drop it or set it true")
        if self.pause_mode is None:
            self.pause_mode = "in_place" if self.async_training else "retract"
        if self.loss_correction is None:
            self.loss_correction = "tis" if self.async_training else "none"
        if self.async_training and self.placement != "separate":
            raise ValueError("async: true needs placement: separate (colocated workers release "
                             "their memory while the trainer trains, so nothing could sample "
                             "meanwhile)")
        if self.fleet.fleet.disaggregated:
            raise ValueError("fleet.fleet.prefill_workers: GRPO rollouts run on unified "
                             "workers; set fleet.fleet.workers instead")
        return self

    @field_validator("group_size")
    @classmethod
    def _group_of_two(cls, n: int) -> int:
        if n < 2:
            raise ValueError(f"must be >= 2, got {n}: GRPO compares the samples of one prompt, so "
                             f"a group of 1 has advantage 0 everywhere and trains nothing")
        return n

    @field_validator("task")
    @classmethod
    def _known_task(cls, name: str) -> str:
        from radixray.rl.registry import get_task
        get_task(name)  # ValueError naming the known tasks
        return name

    @field_validator("reward_function", "rollout_function")
    @classmethod
    def _importable(cls, path: str | None, info) -> str | None:
        if path is not None:
            from radixray.rl.plugins import load_callable
            load_callable(path, info.field_name)  # ValueError naming what is missing
        return path

    def reward_fn(self, task):
        """The reward the job scores samples with: ``reward_function`` or the task's."""
        from radixray.rl.plugins import load_callable
        return load_callable(self.reward_function, "reward_function") if self.reward_function \
            else task.reward

    def rollout_fn(self):
        """The user's rollout function, or None for the task's default."""
        from radixray.rl.plugins import load_callable
        return load_callable(self.rollout_function, "rollout_function") \
            if self.rollout_function else None

    def serve_config(self) -> ServeConfig:
        """The fleet's serve configuration (the ``fleet`` section)."""
        return self.fleet

    def own_fleet_config(self) -> ServeConfig:
        """The configuration of a fleet the job starts itself: the ``fleet`` section with
        engine.exact true (rollouts then sample the fp32 policy the trainer trains) unless
        the section chose exact or quantization itself. A served fleet the job joins keeps
        its own configuration: its name is a hash of it."""
        engine = self.fleet.engine
        if engine.model_fields_set & {"exact", "quantization"}:
            return self.fleet
        return self.fleet.model_copy(update={"engine": engine.model_copy(update={"exact": True})})

    @classmethod
    def parse(cls, data: dict | None) -> GRPOConfig:
        """Validate a dict (e.g. from YAML); raise ConfigError naming the fields."""
        try:
            return cls.model_validate(data or {})
        except ValidationError as exc:
            raise ConfigError(_describe(exc)) from None

    @classmethod
    def load(cls, path: str, overrides: dict | None = None) -> GRPOConfig:
        return cls.parse(merge(read_yaml_mapping(path), overrides or {}))


def _is_moe_folder(model) -> bool:
    """``model`` is a Hugging Face folder of a mixture-of-experts architecture."""
    path = os.path.join(model, "config.json") if isinstance(model, str) else ""
    if not os.path.isfile(path):
        return False
    from radixray.engine.models.moe import MOE_MODEL_TYPES
    with open(path) as f:
        return json.load(f).get("model_type") in MOE_MODEL_TYPES


def _describe(exc: ValidationError) -> str:
    """One ``field: message`` per problem; those inside the fleet section are named as the
    serve config names them, under ``invalid fleet section:``."""
    job, fleet = [], []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        if loc[:1] == ["fleet"]:
            fleet.append(f"{'.'.join(loc[1:]) or 'config'}: {err['msg']}")
        else:
            job.append(f"{'.'.join(loc)}: {err['msg']}" if loc else err["msg"])
    parts = [f"invalid {what}: " + "; ".join(lines)
             for what, lines in (("GRPO config", job), ("fleet section", fleet)) if lines]
    return "; ".join(parts)
