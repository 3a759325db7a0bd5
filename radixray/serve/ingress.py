"""The HTTP front: a Ray Serve deployment wrapping a FastAPI app (no `from __future__
import annotations` here: FastAPI must see the real annotation objects).

Routes: POST /v1/chat/completions, /v1/completions, /generate, /flush_cache, /abort_request;
GET /v1/models, /metrics, /health, /health_generate, /ready; fleet admin: GET
/fleet, POST /fleet/workers/{id}/drain, /fleet/workers/{id}/resume, /fleet/router,
/fleet/eplb/rebalance;
RL control (every worker; see actors/weight_rollout.py): POST /pause_generation,
/continue_generation, /release_memory_occupation, /resume_memory_occupation,
/update_weights_from_disk, /init_weights_update_group, /update_weights_from_distributed,
/destroy_weights_update_group, /update_weight_version (a new name, no transfer),
/load_lora_adapter, /unload_lora_adapter, /update_lora_adapter (on every worker:
actors/fleet_lora.py);
GET /get_weight_version. Tensor updates from a colocated trainer go through the
controller's Ray handle (``update_weights`` with a tensor source), not HTTP.
Every error is an OpenAI-style ``{"error": {...}}`` body; schema errors are 400
and name the field. The generation routes read an ``X-Session-Id`` header: with
session affinity on, requests of one session go to one worker; and an ``X-Request-Id``
header (the request's id for /abort_request unless the body gives ``rid``, and then sent
back in the response's header: serve/request_id.py).
"""


import asyncio
import gc
import logging
import threading
import time
import uuid

from fastapi import FastAPI, Header
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve

from radixray.cluster.config import ServeConfig
from radixray.cluster.errors import actor_unreachable
from radixray.cluster.weight_sources import DiskWeights, DistributedWeights, WeightSource
from radixray.serve import chat_serving, native_serving, openai_serving
from radixray.serve.api_error import ApiError
from radixray.serve.app_errors import install_error_handlers
from radixray.serve.auth import AuthMiddleware, AuthPolicy, install_policy
from radixray.serve.chat_parsers import ChatFeatures
from radixray.serve.frontend import Frontend
from radixray.serve.http_metrics import HttpMetricsMiddleware, replica_metrics
from radixray.serve.limits import BodySizeLimit, RequestLimits, install_body_limit
from radixray.serve.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DestroyWeightsUpdateGroup,
    GenerateRequest,
    InitWeightsUpdateGroup,
    LoadLoraAdapter,
    MemoryTags,
    PauseGeneration,
    RouterUpdate,
    UnloadLoraAdapter,
    UpdateLoraAdapter,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    UpdateWeightVersion,
)
from radixray.serve.request_id import REQUEST_ID_HEADER, base_rid

logger = logging.getLogger("radixray.ingress")

app = FastAPI(title="radixray", description="OpenAI-compatible and native LLM serving")
app.add_middleware(BodySizeLimit)
app.add_middleware(AuthMiddleware)  # around the body limit: no key, no body read
app.add_middleware(HttpMetricsMiddleware)  # around the key check: refused requests count too
install_error_handlers(app)
HEALTH_PROMPT = "The capital city of France is"


def _import_tokenizer_libraries() -> None:
    import transformers  # noqa: F401

    import radixray.engine.weights.loader  # noqa: F401


def _respond(result, rid: str | None = None, header_rid: str | None = None):
    """JSON or SSE. ``rid``: the request's base id, sent back as X-Request-Id unless the
    request came with that header (``header_rid``): Ray Serve's proxy, which sets it on
    every request, echoes it on the response itself (serve/request_id.py)."""
    headers = {REQUEST_ID_HEADER: rid} if isinstance(rid, str) and header_rid is None else None
    if isinstance(result, (dict, list)):
        return JSONResponse(result, headers=headers)
    return ClosingStreamingResponse(result, media_type="text/event-stream", headers=headers)


