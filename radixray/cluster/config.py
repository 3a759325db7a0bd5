"""The serving configuration: one pydantic schema for YAML files, ``build_app`` and the CLI.

Errors name the field: ``ServeConfig.load("x.yaml")`` raises :class:`ConfigError`
with lines like ``engine.chunked_prefill_size: Input should be a valid integer``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    create_model,
    model_validator,
)

from radixray.cluster.autoscaling import RolePolicy
from radixray.cluster.autoscaling_config import AutoscalingSection
from radixray.cluster.routing import RouterSettings
from radixray.engine import options
from radixray.engine.config import EngineConfig

DEFAULT_OPEN_ROUTES = ("/health", "/health_generate", "/ready", "/metrics")  # no key asked


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of bounds."""


class _DataclassSection(BaseModel):
    """A config section derived from an options dataclass (see :func:`section_for`): the
    fields' types and bounds are checked here, with the field's name in the error; the
    dataclass itself then checks what spans fields."""

    model_config = ConfigDict(extra="forbid")
    _options_class: ClassVar[type]

    @model_validator(mode="after")
    def _cross_field_checks(self):
        self.options()
        return self

    def options(self):
        """The section's options as their dataclass (fields of this section's own, like the
        router's retry knobs, are left out)."""
        names = {f.name for f in dataclasses.fields(self._options_class)}
        return self._options_class(**{k: v for k, v in self.model_dump().items() if k in names})


def section_for(cls: type, name: str, doc: str, base: type = _DataclassSection,
                skip: tuple[str, ...] = ()) -> type[BaseModel]:
    """A pydantic model with one field per option of dataclass ``cls`` (declared with
    :func:`radixray.engine.options.option`): same defaults, descriptions and bounds."""
    fields: dict = {}
    for f, kind, optional in options.spec(cls):
        if f.name in skip:
            continue
        m = f.metadata
        if m.get("choices") is not None:
            kind = Literal[tuple(c for c in m["choices"] if c is not None)]
        ann = kind | None if optional else kind
        fields[f.name] = (ann, Field(f.default, description=m["help"], ge=m["ge"], gt=m["gt"],
                                     le=m["le"], lt=m["lt"], pattern=m["pattern"]))
    model = create_model(name, __base__=base, __doc__=doc, **fields)
    model._options_class = cls
    return model


class _EngineBase(_DataclassSection):
    def engine_options(self) -> dict:
        """Keyword arguments for radixray.Engine (every key is an EngineConfig field)."""
        return self.model_dump()


EngineSection = section_for(EngineConfig, "EngineSection", "Start-up options of each worker's "
                            "engine (radixray.engine.config.EngineConfig).", base=_EngineBase)


