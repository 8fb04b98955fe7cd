"""The accelerator and model catalogue: figures load, derived KV sizes are right, errors name the path."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from scoring.catalog import CONFIG_DIR, CatalogError, load_catalog

ACCELERATORS = [
    "h100-sxm",
    "h200",
    "b200",
    "b300",
    "gb300",
    "rubin",
    "rubin-cpx",
    "mi300x",
    "mi308x",
    "mi325x",
    "mi355x",
    "wormhole-n300",
    "blackhole-p150",
    "gaudi3",
    "cpu",
]


def test_every_accelerator_of_the_brief_is_listed() -> None:
    catalog = load_catalog()
    assert set(ACCELERATORS) <= set(catalog.accelerators)


@pytest.mark.parametrize(
    ("model", "kv_bytes"),
    [
        ("deepseek-r1", 70_272),
        ("deepseek-v3", 70_272),
        ("llama-3.1-8b", 131_072),
        ("llama-3.1-70b", 327_680),
        ("gpt-oss-120b", 36_864),
        ("tiny-cpu", 1_024),
    ],
)
def test_kv_bytes_per_token_derived_from_the_shape(model: str, kv_bytes: int) -> None:
    assert load_catalog().model(model).kv_bytes_per_token == kv_bytes


def test_deepseek_moe_split_matches_671b_total_37b_active() -> None:
    r1 = load_catalog().model("deepseek-r1")
    always_on = r1.total_params - r1.routed_params
    active = always_on + r1.moe_layers * r1.moe.experts_per_token * r1.expert_params
    assert r1.moe_layers == 58
    assert active == pytest.approx(37e9, rel=0.02)


def test_missing_dtype_falls_back_to_the_next_wider_one() -> None:
    mi300x = load_catalog().accelerator("mi300x")
    assert mi300x.tflops("fp4") == mi300x.fp8_tflops
    cpu = load_catalog().accelerator("cpu")
    assert cpu.fp8_tflops is None and cpu.tflops("fp8") == cpu.bf16_tflops


def test_entries_are_immutable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        load_catalog().accelerator("h100-sxm").memory_gb = 1.0  # type: ignore[misc]


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(CatalogError, match=r"unknown accelerator 'tpu-v9'.*mi300x"):
        load_catalog().accelerator("tpu-v9")


def _write_with(tmp_path: Path, name: str, field: str, value: object) -> Path:
    data = yaml.safe_load((CONFIG_DIR / "accelerators.yaml").read_text())
    data["accelerators"][name][field] = value
    path = tmp_path / "accelerators.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_invalid_figure_names_the_file_and_key_path(tmp_path: Path) -> None:
    path = _write_with(tmp_path, "mi300x", "memory_tbps", -1)
    with pytest.raises(CatalogError, match=rf"{path}: accelerators\.mi300x\.memory_tbps: .*greater than 0"):
        load_catalog(accelerators_path=path)


def test_unknown_key_is_rejected(tmp_path: Path) -> None:
    path = _write_with(tmp_path, "h200", "memory_tbs", 4.8)
    with pytest.raises(CatalogError, match=r"accelerators\.h200\.memory_tbs"):
        load_catalog(accelerators_path=path)


def test_user_override_is_applied_and_validated() -> None:
    catalog = load_catalog(overrides={"accelerators": {"mi308x": {"price_per_hour": 0.75}}})
    assert catalog.accelerator("mi308x").price_per_hour == 0.75
    assert catalog.accelerator("mi308x").fp8_tflops == 470
    with pytest.raises(CatalogError, match=r"accelerators\.mi308x\.price_per_hour"):
        load_catalog(overrides={"accelerators": {"mi308x": {"price_per_hour": -1}}})


def test_missing_file_is_a_catalog_error(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="cannot read"):
        load_catalog(models_path=tmp_path / "nope.yaml")
