"""Connection hygiene (issue 9 item 3): one client must not stall or lock out the others.

A real `hetgate serve` process in front of a simulated backend, attacked with raw sockets: slowloris heads,
a 64 MiB header, too many headers, a stalled body, idle keep-alive connections, more connections than the
cap. Each scenario checks that the attacker gets an OpenAI-shaped answer (or is closed) and, where it
matters, that a normal client is served meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import resource
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.harness import GatewayProcess
from bench.sim.server import SimServerConfig, SimThread, start_in_thread
from tests.integration.conftest import FAST, MODEL, backend, chat_body, config, metric

POLL_S = 0.02
# The shared gateway's limits (most scenarios use it: a gateway takes seconds to start on a busy machine).
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 1.5
KEEPALIVE_TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def sim_backend() -> Iterator[SimThread]:
    server = start_in_thread(SimServerConfig(model=MODEL), simple_engine=FAST)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gateway(sim_backend: SimThread) -> Iterator[GatewayProcess]:
    limits = {
        "header_timeout_s": HEADER_TIMEOUT_S,
        "body_timeout_s": BODY_TIMEOUT_S,
        "keepalive_timeout_s": KEEPALIVE_TIMEOUT_S,
    }
    with serving(sim_backend, **limits) as process:
        yield process


@contextlib.contextmanager
def serving(sim: SimThread, **server: Any) -> Iterator[GatewayProcess]:
    with GatewayProcess(config([backend(sim, "a")], server=server)) as gateway:
        yield gateway


def normal_request(gateway: GatewayProcess) -> float:
    """One ordinary chat request on a fresh connection; its latency (fails on anything but 200)."""
    started = time.perf_counter()
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", json=chat_body(), timeout=5.0)
    assert reply.status_code == 200, reply.text
    return time.perf_counter() - started


def connect(gateway: GatewayProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", gateway.port), timeout=10)


def read_response(
    sock: socket.socket, timeout_s: float = HEADER_TIMEOUT_S + 10.0
) -> tuple[int, dict[str, str], bytes]:
    """Read one HTTP response to EOF or its content-length: (status, headers, body). The default wait
    outlasts the header timeout, whose 408 some answers are (it is a bound, not a delay)."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response head: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def assert_openai_error(status: int, body: bytes, expected: int) -> None:
    assert status == expected, body
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == expected


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the gateway closed its side (EOF or reset); never blocks."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        while chunk := sock.recv(65536, socket.MSG_DONTWAIT):
            del chunk
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_slowloris_heads_are_closed_and_normal_clients_served(gateway: GatewayProcess) -> None:
    timeout_s = HEADER_TIMEOUT_S
    opened = time.monotonic()
    loris = [connect(gateway) for _ in range(200)]
    for sock in loris:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n")
    stop = threading.Event()

    def trickle() -> None:  # one header byte per connection every 100 ms: never idle, never done
        while not stop.is_set():
            for sock in loris:
                with contextlib.suppress(OSError):
                    sock.send(b"x")
            stop.wait(0.1)

    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    try:
        latencies = [normal_request(gateway) for _ in range(5)]
        still_open = [sock for sock in loris if not closed_by_peer(sock)]
        assert len(still_open) == len(loris), "the normal requests were not served while all were open"
        closed_at: dict[int, float] = {}
        deadline = opened + timeout_s + 10
        while len(closed_at) < len(loris) and time.monotonic() < deadline:
            for i, sock in enumerate(loris):
                if i not in closed_at and closed_by_peer(sock):
                    closed_at[i] = time.monotonic() - opened
            time.sleep(POLL_S)
    finally:
        stop.set()
        trickler.join()
    print(f"\nnormal request latency with 200 slowloris heads open: max {max(latencies) * 1e3:.1f} ms")
    assert len(closed_at) == len(loris), f"{len(loris) - len(closed_at)} slowloris connections still open"
    assert min(closed_at.values()) >= timeout_s * 0.9  # closed by the header timeout, not earlier
    normal_request(gateway)  # and the gateway still serves
    for sock in loris:
        sock.close()


