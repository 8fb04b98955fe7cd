"""Configuration validation: good files load, and every error names the path of the bad value."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import catalogue_checks, read_config
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
    config = parse_config(minimal(), catalogue_checks())
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
        (lambda d: d["models"][0].update(spec="llama-9"), "models[0].spec: unknown model spec 'llama-9'"),
        (lambda d: d.update(routing={"policy": "cost"}), "models[0].spec: required by routing.policy 'cost'"),
        (lambda d: d.update(routing={"cost": {"mfu": 0}}), "routing.cost.mfu"),
        (lambda d: d.update(routing={"cost": {"bw_util": 1.5}}), "routing.cost.bw_util"),
        (lambda d: d.update(routing={"cost": {"efficiency": 0.5}}), "routing.cost.efficiency"),
        (lambda d: d.update(index={"redis_url": "redis://h:port"}), "index.redis_url: bad port"),
        (lambda d: d.update(index={"redis_url": "127.0.0.1:6379"}), "index.redis_url: a Redis URL starts"),
        (
            lambda d: d["backends"][0].update(kv_events={"endpoint": "tcp://*:1", "replay_endpoint": "x"}),
            "backends[0].kv_events.replay_endpoint: not a ZeroMQ endpoint",
        ),
    ],
)
def test_errors_name_the_path(mutate, message):
    data = minimal()
    mutate(data)
    with pytest.raises(ConfigError) as error:
        parse_config(data, catalogue_checks())
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


def test_catalogue_names_are_checked_only_when_given():
    data = minimal(models=[{"name": "m", "spec": "llama-9"}])
    data["backends"][0]["accelerator"] = "mi300"
    config = parse_config(data)  # a file on its own: the catalogue is not consulted
    assert config.models[0].spec == "llama-9"
    with pytest.raises(ConfigError) as error:
        parse_config(data, catalogue_checks(load_tokenizers=False))
    assert str(error.value).splitlines() == [
        "models[0].spec: unknown model spec 'llama-9' (not in configs/models.yaml)",
        "backends[0].accelerator: unknown accelerator 'mi300'",
    ]


def test_redis_urls_of_every_scheme_pass():
    for url in ("redis://127.0.0.1:6379/0", "rediss://user:pw@redis.internal:6380", "unix:///run/redis.sock"):
        assert parse_config(minimal(index={"store": "redis", "redis_url": url})).index.redis_url == url
