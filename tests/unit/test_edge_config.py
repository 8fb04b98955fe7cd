"""The `server` and `admission` sections: example.yaml documents the defaults; bad values name their path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gateway.config import AdmissionConfig, ConfigError, ServerConfig, parse_config

EXAMPLE = Path(__file__).resolve().parents[2] / "configs" / "example.yaml"


def test_example_yaml_lists_the_defaults() -> None:
    data = yaml.safe_load(EXAMPLE.read_text())
    assert ServerConfig.model_validate(data["server"]) == ServerConfig()
    assert AdmissionConfig.model_validate(data["admission"]) == AdmissionConfig()
    assert set(data["server"]) == set(ServerConfig.model_fields)
    assert set(data["admission"]) == set(AdmissionConfig.model_fields)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"server": {"header_timeout_s": 0}}, "server.header_timeout_s"),
        ({"server": {"max_header_bytes": 10}}, "server.max_header_bytes"),
        ({"admission": {"per_key": {"tokens_per_s": -1}}}, "admission.per_key.tokens_per_s"),
        ({"admission": {"max_queue": 3}}, "admission.max_queue"),
    ],
)
def test_bad_values_name_their_path(section: dict, message: str) -> None:
    data = yaml.safe_load(EXAMPLE.read_text())
    data.update(section)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        parse_config(data)


def test_tenant_header_is_matched_lowercase() -> None:
    assert AdmissionConfig(tenant_header="X-Tenant-Id").tenant_header == "x-tenant-id"
