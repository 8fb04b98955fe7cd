"""`hetgate demo`: the seed cluster (1x 8-GPU MI300X + 2x 8-GPU MI308X, DeepSeek-R1) on simulated vLLM
backends, with hetgate in front, on loopback. No GPU and no other service needed.

Each backend is a simulated vLLM (`hetgate sim --engine cost`) whose engine steps are timed by the roofline
of `scoring/cost.py` for its accelerator, run `--time-scale` times faster than real time. The gateway
serves `configs/seed-case.yaml`: long prompts are split (prefill on the MI300X, decode on an MI308X),
short ones are served where they are. With `--requests N` the demo also sends a load (long-prompt
requests like the seed case's, plus short chats) and prints what happened; without it, it serves until
Ctrl-C so you can call it yourself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml
from rich.console import Console
from rich.table import Table

from bench.harness import GatewayProcess
from bench.ports import free_port
from bench.seed_case import FITTED
from bench.sim.server import SimProcess
from bench.workloads import fixed_lengths
from scoring.config_dir import config_dir

CONFIG = config_dir() / "seed-case.yaml"
# The efficiency factors fitted once to the seed case's single-server figures (bench/seed_case.py).
CALIBRATED = {"mfu": FITTED.mfu, "bw_util": FITTED.bw_util}
console = Console(width=110)


def sim_args(backend: dict[str, Any], model: str, time_scale: float) -> list[str]:
    roles = set(backend.get("roles", ["prefill", "decode"]))
    role = "both" if roles == {"prefill", "decode"} else roles.pop()
    return [
        "--model", model, "--engine", "cost", "--accelerator", backend["accelerator"],
        "--gpus", str(backend.get("gpus", 1)), "--role", role, "--time-scale", str(time_scale),
        "--block-size", str(backend.get("block_size", 16)), "--enable-prompt-tokens-details",
        "--max-model-len", "65536", "--efficiency", json.dumps(CALIBRATED),
    ]  # fmt: skip


def print_usage(url: str, model: str) -> None:
    console.print(f"\n[bold]hetgate is serving the seed cluster at {url}[/bold]\n")
    console.print("curl:")
    console.print(
        f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}],'
        f' "max_tokens": 16}}\' -i',
        markup=False,
    )
    console.print("\nopenai (Python):")
    console.print(
        "  from openai import OpenAI\n"
        f"  client = OpenAI(base_url='{url}/v1', api_key='unused')\n"
        f"  print(client.chat.completions.create(model='{model}', "
        "messages=[{'role': 'user', 'content': 'Hello!'}], max_tokens=16))",
        markup=False,
    )
    console.print(f"\nmetrics: {url}/metrics   routes: the x-hetgate-route response header\n")


def demo_requests(n: int, long_share: float, seed: int = 7) -> list[tuple[str, int]]:
    """(prompt text, max_tokens): seed-case-like long prompts, and short chats."""
    rng = random.Random(seed)
    n_long = round(n * long_share)
    long = [(r.text(), 128) for r in fixed_lengths(n_long, 16384, 128, name="demo-long")]
    short = [(r.text(), 64) for r in fixed_lengths(n - n_long, 200, 64, name="demo-short")]
    mixed = long + short
    rng.shuffle(mixed)
    return mixed


async def send_load(url: str, model: str, requests: list[tuple[str, int]], concurrency: int) -> list[dict]:
    queue = list(reversed(requests))
    results: list[dict] = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def worker() -> None:
            while queue:
                prompt, max_tokens = queue.pop()
                results.append(await one_request(session, url, model, prompt, max_tokens))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def one_request(
    session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int
) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        route = response.headers.get("x-hetgate-route", "?")
        async for line in response.content:
            if ttft is None and line.startswith(b"data: {"):
                ttft = time.perf_counter() - started
            if line.startswith(b"data: {") and b'"usage"' in line:
                usage = json.loads(line[6:]).get("usage") or usage
        ok = response.status == 200 and bool(usage)
    return {
        "ok": ok,
        "route": route,
        "ttft": ttft or 0.0,
        "e2e": time.perf_counter() - started,
        "usage": usage,
    }


def summarise(results: list[dict], wall_s: float, time_scale: float) -> None:
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["usage"].get("completion_tokens", 0) for r in ok)
    mode = Counter(r["route"].split(";")[0].removeprefix("mode=") for r in ok)
    table = Table(title=f"demo: {len(ok)}/{len(results)} requests ok in {wall_s:.1f} s wall", width=100)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("routes", ", ".join(f"{k}: {v}" for k, v in sorted(mode.items())))
    for key, label in (("ttft", "TTFT"), ("e2e", "end to end")):
        values = np.array([r[key] for r in ok]) * time_scale
        if values.size:
            p50, p90 = np.percentile(values, [50, 90])
            table.add_row(f"{label} p50 / p90 (simulated s)", f"{p50:.2f} / {p90:.2f}")
    table.add_row("output tokens/s (simulated time)", f"{tokens / (wall_s * time_scale):.1f}")
    table.add_row("cached prompt tokens reported", str(sum(_cached(r) for r in ok)))
    console.print(table)


def _cached(result: dict) -> int:
    details = result["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hetgate demo", description=__doc__)
    parser.add_argument(
        "--config", type=Path, default=CONFIG, help="gateway config whose backends get simulated"
    )
    parser.add_argument("--port", type=int, default=8000, help="gateway port (a free one if taken)")
    parser.add_argument("--time-scale", type=float, default=5.0, help="simulated seconds per wall second")
    parser.add_argument("--requests", type=int, default=0, help="send this many requests, summarise, exit")
    parser.add_argument("--concurrency", type=int, default=12, help="concurrent clients with --requests")
    parser.add_argument("--long-share", type=float, default=0.75, help="share of 16k-token prompts")
    parser.add_argument("--policy", default=None, help="override routing.policy")
    parser.add_argument("--disaggregation", default=None, help="override routing.disaggregation")
    return parser.parse_args(argv)


def _port(wanted: int) -> int:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", wanted))
        except OSError:
            return free_port()
    return wanted


def _exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C does, so the `with` blocks below stop the gateway and the simulators
    (by default SIGTERM ends the process at once and they would be left running)."""
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(128 + signal.SIGTERM))


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    _exit_on_sigterm()
    config = yaml.safe_load(args.config.read_text())
    model = config["models"][0]["name"]
    if args.policy:
        config.setdefault("routing", {})["policy"] = args.policy
    if args.disaggregation:
        config.setdefault("routing", {})["disaggregation"] = args.disaggregation
    console.print(
        f"starting {len(config['backends'])} simulated backends (time scale {args.time_scale}x) ..."
    )
    with contextlib.ExitStack() as stack:
        for backend in config["backends"]:
            sim = stack.enter_context(
                SimProcess(sim_args(backend, model, args.time_scale), startup_timeout_s=60)
            )
            backend["url"] = sim.url
            console.print(
                f"  {backend['id']:>10}: {backend['accelerator']} x{backend.get('gpus', 1)} at {sim.url}"
            )
        gateway = stack.enter_context(GatewayProcess(config, port=_port(args.port)))
        print_usage(gateway.url, model)
        if args.requests <= 0:
            console.print("serving until Ctrl-C")
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(3600)
            return 0
        load = demo_requests(args.requests, args.long_share)
        console.print(f"sending {len(load)} requests ({args.concurrency} at a time) ...")
        started = time.perf_counter()
        results = asyncio.run(send_load(gateway.url, model, load, args.concurrency))
        summarise(results, time.perf_counter() - started, args.time_scale)
        return 0 if all(r["ok"] for r in results) else 1
