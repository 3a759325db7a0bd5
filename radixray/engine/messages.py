"""What the engine sends out of its process: one request's progress per scheduler step
(:class:`RequestUpdate`) and its accounting once finished (:class:`MetaInfo`).

Plain dataclasses with slots: cheap to build on the scheduler thread, pickled by Ray by
reference to this module, read by attribute on the other side. :meth:`MetaInfo.to_json`
is the ``meta_info`` object of the HTTP and in-process APIs.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixray.engine.request import FinishReason, Req

# The torch.distributed group a trainer's weight broadcast uses when the caller names none
# (SGLang's default name); callers that never touch tensors import it from here.
DEFAULT_GROUP = "weight_update_group"


@dataclass(slots=True)
class MetaInfo:
    """Per-request accounting, sent with a request's last update."""

    id: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_time: float | None  # arrival -> first admission
    first_token_latency: float | None
    e2e_latency: float | None
    num_retractions: int
    weight_version: int | str = 0  # the weights that produced its last token
    # [{"weight_version", "start", "end"}] output token index ranges per version, when
    # the request lived through a weight update (None otherwise)
    weight_versions: list[dict] | None = None
    worker_id: str | None = None  # set by the ingress that routed the request
    # return_routed_experts: [token][MoE layer][k] logical expert ids of the tokens at
    # positions routed_experts_start.. (engine/models/routed_experts.py says which); else None
    routed_experts: list | None = None
    routed_experts_start: int | None = None
    # speculative decoding: verify forwards with a draft, and tokens committed per one
    # (shown only when the request had a verify forward)
    spec_verify_ct: int = 0
    spec_accept_length: float | None = None
    # LoRA: the adapter the request ran with and its version at the last token (None: base)
    lora_path: str | None = None
    lora_version: int | str | None = None

    @classmethod
    def of(cls, req: Req, weight_version: int | str = 0) -> MetaInfo:
        """``weight_version``: the engine's version now, for a request never admitted."""
        t0 = req.arrival_time
        spans = req.weight_spans
        routes = req.routed_experts
        asked = req.sampling.return_routed_experts
        return cls(
            id=req.rid, finish_reason=req.finish_reason, prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids), cached_tokens=req.cached_tokens,
            queue_time=(req.admit_time - t0) if req.admit_time else None,
            first_token_latency=(req.first_token_time - t0) if req.first_token_time else None,
            e2e_latency=(req.finish_time - t0) if req.finish_time else None,
            num_retractions=req.num_retractions,
            weight_version=spans[-1][0] if spans else weight_version,
            weight_versions=version_ranges(spans, len(req.output_ids)) if len(spans) > 1 else None,
            routed_experts=(routes.to_list() if routes is not None else []) if asked else None,
            routed_experts_start=(routes.start if routes is not None else req.cached_tokens)
            if asked else None,
            spec_verify_ct=req.spec_verify_ct,
            spec_accept_length=(req.spec_accepted_tokens / req.spec_verify_ct)
            if req.spec_verify_ct else None,
            lora_path=req.lora, lora_version=req.lora_version if req.lora else None)

    def to_json(self) -> dict:
        """The ``meta_info`` object users see (``worker_id`` only when routed)."""
        out = {"id": self.id,
               "finish_reason": self.finish_reason.to_dict() if self.finish_reason else None,
               "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
               "cached_tokens": self.cached_tokens, "queue_time": self.queue_time,
               "first_token_latency": self.first_token_latency,
               "e2e_latency": self.e2e_latency, "num_retractions": self.num_retractions,
               "weight_version": self.weight_version}
        if self.weight_versions is not None:
            out["weight_versions"] = self.weight_versions
        if self.worker_id is not None:
            out["worker_id"] = self.worker_id
        if self.routed_experts is not None:
            out["routed_experts"] = self.routed_experts
            out["routed_experts_start"] = self.routed_experts_start
        if self.spec_verify_ct:
            out["spec_verify_ct"] = self.spec_verify_ct
            out["spec_accept_length"] = self.spec_accept_length
        if self.lora_path is not None:
            out["lora_path"] = self.lora_path
            out["lora_version"] = self.lora_version
        return out


def version_ranges(spans: list[list], n_output: int) -> list[dict]:
    """``[[version, first index], ...]`` -> ``[{"weight_version", "start", "end"}]`` over the
    ``n_output`` output tokens (``end`` exclusive)."""
    ends = [start for _, start in spans[1:]] + [n_output]
    return [{"weight_version": v, "start": start, "end": end}
            for (v, start), end in zip(spans, ends)]


@dataclass(slots=True)
class RequestUpdate:
    """The output one request produced since its last update.

    ``logprobs`` / ``top_logprobs`` are set when the request asked for them. With
    ``return_logprob`` the first update after the prompt's prefill carries its prompt
    logprobs: ``input_logprobs``, one per prompt position from ``logprob_start_len`` to the
    end (the first None), and ``input_top_logprobs`` when top logprobs were asked
    (engine/executor/prompt_logprobs.py). ``meta`` comes with the last update. A request
    that failed has ``error`` (the message) and ``status`` (500: its batch failed, not
    retried; 503: its engine or worker went down, retried before the first token).
    """

    rid: str
    ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    meta: MetaInfo | None = None
    error: str | None = None
    status: int | None = None

    @property
    def finished(self) -> bool:
        return self.meta is not None or self.error is not None

    @classmethod
    def failure(cls, rid: str, error: str, status: int) -> RequestUpdate:
        """An update that ends a request without output (its worker went away)."""
        return cls(rid=rid, ids=[], error=error, status=status)
