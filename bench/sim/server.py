"""The simulated vLLM backend: vLLM 0.32's OpenAI-compatible HTTP protocol over a simulated engine.

aiohttp.web rather than FastAPI: measured on this machine (trivial JSON handler, server CPU per
request) against a raw ASGI callable on uvicorn+httptools, the leanest FastAPI-family path: about
100 us for both at 16 connections, 205 vs 139 us at one connection. aiohttp was kept because it
gives direct hold of the transport and the listening socket, which the fault injector needs (abort
a stream mid-way, stop listening). TCP_NODELAY is set by aiohttp on every connection.

Beyond vLLM's endpoints, two simulator-only ones: `/sim/faults` (GET/POST/DELETE a fault plan, see
bench/sim/faults.py) and `POST /sim/kv_pull` (a decoder's stand-in for the NIXL pull: the prefiller
named by `remote_host`/`remote_port` in kv_transfer_params, which is this HTTP server, unpins the KV).

Start one from tests:
    async with SimServer(SimServerConfig(model="m")) as sim: ...sim.url...      # in the test's loop
    with start_in_thread(SimServerConfig(model="m")) as sim: ...sim.url...      # own thread and loop
    with SimProcess(["--model", "m"]) as sim: ...sim.url...                     # own process
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import aiohttp
import orjson
from aiohttp import web

from bench.sim import protocol
from bench.sim.engine_api import Engine, KVEventSink, SimRequest, TokenOutput
from bench.sim.faults import FaultInjector, FaultPlan, RequestFaults
from bench.sim.kv_events import KVEventsConfig, ZmqKVEventPublisher
from bench.sim.metrics import ServerMetrics, render
from bench.sim.protocol import Kind, ParsedRequest, RequestError
from bench.sim.simple_engine import SimpleEngine, SimpleEngineConfig
from bench.sim.tokenizer import SimTokenizer

log = logging.getLogger(__name__)

READY_PREFIX = "SIM_READY "
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ROLES = ("prefill", "decode", "both")


@dataclass(slots=True)
class SimServerConfig:
    model: str = "sim-model"
    served_model_names: list[str] | None = None  # default: [model]
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port, read it back from SimServer.port / .url
    role: str = "both"  # prefill: answers do_remote_decode; decode: accepts remote KV; both: either
    engine: str = "simple"  # simple | cost
    accelerator: str = "mi300x"
    gpus: int = 8
    time_scale: float = 1.0  # simulated seconds per wall second
    max_model_len: int = 8192
    block_size: int = 16
    num_gpu_blocks: int | None = None  # None: the engine's own (simple: 16384; cost: what fits the HBM)
    cost_model: str | None = None  # cost engine: model name in configs/models.yaml (default: `model`)
    # Cost engine efficiency overrides (scoring/cost.py Efficiency fields, e.g. {"mfu": 0.17}); the seed
    # case's fitted values come from bench/seed_case.py's FITTED.
    efficiency: dict[str, float] | None = None
    enable_prompt_tokens_details: bool = False
    max_num_queued_reqs: int | None = None  # waiting requests beyond this get 503 (vLLM SchedulerConfig)
    api_key: str | None = None  # vLLM's --api-key: /v1/* needs `Authorization: Bearer <key>`
    enable_force_include_usage: bool = False
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    kv_transfer_config: dict[str, Any] | None = None
    faults: FaultPlan = field(default_factory=FaultPlan)
    simple_engine: SimpleEngineConfig | None = None  # timing knobs of the simple engine
    # Overrides `engine`: build any Engine (e.g. a test's own) from this config and the KV event sink.
    engine_factory: Callable[[SimServerConfig, KVEventSink | None], Engine] | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be > 0")

    @property
    def names(self) -> list[str]:
        return self.served_model_names or [self.model]

    @property
    def kv_lease_s(self) -> float:
        extra = (self.kv_transfer_config or {}).get("kv_connector_extra_config") or {}
        return float(extra.get("kv_lease_duration", 30.0))


def build_engine(config: SimServerConfig, kv_events: KVEventSink | None) -> Engine:
    if config.engine_factory is not None:
        return config.engine_factory(config, kv_events)
    if config.engine == "cost":
        return _build_cost_engine(config, kv_events)
    if config.engine != "simple":
        raise ValueError(f"unknown engine {config.engine!r} (expected 'simple' or 'cost')")
    base = config.simple_engine or SimpleEngineConfig()
    engine_config = dataclasses.replace(
        base,
        time_scale=config.time_scale,
        block_size=config.block_size,
        num_gpu_blocks=config.num_gpu_blocks or base.num_gpu_blocks,
        kv_lease_s=config.kv_lease_s,
    )
    return SimpleEngine(engine_config, kv_events)


def _build_cost_engine(config: SimServerConfig, kv_events: KVEventSink | None) -> Engine:
    """The roofline engine (bench/sim/scheduler.py); imported only when asked for."""
    from bench.sim.scheduler import CostEngineConfig, build_cost_engine
    from scoring.catalog import load_catalog
    from scoring.cost import DEFAULT_EFFICIENCY

    catalog = load_catalog()
    return build_cost_engine(
        catalog.model(config.cost_model or config.model),
        catalog.accelerator(config.accelerator),
        config.gpus,
        block_size=config.block_size,
        max_num_seqs=(config.simple_engine or SimpleEngineConfig()).max_num_seqs,
        num_gpu_blocks=config.num_gpu_blocks,
        kv_lease_s=config.kv_lease_s,
        efficiency=dataclasses.replace(DEFAULT_EFFICIENCY, **(config.efficiency or {})),
        engine=CostEngineConfig(time_scale=config.time_scale, kv_host=config.host),
        sink=kv_events,
    )


class SimServer:
    """One simulated vLLM server. `await start()` returns its base URL; `await stop()` frees everything."""

    def __init__(self, config: SimServerConfig | None = None) -> None:
        self.config = config or SimServerConfig()
        self.tokenizer = SimTokenizer()
        self.faults = FaultInjector(self.config.faults)
        self.metrics = ServerMetrics()
        self.served = protocol.ServedModel(
            self.config.names, self.config.max_model_len, self.config.enable_force_include_usage
        )
        self.publisher: ZmqKVEventPublisher | None = None
        self.engine: Engine | None = None
        self.port = self.config.port
        self.in_flight = 0
        self._created = int(time.time())
        self._fingerprint = f"vllm-{protocol.VLLM_VERSION}-sim-{uuid.uuid4().hex[:8]}"
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._client: aiohttp.ClientSession | None = None
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    async def __aenter__(self) -> SimServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> str:
        try:
            await self._start()
        except BaseException:
            await self.stop()  # free whatever did start: sockets, the engine's tasks
            raise
        return self.url

    async def _start(self) -> None:
        if self.config.kv_events.active:
            self.publisher = ZmqKVEventPublisher(self.config.kv_events)
            await self.publisher.start()
        self.engine = build_engine(self.config, self.publisher)
        await self.engine.start()
        self._client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        self._runner = web.AppRunner(self._build_app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        await self._listen(self.config.port)

    async def stop(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._client is not None:
            await self._client.close()
        if self.engine is not None:
            await self.engine.stop()
        if self.publisher is not None:
            await self.publisher.close()

    async def _listen(self, port: int) -> None:
        assert self._runner is not None
        self._site = web.TCPSite(self._runner, self.config.host, port, reuse_address=True)
        await self._site.start()
        # The asyncio.Server (uvloop's under uvloop; typed as AbstractServer): the only place the bound port
        # is exposed.
        server = cast(asyncio.Server | None, self._site._server)
        assert server is not None and server.sockets
        self.port = server.sockets[0].getsockname()[1]

    def set_faults(self, plan: FaultPlan | dict[str, Any]) -> None:
        """Replace the fault plan (a FaultPlan or its JSON dict; see bench/sim/faults.py)."""
        plan = plan if isinstance(plan, FaultPlan) else FaultPlan.from_dict(plan)
        self.faults.set_plan(plan)
        if plan.refuse_connections_s:
            self._start_refusing(plan.refuse_connections_s)

    async def refuse_connections(self, seconds: float) -> None:
        """Stop listening and drop open connections for `seconds`, then listen again on the same port."""
        assert self._runner is not None and self._site is not None
        await self._site.stop()
        for handler in list(self._runner.server.connections if self._runner.server else []):
            if handler.transport is not None:
                handler.transport.abort()
        await asyncio.sleep(seconds)
        await self._listen(self.port)

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/ping", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/version", self._version)
        app.router.add_get("/load", self._load)
        app.router.add_get("/kv_event_sources", self._kv_event_sources)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        app.router.add_route("*", "/sim/faults", self._sim_faults)
        app.router.add_post("/sim/kv_pull", self._sim_kv_pull)
        app.middlewares.append(_not_found_as_fastapi)
        if self.config.api_key:
            app.middlewares.append(_require_api_key(self.config.api_key))
        return app

    # ---- generation -------------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Kind.COMPLETION)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Kind.CHAT)

    async def _generate(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        faults = self.faults.admit(request.path)
        self.in_flight += 1
        try:
            if faults.first_byte_delay_s:
                await asyncio.sleep(faults.first_byte_delay_s)
            if faults.error_status is not None:
                return _json(protocol.error_body(faults.error_status, "simulated fault"), faults.error_status)
            body: Any = None
            try:
                body = await _read_json(request)
                parsed = protocol.parse_request(body, kind, self.served, self.tokenizer)
            except RequestError as err:
                self._release_rejected_transfer(body)
                return _json(err.body(), err.status)
            if self._queue_full():
                self._release_rejected_transfer(body)
                return _json(protocol.error_body(503, "The request queue is full."), 503)
            sim_request = self._sim_request(request, parsed)
            if sim_request.remote_prefill is not None:
                self._notify_prefiller(sim_request.remote_prefill)
            if parsed.stream:
                return await self._stream(request, parsed, sim_request, faults)
            return await self._respond(request, parsed, sim_request, faults)
        finally:
            self.in_flight -= 1

    def _sim_request(self, request: web.Request, parsed: ParsedRequest) -> SimRequest:
        external_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        prefix = "cmpl" if parsed.kind is Kind.COMPLETION else "chatcmpl"
        params = parsed.kv_transfer_params or {}
        role = self.config.role
        return SimRequest(
            # vLLM's internal id: the response id plus an index and a random suffix.
            request_id=f"{prefix}-{external_id}-0-{uuid.uuid4().hex[:8]}",
            prompt_token_ids=parsed.prompt_token_ids,
            max_tokens=parsed.max_tokens,
            prefill_only=bool(params.get("do_remote_decode")) and role != "decode",
            remote_prefill=params if params.get("do_remote_prefill") and role != "prefill" else None,
            seed=parsed.seed,
        )

    async def _respond(
        self, request: web.Request, parsed: ParsedRequest, sim_request: SimRequest, faults: RequestFaults
    ) -> web.StreamResponse:
        started = time.monotonic()
        token_ids: list[int] = []
        final = TokenOutput(0)
        stream = self._engine().generate(sim_request)
        try:
            async for output in stream:
                if not token_ids:
                    self._observe_ttft(started)
                token_ids.append(output.token_id)
                final = output
        except asyncio.CancelledError:
            self.metrics.record_finished("abort")
            raise
        finally:
            await stream.aclose()
        if faults.stream_error_after_chunks is not None:
            self._observe_finished(started, "error")
            return _json(protocol.error_body(500, "simulated engine failure"), 500)
        self._observe_finished(started, final.finish_reason or "length")
        if faults.close_after_chunks is not None:
            return _abort(request)
        text = self.tokenizer.decode(token_ids)
        usage = protocol.usage(len(parsed.prompt_token_ids), len(token_ids), self._cached(final))
        build = protocol.completion_body if parsed.kind is Kind.COMPLETION else protocol.chat_body
        body = build(
            _response_id(sim_request, parsed), self._now(), parsed.model, text, final.finish_reason, usage,
            self._kv_transfer_params(final, len(parsed.prompt_token_ids)), self._fingerprint,
        )  # fmt: skip
        return _json(body, 200)

    async def _stream(
        self, request: web.Request, parsed: ParsedRequest, sim_request: SimRequest, faults: RequestFaults
    ) -> web.StreamResponse:
        started = time.monotonic()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        writer = _SseWriter(request, response, faults)
        response_id, created, model = _response_id(sim_request, parsed), self._now(), parsed.model
        prompt_len, completion_tokens, cached = len(parsed.prompt_token_ids), 0, None
        stream = self._engine().generate(sim_request)
        finish_reason = "abort"
        try:
            await response.prepare(request)
            if parsed.kind is Kind.CHAT:
                first = protocol.stream_chunk(parsed.kind, response_id, created, model, "", None, first=True)
                await writer.send(self._with_usage(first, parsed, prompt_len, 0, None))
            async for output in stream:
                if completion_tokens == 0:
                    self._observe_ttft(started)
                    cached = self._cached(output)
                text = self.tokenizer.token_text(output.token_id, first=completion_tokens == 0)
                completion_tokens += 1
                chunk = protocol.stream_chunk(
                    parsed.kind, response_id, created, model, text, output.finish_reason
                )
                if output.finish_reason is not None and not parsed.include_usage:
                    chunk["system_fingerprint"] = self._fingerprint  # vLLM stamps the terminal chunk
                await writer.send(self._with_usage(chunk, parsed, prompt_len, completion_tokens, cached))
                finish_reason = output.finish_reason or finish_reason
            if parsed.include_usage:
                usage = protocol.usage(prompt_len, completion_tokens, cached)
                final = protocol.usage_chunk(
                    parsed.kind, response_id, created, model, usage, self._fingerprint
                )
                await writer.send(final)
            await writer.done()
        except (ConnectionResetError, _StreamCut):
            finish_reason = "abort"
        except _InjectedStreamError:
            finish_reason = "error"
            await writer.send_error(protocol.error_body(500, "simulated engine failure"))
        except asyncio.CancelledError:
            self.metrics.record_finished("abort")
            raise
        finally:
            await stream.aclose()
        self._observe_finished(started, finish_reason)
        return response

    def _with_usage(
        self,
        chunk: dict[str, Any],
        parsed: ParsedRequest,
        prompt_len: int,
        completion: int,
        cached: int | None,
    ) -> dict[str, Any]:
        if parsed.include_usage and parsed.continuous_usage:
            chunk["usage"] = protocol.usage(prompt_len, completion, cached)
        return chunk

    def _cached(self, output: TokenOutput) -> int | None:
        return output.num_cached_tokens if self.config.enable_prompt_tokens_details else None

    def _kv_transfer_params(self, final: TokenOutput, prompt_len: int) -> dict[str, Any] | None:
        """The engine's params, completed to vLLM 0.32's NIXL pull shape where an engine left keys out."""
        if final.kv_transfer_params is None:
            return None
        defaults = {
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": prompt_len,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": final.num_cached_tokens,
        }
        # The simulator's "side channel" is its HTTP port: the decoder reports the pull to /sim/kv_pull.
        address = {"remote_host": self.config.host, "remote_port": self.port}
        return {**defaults, **final.kv_transfer_params, **address}

    def _queue_full(self) -> bool:
        """vLLM rejects with 503 beyond max_num_queued_reqs (otherwise it queues without limit)."""
        limit = self.config.max_num_queued_reqs
        return limit is not None and self._engine().stats().num_requests_waiting >= limit

    def _release_rejected_transfer(self, body: Any) -> None:
        """vLLM tells the prefiller to free the KV of a decode request it rejects before the engine."""
        params = body.get("kv_transfer_params") if isinstance(body, dict) else None
        if isinstance(params, dict) and params.get("do_remote_prefill") and self.config.role != "prefill":
            self._notify_prefiller(params)

    def _notify_prefiller(self, params: dict[str, Any]) -> None:
        """Stand-in for the NIXL pull: tell the prefiller its KV was read so it unpins the blocks."""
        host, port, request_id = (
            params.get("remote_host"),
            params.get("remote_port"),
            params.get("remote_request_id"),
        )
        if not (host and port and request_id) or self._client is None:
            return
        task = asyncio.create_task(self._post_pull(f"http://{host}:{port}/sim/kv_pull", str(request_id)))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _post_pull(self, url: str, request_id: str) -> None:
        assert self._client is not None
        try:
            async with self._client.post(url, json={"remote_request_id": request_id}) as response:
                await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.debug("kv pull notification to a prefiller failed: %s", type(exc).__name__)

    def _observe_ttft(self, started: float) -> None:
        self.metrics.ttft.observe((time.monotonic() - started) * self.config.time_scale)

    def _observe_finished(self, started: float, reason: str) -> None:
        self.metrics.record_finished(reason)
        self.metrics.e2e.observe((time.monotonic() - started) * self.config.time_scale)

    def _engine(self) -> Engine:
        assert self.engine is not None, "SimServer.start() was not awaited"
        return self.engine

    def _now(self) -> int:
        return int(time.time())

    # ---- small endpoints -------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        return _json(protocol.models_body(self.served, self.config.model, self._created), 200)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.faults.health_status)

    async def _metrics(self, request: web.Request) -> web.Response:
        text = render(self._engine().stats(), self.metrics, self.config.names[0])
        return web.Response(text=text, headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})

    async def _version(self, request: web.Request) -> web.Response:
        return _json({"version": protocol.VLLM_VERSION}, 200)

    async def _load(self, request: web.Request) -> web.Response:
        return _json({"server_load": self.in_flight}, 200)

    async def _kv_event_sources(self, request: web.Request) -> web.Response:
        return _json({"0": self.config.kv_events.to_dict()} if self.config.kv_events.active else {}, 200)

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        return _json({"success": self._engine().reset_prefix_cache()}, 200)

    async def _tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await _read_json(request)
            if not isinstance(body, dict):
                raise RequestError(400, "the body must be a JSON object", err_type="Bad Request")
            token_ids = self._tokenize_body(body)
        except RequestError as err:
            return _json(err.body(), err.status)
        strs = self.tokenizer.token_strs(token_ids) if body.get("return_token_strs") else None
        result = {"count": len(token_ids), "max_model_len": self.config.max_model_len, "tokens": token_ids}
        return _json({**result, "token_strs": strs}, 200)

    def _tokenize_body(self, body: dict[str, Any]) -> list[int]:
        model = body.get("model")
        if model is not None and model not in self.served.names:
            raise RequestError(404, f"The model `{model}` does not exist.", param="model")
        if isinstance(body.get("messages"), list):
            add_generation_prompt = body.get("add_generation_prompt", True) is not False
            return self.tokenizer.encode(
                self.tokenizer.apply_chat_template(body["messages"], add_generation_prompt)
            )
        if isinstance(body.get("prompt"), str):
            return self.tokenizer.encode(body["prompt"])
        raise RequestError(400, "Field required", err_type="Bad Request", param="body.prompt")

    async def _detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await _read_json(request)
            tokens = body.get("tokens") if isinstance(body, dict) else None
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise RequestError(
                    400, "tokens must be a list of integers", err_type="Bad Request", param="body.tokens"
                )
            return _json({"prompt": self.tokenizer.decode(tokens)}, 200)
        except ValueError as err:
            return _json(protocol.error_body(400, str(err)), 400)
        except RequestError as err:
            return _json(err.body(), err.status)

    # ---- simulator control (not part of vLLM) ----------------------------------------------------

    async def _sim_faults(self, request: web.Request) -> web.Response:
        if request.method == "DELETE":
            self.faults.clear()
        elif request.method == "POST":
            try:
                plan = FaultPlan.from_dict(await _read_json(request))
            except (ValueError, TypeError, RequestError) as err:
                return _json(protocol.error_body(400, str(err)), 400)
            self.faults.set_plan(plan)
            if plan.refuse_connections_s:
                # Answer this request first, then stop listening.
                task = asyncio.get_running_loop().call_later(
                    0.01, self._start_refusing, plan.refuse_connections_s
                )
                del task
        elif request.method != "GET":
            return _json(protocol.error_body(405, "Method Not Allowed", "MethodNotAllowed"), 405)
        return _json(self.faults.plan.to_dict(), 200)

    def _start_refusing(self, seconds: float) -> None:
        self.faults.plan.refuse_connections_s = 0.0
        task = asyncio.create_task(self.refuse_connections(seconds))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _sim_kv_pull(self, request: web.Request) -> web.Response:
        try:
            body = await _read_json(request)
        except RequestError as err:
            return _json(err.body(), err.status)
        release = getattr(self._engine(), "release_kv", None)
        released = (
            bool(release(str(body.get("remote_request_id")))) if release and isinstance(body, dict) else False
        )
        return _json({"released": released}, 200)


# ---- helpers -------------------------------------------------------------------------------------


class _StreamCut(Exception):
    """The fault plan cut this stream."""


class _InjectedStreamError(Exception):
    """The fault plan fails this stream in-band."""


class _SseWriter:
    """Writes `data: {json}\\n\\n` frames, applying the request's chunk faults."""

    def __init__(self, request: web.Request, response: web.StreamResponse, faults: RequestFaults) -> None:
        self._request, self._response, self._faults = request, response, faults
        self._sent = 0

    async def send(self, chunk: dict[str, Any]) -> None:
        await self._write(b"data: " + orjson.dumps(chunk) + b"\n\n")

    async def done(self) -> None:
        await self._write(b"data: [DONE]\n\n")
        await self._response.write_eof()

    async def send_error(self, error: dict[str, Any]) -> None:
        """vLLM's mid-stream failure: an error event, then [DONE] (after the headers said 200)."""
        await self._response.write(b"data: " + orjson.dumps(error) + b"\n\n")
        await self._response.write(b"data: [DONE]\n\n")
        await self._response.write_eof()

    async def _write(self, frame: bytes) -> None:
        faults = self._faults
        if faults.close_after_chunks is not None and self._sent >= faults.close_after_chunks:
            _abort(self._request)
            raise _StreamCut
        if faults.stream_error_after_chunks is not None and self._sent >= faults.stream_error_after_chunks:
            raise _InjectedStreamError
        if faults.chunk_delay_s and self._sent:
            await asyncio.sleep(faults.chunk_delay_s)
        await self._response.write(frame)
        self._sent += 1


