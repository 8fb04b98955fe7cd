"""The `hetgate` command line: config checking as strict as `serve`, and help for every sub-command."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from gateway.cli import BENCHMARKS, main

ROOT = Path(__file__).resolve().parents[2]
GOOD_BACKEND = "{id: a, url: 'http://127.0.0.1:1', model: m, accelerator: mi300x}"


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return str(path)


def test_check_config_accepts_the_shipped_configs(capsys):
    for name in ("example.yaml", "seed-case.yaml"):
        assert main(["check-config", str(ROOT / "configs" / name)]) == 0
    assert "OK" in capsys.readouterr().out


def test_check_config_names_the_bad_path(tmp_path, capsys):
    bad = write(
        tmp_path,
        "models: [{name: m}]\nbackends: [{id: a, url: 'http://127.0.0.1:1', model: m, accelerator: mi300}]\n",
    )
    assert main(["check-config", bad]) == 2
    assert "backends[0].accelerator: unknown accelerator 'mi300'" in capsys.readouterr().err


def test_check_config_lists_every_error_once_in_one_pass(tmp_path, capsys):
    bad = write(
        tmp_path,
        f"models: [{{name: m, spec: no-such-model, tokenizer: {tmp_path / 'missing'}}}]\n"
        "backends:\n"
        "  - {id: a, url: 'http://127.0.0.1:1', model: m, accelerator: mi300, gpus: 0}\n"
        "  - {id: b, url: 'not a url', model: m, accelerator: mi300x, kv_events: {endpoint: 'tcp://*'}}\n"
        "index: {store: redis, redis_url: 'http://127.0.0.1:6379'}\n",
    )
    assert main(["check-config", bad]) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()[1:]  # after "configuration error:"
    expected = [
        "models[0].spec: unknown model spec 'no-such-model'",
        f"models[0].tokenizer: cannot load tokenizer from {tmp_path / 'missing'}",
        "backends[0].accelerator: unknown accelerator 'mi300'",
        "backends[0].gpus:",
        "backends[1].url:",
        "backends[1].kv_events.endpoint: not a ZeroMQ endpoint",
        "index.redis_url:",
    ]
    assert len(lines) == len(expected), err
    for line, start in zip(lines, expected, strict=True):
        assert line.startswith(start), err
    assert "at least 1 item" not in err  # no follow-up error for a list whose entries all failed


@pytest.mark.parametrize(
    ("models_line", "message"),
    [
        ("{name: m, spec: no-such-model}", "models[0].spec: unknown model spec 'no-such-model'"),
        ("{name: m, tokenizer: /nonexistent/tokenizer}", "models[0].tokenizer: cannot load tokenizer"),
    ],
)
def test_serve_rejects_what_check_config_rejects_without_a_traceback(tmp_path, capsys, models_line, message):
    bad = write(tmp_path, f"models: [{models_line}]\nbackends: [{GOOD_BACKEND}]\n")
    assert main(["check-config", bad]) == 2
    assert message in capsys.readouterr().err
    assert main(["serve", "--config", bad]) == 2  # refused before anything listens
    assert message in capsys.readouterr().err


def test_a_tokenizer_that_loads_passes(tmp_path, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    Tokenizer(models.WordLevel({"hello": 0, "[UNK]": 1}, unk_token="[UNK]")).save(
        str(folder / "tokenizer.json")
    )
    good = write(
        tmp_path,
        f"models: [{{name: m, spec: llama-3.1-8b, tokenizer: {folder}}}]\nbackends: [{GOOD_BACKEND}]\n",
    )
    assert main(["check-config", good]) == 0, capsys.readouterr().err


@pytest.mark.parametrize(
    ("endpoint", "ok"),
    [("tcp://*:5557", True), ("tcp://10.0.0.2:5557", True), ("tcp://[::]:5557", True),
     ("ipc:///tmp/kv", True), ("tcp://host", False), ("localhost:5557", False), ("tcp://*:port", False)],
)  # fmt: skip
def test_kv_event_endpoints_are_checked(tmp_path, capsys, endpoint, ok):
    backend = GOOD_BACKEND[:-1] + f", kv_events: {{endpoint: '{endpoint}'}}}}"
    path = write(tmp_path, f"models: [{{name: m}}]\nbackends: [{backend}]\n")
    assert main(["check-config", path]) == (0 if ok else 2), capsys.readouterr().err


def test_bench_help_lists_every_benchmark(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hetgate bench")
    for name, (_, summary) in BENCHMARKS.items():
        # The name and its summary apart, on one line (a longer name once ran into its summary).
        assert re.search(rf"^  {re.escape(name)} +{re.escape(summary)}$", out, re.MULTILINE), name


def test_bench_without_a_known_name_is_a_usage_error(capsys):
    for argv in (["bench"], ["bench", "nope"]):
        assert main(argv) == 2
        assert "usage: hetgate bench" in capsys.readouterr().err


def test_sim_help_comes_from_the_simulator(capsys):
    assert main(["sim", "--help"]) == 0
    assert "--kv-transfer-config" in capsys.readouterr().out


SUBCOMMANDS = [["serve"], ["check-config"], ["sim"], ["demo"], *(["bench", name] for name in BENCHMARKS)]


@pytest.mark.parametrize("command", SUBCOMMANDS, ids=" ".join)
def test_every_subcommand_has_complete_help(command, capsys, monkeypatch):
    """`--help` exits 0 under the name users type, and every option and argument says what it does."""
    parsers: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.parse_known_args

    def recording(self, args=None, namespace=None):
        parsers.append(self)
        return original(self, args, namespace)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", recording)
    try:
        code = main([*command, "--help"])
    except SystemExit as exited:  # argparse exits; `hetgate sim` returns the code instead
        code = exited.code
    assert code == 0
    assert capsys.readouterr().out.startswith(f"usage: hetgate {' '.join(command)} ")
    parser = parsers[-1]  # the sub-command's own parser (argparse hands `hetgate`'s on to it)
    silent = [a.dest for a in parser._actions if not a.help and not isinstance(a, argparse._HelpAction)]
    assert silent == []
