"""``fleet.autoscaling``: the user-facing section (YAML, ``build_app``) and the per-role
:class:`~radixray.cluster.autoscaling.RolePolicy` it becomes. Names follow Ray Serve's
``autoscaling_config`` (``target_ongoing_requests``, ``upscale_delay_s``,
``downscale_delay_s``, ``look_back_period_s``), with workers for replicas.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from radixray.cluster.autoscaling import RolePolicy

PREFILL_QUEUE_DEFAULT = 2.0  # requests waiting per prefill worker
DECODE_KV_DEFAULT = 0.8  # share of each decode worker's KV pool in use


def _ordered(section, prefix: str):
    """``section`` unless its max_workers is below its min_workers (ValueError naming both)."""
    if section.max_workers < section.min_workers:
        raise ValueError(f"{prefix}max_workers={section.max_workers} is below "
                         f"{prefix}min_workers={section.min_workers}")
    return section


class RoleScaling(BaseModel):
    """Bounds and load target of one role of a prefill-decode fleet; its latency target
    is the server's SLO (``server.slo_ttft_s`` for prefill, ``server.slo_tpot_s`` for
    decode)."""

    model_config = ConfigDict(extra="forbid")

    min_workers: int = Field(1, ge=1, description="fewest workers of this role")
    max_workers: int = Field(1, ge=1, description="most workers of this role")
    target_queue_length: float | None = Field(
        None, gt=0, description="requests waiting for admission per worker (prefill default "
        f"{PREFILL_QUEUE_DEFAULT:g}; decode: off unless set)")
    target_kv_usage: float | None = Field(
        None, gt=0, le=1, description="share of each worker's KV pool in use (decode default "
        f"{DECODE_KV_DEFAULT:g}; prefill: off unless set)")

    @model_validator(mode="after")
    def _bounds(self) -> RoleScaling:
        return _ordered(self, "")


class AutoscalingSection(BaseModel):
    """The fleet scales between ``min_workers`` and ``max_workers`` on its load
    (cluster/autoscaling.py has the rule; docs/autoscaling.md the guide). The fleet starts
    with ``fleet.workers`` (prefill-decode: ``fleet.prefill_workers`` and
    ``fleet.decode_workers``), which must lie within the bounds."""

    model_config = ConfigDict(extra="forbid")

    min_workers: int = Field(1, ge=1, description="fewest unified workers")
    max_workers: int = Field(1, ge=1, description="most unified workers")
    target_ongoing_requests: float | None = Field(
        2.0, gt=0, description="in-flight requests (running and queued) per unified worker, "
        "as Ray Serve's target_ongoing_requests; null: not a signal")
    target_queue_length: float | None = Field(
        None, gt=0, description="requests waiting for admission per unified worker")
    target_kv_usage: float | None = Field(
        None, gt=0, le=1, description="share of each unified worker's KV pool in use")
    upscale_delay_s: float = Field(30.0, ge=0, description="a scale-up acts only after "
                                   "scale-up proposals for this long without a break")
    downscale_delay_s: float = Field(600.0, ge=0, description="a scale-down acts only "
                                     "after scale-down proposals for this long without a break")
    look_back_period_s: float = Field(30.0, gt=0, description="load figures are averaged, and "
                                      "latencies taken, over this window")
    decision_interval_s: float = Field(10.0, gt=0, description="how often the controller "
                                       "samples the workers' load and decides")
    downscale_tolerance: float = Field(
        0.1, ge=0, lt=1, description="hysteresis: a scale-down needs every signal to stay this "
        "far below its target on the smaller fleet")
    drain_timeout_s: float = Field(
        600.0, gt=0, description="a worker drained away is stopped once its requests finish, "
        "or after this long (the rest are then aborted)")
    prefill: RoleScaling | None = Field(
        None, description="prefill-decode fleets: bounds and queue target of the prefill "
        "workers (scaled on server.slo_ttft_s and their queue); left out: a fixed count")
    decode: RoleScaling | None = Field(
        None, description="prefill-decode fleets: bounds and KV target of the decode workers "
        "(scaled on server.slo_tpot_s and their KV usage); left out: a fixed count")

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSection:
        return _ordered(self, "fleet.autoscaling.")

    def check_counts(self, counts: dict[str, int]) -> None:
        """ValueError (naming the fields) unless each role's starting count lies within its
        bounds. ``counts``: role -> starting workers."""
        if "unified" in counts:
            if self.prefill is not None or self.decode is not None:
                raise ValueError("fleet.autoscaling.prefill / decode apply only to a "
                                 "prefill-decode fleet (fleet.prefill_workers, "
                                 "fleet.decode_workers)")
            if not any((self.target_ongoing_requests, self.target_queue_length,
                        self.target_kv_usage)):
                raise ValueError("fleet.autoscaling needs a target: target_ongoing_requests, "
                                 "target_queue_length or target_kv_usage")
            n = counts["unified"]
            if not self.min_workers <= n <= self.max_workers:
                raise ValueError(f"fleet.workers={n} must lie within fleet.autoscaling."
                                 f"min_workers..max_workers ({self.min_workers}..."
                                 f"{self.max_workers})")
            return
        # set away from their defaults (a dumped and re-read config sets every field)
        used = {name for name in ("min_workers", "max_workers", "target_ongoing_requests",
                                  "target_queue_length", "target_kv_usage")
                if getattr(self, name) != type(self).model_fields[name].default}
        if used:
            raise ValueError(f"fleet.autoscaling.{sorted(used)[0]} applies to unified workers; "
                             f"a prefill-decode fleet sets fleet.autoscaling.prefill and "
                             f"fleet.autoscaling.decode")
        for role in ("prefill", "decode"):
            bounds, n = getattr(self, role), counts[role]
            if bounds is not None and not bounds.min_workers <= n <= bounds.max_workers:
                raise ValueError(f"fleet.{role}_workers={n} must lie within fleet.autoscaling."
                                 f"{role}.min_workers..max_workers ({bounds.min_workers}.."
                                 f"{bounds.max_workers})")

    def policies(self, counts: dict[str, int], slo_ttft_s: float,
                 slo_tpot_s: float) -> dict[str, RolePolicy]:
        """One policy per role that scales (a prefill-decode role without bounds keeps its
        starting count and gets none)."""
        timing = dict(upscale_delay_s=self.upscale_delay_s,
                      downscale_delay_s=self.downscale_delay_s,
                      look_back_period_s=self.look_back_period_s,
                      downscale_tolerance=self.downscale_tolerance)
        if "unified" in counts:
            targets = {"ongoing_requests": self.target_ongoing_requests,
                       "queue_length": self.target_queue_length,
                       "kv_usage": self.target_kv_usage}
            return {"unified": RolePolicy("unified", self.min_workers, self.max_workers,
                                          {k: v for k, v in targets.items() if v}, **timing)}
        out = {}
        for role, latency in (("prefill", {"ttft_s": slo_ttft_s}),
                              ("decode", {"tpot_s": slo_tpot_s})):
            bounds = getattr(self, role)
            if bounds is None:
                continue
            queue = bounds.target_queue_length or (PREFILL_QUEUE_DEFAULT if role == "prefill"
                                                   else None)
            kv = bounds.target_kv_usage or (DECODE_KV_DEFAULT if role == "decode" else None)
            targets = {**latency, "queue_length": queue, "kv_usage": kv}
            out[role] = RolePolicy(role, bounds.min_workers, bounds.max_workers,
                                   {k: v for k, v in targets.items() if v}, **timing)
        return out
