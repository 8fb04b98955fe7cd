"""The gateway's configuration (configs/*.yaml), validated with pydantic.

Every error names the path of the bad value, e.g. `backends[2].accelerator: unknown accelerator 'mi300'`,
so a typo in a 40-backend file is found at once. `configs/example.yaml` shows every key with its default.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, HttpUrl, ValidationError, field_validator, model_validator

from scoring.types import Disaggregation, Role

Connector = Literal["nixl", "shared-storage", "none"]
Policy = Literal["round_robin", "least_load", "prefix", "cost"]


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message lists every bad path."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Listen(_Strict):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000


class ModelConfig(_Strict):
    name: Annotated[str, Field(min_length=1)]
    spec: str | None = None
    tokenizer: Path | None = None
    served_name: str | None = None

    @property
    def upstream_name(self) -> str:
        return self.served_name or self.name


class KVEventsConfig(_Strict):
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


class BackendConfig(_Strict):
    id: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    url: HttpUrl
    model: str
    accelerator: str
    gpus: Annotated[int, Field(ge=1)] = 1
    roles: frozenset[Role] = frozenset({Role.PREFILL, Role.DECODE})
    kv_connector: Connector = "none"
    api_key: str | None = None
    api_key_env: str | None = None
    block_size: Annotated[int, Field(ge=1)] = 16
    max_num_seqs: Annotated[int, Field(ge=1)] = 256
    kv_events: KVEventsConfig | None = None

    @field_validator("roles")
    @classmethod
    def _roles_not_empty(cls, roles: frozenset[Role]) -> frozenset[Role]:
        if not roles:
            raise ValueError("a backend needs at least one role (prefill, decode)")
        return roles

    @property
    def base_url(self) -> str:
        return str(self.url).rstrip("/")

    def upstream_key(self) -> str | None:
        """The key sent to this backend: inline, or read from the environment (kept out of files)."""
        if self.api_key_env:
            return os.environ.get(self.api_key_env)
        return self.api_key


class PrefixKnobs(_Strict):
    balance_abs_threshold: Annotated[float, Field(ge=0)] = 32
    balance_rel_threshold: Annotated[float, Field(ge=1)] = 1.5


class Routing(_Strict):
    policy: Policy = "least_load"
    disaggregation: Disaggregation = Disaggregation.NEVER
    pd_min_prompt_tokens: Annotated[int, Field(ge=0)] = 1024
    pd_fallback: Literal["aggregated", "fail"] = "aggregated"
    route_header: bool = True
    prefix: PrefixKnobs = PrefixKnobs()


class IndexConfig(_Strict):
    store: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "hetgate"
    ttl_s: Annotated[float, Field(gt=0)] = 600
    deadline_ms: Annotated[float, Field(gt=0)] = 20
    tenant_salt_header: str | None = None


class Timeouts(_Strict):
    connect_s: Annotated[float, Field(gt=0)] = 2.0
    ttfb_s: Annotated[float, Field(gt=0)] = 120.0
    idle_s: Annotated[float, Field(gt=0)] = 60.0


class Limits(_Strict):
    max_body_bytes: Annotated[int, Field(ge=1024)] = 8 * 1024 * 1024
    max_attempts: Annotated[int, Field(ge=1, le=10)] = 3


class Health(_Strict):
    interval_s: Annotated[float, Field(gt=0)] = 2.0
    timeout_s: Annotated[float, Field(gt=0)] = 1.0
    failure_threshold: Annotated[int, Field(ge=1)] = 3
    recovery_s: Annotated[float, Field(gt=0)] = 5.0
    metrics_interval_s: Annotated[float, Field(gt=0)] = 1.0


class Auth(_Strict):
    api_keys: tuple[str, ...] = ()
    api_keys_env: str | None = None

    def keys(self) -> tuple[str, ...]:
        from_env = os.environ.get(self.api_keys_env, "") if self.api_keys_env else ""
        return self.api_keys + tuple(k.strip() for k in from_env.split(",") if k.strip())


class ServerConfig(_Strict):
    """Client connection hygiene (gateway/server.py); counted per gateway process."""

    max_header_bytes: Annotated[int, Field(ge=1024)] = 64 * 1024  # request line + headers; 431 above
    max_headers: Annotated[int, Field(ge=1)] = 100  # 431 above (Envoy's max_headers_count)
    header_timeout_s: Annotated[float, Field(gt=0)] = 10.0  # head complete within this: 408 otherwise
    body_timeout_s: Annotated[float, Field(gt=0)] = 60.0  # whole body within this of its head: 408
    keepalive_timeout_s: Annotated[float, Field(gt=0)] = 30.0  # an idle kept-alive connection is closed
    max_connections: Annotated[int, Field(ge=1)] = 4096  # open client connections; 503 above


class RateLimit(_Strict):
    """Limits for one API key or one tenant; 0 switches a limit off."""

    max_concurrent: Annotated[int, Field(ge=0)] = 0  # requests admitted or queued at once
    tokens_per_s: Annotated[float, Field(ge=0)] = 0  # refill of prompt-estimate + max_tokens
    burst_tokens: Annotated[int, Field(ge=0)] = 0  # bucket size (0: 10 s of tokens_per_s)


class AdmissionConfig(_Strict):
    """Admission control (gateway/admission.py): 429 + Retry-After instead of unbounded queueing."""

    max_concurrent: Annotated[int, Field(ge=0)] = 0  # requests served at once per process (0: no bound)
    max_queued: Annotated[int, Field(ge=0)] = 0  # waiting for a slot beyond max_concurrent; 429 above
    queue_timeout_s: Annotated[float, Field(gt=0)] = 10.0  # a queued request waits at most this: 429
    tenant_header: str | None = None  # e.g. x-tenant-id: per_tenant limits apply to its value
    per_key: RateLimit = RateLimit()
    per_tenant: RateLimit = RateLimit()
    default_max_tokens: Annotated[int, Field(ge=0)] = 1024  # charged to a token bucket when unset
    max_identities: Annotated[int, Field(ge=1)] = 10000  # keys (or tenants) tracked at once; 429 above

    @field_validator("tenant_header")
    @classmethod
    def _lower(cls, name: str | None) -> str | None:
        return name.lower() if name else None


class GatewayConfig(_Strict):
    listen: Listen = Listen()
    models: Annotated[tuple[ModelConfig, ...], Field(min_length=1)]
    backends: Annotated[tuple[BackendConfig, ...], Field(min_length=1)]
    routing: Routing = Routing()
    index: IndexConfig = IndexConfig()
    timeouts: Timeouts = Timeouts()
    limits: Limits = Limits()
    health: Health = Health()
    auth: Auth = Auth()
    server: ServerConfig = ServerConfig()
    admission: AdmissionConfig = AdmissionConfig()

    @model_validator(mode="after")
    def _cross_references(self) -> GatewayConfig:
        problems = list(_duplicates("models", (m.name for m in self.models), "name"))
        problems += _duplicates("backends", (b.id for b in self.backends), "id")
        names = {m.name for m in self.models}
        if self.routing.policy == "cost":
            problems += [
                f"models[{i}].spec: required by routing.policy 'cost' (a model of configs/models.yaml)"
                for i, m in enumerate(self.models)
                if not m.spec
            ]
        for i, backend in enumerate(self.backends):
            if backend.model not in names:
                problems.append(f"backends[{i}].model: unknown model {backend.model!r}")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def backends_of(self, model: str) -> tuple[BackendConfig, ...]:
        return tuple(b for b in self.backends if b.model == model)


def _duplicates(section: str, values: Iterable[str], field: str) -> list[str]:
    seen: set[str] = set()
    problems = []
    for i, value in enumerate(values):
        if value in seen:
            problems.append(f"{section}[{i}].{field}: duplicate {value!r}")
        seen.add(value)
    return problems


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _format(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        message = item["msg"].removeprefix("Value error, ")
        path = _path(tuple(p for p in item["loc"] if not str(p).startswith("function-")))
        lines.append(f"{path}: {message}" if path else message)
    return "\n".join(lines)


def parse_config(data: Any, known_accelerators: Iterable[str] | None = None) -> GatewayConfig:
    """Validate a parsed YAML document; raises ConfigError naming every bad path."""
    try:
        config = GatewayConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_format(error)) from None
    if known_accelerators is not None:
        known = set(known_accelerators)
        bad = [
            f"backends[{i}].accelerator: unknown accelerator {b.accelerator!r}"
            for i, b in enumerate(config.backends)
            if b.accelerator not in known
        ]
        if bad:
            raise ConfigError("\n".join(bad))
    return config


def load_config(path: str | Path, known_accelerators: Iterable[str] | None = None) -> GatewayConfig:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return parse_config(data, known_accelerators)
