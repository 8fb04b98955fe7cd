"""Accelerator and model specs from `configs/accelerators.yaml` and `configs/models.yaml`.

The YAML is validated with pydantic (a bad file raises `CatalogError` naming the file and the key path, e.g.
`configs/accelerators.yaml: accelerators.mi300x.memory_tbps: Input should be greater than 0`), then turned
into frozen dataclasses so the cost model and router can share them freely. User overrides are deep-merged
into the raw YAML *before* validation, so an override is checked exactly like the file it changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from scoring.config_dir import config_dir

CONFIG_DIR = config_dir()
_M = TypeVar("_M", bound=BaseModel)
_V = TypeVar("_V")
DTYPES = ("fp4", "fp8", "bf16")  # narrowest first: the fallback order when a peak is missing


class CatalogError(ValueError):
    """A catalogue file is missing, malformed or names an unknown entry."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _AcceleratorIn(_Strict):
    vendor: str
    bf16_tflops: float = Field(gt=0)
    fp8_tflops: float | None = Field(default=None, gt=0)
    fp4_tflops: float | None = Field(default=None, gt=0)
    memory_gb: float = Field(gt=0)
    memory_tbps: float = Field(gt=0)
    scale_up_gbps: float = Field(gt=0)
    scale_out_gbps: float = Field(gt=0)
    price_per_hour: float = Field(ge=0)
    # Fixed cost of one engine step on this device (scheduler, launches, sampling, the engine's Python);
    # absent: the cost model's default (scoring/cost.py Efficiency.step_overhead_s). Fitted for `cpu`.
    step_overhead_s: float | None = Field(default=None, gt=0)
    # Fixed latency of each request before its first step (API server, IPC to the engine); absent: the
    # cost model's default (Efficiency.request_overhead_s). Fitted for `cpu`.
    request_overhead_s: float | None = Field(default=None, ge=0)
    # Cost of each decoding sequence in a step beyond its GEMM share (sampling, output processing); absent:
    # Efficiency.seq_overhead_s. Fitted for `cpu`.
    seq_overhead_s: float | None = Field(default=None, ge=0)


class _MoEIn(_Strict):
    routed_experts: int = Field(gt=0)
    experts_per_token: int = Field(gt=0)
    shared_experts: int = Field(ge=0)
    expert_ffn: int = Field(gt=0)
    dense_layers: int = Field(ge=0)

    @model_validator(mode="after")
    def _top_k_fits(self) -> _MoEIn:
        if self.experts_per_token > self.routed_experts:
            raise ValueError("experts_per_token exceeds routed_experts")
        return self


class _ModelIn(_Strict):
    layers: int = Field(gt=0)
    hidden: int = Field(gt=0)
    heads: int = Field(gt=0)
    kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    vocab: int = Field(gt=0)
    attention: Literal["mha", "mla"]
    kv_lora_rank: int | None = Field(default=None, gt=0)
    qk_rope_head_dim: int | None = Field(default=None, ge=0)
    qk_nope_head_dim: int | None = Field(default=None, gt=0)
    v_head_dim: int | None = Field(default=None, gt=0)
    full_attention_layers: int | None = Field(default=None, gt=0)
    sliding_window: int | None = Field(default=None, gt=0)
    total_params_b: float = Field(gt=0)
    active_params_b: float = Field(gt=0)
    weight_bytes_per_param: float = Field(gt=0)
    kv_bytes_per_element: float = Field(gt=0)
    kv_bytes_per_token: float | None = Field(default=None, gt=0)
    compute_dtype: Literal["bf16", "fp8", "fp4"] = "bf16"
    moe: _MoEIn | None = None

    @model_validator(mode="after")
    def _consistent(self) -> _ModelIn:
        if self.active_params_b > self.total_params_b:
            raise ValueError("active_params_b exceeds total_params_b")
        if self.attention == "mla" and (self.kv_lora_rank is None or self.qk_rope_head_dim is None):
            raise ValueError("mla attention needs kv_lora_rank and qk_rope_head_dim")
        return self


class _AcceleratorsFile(_Strict):
    accelerators: dict[str, _AcceleratorIn]


class _ModelsFile(_Strict):
    models: dict[str, _ModelIn]


@dataclass(frozen=True, slots=True)
class Accelerator:
    """One device's peaks (dense TFLOPS per dtype, memory, links) and its price."""

    name: str
    vendor: str
    bf16_tflops: float
    fp8_tflops: float | None
    fp4_tflops: float | None
    memory_gb: float
    memory_tbps: float
    scale_up_gbps: float
    scale_out_gbps: float
    price_per_hour: float
    step_overhead_s: float | None = None  # None: Efficiency.step_overhead_s
    request_overhead_s: float | None = None  # None: Efficiency.request_overhead_s
    seq_overhead_s: float | None = None  # None: Efficiency.seq_overhead_s

    def tflops(self, dtype: str) -> float:
        """Peak for `dtype`, falling back to the next wider dtype the device does support."""
        for candidate in DTYPES[DTYPES.index(dtype) :]:
            value: float | None = getattr(self, f"{candidate}_tflops")
            if value is not None:
                return value
        raise CatalogError(f"accelerator {self.name!r} has no peak for {dtype!r}")