def _abort(request: web.Request) -> web.StreamResponse:
    if request.transport is not None:
        request.transport.abort()
    return web.Response(status=500)  # never sent: the connection is gone


def _response_id(sim_request: SimRequest, parsed: ParsedRequest) -> str:
    return sim_request.request_id.rsplit("-", 2)[0]


async def _read_json(request: web.Request) -> Any:
    try:
        return orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise RequestError(400, f"JSON decode error: {exc}", err_type="Bad Request", param="body") from exc


def _json(body: Any, status: int) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


@web.middleware
async def _not_found_as_fastapi(request: web.Request, handler: Any) -> web.StreamResponse:
    """FastAPI's bodies for unknown paths and methods, which clients of vLLM see."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return _json({"detail": "Not Found"}, 404)
    except web.HTTPMethodNotAllowed:
        return _json({"detail": "Method Not Allowed"}, 405)


def _require_api_key(key: str) -> Any:
    """vLLM's --api-key: every /v1 route needs the bearer token, else 401 {"error": "Unauthorized"}."""
    expected = f"Bearer {key}"

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith("/v1") and request.headers.get("Authorization") != expected:
            return _json({"error": "Unauthorized"}, 401)
        return await handler(request)

    return check


# ---- launching ------------------------------------------------------------------------------------