class ServerSection(BaseModel):
    """HTTP front, ingress replicas and worker placement."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="HTTP host")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port")
    route_prefix: str = Field("/", description="path prefix of every route")
    ingress: Literal["auto", "direct", "proxy"] = Field(
        "auto", description="where HTTP enters a Ray instance `radixray serve` starts itself "
        "(serve/ingress_mode.py): direct (into the ingress replica, no proxy hop), proxy "
        "(through Serve's proxy actor), auto (direct for one ingress replica)")
    served_model_name: str | None = Field(
        None, description="the model id the APIs answer to (default: 'default' or the model "
        "folder's name)")
    step_transport: Literal["tcp", "ray"] = Field(
        "tcp", description="how each scheduler step's tokens go from a worker to an ingress "
        "replica (cluster/step_socket.py): a TCP connection of their own to a port the "
        "worker's node gives it (a quarter of the CPU per message; Ray is used instead, "
        "logged, where that port cannot be reached), or Ray's streaming generator")
    ingress_replicas: int = Field(1, ge=1, description="Ray Serve replicas of the HTTP ingress")
    ingress_num_cpus: float = Field(0.0, ge=0, description="CPUs each ingress replica reserves")
    worker_num_cpus: float = Field(1.0, ge=0, description="CPUs each engine worker reserves")
    worker_num_gpus: float = Field(0.0, ge=0, description="GPUs each engine worker reserves "
                                   "(at least 1 for a CUDA engine)")
    enable_cache_report: bool = Field(True, description="report usage.prompt_tokens_details."
                                      "cached_tokens in OpenAI replies")
    health_generates: bool = Field(False, description="/health runs a one-token generation, "
                                   "like /health_generate")
    health_check_timeout_s: float = Field(20.0, gt=0, description="the probe generation of "
                                          "/health_generate fails past this many seconds")
    warmup: bool = Field(True, description="each worker generates at start-up, before it takes "
                         "traffic (a model that cannot serve one token fails to start)")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="log level of the ingress and the workers")
    worker_niceness: int | None = Field(
        0, ge=-20, le=19, description="niceness the engine worker gives its threads (Ray starts "
        "workers at 15); null keeps Ray's")
    pd_compute_nice_offset: int = Field(
        10, ge=0, le=19, description="prefill/decode workers: forward passes this much nicer "
        "than the KV transfer threads, which otherwise get half a core while both roles "
        "compute (docs/disaggregation.md)")
    slo_ttft_s: float = Field(2.0, gt=0, description="goodput (radixray:goodput_requests_total) "
                              "counts finished requests whose time to first token is within this")
    slo_tpot_s: float = Field(0.1, gt=0, description="... and whose time per output token is "
                              "within this")
    tool_call_parser: Literal["auto", "none", "hermes", "llama3", "mistral"] = Field(
        "auto", description="how tool calls are read from chat output (serve/chat_parsers.py): "
        "auto (from the chat template's call syntax, else the model family), none (tools "
        "refused), or a format")
    reasoning_parser: Literal["auto", "none", "qwen3", "qwen3-thinking", "deepseek-r1"] = Field(
        "auto", description="how <think> reasoning is split into reasoning_content: auto (when "
        "the chat template writes <think>), none (left in the content), or a parser")
    generic_tool_prompt: bool = Field(
        False, description="a model whose chat template takes no tools gets them described in "
        "a system message, with hermes <tool_call> answers (otherwise tools are a 400)")
    # SecretStr: no log or repr shows the keys
    api_key: SecretStr | None = Field(
        None, description="key the OpenAI and native APIs ask for (Authorization: Bearer; "
        "serve/auth.py); default RADIXRAY_API_KEY, else open")
    admin_api_key: SecretStr | None = Field(
        None, description="key every control route asks for; default RADIXRAY_ADMIN_API_KEY, "
        "else control routes answer on a loopback host only")
    open_routes: list[str] = Field(default_factory=lambda: list(DEFAULT_OPEN_ROUTES),
                                   description="routes answered without any key")
    # Limits on one request (serve/limits.py): a larger one is refused with a 4xx naming the
    # field and the bound before any work starts.
    max_request_body_bytes: int = Field(32 * 2**20, ge=1024, description="largest request "
                                        "body")
    max_n: int = Field(64, ge=1, le=4096, description="most choices per request (n)")
    max_stop_sequences: int = Field(16, ge=0, le=1024, description="most stop strings per "
                                    "request")
    max_top_logprobs: int = Field(20, ge=0, le=1024, description="most top logprobs per token")
    max_queued_requests: int | None = Field(
        1024, ge=1, description="backpressure: a worker with this many requests waiting for "
        "admission refuses new ones with 503 and Retry-After (after the fleet's other workers "
        "were tried); null: no bound")
    queue_full_retry_after_s: int = Field(1, ge=0, le=3600, description="the Retry-After of "
                                          "that 503, in seconds")

    @model_validator(mode="after")
    def _keys_from_the_environment(self) -> ServerSection:
        for field, variable in (("api_key", "RADIXRAY_API_KEY"),
                                ("admin_api_key", "RADIXRAY_ADMIN_API_KEY")):
            if getattr(self, field) is None and os.environ.get(variable):
                setattr(self, field, SecretStr(os.environ[variable]))
            value = getattr(self, field)
            if value is not None and len(value.get_secret_value()) < 8:
                raise ValueError(f"server.{field} must be at least 8 characters")
        return self


class FleetSection(BaseModel):
    """How many engine workers the controller starts, where, and how it watches them."""

    model_config = ConfigDict(extra="forbid")

    workers: int = Field(1, ge=0, description="unified engine workers (prefill and decode on "
                         "each), each with its own model copy and KV pool")
    prefill_workers: int = Field(
        0, ge=0, description="prefill-decode disaggregation (engine/disaggregation/): this many "
        "prefill workers, with decode_workers, instead of unified ones (workers left out or 0)")
    decode_workers: int = Field(0, ge=0, description="prefill-decode disaggregation: this many "
                                "decode workers; the KV moves between them over Mooncake (TCP)")
    prefill_engine: dict = Field(
        default_factory=dict, description="engine options of the prefill workers, over the "
        "engine section (e.g. chunked_prefill_size)")
    decode_engine: dict = Field(
        default_factory=dict, description="engine options of the decode workers, over the "
        "engine section (e.g. max_running_requests)")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement-group strategy of the workers' bundles")
    health_check_interval_s: float = Field(1.0, gt=0, description="how often the controller "
                                           "pings each worker")
    health_check_timeout_s: float = Field(10.0, gt=0, description="a ping unanswered this long "
                                          "marks the worker unhealthy")
    restart_dead_workers: bool = Field(True, description="the controller restarts a worker "
                                       "whose process died")
    max_restarts: int = Field(20, ge=0, description="restarts per worker; past it the worker "
                              "stays dead")
    owner_timeout_s: float = Field(
        30.0, gt=0, description="the controller outlives any one ingress replica; it stops the "
        "fleet once no ingress replica has sent a heartbeat for this long (the app was deleted "
        "or redeployed)")
    actor_max_restarts: int = Field(
        -1, ge=-1, description="Ray restarts the controller and router actors after their "
        "process dies this many times (-1: always); workers are restarted by the controller "
        "(max_restarts)")
    autoscaling: AutoscalingSection | None = Field(
        None, description="scale the workers between bounds on their load "
        "(docs/autoscaling.md); null: a fixed fleet")

    @model_validator(mode="after")
    def _roles(self) -> FleetSection:
        p, d = self.prefill_workers, self.decode_workers
        if not p and not d:
            if self.workers < 1:
                raise ValueError("fleet.workers must be at least 1 (or set fleet.prefill_workers "
                                 "and fleet.decode_workers)")
            if self.prefill_engine or self.decode_engine:
                raise ValueError("fleet.prefill_engine / fleet.decode_engine apply only with "
                                 "fleet.prefill_workers and fleet.decode_workers")
            self._check_autoscaling()
            return self
        if p < 1 or d < 1:
            raise ValueError(f"prefill-decode disaggregation needs fleet.prefill_workers >= 1 and "
                             f"fleet.decode_workers >= 1, got {p} and {d}")
        if "workers" in self.model_fields_set and self.workers:
            raise ValueError(f"fleet.workers={self.workers} (unified workers) cannot be mixed with "
                             f"fleet.prefill_workers / fleet.decode_workers: leave fleet.workers "
                             f"out or set it to 0")
        self.workers = 0
        for name, overrides in (("prefill_engine", self.prefill_engine),
                                ("decode_engine", self.decode_engine)):
            bad = sorted(set(overrides) - set(EngineSection.model_fields))
            if bad or "disaggregation_mode" in overrides:
                raise ValueError(f"fleet.{name}: unknown or fixed engine option(s) "
                                 f"{bad or ['disaggregation_mode']}")
        self._check_autoscaling()
        return self

    def _check_autoscaling(self) -> None:
        if self.autoscaling is not None:
            self.autoscaling.check_counts(self.role_counts())

    def role_counts(self) -> dict[str, int]:
        """Starting workers by role."""
        if self.disaggregated:
            return {"prefill": self.prefill_workers, "decode": self.decode_workers}
        return {"unified": self.workers}

    def max_workers(self) -> int:
        """The most workers the fleet runs at once (its starting count when fixed)."""
        counts = self.role_counts()
        if self.autoscaling is None:
            return sum(counts.values())
        policies = self.autoscaling.policies(counts, 1.0, 1.0)
        return sum(policies[r].max_workers if r in policies else n for r, n in counts.items())

    @property
    def disaggregated(self) -> bool:
        return self.prefill_workers > 0

    def roles(self) -> list[str]:
        """One role per worker slot, in worker index order."""
        if self.disaggregated:
            return ["prefill"] * self.prefill_workers + ["decode"] * self.decode_workers
        return ["unified"] * self.workers


class _RouterBase(_DataclassSection):
    # The retry knobs belong to the ingress's dispatcher, not to the routing core.
    retry_max_attempts: int = Field(3, ge=1, description="attempts to place a request that "
                                    "failed before its first token, on different workers")
    retry_backoff_s: float = Field(0.1, ge=0, description="sleep before a retry; doubles per "
                                   "retry, capped at 2 s")

    def settings(self) -> RouterSettings:
        """The routing core's settings."""
        return self.options()


