"""`hetgate bench soak --minutes N`: mixed load through the gateway while backends fail on a schedule.

Starts simulated backends as processes (three aggregated, one prefill and one decode for P/D), a gateway
(least_load, disaggregation auto), and `--concurrency` clients sending a mix of chat and completions,
streamed and not, short prompts (served aggregated) and long ones (split P/D); some clients disconnect
early and some read slowly. Every `CYCLE_S` seconds the same fault schedule runs: a backend is killed and
restarted on its port, 500 bursts and 503 overload periods, first-byte stalls (under and over the gateway's
`ttfb_s`), streams cut or ended with an in-band error mid-way, a failing prefill leg.

Printed at the end: requests by outcome; errors by cause; how many failed before any byte reached the
client (the gateway could have retried those elsewhere: at most two backends are faulty at once and
`retry.num_retries` is 2, three attempts, so every one of them counts as lost); streams cut without an
error event (silent truncation); the gateway's RSS and open descriptors after warm-up and after the
load (growth); the backends' in-flight count once idle; tracebacks in the gateway log. `--check` exits 1
on a lost request, a silent truncation, a leaked in-flight count or RSS growth over 5 %.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness import GatewayProcess
from bench.sim.server import SimProcess

MODEL = "soak-model"
CYCLE_S = 30.0
SIM_TIMING = ["--ttft-base-s", "0.01", "--prefill-token-s", "0.00002", "--tpot-s", "0.004"]
LONG_PROMPT_WORDS = 400  # ~500 estimated tokens: over pd_min_prompt_tokens, so split P/D
TTFB_S = 2.0


def fixed_port() -> int:
    """A free port below the ephemeral range: a killed backend's port must still be free for its restart
    (a port in the ephemeral range may meanwhile be taken as the local end of some outgoing connection)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    while True:
        port = rng.randrange(10000, max(low, 10001))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


@dataclass(slots=True)
class Backend:
    id: str
    roles: tuple[str, ...]
    port: int = field(default_factory=lambda: fixed_port())
    process: SimProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def args(self) -> list[str]:
        role = "both" if len(self.roles) == 2 else self.roles[0]
        return ["--model", MODEL, "--role", role, "--port", str(self.port), *SIM_TIMING]

    def start(self) -> None:
        for attempt in range(10):  # a restart may find the killed server's port briefly still held
            try:
                self.process = SimProcess(self.args()).start()
                return
            except RuntimeError:
                if attempt == 9:
                    raise
                time.sleep(1.0)

    def kill(self) -> None:
        """SIGKILL: no goodbye to open connections, as a crashed server."""
        if self.process is not None and self.process.process is not None:
            self.process.process.send_signal(signal.SIGKILL)
            self.process.process.wait()
            self.process.stop()  # closes its pipe
        self.process = None

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
        self.process = None

    def config(self) -> dict[str, Any]:
        connector = "nixl" if len(self.roles) == 1 else "none"
        return {"id": self.id, "url": self.url, "model": MODEL, "accelerator": "h100-sxm",
                "roles": list(self.roles), "kv_connector": connector}  # fmt: skip


def cluster() -> list[Backend]:
    both = ("prefill", "decode")
    return [Backend("agg-1", both), Backend("agg-2", both), Backend("agg-3", both),
            Backend("pre-1", ("prefill",)), Backend("dec-1", ("decode",))]  # fmt: skip


def gateway_config(backends: list[Backend]) -> dict[str, Any]:
    return {
        "models": [{"name": MODEL}],
        "backends": [b.config() for b in backends],
        "routing": {"policy": "least_load", "disaggregation": "auto", "pd_min_prompt_tokens": 256},
        "timeouts": {"connect_s": 1.0, "ttfb_s": TTFB_S, "idle_s": 5.0},
        "retry": {"num_retries": 2},
        # The prefix index's TTL is one cycle, so the index is full (steady) once the warm-up is over and its
        # filling is not counted as growth; with the default 600 s it fills for the first 10 minutes.
        "index": {"ttl_s": CYCLE_S},
        "health": {"interval_s": 0.5, "timeout_s": 0.5, "failure_threshold": 2},
    }


# -- the fault schedule ------------------------------------------------------------------------------
Action = Callable[[dict[str, Backend]], Coroutine[Any, Any, None]]


