"""HTTP mode of `hetgate bench policies`: real `hetgate sim` backends behind a real `hetgate serve` process
agree with the discrete-event mode on the same requests at the same arrival times."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time

import pytest

from bench import policies as pb
from bench import workloads as w
from bench.policies_http import agreement, parse_targets, run_http
from bench.ports import free_port

TOLERANCE = 0.10  # the agreement the benchmark promises between its two modes


def test_http_and_des_agree_within_ten_percent_on_a_tiny_run() -> None:
    # Seed-case prompts (16k tokens, DeepSeek-R1 on the seed cluster): TTFTs of about a second on the
    # MI300X and four on the MI308X, long enough that loopback HTTP costs little beside them. Round robin
    # routes the same way in both modes, so what is compared is the serving, not the routing.
    scenario = pb.Scenario("seed-tiny", "amd", tuple(w.fixed_lengths(9, 16384, 8, name="tiny")), "poisson")
    rate, policy = 0.4, "round_robin/never"
    des = pb.run_des(scenario, rate, policy, pb.Slo())
    http = run_http(scenario, rate, policy, pb.Slo(), time_scale=1.0)
    assert des.completed == http.completed == 9
    even = {"mi300x-0": 3, "mi308x-0": 3, "mi308x-1": 3}
    assert http.requests_per_backend == des.requests_per_backend == even
    diff = agreement(des, http)
    print(f"DES vs HTTP relative differences: {diff}")
    assert diff["output_tok_per_s"] <= TOLERANCE
    assert diff["ttft_p50_s"] <= TOLERANCE
    assert http.mode == "http" and http.policy == policy


def test_conversations_follow_their_cache_over_http_as_in_the_des() -> None:
    # Six chats of four turns on the NVIDIA mix, the turns 1.6 s apart at this rate while an answer
    # streams for about as long: each turn must find where its conversation's KV is (the sims' KV events
    # feed hetgate's index) in both modes, so the cache hit rates match and no chat changes backend.
    turns = 4
    chats = tuple(w.multi_turn_chats(6, turns, think_time_s=20.0, seed=0))
    scenario = pb.Scenario("chats-tiny", "nvidia", chats, "trace")
    rate, policy = 0.3 * pb.scenario_bound(scenario).requests_per_s, "prefix/never"
    des = pb.run_des(scenario, rate, policy, pb.Slo())
    http = run_http(scenario, rate, policy, pb.Slo(), time_scale=1.0)
    assert des.completed == http.completed == len(chats)
    assert http.prefix_hit_rate == pytest.approx(des.prefix_hit_rate, abs=0.05)
    assert http.prefix_hit_rate > 0.5  # three of four turns find the history their last turn left
    for row in (des, http):
        assert all(n % turns == 0 for n in row.requests_per_backend.values()), row.requests_per_backend
    assert agreement(des, http)["output_tok_per_s"] <= TOLERANCE


def test_an_external_router_gets_the_same_load_on_the_same_backends() -> None:
    # The floor proxy (bench/floor_proxy.py) stands in for an external router: it forwards everything to
    # one backend and names none, so the row counts what each simulated backend finished.
    ports = [free_port() for _ in range(3)]
    proxy_port = free_port()
    command = [sys.executable, "-m", "bench.floor_proxy", f"http://127.0.0.1:{ports[0]}", str(proxy_port)]
    proxy = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_listening(proxy_port, proxy)
        scenario = pb.Scenario("seed-floor", "amd", tuple(w.fixed_lengths(4, 4096, 4, name="fl")), "poisson")
        target = ("floor", f"http://127.0.0.1:{proxy_port}")
        row = run_http(scenario, 0.5, "", pb.Slo(), 2.0, target=target, sim_ports=ports)
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)
    assert row.mode == row.policy == "target:floor"
    assert row.completed == 4 and row.output_tok_per_s > 0
    assert row.requests_per_backend == {"mi300x-0": 4, "mi308x-0": 0, "mi308x-1": 0}


def _wait_listening(port: int, process: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "the floor proxy exited"
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on {port} after {timeout_s} s")


def test_a_launched_router_is_started_per_point_in_front_of_the_sims() -> None:
    # NAME=COMMAND: the bench starts the router after the sims, with {port} and {workers} filled in, and
    # stops it after the point. The floor proxy takes one upstream: `sh` hands it the first worker.
    command = f"sh -c 'exec {sys.executable} -m bench.floor_proxy \"$0\" {{port}}' {{workers}}"
    scenario = pb.Scenario("seed-launch", "amd", tuple(w.fixed_lengths(3, 4096, 4, name="la")), "poisson")
    row = run_http(scenario, 0.5, "", pb.Slo(), 2.0, target=("floor", command))
    assert row.policy == "target:floor" and row.completed == 3
    assert row.requests_per_backend == {"mi300x-0": 3, "mi308x-0": 0, "mi308x-1": 0}


def test_targets_need_a_name_and_a_url_or_a_command_with_a_port() -> None:
    assert parse_targets(["sglang=http://127.0.0.1:30000"]) == [("sglang", "http://127.0.0.1:30000")]
    launch = "sglang=python -m sglang_router.launch_router --port {port} --worker-urls {workers}"
    assert parse_targets([launch]) == [("sglang", launch.partition("=")[2])]
    for bad in ("sglang", "=http://x", "sglang=", "sglang=python -m router --worker-urls {workers}"):
        with pytest.raises(SystemExit):
            parse_targets([bad])
