"""The roofline-timed vLLM-like engine of the simulator, by name: re-exports its parts from the modules that
hold them, so `from bench.sim.scheduler import ...` keeps working.

* `bench/sim/sched_core.py`: `SchedulerCore` (the clock-driven continuous-batching core; what it reproduces
  of vLLM V1 is described there), `SchedulerConfig`, `StepOutput`.
* `bench/sim/sched_request.py`: one request's state (`EngineRequest`, `RequestEvent`).
* `bench/sim/kv_blocks.py`: the block KV cache with prefix caching (`BlockPool`, `chained_block_hashes`).
* `bench/sim/kv_leases.py`: held KV and remote-KV waits for P/D (`KVLeases`, a mixin of the core).
* `bench/sim/step_timer.py`: step times from the roofline (`StepTimer`).
* `bench/sim/cost_engine.py`: the asyncio `Engine` for the HTTP server (`CostModelEngine`,
  `build_cost_engine`).
"""

from __future__ import annotations

from bench.sim.cost_engine import CostEngineConfig, CostModelEngine, build_cost_engine
from bench.sim.kv_blocks import BlockPool, chained_block_hashes
from bench.sim.kv_leases import KVLeases
from bench.sim.sched_core import SchedulerConfig, SchedulerCore, StepOutput
from bench.sim.sched_request import EngineRequest, RequestEvent
from bench.sim.step_timer import StepTimer

__all__ = [
    "BlockPool",
    "CostEngineConfig",
    "CostModelEngine",
    "EngineRequest",
    "KVLeases",
    "RequestEvent",
    "SchedulerConfig",
    "SchedulerCore",
    "StepOutput",
    "StepTimer",
    "build_cost_engine",
    "chained_block_hashes",
]