class ClosingStreamingResponse(StreamingResponse):
    """A streaming response that closes its body iterator however it ends. A client that
    goes away cancels the response, often while it is sending a chunk rather than pulling
    the next one from the stream; the stream, suspended at its ``yield``, would then be
    closed only when garbage-collected, and its request would keep running (and holding
    its KV) on the worker until then. Closing it at once aborts the request."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


@serve.ingress(app)
class Ingress:
    """One ingress replica: tokenizer + routed channels to the engine workers."""

    def __init__(self, config: dict):
        import ray

        from radixray.cluster.metrics import FleetCollector
        from radixray.serve.dispatch import Dispatcher
        from radixray.serve.fleet import (
            find_router,
            get_or_create_controller,
            owner_beat_interval,
            start_heartbeats,
        )

        self.cfg = ServeConfig.parse(config)
        install_policy(AuthPolicy.from_server(self.cfg.server))
        install_body_limit(self.cfg.server.max_request_body_bytes)
        logging.basicConfig(level=self.cfg.server.log_level.upper(),
                            format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
        self.controller = get_or_create_controller(self.cfg)
        # torch and transformers take seconds to import: do it while the workers load
        libraries = threading.Thread(target=_import_tokenizer_libraries, daemon=True)
        libraries.start()
        self.http_metrics = replica_metrics()
        self.owner = self.http_metrics.replica = f"ingress-{uuid.uuid4().hex[:8]}"
        start_heartbeats(self.controller, self.owner, owner_beat_interval(self.cfg),
                         families=self.http_metrics.families)
        info = ray.get(self.controller.start.remote())  # waits for the workers to load
        libraries.join()
        from radixray.engine.weights.loader import resolve_model
        source = resolve_model(info.model)
        tokenizer = source.tokenizer
        server = self.cfg.server
        chat = ChatFeatures.detect(tokenizer, source.config, server.tool_call_parser,
                                   server.reasoning_parser, server.generic_tool_prompt)
        logger.info("chat API: %s", chat.describe())
        from radixray.serve.pd_dispatch import PDDispatcher
        dispatcher_class = PDDispatcher if self.cfg.fleet.disaggregated else Dispatcher
        dispatcher = dispatcher_class(self.controller, find_router(self.cfg),
                                      self.cfg.router.retry_max_attempts,
                                      self.cfg.router.retry_backoff_s,
                                      step_transport=server.step_transport)
        self.fe = Frontend(tokenizer, info, self.cfg.server.served_model_name, dispatcher,
                           enable_cache_report=self.cfg.server.enable_cache_report,
                           limits=RequestLimits.from_server(self.cfg.server), chat=chat,
                           adapter_source=lambda: self.controller.lora_adapters.remote())
        self.collector = FleetCollector()
        from prometheus_client import CollectorRegistry
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self._ready = False
        self._start_lock: asyncio.Lock | None = None
        self._start_task: asyncio.Task | None = None
        self._probe: asyncio.Future | None = None  # the /health_generate probe in flight

    async def _ensure_ready(self) -> bool:
        """Open the worker channel and warm the path up once (first call does the work)."""
        if self._ready:
            return True
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if not self._ready:
                t0 = time.perf_counter()
                await self.fe.dispatcher.start()
                if self.cfg.server.warmup:
                    await self._generate_one(timeout=300)
                gc.collect()
                gc.freeze()
                self._ready = True
                logger.info("radixray ingress ready in %.2f s: model %r, context %d tokens",
                            time.perf_counter() - t0, self.fe.served_model_name,
                            self.fe.context_len)
        return True

    async def _generate_one(self, timeout: float) -> None:
        """Generate one token end to end; the request is aborted if ``timeout`` hits."""
        choices, streams = await self.fe.start([self.fe.encode(HEALTH_PROMPT)],
                                               [{"max_new_tokens": 1, "temperature": 0.0}])
        await asyncio.wait_for(self.fe.complete(choices, streams), timeout)

    async def _not_serving(self) -> JSONResponse | None:
        """None while this replica serves; otherwise the 503 that says why (starting,
        draining, or no worker up, with each down worker's last error)."""
        if not self._ready:
            return JSONResponse({"status": "starting", "detail": "warming up"}, status_code=503)
        try:
            h = await self.controller.health.remote()
        except Exception as exc:
            if not actor_unreachable(exc):
                raise
            return JSONResponse({"status": "unavailable", "detail": "the fleet's controller is "
                                 "restarting"}, status_code=503)
        if h.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if h.routable == 0:
            return JSONResponse({"status": "unavailable",
                                 "detail": "no engine worker takes requests",
                                 "workers": h.workers, "errors": h.errors}, status_code=503)
        pd = h.disaggregation
        if pd is not None and not pd["ready"]:
            return JSONResponse({"status": "unavailable", "detail": (
                "prefill-decode: needs a routable prefill worker, a routable decode worker and "
                "a successful bootstrap handshake between them"), "disaggregation": pd,
                "workers": h.workers, "errors": h.errors}, status_code=503)
        return None

    # ---- APIs -----------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest,
                               x_session_id: str | None = Header(None),
                               x_request_id: str | None = Header(None)):
        await self._ensure_ready()
        body.rid = base_rid(body.rid, x_request_id)
        return _respond(await chat_serving.chat_completion(self.fe, body, x_session_id),
                        body.rid, x_request_id)

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest,
                          x_session_id: str | None = Header(None),
                          x_request_id: str | None = Header(None)):
        await self._ensure_ready()
        body.rid = base_rid(body.rid, x_request_id)
        return _respond(await openai_serving.completion(self.fe, body, x_session_id), body.rid,
                        x_request_id)

    @app.post("/generate")
    async def generate(self, body: GenerateRequest, x_session_id: str | None = Header(None),
                       x_request_id: str | None = Header(None)):
        await self._ensure_ready()
        if not isinstance(body.rid, list):  # a list names each prompt's generation itself
            body.rid = base_rid(body.rid, x_request_id)
        return _respond(await native_serving.generate(self.fe, body, x_session_id), body.rid,
                        x_request_id)

    @app.get("/v1/models")
    async def models(self):
        return await openai_serving.models_list(self.fe)

    # ---- operations -----------------------------------------------------------------
    @app.get("/ready")
    async def ready(self):
        """503 until the channel is open and the warm-up request has run (the first call
        starts both in the background), and again while draining."""
        if not self._ready:
            task = self._start_task
            error = task.exception() if task is not None and task.done() else None
            if task is None or task.done():  # first call, or retry after a failed start
                self._start_task = asyncio.create_task(self._ensure_ready())
            detail = f"start-up failed: {error}" if error else "warming up"
            return JSONResponse({"status": "starting", "detail": detail}, status_code=503)
        return await self._not_serving() or {"status": "ready"}

    @app.get("/health")
    async def health(self):
        """200 (empty) while some worker takes requests; a 503 whose JSON body says why
        otherwise (an engine whose scheduler failed is down until its restart)."""
        down = await self._not_serving()
        if down is not None:
            return down
        if self.cfg.server.health_generates:
            return await self.health_generate()
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(self):
        """Generate one token end to end; 503 with the reason if that fails or times out.
        One probe runs at a time: calls that arrive while it runs share its outcome, so
        probes never pile up behind real work (and a timed-out one aborts its request)."""
        down = await self._not_serving()
        if down is not None:
            return down
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._probe_once())
        detail = await asyncio.shield(self._probe)  # a caller that leaves keeps it running
        if detail is not None:
            return JSONResponse({"status": "unhealthy", "detail": detail}, status_code=503)
        return Response(status_code=200)

    async def _probe_once(self) -> str | None:
        """None if one token came back in time, else why not."""
        try:
            await self._generate_one(self.cfg.server.health_check_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a failed probe is a 503, and its request is gone
            detail = (f"no token within {self.cfg.server.health_check_timeout_s} s"
                      if isinstance(exc, asyncio.TimeoutError)
                      else getattr(exc, "message", None) or str(exc) or type(exc).__name__)
            logger.warning("health_generate failed: %s", detail)
            return detail
        return None

    @app.post("/flush_cache")
    async def flush_cache(self):
        """Flush every live worker's radix cache (each refuses while it runs requests)."""
        results = await self.controller.flush_cache.remote()
        refused = sorted(w for w, ok in results.items() if ok is not True)
        if not refused:
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse(f"Cache not flushed on {', '.join(refused)}: requests are "
                                 "running.\n", status_code=400)

    @app.post("/abort_request")
    async def abort_request(self, body: AbortRequest):
        """Abort ``rid`` (and the choices derived from it) or, with ``abort_all``, every
        request, on every live worker (both halves of a prefill-decode request). Each ends
        with finish reason ``abort`` and its partial output. Answers the ids aborted, by
        worker and in all; an unknown id aborts nothing and is still a 200 (as in SGLang)."""
        if (body.rid is None) == (not body.abort_all):
            raise ApiError(400, "give exactly one of rid or abort_all=true",
                           param="abort_all" if body.abort_all else "rid")
        by_worker = await self._per_worker(self.controller.abort_request.remote(
            body.rid, body.abort_all))
        rids = sorted({rid for aborted in by_worker.values() for rid in aborted})
        return {"success": True, "aborted": len(rids), "rids": rids,
                "workers": {w: len(aborted) for w, aborted in sorted(by_worker.items())}}

    @app.post("/pause_generation")
    async def pause_generation(self, body: PauseGeneration | None = None):
        """Pause every worker (mode abort, retract or in_place); new requests wait until
        /continue_generation. Answers the requests each worker's mode touched."""
        mode = (body or PauseGeneration()).mode
        touched = await self._per_worker(self.controller.pause_generation.remote(mode))
        return {"mode": mode, "requests": touched}

    @app.post("/continue_generation")
    async def continue_generation(self):
        """Every worker schedules again; answers whether each was paused."""
        return {"was_paused": await self._per_worker(self.controller.continue_generation.remote())}

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(self, body: MemoryTags | None = None):
        """Free the memory of ``tags`` on every (paused) worker."""
        tags = (body or MemoryTags()).tags
        return await self._per_worker(self.controller.release_memory_occupation.remote(tags))

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(self, body: MemoryTags | None = None):
        tags = (body or MemoryTags()).tags
        return await self._per_worker(self.controller.resume_memory_occupation.remote(tags))

    @app.get("/get_weight_version")
    async def get_weight_version(self):
        return await self._admin(self.controller.get_weight_version.remote())

    @app.post("/update_weight_version")
    async def update_weight_version(self, body: UpdateWeightVersion):
        """SGLang's: rename the weights every worker serves (no transfer)."""
        result = await self._admin(self.controller.update_weight_version.remote(
            body.new_version))
        return {"success": True, "message": f"weight version updated to {body.new_version!r}",
                "new_version": result["weight_version"], **result}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(self, body: UpdateWeightsFromDisk):
        """One all-or-none update of every worker from a checkpoint on disk."""
        return await self._update(DiskWeights(body.model_path, lora_name=body.lora_name), body)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(self, body: InitWeightsUpdateGroup):
        return await self._admin(self.controller.init_weights_update_group.remote(
            body.master_address, body.master_port, body.world_size, body.group_name,
            body.backend, body.timeout_s))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(self, body: DestroyWeightsUpdateGroup):
        left = await self._admin(self.controller.destroy_weights_update_group.remote(
            body.group_name))
        return {"success": True, "workers": left}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(self, body: UpdateWeightsFromDistributed):
        source = DistributedWeights(body.names, body.dtypes, body.shapes, body.group_name,
                                    lora_name=body.lora_name)
        return await self._update(source, body)

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(self, body: LoadLoraAdapter):
        """SGLang's: serve a PEFT adapter on every worker, all or none."""
        result = await self._admin(self.controller.load_lora_adapter.remote(body.lora_name,
                                                                             body.lora_path))
        await self.fe.refresh_adapters()
        return {"success": True, "message": f"LoRA adapter {body.lora_name!r} loaded", **result}

    @app.post("/update_lora_adapter")
    async def update_lora_adapter(self, body: UpdateLoraAdapter):
        """New weights for a served adapter on every worker, under its own version."""
        result = await self._admin(self.controller.update_lora_adapter.remote(
            body.lora_name, body.lora_path, body.lora_version))
        return {"success": True, **result}

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(self, body: UnloadLoraAdapter):
        result = await self._admin(self.controller.unload_lora_adapter.remote(body.lora_name))
        await self.fe.refresh_adapters()
        return {"success": True, "message": f"LoRA adapter {body.lora_name!r} unloaded",
                **result}

    async def _update(self, source: WeightSource, body) -> dict:
        result = await self._admin(self.controller.update_weights.remote(
            source, body.weight_version, body.pause_mode, body.release_memory, body.keep_paused))
        if body.lora_name is not None:
            return {"success": True, "message": f"LoRA adapter {body.lora_name!r} updated to "
                    f"version {result['lora_version']!r}", **result}
        return {"success": True, "message": f"weights updated to version "
                f"{result['weight_version']}", **result}

    async def _per_worker(self, call) -> dict:
        """A fan-out's results by worker; 400 naming each worker that refused."""
        results = await self._admin(call)
        errors = {w: r["error"] for w, r in results.items() if isinstance(r, dict) and "error" in r}
        if errors:
            raise ApiError(400, "; ".join(f"{w}: {e}" for w, e in sorted(errors.items())))
        return results

    @app.get("/metrics")
    async def metrics(self):
        """Every live worker's series, the router's, the controller's and every ingress
        replica's HTTP series (this one's as of now), on one page."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        await self.controller.heartbeat.remote(self.owner, self.http_metrics.families())
        self.collector.update(await self.controller.metric_families.remote())
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/kv_conservation")
    async def kv_conservation(self):
        """Assert each live worker's KV slot invariant now; slot counts by worker id
        (a worker whose check failed has an ``error`` entry and the status is 500)."""
        results = await self.controller.check_kv_conservation.remote()
        failed = any("error" in r for r in results.values())
        return JSONResponse(results, status_code=500 if failed else 200)

    # ---- fleet admin ----------------------------------------------------------------
    @app.get("/fleet")
    async def fleet(self):
        """Every worker's record (state, generation, restarts, load) and the router's state."""
        return await self.controller.fleet_state.remote()

    @app.post("/fleet/workers/{worker_id}/drain")
    async def drain_worker(self, worker_id: str):
        """Send no new requests to the worker; its in-flight requests finish."""
        return await self._admin(self.controller.drain_worker.remote(worker_id))

    @app.post("/fleet/workers/{worker_id}/resume")
    async def resume_worker(self, worker_id: str):
        return await self._admin(self.controller.resume_worker.remote(worker_id))

    @app.post("/fleet/eplb/rebalance")
    async def rebalance_experts(self):
        """Rebalance every live worker's expert copies now (MoE models with enable_eplb):
        each worker's report (balancedness before and after, experts moved, seconds); 400
        naming each worker that cannot (EPLB off, weights released)."""
        return await self._per_worker(self.controller.rebalance_experts.remote())

    @app.post("/fleet/router")
    async def set_router(self, body: RouterUpdate):
        """Switch the routing policy (clears the prefix tree and the session map)."""
        return await self._admin(self.controller.set_policy.remote(body.policy))

    async def _admin(self, call):
        from radixray.cluster.errors import unwrap_ray_error
        try:
            return await call
        except Exception as exc:  # noqa: BLE001 - admin errors name the problem
            if actor_unreachable(exc):
                raise  # 503 fleet_restarting (api_error_from)
            err = unwrap_ray_error(exc)
            status = 404 if isinstance(err, KeyError) else 400
            raise ApiError(status, str(err).strip("'\""), param="worker_id"
                           if status == 404 else None) from None


def ingress_deployment(cfg: ServeConfig):
    """The Serve deployment for ``cfg`` (replicas and CPUs from cfg.server)."""
    return serve.deployment(Ingress, name="Ingress").options(
        num_replicas=cfg.server.ingress_replicas,
        ray_actor_options={"num_cpus": cfg.server.ingress_num_cpus},
        max_ongoing_requests=4096,
    )
