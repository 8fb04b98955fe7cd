"""HTTP mode of `hetgate bench policies`: the same scenarios through real processes on loopback.

Each (scenario, rate, policy) point starts one `hetgate sim --engine cost` per backend of the cluster (timed
by the same roofline as the discrete-event mode, `--time-scale` simulated seconds per wall second), a real
`hetgate serve` with that policy in front, and replays the scenario's requests at their arrival times as
streamed /v1/completions with token-id prompts (exact prompt lengths). Times are reported in simulated
seconds, so a row is comparable with the DES row of the same point. `--target NAME=URL` sends the same load
to an external OpenAI-compatible router instead of hetgate: configure it with the backends' URLs from the
cluster's config file (the sims listen on those ports when a target is given). `--target NAME=COMMAND`
starts the router itself for each point, after the sims, with `{port}` and `{workers}` (the sims' URLs,
space-separated) filled in, e.g. `sglang=python -m sglang_router.launch_router --host 127.0.0.1
--port {port} --policy cache_aware --worker-urls {workers}`.
Fresh processes per point (the external router too when launched), so no cache, prefix tree or learnt
correction carries over from one point to the next.

Utilisation is not measured over HTTP (the sims do not export busy time); `utilisation` is empty there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shlex
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp
import numpy as np

from bench.clusters import Cluster
from bench.harness import GatewayProcess
from bench.policies import (
    Outcome,
    Plan,
    Row,
    Scenario,
    Slo,
    cluster_named,
    get_scenario,
    rates_for,
    row_from,
    scenario_bound,
)
from bench.ports import free_port
from bench.sim.server import SimProcess
from bench.sim.tokenizer import write_tokenizer_json
from bench.workloads import WorkloadRequest
from gateway.decision import SESSION_HEADER

_ROUTE = re.compile(r"(prefill|decode|backend|predicted_ttft_ms|predicted_tpot_ms)=([^;\s]+)")


def sim_args(
    cluster: Cluster, index: int, time_scale: float, port: int | None, kv_events_port: int | None = None
) -> list[str]:
    """`hetgate sim` arguments for backend `index` of `cluster`; with `kv_events_port`, it publishes its KV
    events there as vLLM does (`--kv-events-config`), for the gateway's precise index."""
    backend = cluster.config.backends[index]
    roles = {r.value for r in backend.roles}
    role = "both" if roles == {"prefill", "decode"} else roles.pop()
    eff = cluster.efficiency
    args = [
        "--model", cluster.config.models[0].name, "--cost-model", cluster.model.name, "--engine", "cost",
        "--accelerator", backend.accelerator, "--gpus", str(backend.gpus), "--role", role,
        "--time-scale", str(time_scale), "--block-size", str(backend.block_size),
        "--max-num-seqs", str(backend.max_num_seqs), "--enable-prompt-tokens-details",
        "--max-model-len", "131072", "--efficiency", json.dumps({"mfu": eff.mfu, "bw_util": eff.bw_util}),
    ]  # fmt: skip
    if kv_events_port is not None:
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{kv_events_port}"}
        args += ["--kv-events-config", json.dumps(events)]
    return args + (["--port", str(port)] if port else [])


def gateway_config(
    cluster: Cluster,
    urls: Sequence[str],
    policy: str,
    kv_events_ports: Sequence[int] = (),
    tokenizer: Path | None = None,
) -> dict[str, Any]:
    """hetgate's config for the sims at `urls`; with `kv_events_ports` (one per sim), a precise prefix index
    fed by their KV events, as the simulator's router sees the engines' caches. `tokenizer`: the sims'
    (`write_tokenizer_json`), so text prompts are counted and hashed as the sims tokenize them; without
    it the gateway estimates ~4 characters a token (the workloads' words take 6.5) and its text hashes
    never meet the events' token hashes."""
    name, _, split = policy.partition("/")
    config = cluster.config.model_dump(mode="json", exclude_none=True)
    if tokenizer is not None:
        for model in config["models"]:
            model["tokenizer"] = str(tokenizer)
    for backend, url in zip(config["backends"], urls, strict=True):
        backend["url"] = url
    for backend, port in zip(config["backends"], kv_events_ports, strict=False):
        backend["kv_events"] = {"endpoint": f"tcp://*:{port}"}  # the sim binds, the gateway connects
    config["routing"] = {**config["routing"], "policy": name, "disaggregation": split or "never"}
    config["health"] = {"interval_s": 0.5, "metrics_interval_s": 0.25}
    config["timeouts"] = {"connect_s": 2.0, "ttfb_s": 600.0, "idle_s": 600.0}
    return config


