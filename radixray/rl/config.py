"""The GRPO job's configuration: one pydantic model, read from YAML, errors naming the field.

The ``fleet`` section is a serve configuration (:class:`~radixray.cluster.config.ServeConfig`:
engine options, number of workers, router): the job starts that fleet on the Ray cluster,
or joins it when an app with the same configuration already runs there (``radixray serve``
started elsewhere), in which case user traffic and rollouts share the workers.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from radixray.cluster.config import (
    ConfigError,
    ServeConfig,
    format_validation_error,
    merge,
    read_yaml_mapping,
)
from radixray.engine.control_types import PauseMode

PLACEMENTS = ("colocated", "separate")


class GRPOConfig(BaseModel):
    """One GRPO run: what to train on, how to sample, how to optimise, where things run."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("default", description="'default' (SmolLM2-135M-Instruct), a Hugging "
                       "Face folder, or a .gguf file; the workers and the trainer load the same")
    task: str = Field("arithmetic", description="a task of radixray.rl.tasks.TASKS")
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
    deterministic: bool = Field(False, description="batch-invariant workers and an engine-exact "
                                "trainer forward: rollout and train logprobs equal to the bit "
                                "(CPU, float32)")
    pause_mode: PauseMode = Field(
        "retract", description="what a weight update does to user requests on a shared fleet")
    rollout_priority: int = Field(-1, description="rollouts' scheduling priority (user "
                                  "requests default to 0; needs enable_priority_scheduling)")
    held_out_prompts: int = Field(32, ge=0, description="held-out problems scored greedily "
                                  "before and after training (0: skip)")
    seed: int = Field(0, ge=0)
    fleet: dict = Field(default_factory=dict, description="a serve config (engine, fleet, "
                        "router sections); engine.model defaults to ``model``")

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
        from radixray.rl.tasks import get_task
        get_task(name)  # ValueError naming the known tasks
        return name

    def serve_config(self) -> ServeConfig:
        """The fleet's serve configuration (``engine.model`` from ``model`` and
        ``engine.deterministic`` from ``deterministic`` unless given; a fleet that is not
        deterministic under a deterministic job is refused)."""
        data = merge({"engine": {"model": self.model, "deterministic": self.deterministic}},
                     self.fleet)
        if self.deterministic and not data["engine"]["deterministic"]:
            raise ConfigError("deterministic: true needs a deterministic fleet, but "
                              "fleet.engine.deterministic is false: drop it or set it true")
        try:
            cfg = ServeConfig.parse(data)
        except ConfigError as exc:
            raise ConfigError(str(exc).replace("invalid config: ", "invalid fleet section: ")) \
                from None
        if cfg.fleet.disaggregated:
            raise ConfigError("fleet.fleet.prefill_workers: GRPO rollouts run on unified "
                              "workers; set fleet.fleet.workers instead")
        return cfg

    @classmethod
    def parse(cls, data: dict | None) -> GRPOConfig:
        try:
            cfg = cls.model_validate(data or {})
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, "GRPO config")) from None
        cfg.serve_config()  # the fleet section is checked now, not when the job starts it
        return cfg

    @classmethod
    def load(cls, path: str, overrides: dict | None = None) -> GRPOConfig:
        return cls.parse(merge(read_yaml_mapping(path), overrides or {}))
