"""One request's state inside the scheduler: what it asks for (`EngineRequest`), where it stands
(`ReqState`: lifecycle state, computed and generated tokens, its KV blocks, P/D timers) and what one step
produced for it (`RequestEvent`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

WAITING, TRANSFERRING, RUNNING, HELD, DONE = range(5)


@dataclass(slots=True)
class EngineRequest:
    """What the scheduler needs to know about one request (token ids only if KV events are wanted)."""

    request_id: str
    prompt_len: int
    max_tokens: int
    block_hashes: Sequence[int] = ()  # chained hashes of the full prompt blocks, at this engine's block size
    prompt_token_ids: Sequence[int] | None = None
    prefill_only: bool = False
    remote_kv_tokens: int = 0  # P/D decode: prompt tokens whose KV a prefiller computed
    kv_transfer_s: float = 0.0  # P/D decode: how long pulling that KV takes once blocks are allocated


@dataclass(slots=True)
class RequestEvent:
    """One request's result of one step: a token (or none, mid-prefill) and whether it finished."""

    request_id: str
    first_token: bool
    finish_reason: str | None
    num_cached_tokens: int
    num_output_tokens: int = 0  # tokens of this request generated so far, this one included


class ReqState:
    __slots__ = (
        "admitted_once",
        "blocks",
        "cached_tokens",
        "computed",
        "hashed_blocks",
        "held_until",
        "num_hashes",
        "outputs",
        "prompt_len",
        "ready_at",
        "spec",
        "state",
    )

    def __init__(self, spec: EngineRequest) -> None:
        self.spec = spec
        self.prompt_len = spec.prompt_len
        self.num_hashes = len(spec.block_hashes)
        self.state = WAITING
        self.computed = 0  # tokens whose KV is in cache
        self.outputs = 0  # tokens generated so far
        self.blocks: list[int] = []
        self.hashed_blocks = 0  # leading prompt blocks registered in (or taken from) the prefix cache
        self.cached_tokens = 0  # prompt tokens served without local compute (prefix hit + remote KV)
        self.ready_at = 0.0
        self.held_until = 0.0
        self.admitted_once = False

    @property
    def known(self) -> int:
        return self.spec.prompt_len + self.outputs
