"""`hetgate sim` flags map onto the server configuration with vLLM's names and meanings."""

from __future__ import annotations

import json

import pytest

from bench.sim.cli import build_parser, config_from_args, main


def config(*argv: str):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_defaults() -> None:
    parsed = config()
    assert (parsed.host, parsed.port, parsed.role, parsed.engine) == ("127.0.0.1", 8000, "both", "simple")
    assert parsed.time_scale == 1.0 and not parsed.kv_events.active
    assert parsed.names == ["sim-model"]


def test_vllm_flags() -> None:
    events = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:5557", "topic": "kv"}
    parsed = config(
        "--model", "llama-3.1-8b", "--served-model-name", "a", "b", "--max-model-len", "1024",
        "--block-size", "64", "--num-gpu-blocks-override", "100", "--enable-prompt-tokens-details",
        "--kv-events-config", json.dumps(events),
        "--engine", "cost", "--accelerator", "mi308x", "--gpus", "4",
    )  # fmt: skip
    assert parsed.names == ["a", "b"] and parsed.max_model_len == 1024
    assert (parsed.block_size, parsed.num_gpu_blocks) == (64, 100)
    assert parsed.enable_prompt_tokens_details
    assert parsed.kv_events.active and parsed.kv_events.endpoint == "tcp://127.0.0.1:5557"
    assert (parsed.engine, parsed.accelerator, parsed.gpus) == ("cost", "mi308x", 4)


@pytest.mark.parametrize(
    ("kv_role", "role"), [("kv_producer", "prefill"), ("kv_consumer", "decode"), ("kv_both", "both")]
)
def test_role_follows_kv_role_unless_given(kv_role: str, role: str) -> None:
    transfer = json.dumps({"kv_connector": "NixlConnector", "kv_role": kv_role})
    assert config("--kv-transfer-config", transfer).role == role
    assert config("--kv-transfer-config", transfer, "--role", "decode").role == "decode"


def test_lease_comes_from_the_connector_config() -> None:
    transfer = json.dumps({"kv_role": "kv_producer", "kv_connector_extra_config": {"kv_lease_duration": 5}})
    assert config("--kv-transfer-config", transfer).kv_lease_s == 5.0


def test_fault_plan_flag() -> None:
    parsed = config("--faults", '{"error_status": 503, "error_count": 3}')
    assert (parsed.faults.error_status, parsed.faults.error_count) == (503, 3)


@pytest.mark.parametrize(
    "argv",
    [
        ["--faults", '{"nope": 1}'],
        ["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "kafka"}'],
        ["--role", "middle"],
        ["--time-scale", "0"],
    ],
)
def test_bad_flags_return_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert capsys.readouterr().err
