"""The Redis prefix index across gateway processes, and the gateway when Redis dies or freezes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.client
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvindex.prompt import PromptHasher
from kvindex.redis import RedisIndex
from tests.integration.conftest import MODEL, backend, chat_body, config, metric
from tests.redis_server import redis_server_factory

__all__ = ["redis_server_factory"]


# Generous for the tests of sharing: a first call of a fresh worker on a busy 2-core machine can outlast
# 20 ms, and then the guard routes without the index for a second (the load test keeps the real 20 ms).
SHARING_DEADLINE_MS = 1000
BLOCK_SIZE = 16  # the backends' default block_size (gateway/config.py)


def prefix_config(sims, redis_url: str, deadline_ms: float = SHARING_DEADLINE_MS) -> dict:
    return config(
        [backend(s, f"b{i}") for i, s in enumerate(sims)],
        routing={"policy": "prefix"},
        index={"store": "redis", "redis_url": redis_url, "deadline_ms": deadline_ms, "key_prefix": "t"},
    )


def conversation(i: int) -> str:
    return f"conversation {i}: " + " ".join(f"w{i}x{j}" for j in range(300))


def route(gw, prompt: str) -> str:
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(prompt, max_tokens=2), timeout=10)
    assert r.status_code == 200
    return r.headers["x-hetgate-route"]


def backend_of(route_header: str) -> str:
    return route_header.rsplit("backend=", 1)[1]


def holds(redis_url: str, backend_id: str, prompt: str) -> bool:
    """Whether the shared index holds this prompt's first block for the backend, asked the way a gateway
    asks (same hashes, same store), so a late write of another prompt cannot be mistaken for it."""
    _, hashes = PromptHasher(MODEL, [BLOCK_SIZE]).features(chat_body(prompt), "chat")

    async def match() -> list[int]:
        index = RedisIndex.from_url(redis_url, key_prefix="t")
        try:
            return await index.match(MODEL, BLOCK_SIZE, hashes[BLOCK_SIZE], [backend_id])
        finally:
            await index.close()

    return asyncio.run(match())[0] > 0


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def route_and_wait_for_record(gw, prompt: str, redis_url: str) -> str:
    """Route a prompt never sent before, then wait until the index holds its blocks for the chosen
    backend (the gateway records them when the backend answers, off the request path)."""
    chosen = route(gw, prompt)
    backend = backend_of(chosen)
    wait_until(lambda: holds(redis_url, backend, prompt), what=f"{backend}'s record")
    return chosen


def test_two_gateways_share_one_index(sim, gateway, redis_server_factory):
    redis_ = redis_server_factory()
    sims = [sim(), sim(), sim()]
    first = gateway(prefix_config(sims, redis_.url))
    second = gateway(prefix_config(sims, redis_.url))
    for i in range(6):  # a chance match would need 6 coin flips in a row (1 in 729 with 3 backends)
        chosen = route_and_wait_for_record(first, conversation(i), redis_.url)
        assert route(second, conversation(i) + " and a follow-up question") == chosen


def _worker_pids(master: int) -> set[int]:
    """The processes `hetgate serve --workers N` started (children of its supervisor)."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # after "(comm)": state, ppid
            if parent == master:
                pids.add(int(stat.parent.name))
    return pids


