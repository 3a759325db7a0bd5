"""The serving configuration: one pydantic schema for YAML files, ``build_app`` and the CLI.

Errors name the field: ``ServeConfig.load("x.yaml")`` raises :class:`ConfigError`
with lines like ``engine.chunked_prefill_size: Input should be a valid integer``.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from radixray.cluster.routing import PolicyName, RouterSettings
from radixray.engine.config import DEVICE_PATTERN, EngineConfig


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of bounds."""


class EngineSection(BaseModel):
    """Start-up options of each worker's engine (see radixray.engine.config.EngineConfig)."""

    model_config = ConfigDict(extra="forbid")

    model: str = "default"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    device: str = Field("cpu", pattern=DEVICE_PATTERN)  # cuda needs server.worker_num_gpus
    quantization: Literal["w8a8_int8"] | None = None
    quantize_lm_head: bool = False  # w8a8_int8 only: the lm_head as an int8 GEMM too
    kv_cache_dtype: Literal["auto", "bfloat16", "fp8_e5m2"] = "auto"
    mem_fraction_static: float = Field(0.3, gt=0, lt=1)
    max_total_tokens: int | None = Field(None, ge=2)
    chunked_prefill_size: int | None = 2048
    max_prefill_tokens: int = Field(16384, ge=1)
    max_running_requests: int | None = Field(None, ge=1)
    context_length: int | None = Field(None, ge=2)
    schedule_policy: Literal["fcfs", "lpm"] = "fcfs"
    schedule_conservativeness: float = Field(1.0, gt=0)
    enable_priority_scheduling: bool = False
    disable_radix_cache: bool = False
    radix_eviction_policy: Literal["lru", "lfu"] = "lru"
    attention_backend: str = "auto"
    cpu_kernels: bool = True
    num_threads: int | None = Field(None, ge=1)
    decode_log_interval: int = Field(40, ge=1)
    stream_interval: int = Field(1, ge=1)
    random_seed: int = 0
    check_kv_conservation: bool = False
    # a fault in this many scheduler steps in a row marks the engine failed and the worker
    # is restarted
    max_consecutive_failed_steps: int = Field(3, ge=1)

    @model_validator(mode="after")
    def _lm_head_needs_int8(self) -> EngineSection:
        if self.quantize_lm_head and self.quantization != "w8a8_int8":
            raise ValueError("quantize_lm_head needs quantization: w8a8_int8")
        return self

    def engine_options(self) -> dict:
        """Keyword arguments for radixray.Engine (every key is an EngineConfig field)."""
        known = {f.name for f in fields(EngineConfig)}
        return {k: v for k, v in self.model_dump().items() if k in known}


class ServerSection(BaseModel):
    """HTTP front, ingress replicas and worker placement."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    route_prefix: str = "/"
    # where HTTP enters a Ray instance `radixray serve` starts itself (see cluster/ingress_mode.py):
    # direct (into the ingress replica), proxy (through Serve's proxy actor), auto (direct for
    # one ingress replica)
    ingress: Literal["auto", "direct", "proxy"] = "auto"
    served_model_name: str | None = None  # default: "default" or the model folder's name
    ingress_replicas: int = Field(1, ge=1)
    ingress_num_cpus: float = Field(0.0, ge=0)
    worker_num_cpus: float = Field(1.0, ge=0)
    worker_num_gpus: float = Field(0.0, ge=0)
    enable_cache_report: bool = True  # usage.prompt_tokens_details.cached_tokens in OpenAI replies
    health_generates: bool = False  # /health runs a one-token generation like /health_generate
    health_check_timeout_s: float = Field(20.0, gt=0)
    warmup: bool = True
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # niceness the EngineWorker gives its threads (Ray starts workers at 15); None keeps Ray's
    worker_niceness: int | None = Field(0, ge=-20, le=19)


class FleetSection(BaseModel):
    """How many engine workers the controller starts, where, and how it watches them."""

    model_config = ConfigDict(extra="forbid")

    workers: int = Field(1, ge=1)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    health_check_interval_s: float = Field(1.0, gt=0)
    health_check_timeout_s: float = Field(10.0, gt=0)  # a ping that long unanswered: unhealthy
    restart_dead_workers: bool = True
    max_restarts: int = Field(20, ge=0)  # per worker; past it the worker stays dead
    # The controller outlives any one ingress replica; it stops the fleet once no ingress
    # replica has sent a heartbeat for this long (the app was deleted or redeployed).
    owner_timeout_s: float = Field(30.0, gt=0)


class RouterSection(BaseModel):
    """Which worker a request goes to, and what happens when that worker fails."""

    model_config = ConfigDict(extra="forbid")

    policy: PolicyName = "cache_aware"
    cache_threshold: float = Field(0.3, ge=0, le=1)
    balance_abs_threshold: int = Field(64, ge=0)
    balance_rel_threshold: float = Field(1.5, ge=1)
    max_tree_size: int = Field(2 ** 26, ge=1)  # characters per worker
    eviction_interval_s: float = Field(120.0, gt=0)
    session_affinity: bool = True  # the X-Session-Id header pins a conversation to a worker
    max_sessions: int = Field(100_000, ge=1)
    retry_max_attempts: int = Field(3, ge=1)
    retry_backoff_s: float = Field(0.1, ge=0)  # doubles per retry, capped at 2 s
    circuit_failure_threshold: int = Field(5, ge=1)
    circuit_cooldown_s: float = Field(30.0, gt=0)

    def settings(self) -> RouterSettings:
        """The routing core's settings (the retry knobs belong to the ingress, not the router)."""
        keep = {f for f in RouterSettings.__dataclass_fields__}
        return RouterSettings(**{k: v for k, v in self.model_dump().items() if k in keep})


