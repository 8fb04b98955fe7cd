"""The simulated vLLM backend: vLLM 0.32's OpenAI-compatible HTTP protocol over a simulated engine.

aiohttp.web rather than FastAPI: measured on this machine (trivial JSON handler, server CPU per
request) against a raw ASGI callable on uvicorn+httptools, the leanest FastAPI-family path: about
100 us for both at 16 connections, 205 vs 139 us at one connection. aiohttp was kept because it
gives direct hold of the transport and the listening socket, which the fault injector needs (abort
a stream mid-way, stop listening). TCP_NODELAY is set by aiohttp on every connection.

Beyond vLLM's endpoints, two simulator-only ones: `/sim/faults` (GET/POST/DELETE a fault plan, see
bench/sim/faults.py) and `POST /sim/kv_pull` (a decoder's stand-in for the NIXL pull: the prefiller
named by `remote_host`/`remote_port` in kv_transfer_params, which is this HTTP server, unpins the KV).
Its settings and engine: bench/sim/server_config.py; starting one: bench/sim/server.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, cast

import aiohttp
from aiohttp import web

from bench.sim import protocol
from bench.sim.engine_api import Engine, SimRequest, TokenOutput
from bench.sim.faults import FaultInjector, FaultPlan, RequestFaults
from bench.sim.http_helpers import (
    InjectedStreamError,
    SseWriter,
    StreamCut,
    abort,
    json_reply,
    not_found_as_fastapi,
    read_json,
    require_api_key,
    response_id_of,
)
from bench.sim.kv_events import ZmqKVEventPublisher
from bench.sim.metrics import ServerMetrics, render
from bench.sim.protocol import Kind, ParsedRequest, RequestError
from bench.sim.server_config import SimServerConfig, build_engine
from bench.sim.tokenizer import SimTokenizer

log = logging.getLogger(__name__)

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


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
        app.middlewares.append(not_found_as_fastapi)
        if self.config.api_key:
            app.middlewares.append(require_api_key(self.config.api_key))
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
                return json_reply(
                    protocol.error_body(faults.error_status, "simulated fault"), faults.error_status
                )
            body: Any = None
            try:
                body = await read_json(request)
                parsed = protocol.parse_request(body, kind, self.served, self.tokenizer)
            except RequestError as err:
                self._release_rejected_transfer(body)
                return json_reply(err.body(), err.status)
            if self._queue_full():
                self._release_rejected_transfer(body)
                return json_reply(protocol.error_body(503, "The request queue is full."), 503)
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
            return json_reply(protocol.error_body(500, "simulated engine failure"), 500)
        self._observe_finished(started, final.finish_reason or "length")
        if faults.close_after_chunks is not None:
            return abort(request)
        text = self.tokenizer.decode(token_ids)
        usage = protocol.usage(len(parsed.prompt_token_ids), len(token_ids), self._cached(final))
        build = protocol.completion_body if parsed.kind is Kind.COMPLETION else protocol.chat_body
        body = build(
            response_id_of(sim_request, parsed), self._now(), parsed.model, text, final.finish_reason, usage,
            self._kv_transfer_params(final, len(parsed.prompt_token_ids)), self._fingerprint,
        )  # fmt: skip
        return json_reply(body, 200)

    async def _stream(
        self, request: web.Request, parsed: ParsedRequest, sim_request: SimRequest, faults: RequestFaults
    ) -> web.StreamResponse:
        started = time.monotonic()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        writer = SseWriter(request, response, faults)
        response_id, created, model = response_id_of(sim_request, parsed), self._now(), parsed.model
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
        except (ConnectionResetError, StreamCut):
            finish_reason = "abort"
        except InjectedStreamError:
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
        return json_reply(protocol.models_body(self.served, self.config.model, self._created), 200)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.faults.health_status)

    async def _metrics(self, request: web.Request) -> web.Response:
        text = render(self._engine().stats(), self.metrics, self.config.names[0])
        return web.Response(text=text, headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})

    async def _version(self, request: web.Request) -> web.Response:
        return json_reply({"version": protocol.VLLM_VERSION}, 200)

    async def _load(self, request: web.Request) -> web.Response:
        return json_reply({"server_load": self.in_flight}, 200)

    async def _kv_event_sources(self, request: web.Request) -> web.Response:
        return json_reply({"0": self.config.kv_events.to_dict()} if self.config.kv_events.active else {}, 200)

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        return json_reply({"success": self._engine().reset_prefix_cache()}, 200)

    async def _tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
            if not isinstance(body, dict):
                raise RequestError(400, "the body must be a JSON object", err_type="Bad Request")
            token_ids = self._tokenize_body(body)
        except RequestError as err:
            return json_reply(err.body(), err.status)
        strs = self.tokenizer.token_strs(token_ids) if body.get("return_token_strs") else None
        result = {"count": len(token_ids), "max_model_len": self.config.max_model_len, "tokens": token_ids}
        return json_reply({**result, "token_strs": strs}, 200)

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
            body = await read_json(request)
            tokens = body.get("tokens") if isinstance(body, dict) else None
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise RequestError(
                    400, "tokens must be a list of integers", err_type="Bad Request", param="body.tokens"
                )
            return json_reply({"prompt": self.tokenizer.decode(tokens)}, 200)
        except ValueError as err:
            return json_reply(protocol.error_body(400, str(err)), 400)
        except RequestError as err:
            return json_reply(err.body(), err.status)

    # ---- simulator control (not part of vLLM) ----------------------------------------------------

    async def _sim_faults(self, request: web.Request) -> web.Response:
        if request.method == "DELETE":
            self.faults.clear()
        elif request.method == "POST":
            try:
                plan = FaultPlan.from_dict(await read_json(request))
            except (ValueError, TypeError, RequestError) as err:
                return json_reply(protocol.error_body(400, str(err)), 400)
            self.faults.set_plan(plan)
            if plan.refuse_connections_s:
                # Answer this request first, then stop listening.
                task = asyncio.get_running_loop().call_later(
                    0.01, self._start_refusing, plan.refuse_connections_s
                )
                del task
        elif request.method != "GET":
            return json_reply(protocol.error_body(405, "Method Not Allowed", "MethodNotAllowed"), 405)
        return json_reply(self.faults.plan.to_dict(), 200)

    def _start_refusing(self, seconds: float) -> None:
        self.faults.plan.refuse_connections_s = 0.0
        task = asyncio.create_task(self.refuse_connections(seconds))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _sim_kv_pull(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
        except RequestError as err:
            return json_reply(err.body(), err.status)
        release = getattr(self._engine(), "release_kv", None)
        released = (
            bool(release(str(body.get("remote_request_id")))) if release and isinstance(body, dict) else False
        )
        return json_reply({"released": released}, 200)
