"""The backends file source against files written the way people write them: not atomically."""

from __future__ import annotations

from pathlib import Path

import yaml

from gateway.config import BackendConfig, GatewayConfig
from gateway.discovery import FileSource

CONFIG = GatewayConfig.model_validate(
    {"models": [{"name": "m"}], "discovery": {"source": "file", "file": {"path": "backends.yaml"}}}
)


def listing(*ids: str) -> str:
    rows = [
        {"id": i, "url": f"http://127.0.0.1:{9000 + n}", "model": "m", "accelerator": "h100"}
        for n, i in enumerate(ids)
    ]
    return yaml.safe_dump(rows)


def source(path: Path) -> tuple[FileSource, list[tuple[BackendConfig, ...]]]:
    snapshots: list[tuple[BackendConfig, ...]] = []
    return FileSource(path, 0.1, CONFIG, snapshots.append, {"h100"}), snapshots


def ids(snapshot: tuple[BackendConfig, ...]) -> list[str]:
    return [b.id for b in snapshot]


def test_a_change_applies_once_the_file_stands_still_for_a_poll(tmp_path: Path) -> None:
    path = tmp_path / "backends.yaml"
    path.write_text(listing("a"))
    files, snapshots = source(path)
    files.poll(settle=False)  # start-up: at once
    assert [ids(s) for s in snapshots] == [["a"]]
    path.write_text(listing("a", "b"))
    files.poll()  # changed since the last poll: it may still be being written
    assert len(snapshots) == 1
    files.poll()  # unchanged for a poll: read
    assert [ids(s) for s in snapshots] == [["a"], ["a", "b"]]
    files.poll()
    assert len(snapshots) == 2  # read once


def test_a_file_caught_mid_write_never_replaces_the_backends(tmp_path: Path) -> None:
    path = tmp_path / "backends.yaml"
    path.write_text(listing("a", "b"))
    files, snapshots = source(path)
    files.poll(settle=False)
    full = listing("a", "b", "c")
    path.write_text("")  # truncated: the writer has not written yet
    files.poll()
    path.write_text(full[: len(full) // 2])  # half written
    files.poll()
    path.write_text(full)
    files.poll()
    files.poll()
    assert [ids(s) for s in snapshots] == [["a", "b"], ["a", "b", "c"]]


def test_an_empty_file_keeps_the_backends_and_an_empty_list_clears_them(tmp_path: Path) -> None:
    path = tmp_path / "backends.yaml"
    path.write_text(listing("a"))
    files, snapshots = source(path)
    files.poll(settle=False)
    path.write_text("  \n")
    files.poll()
    files.poll()
    assert [ids(s) for s in snapshots] == [["a"]]
    path.write_text("[]\n")
    files.poll()
    files.poll()
    assert [ids(s) for s in snapshots] == [["a"], []]
