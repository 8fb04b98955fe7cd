"""The `hetgate` command: serve, check-config, sim, demo, bench."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from gateway.config import ConfigError, GatewayConfig, load_config

# `hetgate bench NAME ...` runs `main(argv)` of the module named here.
BENCHMARKS = {
    "overhead": "bench.overhead",
    "seed-case": "bench.seed_case",
    "index": "bench.index_bench",
    "cache": "bench.cache_bench",
    "des": "bench.des_bench",
    "soak": "bench.soak",
}

CONFIG_ENV = "HETGATE_CONFIG"


def known_accelerators() -> set[str] | None:
    """Accelerator names from configs/accelerators.yaml; None when the catalogue cannot be read."""
    try:
        from scoring.catalog import load_catalog
    except ImportError:
        return None
    return set(load_catalog().accelerators)


def read_config(path: str) -> GatewayConfig:
    return load_config(path, known_accelerators())


def app_from_env():
    from gateway.app import create_asgi_app

    return create_asgi_app(read_config(os.environ[CONFIG_ENV]))


def _serve(args: argparse.Namespace) -> int:
    from gateway.server import serve

    config = read_config(args.config)
    os.environ[CONFIG_ENV] = os.path.abspath(args.config)
    serve(
        "gateway.cli:app_from_env",
        host=args.host or config.listen.host,
        port=config.listen.port if args.port is None else args.port,
        workers=args.workers,
        log_level=args.log_level,
        limits=config.server,
    )
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
    serve.add_argument("--log-level", default="warning")
    serve.set_defaults(run=_serve)

    check = commands.add_parser("check-config", help="validate a configuration file")
    check.add_argument("file")
    check.set_defaults(run=_check_config)

    commands.add_parser("sim", help="run a simulated vLLM backend (hetgate sim --help)", add_help=False)
    commands.add_parser(
        "demo", help="a simulated cluster behind the gateway (hetgate demo --help)", add_help=False
    )
    commands.add_parser("bench", help=f"benchmarks: {', '.join(BENCHMARKS)}", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # sim, demo and bench own their flags: hand them the rest of the command line untouched.
    if argv and argv[0] == "sim":
        return _delegate("bench.sim.cli", argv[1:])
    if argv and argv[0] == "demo":
        return _delegate("bench.demo", argv[1:])
    if argv and argv[0] == "bench":
        if len(argv) < 2 or argv[1] not in BENCHMARKS:
            print(f"usage: hetgate bench {{{','.join(BENCHMARKS)}}} [options]", file=sys.stderr)
            return 2
        return _delegate(BENCHMARKS[argv[1]], argv[2:])
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as error:
        print(f"configuration error:\n{error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