def rejections(gateway: GatewayProcess, reason: str) -> float:
    return metric(gateway.url, "hetgate:connection_rejections_total", reason=reason)


def test_slowloris_head_gets_an_openai_shaped_408(gateway: GatewayProcess) -> None:
    before = rejections(gateway, "header_timeout")
    with connect(gateway) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n")
        status, headers, body = read_response(sock)
        assert_openai_error(status, body, 408)
        assert headers["connection"] == "close"
    assert rejections(gateway, "header_timeout") == before + 1


def test_silent_connection_is_closed_by_the_header_timeout(gateway: GatewayProcess) -> None:
    with connect(gateway) as sock:
        status, _, body = read_response(sock)  # never sent a byte
        assert_openai_error(status, body, 408)


def _send_huge_header(gateway: GatewayProcess, size: int, result: dict[str, Any]) -> None:
    """Send a head with one `size`-byte header in 1 MiB writes; stop as soon as the gateway answers."""
    chunk = b"a" * (1 << 20)
    sent = 0
    with connect(gateway) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nX-Big: ")
        try:
            while sent < size:
                readable, _, _ = select.select([sock], [], [], 0)
                if readable:
                    break
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError as error:
            result["send_error"] = error
        result["sent"] = sent
        try:
            result["response"] = read_response(sock)
        except OSError as error:
            result["read_error"] = error


def test_64mib_header_is_refused_without_stalling_others(gateway: GatewayProcess) -> None:
    size = 64 << 20
    normal_request(gateway)  # warm
    rss_before = rss_bytes(gateway.pid)
    results: list[dict[str, Any]] = [{} for _ in range(8)]
    senders = [
        threading.Thread(target=_send_huge_header, args=(gateway, size, r), daemon=True) for r in results
    ]
    for sender in senders:
        sender.start()
    latencies = []
    while any(s.is_alive() for s in senders):
        latencies.append(normal_request(gateway))
    for sender in senders:
        sender.join()
    rss_growth = rss_bytes(gateway.pid) - rss_before
    print(
        f"\n8 x 64 MiB headers: normal requests served {len(latencies)}, max latency "
        f"{max(latencies, default=0) * 1e3:.1f} ms, gateway RSS growth {rss_growth / 2**20:.1f} MiB"
    )
    for result in results:
        assert "response" in result, result
        status, _, body = result["response"]
        assert_openai_error(status, body, 431)
        assert result["sent"] < size  # refused long before the header was whole
    assert rss_growth < 64 << 20  # before the limit, 8 such headers took 628 MB
    normal_request(gateway)


@pytest.mark.parametrize(
    "headers",
    [
        {f"x-h{i}": "v" for i in range(101)},  # over max_headers
        {"x-big": "a" * 70_000},  # over max_header_bytes, arriving in one read
    ],
    ids=["count", "size"],
)
def test_oversized_head_gets_431(gateway: GatewayProcess, headers: dict[str, str]) -> None:
    reason = "too_many_headers" if len(headers) > 1 else "header_too_large"
    before = rejections(gateway, reason)
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", json=chat_body(), headers=headers)
    assert_openai_error(reply.status_code, reply.content, 431)
    normal_request(gateway)
    assert rejections(gateway, reason) == before + 1


def test_head_just_under_the_limits_is_served(sim_backend: SimThread) -> None:
    with serving(sim_backend, max_header_bytes=16384, max_headers=25) as gateway:
        headers = {f"x-h{i}": "v" * 500 for i in range(15)}
        reply = httpx.post(f"{gateway.url}/v1/chat/completions", json=chat_body(), headers=headers)
        assert reply.status_code == 200, reply.text


def test_malformed_request_gets_openai_shaped_400(gateway: GatewayProcess) -> None:
    before = rejections(gateway, "malformed")
    with connect(gateway) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: gw\r\nBad Header\x01: x\r\n\r\n")
        status, _, body = read_response(sock)
        assert_openai_error(status, body, 400)
    assert rejections(gateway, "malformed") == before + 1


