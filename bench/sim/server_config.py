"""The simulated vLLM server's settings (`hetgate sim`'s flags) and the engine they build.

`build_engine` picks the engine a `SimServerConfig` asks for: the simple timing model
(bench/sim/simple_engine.py), the roofline engine (bench/sim/scheduler.py), or a test's own factory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.sim.engine_api import Engine, KVEventSink
from bench.sim.faults import FaultPlan
from bench.sim.kv_events import KVEventsConfig
from bench.sim.simple_engine import SimpleEngine, SimpleEngineConfig

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
    # Cost engine: figures of `accelerator` replacing the catalogue's (`hetgate sim calibrate --json`'s fit).
    accelerator_overrides: dict[str, float] | None = None
    enable_prompt_tokens_details: bool = False
    max_num_batched_tokens: int = 8192  # cost engine: token budget of one step (chunked prefill)
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

    overrides = {config.accelerator: config.accelerator_overrides} if config.accelerator_overrides else {}
    catalog = load_catalog(overrides={"accelerators": overrides})
    return build_cost_engine(
        catalog.model(config.cost_model or config.model),
        catalog.accelerator(config.accelerator),
        config.gpus,
        block_size=config.block_size,
        max_num_seqs=(config.simple_engine or SimpleEngineConfig()).max_num_seqs,
        num_gpu_blocks=config.num_gpu_blocks,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_lease_s=config.kv_lease_s,
        efficiency=dataclasses.replace(DEFAULT_EFFICIENCY, **(config.efficiency or {})),
        engine=CostEngineConfig(time_scale=config.time_scale, kv_host=config.host),
        sink=kv_events,
    )