class SimThread:
    """A SimServer running on its own event loop in a daemon thread (for sync tests and tools)."""

    def __init__(self, config: SimServerConfig | None = None) -> None:
        self.server = SimServer(config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sim-server", daemon=True)

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> SimThread:
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(timeout=30)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
            raise
        return self

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the server's loop (engine and fault state are not thread-safe)."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    def set_faults(self, plan: FaultPlan | dict[str, Any]) -> None:
        self.call(lambda: self.server.set_faults(plan))

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> SimThread:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start_in_thread(config: SimServerConfig | None = None, **fields: Any) -> SimThread:
    """Start a simulated backend in a thread; `fields` are SimServerConfig fields. Stop it with .stop()
    or use it as a context manager."""
    if fields:
        config = SimServerConfig(**fields) if config is None else _replace(config, fields)
    return SimThread(config).start()


def _replace(config: SimServerConfig, fields: dict[str, Any]) -> SimServerConfig:
    return SimServerConfig(**{**{name: getattr(config, name) for name in config.__slots__}, **fields})


class SimProcess:
    """`python -m bench.sim.cli ARGS --port 0` as a child process; `.url` once it is serving."""

    def __init__(self, args: list[str], startup_timeout_s: float = 30.0) -> None:
        self.args = list(args)
        self.startup_timeout_s = startup_timeout_s
        self.url = ""
        self.process: subprocess.Popen[str] | None = None

    def __enter__(self) -> SimProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> SimProcess:
        args = self.args if "--port" in self.args else [*self.args, "--port", "0"]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.sim.cli", *args],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.url = _read_ready_line(self.process, self.startup_timeout_s)
        return self

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


def _read_ready_line(process: subprocess.Popen[str], timeout_s: float) -> str:
    stdout = process.stdout
    assert stdout is not None
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.extend(_ready_urls(stdout)), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not result:
        process.kill()
        process.wait()
        raise RuntimeError(
            f"simulated backend did not start within {timeout_s} s (exit code {process.returncode})"
        )
    return result[0]


def _ready_urls(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if line.startswith(READY_PREFIX):
            yield line[len(READY_PREFIX) :].split()[0]
            return


async def serve_forever(config: SimServerConfig, ready: Callable[[SimServer], None] | None = None) -> None:
    """Run until cancelled (the CLI's loop)."""
    async with SimServer(config) as server:
        if ready is not None:
            ready(server)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()