def plan(backend_id: str, **faults: Any) -> Action:
    async def apply(backends: dict[str, Backend]) -> None:
        async with aiohttp.ClientSession() as session:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                await session.post(
                    f"{backends[backend_id].url}/sim/faults",
                    json=faults,
                    timeout=aiohttp.ClientTimeout(total=2),
                )

    apply.__name__ = f"{backend_id}: {json.dumps(faults)}"
    return apply


def kill(backend_id: str) -> Action:
    async def apply(backends: dict[str, Backend]) -> None:
        await asyncio.to_thread(backends[backend_id].kill)

    apply.__name__ = f"{backend_id}: kill"
    return apply


def restart(backend_id: str) -> Action:
    async def apply(backends: dict[str, Backend]) -> None:
        await asyncio.to_thread(backends[backend_id].start)

    apply.__name__ = f"{backend_id}: restart"
    return apply


# (seconds into each cycle, action). At most two aggregated backends are faulty at any moment.
SCHEDULE: list[tuple[float, Action]] = [
    (1.0, plan("agg-1", error_status=500, error_count=10)),
    (4.0, kill("agg-2")),
    (6.0, plan("pre-1", error_status=500, error_count=5)),
    (9.0, plan("agg-3", first_byte_delay_s=0.5, delay_count=10)),
    (12.0, restart("agg-2")),
    (14.0, plan("agg-1", first_byte_delay_s=TTFB_S + 1.5, delay_count=2)),
    # Overload is a period (the gateway tries a backend that answered 503 last for a while, so a counted
    # burst would stretch on and overlap the next faults).
    (17.0, plan("agg-3", error_status=503, error_for_s=1.0)),
    (19.0, plan("dec-1", error_status=503, error_for_s=0.5)),
    (21.0, plan("agg-2", stream_error_after_chunks=2, stream_error_count=3)),
    (24.0, plan("agg-1", close_after_chunks=2, close_count=3)),
]


async def run_schedule(backends: dict[str, Backend], until: float, log: list[str]) -> None:
    """Start each action on time (a restart takes seconds on a busy machine: it must not delay the rest)."""
    start = time.monotonic()
    running: set[asyncio.Task[None]] = set()
    cycle = 0
    while True:
        for offset, action in SCHEDULE:
            at = start + cycle * CYCLE_S + offset
            if at >= until:
                await asyncio.gather(*running)
                return
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            task = asyncio.create_task(action(backends))
            running.add(task)
            task.add_done_callback(running.discard)
            log.append(f"{time.monotonic() - start:7.1f}s {action.__name__}")
        cycle += 1


# -- the load ----------------------------------------------------------------------------------------
@dataclass(slots=True)
class Result:
    outcome: str  # ok | disconnected | status_NNN | stream_error | truncated | reset | timeout | bad_body
    before_first_byte: bool  # the failure happened before the gateway sent the client any byte
    mode: str
    why: str = ""  # an error reply's `error.code` or `error.type` (the gateway's or a backend's words)


def request_shape(rng: random.Random) -> tuple[str, dict[str, Any]]:
    chat = rng.random() < 0.6
    long = rng.random() < 0.25
    text = " ".join(
        rng.choice(("alpha", "beta", "gamma", "delta")) for _ in range(LONG_PROMPT_WORDS if long else 12)
    )
    body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randint(4, 24), "stream": rng.random() < 0.6}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        return "/v1/chat/completions", body
    body["prompt"] = text
    return "/v1/completions", body


async def one_request(session: aiohttp.ClientSession, url: str, rng: random.Random) -> Result:
    path, body = request_shape(rng)
    disconnect = rng.random() < 0.08
    slow = rng.random() < 0.05
    try:
        async with session.post(url + path, json=body) as response:
            mode = response.headers.get("x-hetgate-route", "mode=?").split(";")[0].removeprefix("mode=")
            if response.status != 200:
                return Result(f"status_{response.status}", True, mode, error_kind(await response.read()))
            if disconnect:
                await response.content.readany()
                return Result("disconnected", False, mode)
            if not body["stream"]:
                payload = json.loads(await response.read())
                ok = "choices" in payload
                return Result("ok" if ok else "bad_body", False, mode)
            return await read_stream(response, slow, mode)
    except TimeoutError:
        return Result("timeout", True, "?")
    except (aiohttp.ClientError, json.JSONDecodeError):
        return Result("reset", True, "?")


def error_kind(body: bytes) -> str:
    """An OpenAI-shaped error's code (or type); the message is not kept (it may quote a backend)."""
    try:
        error = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        return "not-json"
    return str(error.get("code") or error.get("type") or "?")


