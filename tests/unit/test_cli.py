"""The `hetgate` command line: config checking, and sub-commands that own their flags."""

from __future__ import annotations

from pathlib import Path

from gateway.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_check_config_accepts_the_shipped_configs(capsys):
    for name in ("example.yaml", "seed-case.yaml"):
        assert main(["check-config", str(ROOT / "configs" / name)]) == 0
    assert "OK" in capsys.readouterr().out


def test_check_config_names_the_bad_path(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "models: [{name: m}]\nbackends: [{id: a, url: 'http://127.0.0.1:1', model: m, accelerator: mi300}]\n"
    )
    assert main(["check-config", str(bad)]) == 2
    assert "backends[0].accelerator: unknown accelerator 'mi300'" in capsys.readouterr().err


def test_unknown_benchmark_is_a_usage_error(capsys):
    assert main(["bench", "nope"]) == 2
    assert "usage: hetgate bench" in capsys.readouterr().err


def test_sim_help_comes_from_the_simulator(capsys):
    assert main(["sim", "--help"]) == 0
    assert "--kv-transfer-config" in capsys.readouterr().out
