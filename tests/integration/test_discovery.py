"""Backends that come and go while the gateway serves: Kubernetes pods (a fake API server speaking the real
list+watch wire format), a watched backends file, and the configuration reloaded on change or SIGHUP."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from bench.sim.simple_engine import SimpleEngineConfig
from tests.fake_kube import FakeKubeApi, make_pod
from tests.integration.conftest import MODEL, backend, chat_body, config

# Streams last long enough (10 ms a token) to still be open while a pod goes away.
STEADY = SimpleEngineConfig(ttft_base_s=0.002, prefill_token_s=0.00001, tpot_s=0.01)
LABELS = {"app": "vllm", "hetgate.io/model": MODEL, "hetgate.io/accelerator": "h100-sxm"}
TOKEN = "service-account-token"


def served_by(gw_url: str, count: int = 12, **fields: object) -> list[str]:
    """The backend id of each of `count` requests (from the route header)."""
    out = []
    with httpx.Client(timeout=10) as client:
        for _ in range(count):
            reply = client.post(f"{gw_url}/v1/chat/completions", json=chat_body(**fields))
            assert reply.status_code == 200, reply.text
            out.append(reply.headers["x-hetgate-route"].split("backend=")[1].split(";")[0])
    return out


def until(check: Callable[[], bool], timeout_s: float = 10.0) -> float:
    """Polls `check` until true; returns the seconds it took."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout_s, "condition not reached in time"
        time.sleep(0.05)
    return time.monotonic() - started


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[tuple[FakeKubeApi, Path]]:
    api = FakeKubeApi(TOKEN).start()
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    yield api, token
    api.stop()


def port(server: object) -> int:
    return int(str(server.url).rsplit(":", 1)[1])  # type: ignore[attr-defined]


def kube_config(api: FakeKubeApi, token: Path, **kubernetes: object) -> dict:
    cfg = config([], routing={"policy": "round_robin"})
    del cfg["backends"]
    settings = {"namespace": "llm", "label_selector": "app=vllm", "api_server": api.url,
                "token_file": str(token), "ca_file": None, **kubernetes}  # fmt: skip
    cfg["discovery"] = {"source": "kubernetes", "kubernetes": settings}
    return cfg


def test_pods_join_leave_and_drain_through_list_and_watch(sim, gateway, kube) -> None:
    api, token = kube
    a, b, c = (sim(simple_engine=STEADY) for _ in range(3))
    api.add(make_pod("a", port(a), LABELS))
    api.add(make_pod("b", port(b), LABELS))
    api.add(make_pod("not-ready", port(c), LABELS, ready=False))
    api.add(make_pod("other-app", port(c), {**LABELS, "app": "other"}))
    gw = gateway(kube_config(api, token))
    until(lambda: set(served_by(gw.url, 4)) == {"a", "b"})

    # A pod added to the watched set takes traffic within 2 s, with no failed request.
    api.add(make_pod("c", port(c), LABELS))
    assert until(lambda: "c" in served_by(gw.url, 3)) < 2.0

    # A terminating pod gets no new request; its open stream finishes.
    with httpx.Client(timeout=30) as client, client.stream(
        "POST", f"{gw.url}/v1/chat/completions", json=chat_body(stream=True, max_tokens=400),
        headers={"x-request-id": "long-stream"},
    ) as stream:  # fmt: skip
        on = stream.headers["x-hetgate-route"].split("backend=")[1].split(";")[0]
        terminating = make_pod(on, port({"a": a, "b": b, "c": c}[on]), LABELS)
        terminating["metadata"]["deletionTimestamp"] = "2026-11-30T10:00:00Z"
        api.modify(terminating)
        until(lambda: on not in served_by(gw.url, 6))
        body = b"".join(stream.iter_bytes())
    assert body.rstrip().endswith(b"data: [DONE]")
    api.delete(on)
    assert on not in served_by(gw.url, 6)


