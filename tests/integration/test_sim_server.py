"""The simulated backend for real: loopback HTTP, the official `openai` client, fault injection, P/D."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.sim.server import SimProcess, SimServer, SimServerConfig, start_in_thread
from bench.sim.simple_engine import SimpleEngineConfig

MODEL = "sim-int"


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    async with SimServer(SimServerConfig(model=MODEL, enable_prompt_tokens_details=True)) as server:
        yield server


@pytest.fixture
async def oai(sim: SimServer) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(base_url=f"{sim.url}/v1", api_key="unused", max_retries=0)
    yield client
    await client.close()


async def metric(server: SimServer, name: str, **labels: str) -> float:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{server.url}/metrics")).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    raise AssertionError(f"no sample {name}{labels}")


async def eventually(condition: Callable[[], object], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():  # type: ignore[misc]
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


# ---- the official client -------------------------------------------------------------------------


async def test_openai_client_completion_and_chat(oai: openai.AsyncOpenAI) -> None:
    completion = await oai.completions.create(model=MODEL, prompt="one two three four", max_tokens=5)
    assert completion.object == "text_completion"
    assert completion.usage is not None and completion.usage.completion_tokens == 5
    assert completion.choices[0].finish_reason == "length"
    chat = await oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=3
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content


async def test_openai_client_streams_with_usage(oai: openai.AsyncOpenAI) -> None:
    stream = await oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream please"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4
    assert chunks[-2].choices[0].finish_reason == "length"


async def test_openai_client_sees_cached_tokens(oai: openai.AsyncOpenAI) -> None:
    prompt = " ".join(f"w{i}" for i in range(70))
    await oai.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    again = await oai.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == 64


async def test_openai_client_error_classes(oai: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        await oai.completions.create(model="other", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as raised:
        await oai.completions.create(model=MODEL, prompt="hi", max_tokens=10**6)
    assert "maximum context length" in raised.value.message


# ---- fault injection -----------------------------------------------------------------------------


async def test_error_status_for_the_next_requests_set_over_http(
    sim: SimServer, oai: openai.AsyncOpenAI
) -> None:
    async with httpx.AsyncClient(base_url=sim.url) as http:
        assert (
            await http.post("/sim/faults", json={"error_status": 503, "error_count": 2})
        ).status_code == 200
        for _ in range(2):
            with pytest.raises(openai.InternalServerError) as raised:
                await oai.completions.create(model=MODEL, prompt="hi", max_tokens=1)
            assert raised.value.status_code == 503
        await oai.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        assert (await http.get("/sim/faults")).json()["error_count"] == 0
        bad = await http.post("/sim/faults", json={"error_status": "x"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == 400


async def test_rate_limit_status(sim: SimServer, oai: openai.AsyncOpenAI) -> None:
    sim.set_faults({"error_status": 429, "error_count": 1})
    with pytest.raises(openai.RateLimitError):
        await oai.completions.create(model=MODEL, prompt="hi", max_tokens=1)


async def test_stream_cut_after_k_chunks(sim: SimServer) -> None:
    request = {"model": MODEL, "prompt": "cut me", "max_tokens": 20, "stream": True}
    async with httpx.AsyncClient(base_url=sim.url) as http:
        await http.post("/sim/faults", json={"close_after_chunks": 2, "close_count": 1})
        frames: list[str] = []
        with pytest.raises(httpx.RemoteProtocolError):
            async with http.stream("POST", "/v1/completions", json=request) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        frames.append(line)
        assert len(frames) == 2
        whole = await http.post("/v1/completions", json=request)
        assert whole.text.endswith("data: [DONE]\n\n")


async def test_non_streamed_request_cut_gets_no_response(sim: SimServer) -> None:
    sim.set_faults({"close_after_chunks": 0, "close_count": 1})
    async with httpx.AsyncClient(base_url=sim.url) as http:
        with pytest.raises(httpx.RemoteProtocolError):
            await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})


async def test_first_byte_stall_trips_a_client_deadline(sim: SimServer) -> None:
    sim.set_faults({"first_byte_delay_s": 5.0, "delay_count": 1})
    async with httpx.AsyncClient(base_url=sim.url, timeout=httpx.Timeout(5.0, read=0.2)) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
        fine = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert fine.status_code == 200


async def test_chunk_stall_trips_a_read_deadline_mid_stream(sim: SimServer) -> None:
    sim.set_faults({"chunk_delay_s": 5.0, "delay_count": 1})
    request = {"model": MODEL, "prompt": "slow", "max_tokens": 5, "stream": True}
    frames: list[str] = []
    async with httpx.AsyncClient(base_url=sim.url, timeout=httpx.Timeout(5.0, read=0.3)) as http:
        with pytest.raises(httpx.ReadTimeout):
            async with http.stream("POST", "/v1/completions", json=request) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        frames.append(line)
    assert len(frames) == 1


async def test_in_band_stream_error(sim: SimServer) -> None:
    sim.set_faults({"stream_error_after_chunks": 2})
    request = {"model": MODEL, "prompt": "fail", "max_tokens": 10, "stream": True}
    async with httpx.AsyncClient(base_url=sim.url) as http:
        streamed = await http.post("/v1/completions", json=request)
        whole = await http.post("/v1/completions", json={**request, "stream": False})
    assert streamed.status_code == 200
    frames = streamed.text.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    assert json.loads(frames[2].removeprefix("data: "))["error"]["code"] == 500
    assert len(frames) == 5
    assert whole.status_code == 500 and whole.json()["error"]["code"] == 500
    assert await metric(sim, "vllm:request_success_total", finished_reason="error") == 2


async def test_queue_overflow_is_503() -> None:
    engine = SimpleEngineConfig(max_num_seqs=1, tpot_s=0.05)
    config = SimServerConfig(model=MODEL, max_num_queued_reqs=1, simple_engine=engine)
    request = {"model": MODEL, "prompt": "busy", "max_tokens": 200, "stream": True}
    async with SimServer(config) as server, httpx.AsyncClient(base_url=server.url) as http:

        async def hold() -> None:
            async with http.stream("POST", "/v1/completions", json=request) as response:
                async for _ in response.aiter_lines():
                    pass

        holders = [asyncio.create_task(hold()) for _ in range(2)]

        async def one_waiting() -> bool:
            return await metric(server, "vllm:num_requests_waiting") == 1

        await eventually(one_waiting)
        rejected = await http.post("/v1/completions", json={**request, "stream": False})
        for task in holders:
            task.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
    assert rejected.status_code == 503
    assert rejected.json()["error"]["code"] == 503


async def test_health_fault(sim: SimServer) -> None:
    async with httpx.AsyncClient(base_url=sim.url) as http:
        await http.post("/sim/faults", json={"health_status": 503})
        assert (await http.get("/health")).status_code == 503
        await http.delete("/sim/faults")
        assert (await http.get("/health")).status_code == 200


async def test_refused_connections_then_listening_again(sim: SimServer) -> None:
    async with httpx.AsyncClient(base_url=sim.url) as http:
        await http.post("/sim/faults", json={"refuse_connections_s": 1.0})

    async def refused() -> bool:
        try:
            async with httpx.AsyncClient(base_url=sim.url) as fresh:
                await fresh.get("/health")
        except httpx.ConnectError:
            return True
        return False

    async def serving() -> bool:
        return not await refused()

    await eventually(refused)
    await eventually(serving)


async def test_client_disconnect_aborts_the_request() -> None:
    config = SimServerConfig(model=MODEL, simple_engine=SimpleEngineConfig(tpot_s=0.01))
    async with SimServer(config) as server, httpx.AsyncClient(base_url=server.url) as http:
        request = {"model": MODEL, "prompt": "long one", "max_tokens": 5000, "stream": True}
        async with http.stream("POST", "/v1/completions", json=request) as response:
            assert response.status_code == 200
            async for _ in response.aiter_lines():
                break

        async def aborted() -> bool:
            return await metric(server, "vllm:request_success_total", finished_reason="abort") == 1

        await eventually(aborted)
        assert await metric(server, "vllm:num_requests_running") == 0


# ---- P/D between two servers ---------------------------------------------------------------------


async def test_prefill_on_the_cost_engine_then_decode_elsewhere() -> None:
    prefill_config = SimServerConfig(
        model="llama-3.1-8b", engine="cost", accelerator="mi300x", gpus=1, role="prefill", time_scale=10.0
    )
    decode_config = SimServerConfig(model="llama-3.1-8b", role="decode", enable_prompt_tokens_details=True)
    prompt = " ".join(f"w{i}" for i in range(100))
    async with SimServer(prefill_config) as prefiller, SimServer(decode_config) as decoder:
        async with httpx.AsyncClient() as http:
            first = await http.post(
                f"{prefiller.url}/v1/completions",
                json={"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
                headers={"X-Request-Id": "pd-1"},
            )
            params = first.json()["kv_transfer_params"]
            assert params["remote_port"] == prefiller.port and params["transfer_mode"] == "pull"
            assert await metric(prefiller, "hetgate:kv_blocks_held_for_transfer") > 0
            second = await http.post(
                f"{decoder.url}/v1/completions",
                json={"prompt": prompt, "max_tokens": 3, "kv_transfer_params": params},
                headers={"X-Request-Id": "pd-1"},
            )
        assert second.json()["id"] == "cmpl-pd-1"
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # P's cached count
        assert await metric(decoder, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0

        async def released() -> bool:
            return await metric(prefiller, "hetgate:kv_blocks_held_for_transfer") == 0

        await eventually(released)


async def test_a_rejected_decode_still_frees_the_prefillers_kv() -> None:
    prompt = " ".join(f"w{i}" for i in range(50))
    async with (
        SimServer(SimServerConfig(model=MODEL, role="prefill")) as prefiller,
        SimServer(SimServerConfig(model=MODEL, role="decode", max_model_len=256)) as decoder,
        httpx.AsyncClient() as http,
    ):
        first = await http.post(
            f"{prefiller.url}/v1/completions",
            json={"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        )
        params = first.json()["kv_transfer_params"]
        assert await metric(prefiller, "hetgate:kv_blocks_held_for_transfer") == 4
        rejected = await http.post(
            f"{decoder.url}/v1/completions",
            json={"prompt": prompt, "max_tokens": 1000, "kv_transfer_params": params},
        )
        assert rejected.status_code == 400

        async def released() -> bool:
            return await metric(prefiller, "hetgate:kv_blocks_held_for_transfer") == 0

        await eventually(released)


# ---- other ways to start one ---------------------------------------------------------------------


def test_start_in_thread_and_set_faults() -> None:
    with start_in_thread(model=MODEL, max_model_len=512) as sim:
        assert httpx.get(f"{sim.url}/v1/models").json()["data"][0]["max_model_len"] == 512
        sim.set_faults({"error_status": 500, "error_count": 1})
        assert httpx.post(f"{sim.url}/v1/completions", json={"prompt": "x"}).status_code == 500
        assert httpx.post(f"{sim.url}/v1/completions", json={"prompt": "x"}).status_code == 200


def test_subprocess_with_cli_flags() -> None:
    args = [
        "--model",
        "m",
        "--served-model-name",
        "alias",
        "--max-model-len",
        "256",
        "--faults",
        '{"health_status": 503}',
    ]
    with SimProcess(args) as sim:
        assert httpx.get(f"{sim.url}/health").status_code == 503
        models = httpx.get(f"{sim.url}/v1/models").json()["data"]
        assert [card["id"] for card in models] == ["alias"]
        response = httpx.post(
            f"{sim.url}/v1/completions", json={"model": "alias", "prompt": "x", "max_tokens": 300}
        )
        assert response.status_code == 400
    assert sim.process is not None and sim.process.returncode is not None
