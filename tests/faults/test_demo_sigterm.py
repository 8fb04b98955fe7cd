"""`hetgate demo` stopped with SIGTERM (as a service manager or `docker stop` does) stops its gateway and
simulated backends too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def descendants(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            found |= {child} | descendants(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_stops_the_gateway_and_the_simulators():
    demo = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "demo", "--port", "0", "--time-scale", "20"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    children: set[int] = set()
    try:
        assert demo.stdout is not None
        for line in demo.stdout:
            if "serving until Ctrl-C" in line:
                break
        else:
            raise AssertionError(f"the demo ended before serving (exit {demo.wait()})")
        children = descendants(demo.pid)
        assert len(children) >= 4  # three simulated backends and the gateway
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(timeout=60) != 0
        deadline = time.monotonic() + 20
        while any(alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in children if alive(p)]
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        if demo.stdout is not None:
            demo.stdout.close()
        for pid in children:  # what this test started, should it fail: never left running
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