def test_resumes_from_bookmarks_and_relists_after_gone(sim, gateway, kube) -> None:
    api, token = kube
    a, b = sim(), sim()
    api.add(make_pod("a", port(a), LABELS))
    gw = gateway(kube_config(api, token))
    until(lambda: served_by(gw.url, 2) == ["a", "a"])

    # Events of pods outside the selector move the version on; a bookmark tells the gateway, and the
    # next watch resumes from there rather than from the last pod it saw.
    api.add(make_pod("elsewhere", port(b), {**LABELS, "app": "other"}))
    bookmarked = api.version
    until(lambda: bookmarked in api.bookmarks)  # sent on the server's own clock
    api.end_watches()
    until(lambda: bookmarked in api.watch_versions)

    # History compacted and the watch ended: resuming gets 410, so the gateway lists again and sees the
    # change it missed (a gone, b added).
    lists = api.lists
    api.compact()
    api.end_watches()
    api.delete("a")
    api.add(make_pod("b", port(b), LABELS))
    until(lambda: api.lists > lists)
    until(lambda: set(served_by(gw.url, 4)) == {"b"})


def test_model_from_v1_models_and_bad_token_keeps_serving(sim, gateway, kube) -> None:
    api, token = kube
    a = sim()
    unlabelled = {k: v for k, v in LABELS.items() if k != "hetgate.io/model"}
    api.add(make_pod("a", port(a), unlabelled))
    gw = gateway(kube_config(api, token))
    until(lambda: httpx.get(f"{gw.url}/ready", timeout=5).status_code == 200)  # model learnt from vLLM
    assert set(served_by(gw.url, 3)) == {"a"}

    api.token = "rotated"  # the gateway's token no longer works: it retries, and keeps its backends
    api.end_watches()
    until(lambda: api.unauthorized > 0)
    assert set(served_by(gw.url, 3)) == {"a"}
    token.write_text("rotated")  # the token file is re-read on every call (projected tokens rotate)
    b = sim()
    api.add(make_pod("b", port(b), LABELS))
    until(lambda: "b" in served_by(gw.url, 4), timeout_s=40)


def test_backends_file_is_followed_and_a_bad_one_rejected(sim, gateway, tmp_path: Path) -> None:
    a, b = sim(), sim()
    listing = tmp_path / "backends.yaml"
    listing.write_text(yaml.safe_dump([backend(a, "a")]))
    cfg = config([])
    del cfg["backends"]
    cfg["discovery"] = {"source": "file", "file": {"path": str(listing), "poll_s": 0.1}}
    gw = gateway(cfg)
    assert set(served_by(gw.url, 3)) == {"a"}

    listing.write_text(yaml.safe_dump([backend(a, "a"), backend(b, "b")]))
    assert until(lambda: "b" in served_by(gw.url, 3)) < 2.0
    listing.write_text(yaml.safe_dump([backend(a, "a"), {**backend(b, "b"), "accelerator": "nope"}]))
    # The bad list was read and refused: it must not have replaced the good one.
    until(lambda: "backends[1].accelerator: unknown accelerator 'nope'" in gw.log_path.read_text())
    assert set(served_by(gw.url, 6)) == {"a", "b"}
    listing.write_text(yaml.safe_dump([backend(b, "b")]))
    until(lambda: set(served_by(gw.url, 4)) == {"b"})


def test_config_reload_on_change_rejects_bad_files_and_survives_sighup(sim, gateway) -> None:
    a, b = sim(), sim()
    cfg = config([backend(a, "a")])
    gw = gateway(cfg)
    assert set(served_by(gw.url, 3)) == {"a"}

    gw.config_path.write_text(yaml.safe_dump(config([backend(a, "a"), backend(b, "b")])))
    until(lambda: set(served_by(gw.url, 4)) == {"a", "b"})

    broken = config([backend(a, "a")], routing={"policy": "fastest"})
    gw.config_path.write_text(yaml.safe_dump(broken))
    until(lambda: "routing.policy" in gw.log_path.read_text())
    assert set(served_by(gw.url, 4)) == {"a", "b"}  # the running configuration stays

    gw.config_path.write_text(yaml.safe_dump(config([backend(b, "b")], routing={"route_header": True})))
    os.kill(gw.pid, signal.SIGHUP)  # reloads now (and must not end the process, SIGHUP's default)
    until(lambda: set(served_by(gw.url, 4)) == {"b"})
    assert gw.process is not None and gw.process.poll() is None
