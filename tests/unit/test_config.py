"""Configuration validation: good files load, and every error names the path of the bad value."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import known_accelerators, read_config
from gateway.config import ConfigError, parse_config

ROOT = Path(__file__).resolve().parents[2]


def minimal(**overrides):
    data = {
        "models": [{"name": "m"}],
        "backends": [
            {"id": "a", "url": "http://127.0.0.1:8101", "model": "m", "accelerator": "mi300x", "gpus": 8},
            {
                "id": "b",
                "url": "http://127.0.0.1:8102",
                "model": "m",
                "accelerator": "mi308x",
                "roles": ["decode"],
            },
        ],
    }
    data.update(overrides)
    return data


def test_example_config_is_valid():
    config = read_config(str(ROOT / "configs" / "example.yaml"))
    assert config.backends[0].base_url == "http://127.0.0.1:8101"


def test_defaults_fill_in():
    config = parse_config(minimal(), known_accelerators())
    assert config.routing.policy == "least_load"
    assert config.backends[0].roles == {"prefill", "decode"}
    assert config.backends[1].roles == {"decode"}


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda d: d["backends"][1].update(accelerator="mi300"),
            "backends[1].accelerator: unknown accelerator 'mi300'",
        ),
        (lambda d: d["backends"][0].update(model="x"), "backends[0].model: unknown model 'x'"),
        (lambda d: d["backends"][1].update(id="a"), "backends[1].id: duplicate 'a'"),
        (lambda d: d["backends"][0].update(roles=["both"]), "backends[0].roles"),
        (lambda d: d["backends"][0].update(roles=[]), "backends[0].roles"),
        (lambda d: d["backends"][0].update(kv_connector="lmcache"), "backends[0].kv_connector"),
        (lambda d: d["backends"][0].update(url="not a url"), "backends[0].url"),
        (lambda d: d["backends"][0].update(gpus=0), "backends[0].gpus"),
        (lambda d: d.update(routing={"policy": "random"}), "routing.policy"),
        (lambda d: d.update(routing={"disaggregation": "sometimes"}), "routing.disaggregation"),
        (lambda d: d.update(timeouts={"idle_s": -1}), "timeouts.idle_s"),
        (lambda d: d.update(surprise=1), "surprise"),
        (lambda d: d.update(models=[]), "models"),
    ],
)
def test_errors_name_the_path(mutate, message):
    data = minimal()
    mutate(data)
    with pytest.raises(ConfigError) as error:
        parse_config(data, known_accelerators())
    assert message in str(error.value)


def test_api_keys_from_environment(monkeypatch):
    monkeypatch.setenv("HG_KEYS", "k1, k2")
    config = parse_config(minimal(auth={"api_keys": ["k0"], "api_keys_env": "HG_KEYS"}))
    assert config.auth.keys() == ("k0", "k1", "k2")


def test_unreadable_and_non_mapping_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        read_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        read_config(str(bad))