async def read_stream(response: aiohttp.ClientResponse, slow: bool, mode: str) -> Result:
    done = errored = False
    events = 0
    async for line in response.content:
        if slow:
            await asyncio.sleep(0.02)
        if not line.startswith(b"data: "):
            continue
        if done:
            return Result("after_done", False, mode)  # nothing may follow [DONE]
        events += 1
        if line.startswith(b"data: [DONE]"):
            done = True
        elif line.startswith(b'data: {"error"'):
            errored = True
    if errored:
        return Result("stream_error", False, mode)
    return Result("ok" if done else "truncated", False, mode)


async def load(url: str, concurrency: int, until: float, seed: int) -> list[Result]:
    results: list[Result] = []
    timeout = aiohttp.ClientTimeout(total=30)
    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def client(n: int) -> None:
            rng = random.Random(seed * 1000 + n)
            while time.monotonic() < until:
                results.append(await one_request(session, url, rng))

        await asyncio.gather(*(client(n) for n in range(concurrency)))
    return results


# -- the gateway process -----------------------------------------------------------------------------
def process_figures(pid: int) -> tuple[int, int]:
    """(RSS bytes, open descriptors) of the gateway process."""
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


async def sample_rss(pid: int, until: float) -> list[float]:
    """The gateway's RSS (MiB) once a cycle: growth that levels off is warm-up, steady growth a leak."""
    samples = []
    while time.monotonic() < until:
        samples.append(round(process_figures(pid)[0] / 2**20, 1))
        await asyncio.sleep(min(CYCLE_S, max(0.0, until - time.monotonic())))
    return samples


GATEWAY_COUNTS = (
    "hetgate:backend_in_flight",
    "hetgate:backend_pending_decode_legs",
    "hetgate:retries_total",
    "hetgate:retry_budget_exhausted_total",
)