class ServeConfig(BaseModel):
    """Everything ``radixray serve`` / ``radixray.build_app`` needs."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineSection = Field(default_factory=EngineSection)
    server: ServerSection = Field(default_factory=ServerSection)
    fleet: FleetSection = Field(default_factory=FleetSection)
    router: RouterSection = Field(default_factory=RouterSection)
    app_name: str = "radixray"
    namespace: str = "radixray"

    @model_validator(mode="after")
    def _gpu_for_cuda(self) -> ServeConfig:
        if self.engine.device != "cpu" and self.server.worker_num_gpus <= 0:
            raise ValueError(f"engine.device={self.engine.device!r} needs server.worker_num_gpus > 0 "
                             "(Ray hides GPUs from actors that reserve none)")
        return self

    @model_validator(mode="after")
    def _fill_names(self) -> ServeConfig:
        if self.server.served_model_name is None:
            import os
            model = self.engine.model
            name = "default" if model in ("", "default") else os.path.basename(model.rstrip("/"))
            self.server.served_model_name = name.removesuffix(".gguf")
        return self

    @classmethod
    def parse(cls, data: dict | ServeConfig | None) -> ServeConfig:
        """Validate a dict (e.g. from YAML or a Serve ``args`` block); raise ConfigError naming fields."""
        if isinstance(data, ServeConfig):
            return data
        try:
            return cls.model_validate(data or {})
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, "config")) from None

    @classmethod
    def load(cls, path: str, overrides: dict | None = None) -> ServeConfig:
        """Read a YAML file, apply ``{"engine": {...}, "server": {...}}`` overrides, validate."""
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
        return cls.parse(merge(data, overrides or {}))

    def fleet_key(self) -> str:
        """Short hash of everything that shapes the fleet (engine, fleet, router, worker
        resources). A redeploy that changes any of it gets a new fleet; one that changes
        only the HTTP side (port, ingress replicas) keeps the running one."""
        import hashlib
        import json
        shape = {"engine": self.engine.model_dump(), "fleet": self.fleet.model_dump(),
                 "router": self.router.model_dump(),
                 "worker": [self.server.worker_num_cpus, self.server.worker_num_gpus]}
        return hashlib.sha1(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:8]

    def controller_name(self) -> str:
        return f"{self.app_name}-controller-{self.fleet_key()}"

    def router_name(self) -> str:
        return f"{self.app_name}-router-{self.fleet_key()}"


def merge(base: dict, extra: dict) -> dict:
    """Deep-merge ``extra`` into a copy of ``base`` (mappings merge, other values replace)."""
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def format_validation_error(exc: ValidationError, what: str) -> str:
    """One line per problem: ``dotted.field: message``."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or what
        lines.append(f"{loc}: {err['msg']}")
    return f"invalid {what}: " + "; ".join(lines)
