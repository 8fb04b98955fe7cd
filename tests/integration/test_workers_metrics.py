"""`hetgate serve --workers N`: whichever worker answers a scrape, /metrics counts every worker's requests
(prometheus-client's multiprocess mode)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from prometheus_client.mmap_dict import MmapedDict

from tests.integration.conftest import backend, chat_body, config, metric


def test_any_worker_reports_all_workers_requests(sim, gateway, tmp_path: Path) -> None:
    a = sim()
    folder = tmp_path / "metrics"
    folder.mkdir()
    gw = gateway(config([backend(a, "a")]), workers=2, env={"PROMETHEUS_MULTIPROC_DIR": str(folder)})
    sent = 40
    for _ in range(sent):  # a new connection each time: the kernel spreads them over the workers
        reply = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), timeout=10)
        assert reply.status_code == 200
    # Both workers served: each counted some of the requests in its own file (every worker writes a
    # counter file at startup, so the files alone would prove nothing).
    per_worker = [requests_in(file) for file in folder.glob("counter_*.db")]
    assert sum(per_worker) == sent
    assert sum(1 for count in per_worker if count > 0) == 2, per_worker
    for _ in range(6):  # scrapes land on either worker; each must see all requests
        assert metric(gw.url, "hetgate:requests_total", status="200") == sent
        assert metric(gw.url, "hetgate:backend_in_flight", backend="a") == 0
        page = httpx.get(f"{gw.url}/metrics", timeout=5).text
        assert 'hetgate:backend_healthy{backend="a"} 1.0' in page
        assert "pid=" not in page  # series aggregated over workers, not one per worker


def requests_in(file: Path) -> float:
    """hetgate:requests_total as one worker's multiprocess file holds it."""
    values = MmapedDict.read_all_values_from_file(str(file))
    return sum(value for key, value, *_ in values if json.loads(key)[1] == "hetgate:requests_total")
