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
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    HttpUrl,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

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
    # With the Redis store, replicas and workers share their in-flight counts per backend (one round trip
    # every share_interval_s, off the request path); a replica silent for share_ttl_s is forgotten.
    share_load: bool = True
    share_interval_s: Annotated[float, Field(gt=0)] = 0.2
    share_ttl_s: Annotated[float, Field(gt=0)] = 2.0


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


class FileDiscovery(_Strict):
    path: Path  # a YAML list of backends (the `backends[]` schema); relative paths: to the config file
    poll_s: Annotated[float, Field(gt=0)] = 1.0


class KubernetesDiscovery(_Strict):
    """Model-server pods found by label selector in one namespace, through the API server's list+watch."""

    namespace: str | None = None  # default: the gateway pod's own namespace (service-account mount)
    label_selector: Annotated[str, Field(min_length=1)] = "app.kubernetes.io/component=model-server"
    port: Annotated[int, Field(ge=1, le=65535)] = 8000  # vLLM's port (annotation hetgate.io/port wins)
    model: str | None = None  # model of pods without a hetgate.io/model label (else: asked of /v1/models)
    api_server: str | None = None  # default: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT
    token_file: Path = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
    ca_file: Path | None = Path("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")
    watch_timeout_s: Annotated[int, Field(ge=1)] = 300  # the server ends each watch; it is resumed


class Discovery(_Strict):
    source: Literal["static", "file", "kubernetes"] = "static"
    file: FileDiscovery | None = None
    kubernetes: KubernetesDiscovery = KubernetesDiscovery()


class Auth(_Strict):
    api_keys: tuple[str, ...] = ()
    api_keys_env: str | None = None

    def keys(self) -> tuple[str, ...]:
        from_env = os.environ.get(self.api_keys_env, "") if self.api_keys_env else ""
        return self.api_keys + tuple(k.strip() for k in from_env.split(",") if k.strip())


class GatewayConfig(_Strict):
    listen: Listen = Listen()
    models: Annotated[tuple[ModelConfig, ...], Field(min_length=1)]
    backends: tuple[BackendConfig, ...] = ()  # with discovery `static`: at least one
    discovery: Discovery = Discovery()
    routing: Routing = Routing()
    index: IndexConfig = IndexConfig()
    timeouts: Timeouts = Timeouts()
    limits: Limits = Limits()
    health: Health = Health()
    auth: Auth = Auth()

    @model_validator(mode="after")
    def _cross_references(self) -> GatewayConfig:
        problems = list(_duplicates("models", (m.name for m in self.models), "name"))
        if self.discovery.source == "static" and not self.backends:
            problems.append("backends: at least one backend is needed with discovery.source 'static'")
        if self.discovery.source == "file" and self.discovery.file is None:
            problems.append("discovery.file: required by discovery.source 'file' (path: FILE)")
        if (known := self.discovery.kubernetes.model) and known not in {m.name for m in self.models}:
            problems.append(f"discovery.kubernetes.model: unknown model {known!r}")
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


def _format(error: ValidationError, root: str = "") -> str:
    lines = []
    for item in error.errors():
        message = item["msg"].removeprefix("Value error, ")
        path = _path(tuple(p for p in item["loc"] if not str(p).startswith("function-")))
        path = root + ("" if not path else path if path.startswith("[") else "." + path) if root else path
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


_BACKEND_LIST = TypeAdapter(tuple[BackendConfig, ...])


def parse_backends(
    data: Any, config: GatewayConfig, known_accelerators: Iterable[str] | None = None
) -> tuple[BackendConfig, ...]:
    """A backend list from a discovery source, checked as `backends[]` of `config` would be."""
    try:
        backends = _BACKEND_LIST.validate_python(data if data is not None else ())
    except ValidationError as error:
        raise ConfigError(_format(error, root="backends")) from None
    names = {m.name for m in config.models}
    problems = list(_duplicates("backends", (b.id for b in backends), "id"))
    problems += [
        f"backends[{i}].model: unknown model {b.model!r}"
        for i, b in enumerate(backends)
        if b.model not in names
    ]
    if known_accelerators is not None:
        known = set(known_accelerators)
        problems += [
            f"backends[{i}].accelerator: unknown accelerator {b.accelerator!r}"
            for i, b in enumerate(backends)
            if b.accelerator not in known
        ]
    if problems:
        raise ConfigError("\n".join(problems))
    return backends


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
