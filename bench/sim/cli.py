"""`hetgate sim ...`: run one simulated vLLM backend. Flag names follow vLLM's where vLLM has the flag.

Prints `SIM_READY http://HOST:PORT` on stdout once serving (SimProcess waits for that line), and,
when KV events are on, `SIM_KV_EVENTS <endpoint>` (and `SIM_KV_REPLAY <endpoint>`) before it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys

from bench.sim.faults import FaultPlan
from bench.sim.kv_events import KVEventsConfig
from bench.sim.server import READY_PREFIX, ROLES, SimServer, SimServerConfig, serve_forever
from bench.sim.simple_engine import SimpleEngineConfig

_SIMPLE = SimpleEngineConfig()  # the simple engine's defaults


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetgate sim", description="Simulated vLLM 0.32 OpenAI-compatible backend"
    )
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="listen address")
    add("--port", type=int, default=8000, help="0 picks a free port (printed on the ready line)")
    add("--model", default="sim-model", help="model name (as vLLM's --model)")
    add("--served-model-name", nargs="+", default=None, help="names clients may send (default --model)")
    add("--role", choices=ROLES, default=None, help="P/D role (default: from kv_role, else both)")
    add(
        "--engine",
        choices=("simple", "cost"),
        default="simple",
        help="simple: fixed per-token times; cost: steps timed by the roofline cost model",
    )
    add("--accelerator", default="mi300x", help="cost engine: configs/accelerators.yaml entry")
    add("--gpus", type=int, default=8, help="cost engine: devices the server spans")
    add("--time-scale", type=float, default=1.0, help="simulated seconds per wall second")
    add("--max-model-len", type=int, default=8192, help="as vLLM's: longest prompt + output")
    add("--block-size", type=int, default=16, help="as vLLM's: KV-cache block size in tokens")
    add("--num-gpu-blocks-override", type=int, default=None, help="as vLLM's: KV-cache size in blocks")
    add("--cost-model", default=None, help="cost engine: model name in configs/models.yaml (default --model)")
    add(
        "--accelerator-overrides",
        type=json.loads,
        default=None,
        help="cost engine: JSON figures replacing the catalogue's (e.g. a `hetgate sim calibrate` fit)",
    )
    add("--efficiency", type=json.loads, default=None, help='cost engine: JSON overrides, e.g. {"mfu": 0.17}')
    add("--enable-prompt-tokens-details", action="store_true", help="as vLLM's: report cached tokens")
    add("--enable-force-include-usage", action="store_true", help="as vLLM's: usage in every stream")
    add("--kv-events-config", type=KVEventsConfig.from_json, default=None, help="JSON, as vLLM's flag")
    add("--kv-transfer-config", type=json.loads, default=None, help="JSON, as vLLM's flag")
    add(
        "--faults",
        type=lambda text: FaultPlan.from_dict(json.loads(text)),
        default=None,
        help="fault plan JSON",
    )
    add("--ttft-base-s", type=float, default=_SIMPLE.ttft_base_s, help="simple engine")
    add("--prefill-token-s", type=float, default=_SIMPLE.prefill_token_s, help="simple engine")
    add("--tpot-s", type=float, default=_SIMPLE.tpot_s, help="simple engine")
    add("--max-num-seqs", type=int, default=_SIMPLE.max_num_seqs, help="as vLLM's: running sequences")
    add("--max-num-batched-tokens", type=int, default=8192, help="as vLLM's: token budget of one step (cost)")
    add("--max-num-queued-reqs", type=int, default=None, help="beyond this many waiting: 503")
    add("--api-key", default=None, help="as vLLM's: /v1/* needs this bearer token")
    return parser


def _role_from_kv_transfer(kv_transfer_config: dict[str, object] | None) -> str:
    """vLLM's kv_role names the side a server plays in P/D."""
    kv_role = (kv_transfer_config or {}).get("kv_role")
    return {"kv_producer": "prefill", "kv_consumer": "decode"}.get(str(kv_role), "both")


def config_from_args(args: argparse.Namespace) -> SimServerConfig:
    return SimServerConfig(
        model=args.model,
        served_model_names=args.served_model_name,
        host=args.host,
        port=args.port,
        role=args.role or _role_from_kv_transfer(args.kv_transfer_config),
        engine=args.engine,
        accelerator=args.accelerator,
        gpus=args.gpus,
        time_scale=args.time_scale,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks_override,
        cost_model=args.cost_model,
        efficiency=args.efficiency,
        accelerator_overrides=args.accelerator_overrides,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        max_num_queued_reqs=args.max_num_queued_reqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        api_key=args.api_key,
        enable_force_include_usage=args.enable_force_include_usage,
        kv_events=args.kv_events_config or KVEventsConfig(),
        kv_transfer_config=args.kv_transfer_config,
        faults=args.faults or FaultPlan(),
        simple_engine=SimpleEngineConfig(
            ttft_base_s=args.ttft_base_s,
            prefill_token_s=args.prefill_token_s,
            tpot_s=args.tpot_s,
            max_num_seqs=args.max_num_seqs,
        ),
    )


def _announce(server: SimServer) -> None:
    if server.publisher is not None:
        print(f"SIM_KV_EVENTS {server.publisher.endpoint}", flush=True)
        if server.publisher.replay_endpoint:
            print(f"SIM_KV_REPLAY {server.publisher.replay_endpoint}", flush=True)
    print(f"{READY_PREFIX}{server.url}", flush=True)


async def _run(config: SimServerConfig) -> None:
    task = asyncio.create_task(serve_forever(config, _announce))
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await task


def main(argv: list[str]) -> int:
    if argv and argv[0] == "calibrate":  # `hetgate sim calibrate`: fit a catalogue entry to a real server
        from bench.sim.calibrate import main as calibrate

        return calibrate(argv[1:])
    try:
        config = config_from_args(build_parser().parse_args(argv))
    except SystemExit as exit_:  # argparse's --help and usage errors: return their code, do not exit
        return exit_.code if isinstance(exit_.code, int) else 2
    except ValueError as err:
        print(f"hetgate sim: {err}", file=sys.stderr)
        return 2
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # uvloop is optional; asyncio's loop works, slower
        pass
    try:
        asyncio.run(_run(config))
    except (ValueError, OSError) as err:  # unknown catalog model or accelerator, port in use, bad endpoint
        print(f"hetgate sim: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