async def gateway_counts(url: str) -> dict[str, float]:
    """Sums over labels of a few of the gateway's series (in flight once idle; retries and refusals)."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        text = await response.text()
    sums = dict.fromkeys(GATEWAY_COUNTS, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
    return sums


async def soak(
    gateway: GatewayProcess, backends: dict[str, Backend], args: argparse.Namespace
) -> dict[str, Any]:
    started = time.monotonic()
    until = started + args.minutes * 60
    schedule_log: list[str] = []
    load_task = asyncio.create_task(load(gateway.url, args.concurrency, until, args.seed))
    schedule = asyncio.create_task(run_schedule(backends, until, schedule_log))
    # The starting figures once every path (faults included) ran and the allocator and the prefix index have
    # settled: a fifth of the run, at least one cycle (or a quarter of a run shorter than two minutes).
    await asyncio.sleep(min(max(CYCLE_S, args.minutes * 12), args.minutes * 15))
    rss_start, fds_start = process_figures(gateway.pid)
    samples = asyncio.create_task(sample_rss(gateway.pid, until))
    await schedule
    results = await load_task
    for backend in backends.values():  # every backend back up, then let the gateway settle
        if backend.process is None:
            await asyncio.to_thread(backend.start)
    await asyncio.sleep(3.0)
    rss_end, fds_end = process_figures(gateway.pid)
    return {
        "minutes": args.minutes,
        "wall_s": round(time.monotonic() - started, 1),
        "results": results,
        "faults": schedule_log,
        "rss": (rss_start, rss_end),
        "rss_samples": await samples,
        "fds": (fds_start, fds_end),
        "gateway_counts": await gateway_counts(gateway.url),
        "tracebacks": gateway.log_path.read_text(errors="replace").count("Traceback"),
    }


def report(figures: dict[str, Any]) -> dict[str, Any]:
    results: list[Result] = figures["results"]
    outcomes = Counter(r.outcome for r in results)
    modes = Counter(r.mode for r in results)
    lost = sum(
        1
        for r in results
        if r.before_first_byte and r.outcome != "timeout" and r.outcome.startswith(("status_5", "reset"))
    )
    rss_start, rss_end = figures["rss"]
    fds_start, fds_end = figures["fds"]
    summary = {
        "requests": len(results),
        "requests_per_s": round(len(results) / max(figures["wall_s"], 1e-9), 1),
        "outcomes": dict(outcomes.most_common()),
        "modes": dict(modes.most_common()),
        "errors_by_mode": dict(
            Counter(
                f"{r.outcome} ({r.mode}{', ' + r.why if r.why else ''})"
                for r in results
                if r.outcome not in ("ok", "disconnected")
            ).most_common()
        ),
        "lost_retriable": lost,
        "silent_truncations": outcomes["truncated"] + outcomes["after_done"],
        "client_timeouts": outcomes["timeout"],
        "rss_mib": (round(rss_start / 2**20, 1), round(rss_end / 2**20, 1)),
        "rss_growth_pct": round(100 * (rss_end - rss_start) / rss_start, 2),
        "rss_samples_mib": figures["rss_samples"],
        "fds": (fds_start, fds_end),
        "in_flight_after": figures["gateway_counts"]["hetgate:backend_in_flight"],
        "pending_decode_legs_after": figures["gateway_counts"]["hetgate:backend_pending_decode_legs"],
        "retries": figures["gateway_counts"]["hetgate:retries_total"],
        "retry_budget_exhausted": figures["gateway_counts"]["hetgate:retry_budget_exhausted_total"],
        "gateway_tracebacks": figures["tracebacks"],
        "fault_actions": len(figures["faults"]),
    }
    return summary


def print_report(summary: dict[str, Any], faults: list[str]) -> None:
    print(f"\nsoak: {summary['requests']} requests ({summary['requests_per_s']}/s), ", end="")
    print(f"{summary['fault_actions']} fault actions")
    print("faults (first cycle):")
    for line in faults[: len(SCHEDULE)]:
        print(f"  {line}")
    print("outcomes:")
    for outcome, n in summary["outcomes"].items():
        print(f"  {outcome:<14} {n}")
    print(f"route modes: {summary['modes']}")
    print(f"errors by cause and route: {summary['errors_by_mode']}")
    print(f"lost (failed before the first byte, retriable elsewhere): {summary['lost_retriable']}")
    retries, refused = summary["retries"], summary["retry_budget_exhausted"]
    print(f"gateway retries: {retries:g}, refused by the retry budget: {refused:g}")
    print(
        f"silent truncations (cut without an error event, or after [DONE]): {summary['silent_truncations']}"
    )
    print(f"client timeouts (30 s): {summary['client_timeouts']}")
    rss, fds = summary["rss_mib"], summary["fds"]
    print(f"gateway RSS after warm-up -> end: {rss[0]} -> {rss[1]} MiB ({summary['rss_growth_pct']:+.2f} %)")
    print(f"gateway RSS once a cycle (MiB): {summary['rss_samples_mib']}")
    print(f"gateway open fds after warm-up -> end: {fds[0]} -> {fds[1]}")
    print(f"backend in-flight once idle: {summary['in_flight_after']:g}")
    print(f"split decode legs still due once idle: {summary['pending_decode_legs_after']:g}")
    print(f"tracebacks in the gateway log: {summary['gateway_tracebacks']}")


def violations(summary: dict[str, Any]) -> list[str]:
    problems = []
    if summary["lost_retriable"]:
        problems.append(f"{summary['lost_retriable']} retriable requests lost")
    if summary["silent_truncations"]:
        problems.append(f"{summary['silent_truncations']} silent truncations")
    if summary["in_flight_after"]:
        problems.append(f"in-flight count {summary['in_flight_after']:g} once idle")
    if summary["pending_decode_legs_after"]:
        problems.append(f"{summary['pending_decode_legs_after']:g} split decode legs still due once idle")
    if summary["rss_growth_pct"] > 5:
        problems.append(f"RSS grew {summary['rss_growth_pct']} %")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hetgate bench soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=2.0, help="how long the load and faults run")
    parser.add_argument("--concurrency", type=int, default=8, help="clients sending at once")
    parser.add_argument("--seed", type=int, default=1, help="seed of the load mix and client behaviour")
    parser.add_argument("--json", type=Path, default=None, help="also write the summary here")
    parser.add_argument("--check", action="store_true", help="exit 1 on a lost request, truncation or leak")
    args = parser.parse_args(argv)
    backends = {b.id: b for b in cluster()}
    try:
        for backend in backends.values():
            backend.start()
        with GatewayProcess(gateway_config(list(backends.values()))) as gateway:
            figures = asyncio.run(soak(gateway, backends, args))
    finally:
        for backend in backends.values():
            backend.stop()
    summary = report(figures)
    print_report(summary, figures["faults"])
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    problems = violations(summary)
    if problems:
        print("NOT MET: " + "; ".join(problems))
    return 1 if args.check and problems else 0