async def replay(
    url: str, model: str, requests: Sequence[WorkloadRequest], time_scale: float, text: bool = False
) -> list[Outcome]:
    """Send each request at its arrival time (scaled to wall time); times come back in simulated seconds.
    Prompts go as token ids (exact lengths), or as text (`text`: for routers that take no token ids,
    such as sglang-router; the simulator's tokenizer reads about one token per word)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter() + 0.2
        tasks = [
            _one(session, url, model, r, r.text() if text else r.token_ids(), start, time_scale)
            for r in requests
        ]
        return list(await asyncio.gather(*tasks))


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    r: WorkloadRequest,
    prompt: str | list[int],
    start: float,
    scale: float,
) -> Outcome:
    await asyncio.sleep(max(0.0, start + r.arrival_s / scale - time.perf_counter()))
    sent = time.perf_counter()
    body = {
        "model": model, "prompt": prompt, "max_tokens": r.max_tokens, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True,
    }  # fmt: skip
    first = finish = 0.0
    tokens = 0
    route = ""
    try:
        # A chat's turns name their conversation, as the simulator tells the router (`in_conversation`).
        headers = {} if r.session is None else {SESSION_HEADER.decode(): r.session}
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as response:
            route = response.headers.get("x-hetgate-route", "")
            chunks = 0  # text chunks: the token count when a router drops the usage chunk (sglang-router)
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                now = time.perf_counter()
                event = json.loads(line[6:])
                if any(c.get("text") for c in event.get("choices") or ()):
                    first = first or now
                    chunks += 1
                finish = now
                usage = event.get("usage") or {}
                tokens = int(usage.get("completion_tokens") or tokens)
            tokens = tokens or chunks
            ok = response.status == 200 and tokens > 0
    except (TimeoutError, aiohttp.ClientError):
        ok = False
    fields = dict(_ROUTE.findall(route))
    backends = tuple(fields[k] for k in ("prefill", "decode", "backend") if k in fields) or ("?",)
    to_sim = lambda t: (t - start) * scale  # noqa: E731
    # The gateway's predictions are in the simulated hardware's seconds, as `to_sim` makes the measured ones.
    predicted = [float(fields.get(f"predicted_{k}_ms", "nan")) / 1000 for k in ("ttft", "tpot")]
    return Outcome(
        ok, to_sim(sent), to_sim(first), to_sim(finish), tokens, "mode=pd" in route, backends, *predicted
    )


async def _wait_ready(
    url: str, timeout_s: float = 120.0, process: subprocess.Popen[bytes] | None = None
) -> None:
    """An external router may find its workers only after they start: wait until its /v1/models answers
    with anything but a server error (a 503 says it has no worker yet; a bare proxy may say 405)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"the router exited ({process.returncode}) before {url} answered")
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.get(f"{url}/v1/models") as response:
                    if response.status < 500:
                        return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not answer /v1/models within {timeout_s:.0f} s")


async def _scrape(urls: Sequence[str]) -> tuple[float, float, list[int]]:
    """Prefix cache (hits, queries) summed over the sims' /metrics, and each sim's finished requests."""
    hits = queries = 0.0
    finished = []
    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.get(f"{url}/metrics") as response:
                text = await response.text()
            hits += _counter(text, "vllm:prefix_cache_hits_total")
            queries += _counter(text, "vllm:prefix_cache_queries_total")
            finished.append(int(_counter(text, "vllm:request_success_total")))
    return hits, queries, finished