@dataclass(frozen=True, slots=True)
class MoE:
    routed_experts: int
    experts_per_token: int
    shared_experts: int
    expert_ffn: int
    dense_layers: int


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model's shape, reduced to what the roofline needs (plus the raw fields for reference)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    attention: str
    total_params: float
    active_params: float
    weight_bytes_per_param: float
    kv_bytes_per_token: float
    compute_dtype: str
    # Attention FLOPs for one (query, key) pair summed over the layers whose context grows.
    attn_flops_per_pair: float
    moe: MoE | None

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.weight_bytes_per_param

    @property
    def moe_layers(self) -> int:
        return 0 if self.moe is None else self.layers - self.moe.dense_layers

    @property
    def expert_params(self) -> float:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 0.0 if self.moe is None else 3.0 * self.hidden * self.moe.expert_ffn

    @property
    def routed_params(self) -> float:
        """All routed-expert parameters: read only when some token in the batch picks them."""
        return 0.0 if self.moe is None else self.moe_layers * self.moe.routed_experts * self.expert_params


@dataclass(frozen=True, slots=True)
class Catalog:
    accelerators: Mapping[str, Accelerator]
    models: Mapping[str, ModelSpec]

    def accelerator(self, name: str) -> Accelerator:
        return _lookup(self.accelerators, name, "accelerator")

    def model(self, name: str) -> ModelSpec:
        return _lookup(self.models, name, "model")


def _lookup(table: Mapping[str, _V], name: str, kind: str) -> _V:
    try:
        return table[name]
    except KeyError:
        raise CatalogError(f"unknown {kind} {name!r}; known: {', '.join(sorted(table))}") from None


def load_catalog(
    accelerators_path: str | Path | None = None,
    models_path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Catalog:
    """Load both files; `overrides` is `{"accelerators": {name: {field: value}}, "models": {...}}`."""
    overrides = overrides or {}
    acc_path = Path(accelerators_path) if accelerators_path else CONFIG_DIR / "accelerators.yaml"
    mod_path = Path(models_path) if models_path else CONFIG_DIR / "models.yaml"
    acc_raw = _merge(_read_yaml(acc_path), {"accelerators": overrides.get("accelerators", {})})
    mod_raw = _merge(_read_yaml(mod_path), {"models": overrides.get("models", {})})
    accelerators = _validate(_AcceleratorsFile, acc_raw, acc_path).accelerators
    models = _validate(_ModelsFile, mod_raw, mod_path).models
    return Catalog(
        accelerators={
            name: Accelerator(name=name, **spec.model_dump()) for name, spec in accelerators.items()
        },
        models={name: _model_spec(name, spec) for name, spec in models.items()},
    )


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise CatalogError(f"{path}: cannot read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise CatalogError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise CatalogError(f"{path}: expected a mapping at the top level")
    return data


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _validate(schema: type[_M], raw: dict[str, Any], path: Path) -> _M:
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise CatalogError(f"{path}: {where}: {first['msg']}") from exc


def _model_spec(name: str, spec: _ModelIn) -> ModelSpec:
    moe = MoE(**spec.moe.model_dump()) if spec.moe else None
    return ModelSpec(
        name=name,
        layers=spec.layers,
        hidden=spec.hidden,
        heads=spec.heads,
        kv_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        vocab=spec.vocab,
        attention=spec.attention,
        total_params=spec.total_params_b * 1e9,
        active_params=spec.active_params_b * 1e9,
        weight_bytes_per_param=spec.weight_bytes_per_param,
        kv_bytes_per_token=spec.kv_bytes_per_token or _kv_bytes_per_token(spec),
        compute_dtype=spec.compute_dtype,
        attn_flops_per_pair=_attn_flops_per_pair(spec),
        moe=moe,
    )


def _kv_bytes_per_token(spec: _ModelIn) -> float:
    if spec.attention == "mla":
        assert spec.kv_lora_rank is not None and spec.qk_rope_head_dim is not None
        elements = (spec.kv_lora_rank + spec.qk_rope_head_dim) * spec.layers
    else:
        elements = 2 * (spec.full_attention_layers or spec.layers) * spec.kv_heads * spec.head_dim
    return elements * spec.kv_bytes_per_element


def _attn_flops_per_pair(spec: _ModelIn) -> float:
    """QK^T plus AV, 2 FLOPs per multiply-add, over the layers with full attention.

    MLA prefill runs as ordinary attention with 192-wide queries/keys and 128-wide values per head.
    """
    if spec.attention == "mla":
        qk = (spec.qk_nope_head_dim or spec.head_dim) + (spec.qk_rope_head_dim or 0)
        v = spec.v_head_dim or spec.head_dim
        return 2.0 * spec.heads * (qk + v) * spec.layers
    return 2.0 * spec.heads * 2 * spec.head_dim * (spec.full_attention_layers or spec.layers)