RouterSection = section_for(RouterSettings, "RouterSection", "Which worker a request goes to, "
                            "and what happens when that worker fails.", base=_RouterBase)


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
        return cls.parse(merge(read_yaml_mapping(path), overrides or {}))

    @model_validator(mode="after")
    def _role_engines(self) -> ServeConfig:
        if self.engine.disaggregation_mode is not None:
            raise ValueError("engine.disaggregation_mode is set per worker by the fleet: use "
                             "fleet.prefill_workers and fleet.decode_workers")
        if self.engine.ep_size > 1 and self.fleet.autoscaling is not None:
            raise ValueError(f"fleet.autoscaling with engine.ep_size={self.engine.ep_size} is "
                             f"not supported yet (an expert-parallel group scales whole)")
        if self.engine.ep_size > 1 and self.fleet.disaggregated:
            raise ValueError(f"engine.ep_size={self.engine.ep_size} with prefill-decode "
                             f"disaggregation (fleet.prefill_workers) is not supported yet")
        for role in ("prefill", "decode"):
            if self.fleet.disaggregated:
                try:
                    EngineSection.model_validate(self.engine_options_for(role))
                except ValidationError as exc:
                    raise ValueError(f"fleet.{role}_engine: "
                                     f"{format_validation_error(exc, role + '_engine')}") from None
        return self

    def autoscaling_policies(self) -> dict[str, RolePolicy]:
        """Role -> its scaling policy ({} for a fixed fleet)."""
        scaling = self.fleet.autoscaling
        if scaling is None:
            return {}
        return scaling.policies(self.fleet.role_counts(), self.server.slo_ttft_s,
                                self.server.slo_tpot_s)

    def role_bundles(self, role: str) -> list[dict]:
        """The bundles of one worker of ``role`` in a placement group of its own (an
        autoscaled fleet's): one per tensor-parallel rank; [] when workers reserve nothing."""
        bundle = self.rank_bundle()
        return [dict(bundle) for _ in range(self.engine_options_for(role)["tp_size"])] \
            if bundle else []

    def slot_roles(self) -> list[str]:
        """One role per worker actor, in slot order: each worker of ``fleet.roles()`` is
        ``engine.ep_size`` consecutive rank actors (an expert-parallel group)."""
        return [role for role in self.fleet.roles() for _ in range(self.engine.ep_size)]

    def engine_options_for(self, role: str) -> dict:
        """The engine options of a worker of ``role`` (unified, prefill or decode)."""
        opts = self.engine.engine_options()
        if role != "unified":
            opts.update(getattr(self.fleet, f"{role}_engine"))
            opts["disaggregation_mode"] = role
        return opts

    def rank_resources(self) -> tuple[float, float]:
        """(CPUs, GPUs) each rank actor reserves: a worker actor, and each follower rank
        actor of a tensor-parallel worker (actors/tp_ranks.py)."""
        return self.server.worker_num_cpus, self.server.worker_num_gpus

    def rank_bundle(self) -> dict:
        """The resources one rank's placement bundle asks for ({} when none)."""
        return {k: v for k, v in zip(("CPU", "GPU"), self.rank_resources()) if v > 0}

    def slot_bundles(self) -> list[list[int]]:
        """Each worker slot's bundle indices in the fleet's placement group, in slot order:
        ``tp_size`` of its role consecutive bundles (the worker actor in the first, its
        follower ranks in the others; prefill and decode may differ in tp_size)."""
        out, at = [], 0
        for role in self.slot_roles():
            tp = self.engine_options_for(role)["tp_size"]
            out.append(list(range(at, at + tp)))
            at += tp
        return out

    def worker_bundles(self) -> list[dict]:
        """The fleet placement group's bundles (empty when workers reserve nothing, or when
        each worker has a group of its own: an autoscaled fleet, see role_bundles)."""
        bundle = self.rank_bundle()
        if not bundle or self.fleet.autoscaling is not None:  # a group per worker instead
            return []
        return [dict(bundle) for slot in self.slot_bundles() for _ in slot]

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

    def worker_name(self, worker_id: str) -> str:
        """The named actor of a worker slot (found again by a restarted controller)."""
        return f"{self.app_name}-{worker_id}-{self.fleet_key()}"


def read_yaml_mapping(path: str) -> dict:
    """A YAML file's top-level mapping (empty file: {}); ConfigError for anything else."""
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


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