def _post_head(length: int) -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def test_stalled_body_gets_408(gateway: GatewayProcess) -> None:
    timeout_s = BODY_TIMEOUT_S
    before = rejections(gateway, "body_timeout")
    with connect(gateway) as sock:
        sock.sendall(_post_head(1000) + b'{"model": ')
        sent = time.monotonic()
        status, _, body = read_response(sock)
        assert time.monotonic() - sent >= timeout_s * 0.9
        assert_openai_error(status, body, 408)
        normal_request(gateway)
    assert rejections(gateway, "body_timeout") == before + 1


def test_body_in_pieces_within_the_timeout_is_served(gateway: GatewayProcess) -> None:
    payload = json.dumps(chat_body()).encode()
    with connect(gateway) as sock:
        sock.sendall(_post_head(len(payload)))
        for i in range(0, len(payload), 20):
            sock.sendall(payload[i : i + 20])
            time.sleep(0.02)  # a slow but honest client
        status, _, body = read_response(sock)
        assert status == 200, body


def test_idle_keepalive_connection_is_closed(gateway: GatewayProcess) -> None:
    timeout_s = KEEPALIVE_TIMEOUT_S
    with connect(gateway) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
        status, headers, _ = read_response(sock)
        assert status == 200 and headers.get("connection") != "close"
        answered = time.monotonic()
        sock.settimeout(timeout_s + 10)
        assert sock.recv(1) == b""  # the gateway closed the idle connection
        assert time.monotonic() - answered >= timeout_s * 0.9


def test_connection_cap_answers_503_instead_of_resetting(sim_backend: SimThread) -> None:
    cap = 10
    with serving(sim_backend, max_connections=cap, header_timeout_s=60) as gateway:
        idle = [connect(gateway) for _ in range(cap)]
        try:
            deadline = time.monotonic() + 10
            while True:  # the gateway accepts the idle connections asynchronously: poll
                with connect(gateway) as sock:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
                    status, _, body = read_response(sock)
                if status == 503 or time.monotonic() > deadline:
                    break
                time.sleep(POLL_S)
            assert_openai_error(status, body, 503)
        finally:
            for sock in idle:
                sock.close()
        deadline = time.monotonic() + 10
        while httpx.get(f"{gateway.url}/health").status_code != 200:
            assert time.monotonic() < deadline, "the gateway did not recover after the cap"
            time.sleep(POLL_S)
        normal_request(gateway)
        assert rejections(gateway, "connection_limit") >= 1  # every poll over the cap was one


def test_open_file_soft_limit_is_raised_to_the_hard_limit(sim_backend: SimThread) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(1024, hard // 2)
    gateway = GatewayProcess(config([backend(sim_backend, "a")]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        gateway.start()  # inherits the low soft limit
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        limits = Path(f"/proc/{gateway.pid}/limits").read_text()
        row = next(line for line in limits.splitlines() if line.startswith("Max open files"))
        assert row.split()[3:5] == [str(hard), str(hard)], row
    finally:
        gateway.stop()


def test_early_answer_is_not_followed_by_a_408(gateway: GatewayProcess) -> None:
    """A body refused by its declared length (413) is not read: the body timeout closes, adds nothing."""
    with connect(gateway) as sock:
        sock.sendall(_post_head(100_000_000) + b"{")
        status, _, body = read_response(sock)
        assert status == 413, body
        sock.settimeout(BODY_TIMEOUT_S + 10)
        rest = b""
        while chunk := sock.recv(65536):
            rest += chunk
        assert rest == b""  # closed, nothing after the 413


def test_slow_head_on_a_kept_alive_connection_gets_408(gateway: GatewayProcess) -> None:
    """The header timeout also covers the second request of a connection, from its first byte."""
    with connect(gateway) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
        assert read_response(sock)[0] == 200
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\n")  # and the rest never comes
        started = time.monotonic()
        status, _, body = read_response(sock)
        assert_openai_error(status, body, 408)
        assert time.monotonic() - started >= HEADER_TIMEOUT_S * 0.9