def _counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def run_http(
    scenario: Scenario,
    rate: float,
    policy: str,
    slo: Slo,
    time_scale: float,
    target: tuple[str, str] | None = None,
    sim_ports: Sequence[int] | None = None,
    text_prompts: bool = False,
) -> Row:
    """One point over HTTP: hetgate with `policy`, or the external router `target` = (name, url). The sims
    listen on `sim_ports`; by default on free ports, or with a running router (`target` a URL) on the ports
    of the config's URLs."""
    cluster = cluster_named(scenario.cluster)
    requests = scenario.at_rate(rate)
    model = cluster.config.models[0].name
    ports: list[int | None] = [None] * len(cluster.ids)
    if sim_ports is not None:
        ports = list(sim_ports)
    elif target is not None and _is_url(target[1]):  # a running router was configured with these
        ports = [urlparse(b.base_url).port for b in cluster.config.backends]
    # hetgate's index is precise, fed by the sims' KV events, as the DES's router sees the engines' caches;
    # an external router keeps its own (approximate) tree.
    events: list[int] = [free_port() for _ in ports] if target is None else []
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        sims = [
            SimProcess(
                sim_args(cluster, k, time_scale, port, events[k] if events else None), startup_timeout_s=90
            )
            for k, port in enumerate(ports)
        ]
        for sim in sims:
            stack.callback(sim.stop)
        with ThreadPoolExecutor(
            len(sims)
        ) as pool:  # each start waits for its ready line: wait for all at once
            list(pool.map(SimProcess.start, sims))
        urls = [s.url for s in sims]
        if target is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            tokenizer = write_tokenizer_json(folder / "tokenizer.json")
            config = gateway_config(cluster, urls, policy, events, tokenizer)
            gateway = stack.enter_context(GatewayProcess(config))
            front = gateway.url
        elif _is_url(target[1]):
            front = target[1].rstrip("/")
            asyncio.run(_wait_ready(front))
        else:
            front = stack.enter_context(launched_router(target[1], urls))
        outcomes = asyncio.run(replay(front, model, requests, time_scale, text_prompts))
        hits, queries, finished = asyncio.run(_scrape(urls))
    extra = {
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "utilisation": {},
        "wall_s": round(time.perf_counter() - started, 3),
    }
    mode, label = ("http", policy) if target is None else (f"target:{target[0]}", f"target:{target[0]}")
    limits = slo.limits(cluster, scenario.requests)
    bound = scenario_bound(scenario)
    row = row_from(scenario, mode, rate, bound, label, outcomes, limits, extra, cluster.ids)
    if "?" in row.requests_per_backend:  # an external router names no backend: count what each sim finished
        # (a split request finishes on both sides; a router that splits is counted on both)
        row.requests_per_backend = dict(zip(cluster.ids, finished, strict=True))
    return row


@contextlib.contextmanager
def launched_router(command: str, workers: Sequence[str]) -> Iterator[str]:
    """Start an external router from `command` ({port}, {workers} filled in) in front of `workers`; yield
    its URL once /v1/models answers; stop it after. Its output goes to a temporary log, shown on failure."""
    port = free_port()
    argv = shlex.split(command.format(port=port, workers=" ".join(workers)))
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            try:
                asyncio.run(_wait_ready(url, process=process))
            except RuntimeError as error:
                log.seek(0)
                output = log.read()[-2000:].decode(errors="replace")
                raise RuntimeError(f"{error}; its output ends:\n{output}") from error
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _is_url(where: str) -> bool:
    return where.startswith(("http://", "https://"))


def parse_targets(specs: Sequence[str]) -> list[tuple[str, str]]:
    """NAME=URL (a router already running) or NAME=COMMAND (started per point; see the module doc)."""
    out = []
    for spec in specs:
        name, sep, where = spec.partition("=")
        if not sep or not name or not where.strip():
            raise SystemExit(f"--target wants NAME=URL or NAME=COMMAND, not {spec!r}")
        if not _is_url(where) and "{port}" not in where:
            raise SystemExit(f"--target {name}: a command needs {{port}} and usually {{workers}}: {where!r}")
        out.append((name, where))
    return out


def http_sweep(
    plan: Plan, time_scale: float, targets: Sequence[str], progress: Callable[[Row], None] | None = None
) -> list[Row]:
    external = parse_targets(targets)
    rows: list[Row] = []
    for name in plan.scenarios:
        scenario = get_scenario(name, plan.requests)
        for rate in rates_for(plan, scenario):
            points: list[tuple[str, tuple[str, str] | None]] = [(p, None) for p in plan.policies]
            points += [(f"target:{t[0]}", t) for t in external]
            for policy, target in points:
                # With an external router in the run, every row sends text: the same prompts for all.
                text = bool(external)
                rows.append(run_http(scenario, rate, policy, plan.slo, time_scale, target, text_prompts=text))
                if progress:
                    progress(rows[-1])
    return rows


def agreement(des: Row, http: Row) -> dict[str, float]:
    """Relative differences |http - des| / des of the figures both modes measure."""
    out = {}
    for key in ("output_tok_per_s", "ttft_p50_s", "ttft_p90_s", "tpot_p90_s", "goodput_frac"):
        a, b = float(getattr(des, key)), float(getattr(http, key))
        out[key] = abs(b - a) / abs(a) if a else float(np.inf if b else 0.0)
    return out
