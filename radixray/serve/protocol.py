"""Request schemas of the HTTP APIs (OpenAI-compatible and native) and their sampling params.

Schema errors (wrong types, out-of-range values, unknown roles, fields this server does not
implement) become HTTP 400 with an OpenAI-style error object naming the field (serve/ingress.py).
No field is dropped silently: every request model forbids unknown fields, and the few OpenAI
fields that cannot change the output (``user``, ``metadata``, ``store``, ``service_tier``)
are declared, accepted and ignored. A field that is
also an engine sampling parameter takes its bounds from the engine's declaration
(:class:`radixray.engine.sampling.SamplingParams`), so the two never disagree.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from radixray.cluster.routing import PolicyName
from radixray.engine.control import MemoryTag, PauseMode, ReleasableDuringUpdate
from radixray.engine.grammar.spec import JSON_OBJECT_SCHEMA
from radixray.engine.request_ids import MAX_RID_LENGTH
from radixray.engine.sampling import bounds
from radixray.engine.weights.version import check_version

# A request id a client gives (``rid``; serve/request_id.py)
RequestId = Annotated[str, Field(min_length=1, max_length=MAX_RID_LENGTH)]


def _engine_bounded(name: str, default=None):
    """A request field checked against the bounds of the engine's sampling param ``name``."""
    return Field(default, **bounds(name))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    # vLLM's extension (load generators such as guidellm send it): with include_usage, the
    # usage so far in every chunk too
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema output must satisfy. ``strict`` is taken
    either way: the grammar always enforces the schema (xgrammar's strict mode)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI ``response_format``: text (no constraint), any JSON object, or a JSON schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> str | None:
        """The engine's ``json_schema`` for this format (None for text); ValueError when a
        json_schema format has no schema."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return JSON_OBJECT_SCHEMA
        if self.json_schema is None:
            raise ValueError("response_format.json_schema is required when type is json_schema")
        return json.dumps(self.json_schema.schema_)


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI names + extensions)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = Field(1, ge=1)  # bounded by server.max_n (serve/limits.py)
    # OpenAI asks for at least one token (the engine's max_new_tokens may be 0)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = _engine_bounded("temperature")
    top_p: float | None = _engine_bounded("top_p")
    top_k: int | None = _engine_bounded("top_k")
    min_p: float | None = _engine_bounded("min_p")
    seed: int | None = _engine_bounded("seed")
    presence_penalty: float | None = _engine_bounded("presence_penalty")
    frequency_penalty: float | None = _engine_bounded("frequency_penalty")
    repetition_penalty: float | None = _engine_bounded("repetition_penalty")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # Accepted and ignored: OpenAI fields that label or store a request, never change output.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # SGLang's extension: the request's id, for POST /abort_request (the X-Request-Id header
    # gives it too; serve/request_id.py)
    rid: RequestId | None = None

    def sampling_params(self, max_tokens: int, choice: int = 0) -> dict:
        """Engine sampling params for choice ``choice`` (seeds differ per choice when n > 1)."""
        sp: dict = {"max_new_tokens": max_tokens, "ignore_eos": self.ignore_eos,
                    "skip_special_tokens": self.skip_special_tokens,
                    "temperature": 1.0 if self.temperature is None else self.temperature}
        for name in ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None:
                sp[name] = value
        if self.stop is not None:
            sp["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.seed is not None:
            sp["seed"] = self.seed + choice
        if self.response_format is not None and (schema := self.response_format.constraint()):
            sp["json_schema"] = schema
        return sp

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every streamed chunk carries the usage so far."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = _engine_bounded("top_logprobs_num")  # and by server.max_top_logprobs
    # 0 only with echo (the prompt's logprobs alone, as lm-eval's loglikelihood asks);
    # openai_serving.completion refuses it otherwise
    max_tokens: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None  # refused when set (400)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


# OpenAI's rule for function names
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class FunctionDefinition(BaseModel):
    """A tool's function: its name, what it does, and its arguments' JSON schema (none:
    it takes no arguments). ``strict`` is taken either way: a constrained call always
    follows the schema."""

    model_config = ConfigDict(extra="forbid")

    name: FunctionName
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: exactly that call."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionChoice


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it


class ToolCall(BaseModel):
    """A call in an assistant message of the history."""

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this answers
    reasoning_content: str | None = None  # assistant messages (a reasoning model's thoughts)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = _engine_bounded("top_logprobs_num")  # and server.max_top_logprobs
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # SGLang's extensions: reasoning in message.reasoning_content (false: left in content),
    # and keyword arguments of the chat template (enable_thinking, ...)
    separate_reasoning: bool = True
    chat_template_kwargs: dict | None = None

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, tools):
        names = [t.function.name for t in tools or ()]
        if len(set(names)) != len(names):
            raise ValueError(f"function names must be unique; got {names}")
        return tools


class GenerateRequest(BaseModel):
    """Native /generate: text or input_ids, engine sampling_params, optional streaming."""

    model_config = ConfigDict(extra="forbid")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = _engine_bounded("top_logprobs_num", 0)  # and server.max_top_logprobs
    # with return_logprob: meta_info.input_token_logprobs from this prompt position (SGLang's
    # -1: only the last prompt token's entry); return_text_in_logprobs fills each entry's text
    logprob_start_len: int = _engine_bounded("logprob_start_len", -1)
    return_text_in_logprobs: bool = False
    # MoE models: meta_info.routed_experts (as SGLang's field; the same as the sampling param)
    return_routed_experts: bool = False
    # One id for the request (a batch's prompts run as rid_0, rid_1, ...) or one per prompt;
    # for POST /abort_request (serve/request_id.py)
    rid: RequestId | list[RequestId] | None = None
    priority: int | None = None
    # the LoRA adapter's name (SGLang's field): one for every prompt or one (or null) per prompt
    lora_path: str | list[str | None] | None = None


class PauseGeneration(BaseModel):
    """POST /pause_generation: how running requests are treated while paused."""

    model_config = ConfigDict(extra="forbid")

    mode: PauseMode = "abort"


class MemoryTags(BaseModel):
    """POST /release_memory_occupation, /resume_memory_occupation (null: every tag)."""

    model_config = ConfigDict(extra="forbid")

    tags: list[MemoryTag] | None = None


class _FleetUpdate(BaseModel):
    """How a fleet-wide weight update runs (see actors/weight_rollout.py)."""

    model_config = ConfigDict(extra="forbid")

    weight_version: int | str | None = Field(None, description=(
        "an int greater than every int version served so far, or a string label as in SGLang "
        "('v1', a step tag; no order, may repeat); default: the next int"))
    pause_mode: PauseMode | None = "retract"
    release_memory: list[ReleasableDuringUpdate] = []
    keep_paused: bool = False
    lora_name: str | None = Field(None, min_length=1, description=(
        "update this served LoRA adapter instead of the base weights: PEFT-named tensors (a "
        "PEFT folder from disk: the whole adapter), under the adapter's own version "
        "(weight_version then names it; the base version stays)"))

    @field_validator("weight_version", mode="before")
    @classmethod
    def _version_shape(cls, v):
        """An int >= 1 (not a bool or a float) or a non-empty label; the fleet checks the
        order against the versions it served."""
        return v if v is None else check_version(v, 0, "the first load is version 0")


class UpdateWeightsFromDisk(_FleetUpdate):
    """POST /update_weights_from_disk: a Hugging Face folder or .safetensors file that every
    worker can read."""

    model_path: str = Field(min_length=1)


class UpdateWeightVersion(BaseModel):
    """POST /update_weight_version (SGLang's): rename the weights every worker serves, no
    transfer; the same rules as an update's weight_version."""

    model_config = ConfigDict(extra="forbid")

    new_version: int | str = Field(description="an int greater than every int version served "
                                   "so far, or a string label")
    abort_all_requests: bool = Field(False, description="not supported: true is refused")

    @field_validator("new_version", mode="before")
    @classmethod
    def _version_shape(cls, v):
        return check_version(v, 0, "the first load is version 0")

    @field_validator("abort_all_requests")
    @classmethod
    def _no_abort(cls, v: bool) -> bool:
        if v:
            raise ValueError("abort_all_requests is not supported here: abort the requests "
                             "first (POST /abort_request with abort_all), then rename")
        return v


class DestroyWeightsUpdateGroup(BaseModel):
    """POST /destroy_weights_update_group: every worker leaves the trainer's group."""

    model_config = ConfigDict(extra="forbid")

    group_name: str = "weight_update_group"


class InitWeightsUpdateGroup(BaseModel):
    """POST /init_weights_update_group: every worker joins the trainer's (rank 0) group."""

    model_config = ConfigDict(extra="forbid")

    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: float = Field(120.0, gt=0, le=3600, description="how long to wait for every rank")


class UpdateWeightsFromDistributed(_FleetUpdate):
    """POST /update_weights_from_distributed: receive the trainer's broadcast of these
    tensors, in this order, over ``group_name``."""

    names: list[str] = Field(min_length=1)
    dtypes: list[Literal["float32", "float16", "bfloat16"]]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"


class LoadLoraAdapter(BaseModel):
    """POST /load_lora_adapter (SGLang's body): serve a PEFT adapter on every worker."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(description="the adapter's name: requests give it as model "
                           "(alone or '<model>:<name>') or as lora_path")
    lora_path: str = Field(description="the PEFT folder (adapter_config.json + "
                           "adapter_model.safetensors), as the workers see it")


class UnloadLoraAdapter(BaseModel):
    """POST /unload_lora_adapter (SGLang's body): stop serving an adapter on every worker."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(description="the adapter's name")


class UpdateLoraAdapter(BaseModel):
    """POST /update_lora_adapter: new weights for a served adapter on every worker (RL with
    a LoRA policy), under the adapter's own version."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(description="the adapter's name")
    lora_path: str = Field(description="the PEFT folder of its new weights")
    lora_version: int | str | None = Field(None, description="an int greater than every int "
                                           "version the adapter served, or a string label; "
                                           "null: the next int")


class RouterUpdate(BaseModel):
    """POST /fleet/router: change the routing policy at run time."""

    model_config = ConfigDict(extra="forbid")

    policy: PolicyName


class AbortRequest(BaseModel):
    """POST /abort_request (SGLang's body): the request ``rid`` (and the choices derived
    from it), or every request with ``abort_all``; exactly one of the two."""

    model_config = ConfigDict(extra="forbid")

    rid: RequestId | None = None
    abort_all: bool = False