def _socket_inode(local_port: int, remote_port: int) -> str:
    """The inode of the gateway's end of one loopback TCP connection (from /proc/net/tcp)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, inode = fields[1], fields[2], fields[9]
        if int(local.split(":")[1], 16) == local_port and int(remote.split(":")[1], 16) == remote_port:
            return inode
    raise AssertionError(f"no connection {local_port} <- {remote_port} in /proc/net/tcp")


def _holder(pids: set[int], inode: str) -> int:
    """Which of `pids` holds the socket `inode` open: the worker that accepted the connection."""
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd) == f"socket:[{inode}]":
                    return pid
    raise AssertionError(f"no worker holds socket {inode}")


def route_via_worker(gw, prompt: str, workers: set[int]) -> tuple[str, int]:
    """Route on a new connection; returns the route and the worker process that served it."""
    connection = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=10)
    try:
        body = json.dumps(chat_body(prompt, max_tokens=2))
        connection.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        response = connection.getresponse()
        response.read()
        assert response.status == 200
        assert connection.sock is not None
        # The connection is still open (keep-alive): find the worker holding its other end.
        inode = _socket_inode(gw.port, connection.sock.getsockname()[1])
        return response.headers["x-hetgate-route"], _holder(workers, inode)
    finally:
        connection.close()


def test_workers_of_one_serve_share_the_index(sim, gateway, redis_server_factory):
    redis_ = redis_server_factory()
    sims = [sim(), sim(), sim()]
    gw = gateway(prefix_config(sims, redis_.url), workers=2)
    assert gw.process is not None
    wait_until(lambda: len(_worker_pids(gw.process.pid)) >= 2, what="two workers")
    workers = _worker_pids(gw.process.pid)
    served_by: set[int] = set()
    # New connections each time: the kernel spreads them over the workers. Keep going until both
    # workers have served follow-ups, so the test proves the index is shared, not merely consistent.
    for i in range(12):
        chosen = route_and_wait_for_record(gw, conversation(i), redis_.url)
        for turn in range(3):
            follow_up, worker = route_via_worker(gw, conversation(i) + f" turn {turn}", workers)
            assert follow_up == chosen
            served_by.add(worker)
        if len(served_by) == 2 and i >= 3:
            break
    assert len(served_by) == 2, "one worker served every follow-up"


def _load(gw, stop: threading.Event, results: list[tuple[int, float]]) -> None:
    """Requests from 4 threads until `stop`: (status, start time) of each, appended to `results`."""

    def loop(worker: int) -> None:
        with httpx.Client(timeout=10) as client:
            i = 0
            while not stop.is_set():
                started = time.monotonic()
                body = chat_body(conversation(worker * 1000 + i % 7), max_tokens=2)
                status = client.post(f"{gw.url}/v1/chat/completions", json=body).status_code
                results.append((status, started))  # list.append is atomic
                i += 1

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(loop, range(4)))


@pytest.mark.parametrize("failure", ["kill", "pause"])
def test_redis_failure_under_load_fails_no_request(sim, gateway, redis_server_factory, failure):
    redis_ = redis_server_factory()
    gw = gateway(prefix_config([sim(), sim()], redis_.url, deadline_ms=20))
    stop = threading.Event()
    results: list[tuple[int, float]] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        load = pool.submit(_load, gw, stop, results)
        wait_until(lambda: len(results) >= 10, what="load before the failure")
        failed_at = time.monotonic()
        redis_.kill() if failure == "kill" else redis_.pause()
        wait_until(lambda: sum(1 for _, t in results if t > failed_at) >= 20, what="load after it")
        stop.set()
        load.result()
    if failure == "pause":
        redis_.resume()
    # Every request succeeded (none failed, none hung past the client's 10 s timeout), requests kept
    # being served while Redis was gone, and the gateway did meet the failure.
    assert {status for status, _ in results} == {200}
    assert metric(gw.url, "hetgate:index_errors_total") > 0


def test_index_recovers_when_redis_returns(sim, gateway, redis_server_factory):
    redis_ = redis_server_factory()
    sims = [sim(), sim(), sim()]
    gw = gateway(prefix_config(sims, redis_.url, deadline_ms=20))
    redis_.pause()
    assert route(gw, conversation(1)).startswith("mode=aggregated")
    assert metric(gw.url, "hetgate:index_errors_total") > 0
    redis_.resume()
    # The guard leaves the store alone for retry_after_s after a failure, then asks it again: poll with
    # fresh conversations until one is routed without an index error (a miss is not an error).
    probes = iter(range(100, 10_000))

    def index_answers() -> bool:
        errors = metric(gw.url, "hetgate:index_errors_total")
        route(gw, conversation(next(probes)))
        return metric(gw.url, "hetgate:index_errors_total") == errors

    wait_until(index_answers, what="the index to answer again")
    for i in range(20, 24):
        chosen = route_and_wait_for_record(gw, conversation(i), redis_.url)
        assert route(gw, conversation(i) + " again") == chosen
