"""The gateway's configuration (configs/*.yaml), validated with pydantic.

Every error names the path of the bad value, e.g. `backends[2].accelerator: unknown accelerator 'mi300'`,
so a typo in a 40-backend file is found at once, and all of a file's errors are listed in one pass.
`configs/example.yaml` shows every key with its default.

What needs more than the file itself is checked only when the caller hands it over in `Checks`: the
catalogue's names (accelerators, model specs) and whether tokenizers load. `hetgate check-config` and
`hetgate serve` give both, so a file that passes `check-config` starts.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    HttpUrl,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from scoring.types import Disaggregation, Role

Connector = Literal["nixl", "shared-storage", "none"]
Policy = Literal["round_robin", "least_load", "prefix", "cost"]


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message lists every bad path."""


@dataclass(frozen=True, slots=True)
class Checks:
    """What validation may consult beyond the file (handed to pydantic as its validation context)."""

    accelerators: frozenset[str] | None = None  # configs/accelerators.yaml's names; None: not checked
    model_specs: frozenset[str] | None = None  # configs/models.yaml's names; None: not checked
    load_tokenizers: bool = False  # load each models[].tokenizer as `serve` does


def _checks(info: ValidationInfo) -> Checks:
    return info.context if isinstance(info.context, Checks) else Checks()


# ZeroMQ endpoints as vLLM's --kv-events-config takes them: tcp://HOST:PORT (HOST may be `*` or an
# [IPv6] literal), ipc://PATH, inproc://NAME.
_ZMQ_ENDPOINT = re.compile(r"^(tcp://(\*|\[[0-9A-Fa-f:.]+\]|[^\s:/*\[\]]+):\d{1,5}|ipc://\S+|inproc://\S+)$")
_REDIS_SCHEMES = ("redis", "rediss", "unix")
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # an HTTP token (RFC 9110, 5.6.2)


def _header_name(name: str | None) -> str | None:
    """A header name as the server hands it over (lower case); None or empty: no header."""
    if not name:
        return None
    if not _HEADER_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a header name (letters, digits and !#$%&'*+-.^_`|~ only)")
    return name.lower()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Listen(_Strict):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000


class SloConfig(_Strict):
    """The latency a request of this model should meet; the `cost` policy plans for it."""

    ttft_s: Annotated[float, Field(gt=0)]
    tpot_s: Annotated[float, Field(gt=0)]


class ModelConfig(_Strict):
    name: Annotated[str, Field(min_length=1)]
    spec: str | None = None
    slo: SloConfig | None = None  # None: relative to the fastest backend (scoring/cost_policy.py)
    tokenizer: Path | None = None
    served_name: str | None = None

    @field_validator("spec")
    @classmethod
    def _known_spec(cls, spec: str | None, info: ValidationInfo) -> str | None:
        known = _checks(info).model_specs
        if spec is not None and known is not None and spec not in known:
            raise ValueError(f"unknown model spec {spec!r} (not in configs/models.yaml)")
        return spec

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_loads(cls, path: Path | None, info: ValidationInfo) -> Path | None:
        if path is not None and _checks(info).load_tokenizers:
            from kvindex.tokenizer import ChatTokenizer  # imported here: only `serve`/`check-config` load

            ChatTokenizer.load(path)  # TokenizerError is a ValueError naming the file
        return path

    @property
    def upstream_name(self) -> str:
        return self.served_name or self.name


class KVEventsConfig(_Strict):
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq_endpoint(cls, endpoint: str | None) -> str | None:
        if endpoint is not None and not _ZMQ_ENDPOINT.match(endpoint):
            raise ValueError(f"not a ZeroMQ endpoint (tcp://HOST:PORT, ipc://PATH): {endpoint!r}")
        return endpoint


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

    @field_validator("accelerator")
    @classmethod
    def _known_accelerator(cls, accelerator: str, info: ValidationInfo) -> str:
        known = _checks(info).accelerators
        if known is not None and accelerator not in known:
            raise ValueError(f"unknown accelerator {accelerator!r}")
        return accelerator

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
    """SGLang cache_aware's knobs, at its defaults (scoring/prefix.py)."""

    cache_threshold: Annotated[float, Field(ge=0, le=1)] = 0.3
    balance_abs_threshold: Annotated[float, Field(ge=0)] = 64
    balance_rel_threshold: Annotated[float, Field(ge=1)] = 1.5


class CostKnobs(_Strict):
    """Where the `cost` policy's roofline starts (scoring/cost.py `Efficiency`; None: its defaults): the
    share of peak FLOPS and memory bandwidth the backends reach. The policy corrects its compute
    figures online; the default TPOT target (3x the fastest backend's unloaded step) is priced at these."""

    mfu: Annotated[float, Field(gt=0, le=1)] | None = None
    bw_util: Annotated[float, Field(gt=0, le=1)] | None = None


class Routing(_Strict):
    policy: Policy = "least_load"
    disaggregation: Disaggregation = Disaggregation.NEVER
    # None: the policy's own (`Ranker.split_gate_tokens`: 1024, and 0 under `cost`, which prices the split).
    pd_min_prompt_tokens: Annotated[int, Field(ge=0)] | None = None
    pd_fallback: Literal["aggregated", "fail"] = "aggregated"
    route_header: bool = True
    # A request carrying this header is a turn of a named conversation (only its presence is read; `cost`
    # starts new conversations where its SLO plan decodes). None: no request is read as one.
    session_header: str | None = "x-session-id"
    prefix: PrefixKnobs = PrefixKnobs()
    cost: CostKnobs = CostKnobs()

    @field_validator("session_header")
    @classmethod
    def _header_name(cls, name: str | None) -> str | None:
        return _header_name(name)


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

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in _REDIS_SCHEMES:
            raise ValueError(f"a Redis URL starts with {', '.join(s + '://' for s in _REDIS_SCHEMES)}")
        try:
            parts.port  # noqa: B018 -- raises on a port that is not a number in range
        except ValueError as error:
            raise ValueError(f"bad port in the Redis URL: {error}") from None
        return url


class Timeouts(_Strict):
    connect_s: Annotated[float, Field(gt=0)] = 2.0
    ttfb_s: Annotated[float, Field(gt=0)] = 120.0
    idle_s: Annotated[float, Field(gt=0)] = 60.0


class Limits(_Strict):
    max_body_bytes: Annotated[int, Field(ge=1024)] = 8 * 1024 * 1024
    # Fields only the gateway may set (kv_transfer_params): removed from client bodies, or refused with 400.
    internal_fields: Literal["strip", "reject"] = "strip"
    # A non-streamed backend reply larger than this is cut with a 502 instead of being buffered whole.
    max_response_bytes: Annotated[int, Field(ge=1024)] = 64 * 1024 * 1024


class Outlier(_Strict):
    """Passive ejection from real traffic, as Envoy's outlier_detection (see gateway/outlier.py)."""

    consecutive_5xx: Annotated[int, Field(ge=0)] = 5  # 0: off
    consecutive_gateway_failure: Annotated[int, Field(ge=0)] = 5  # 0: off
    base_ejection_time_s: Annotated[float, Field(gt=0)] = 30.0
    max_ejection_time_s: Annotated[float, Field(gt=0)] = 300.0
    max_ejection_percent: Annotated[float, Field(ge=0, le=100)] = 10.0
    decay_interval_s: Annotated[float, Field(gt=0)] = 10.0


class Health(_Strict):
    interval_s: Annotated[float, Field(gt=0)] = 2.0
    timeout_s: Annotated[float, Field(gt=0)] = 1.0
    failure_threshold: Annotated[int, Field(ge=1)] = 3
    metrics_interval_s: Annotated[float, Field(gt=0)] = 1.0
    panic_threshold_percent: Annotated[float, Field(ge=0, le=100)] = 50.0
    # After a 429/503 (vLLM's backpressure, not ill health) a backend is tried last for this long; 0: off.
    # See gateway/decision.py `demote`.
    backpressure_cooldown_s: Annotated[float, Field(ge=0)] = 1.0
    outlier: Outlier = Outlier()


RetryOn = Literal[
    "5xx", "gateway-error", "reset", "connect-failure", "retriable-4xx", "retriable-status-codes"
]


class Retry(_Strict):
    """Which failed attempts go to another backend, as Envoy's retry_on (see gateway/retry.py)."""

    retry_on: tuple[RetryOn, ...] = ("connect-failure", "reset", "5xx", "retriable-status-codes")
    retriable_status_codes: tuple[Annotated[int, Field(ge=400, le=599)], ...] = (429,)
    num_retries: Annotated[int, Field(ge=0, le=9)] = 2
    budget_percent: Annotated[float, Field(ge=0, le=100)] = 20.0
    min_retry_concurrency: Annotated[int, Field(ge=0)] = 3


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


class ServerConfig(_Strict):
    """Client connection hygiene (gateway/server.py); counted per gateway process."""

    max_header_bytes: Annotated[int, Field(ge=1024)] = 64 * 1024  # request line + headers; 431 above
    max_headers: Annotated[int, Field(ge=1)] = 100  # 431 above (Envoy's max_headers_count)
    header_timeout_s: Annotated[float, Field(gt=0)] = 10.0  # head complete within this: 408 otherwise
    body_timeout_s: Annotated[float, Field(gt=0)] = 60.0  # whole body within this of its head: 408
    keepalive_timeout_s: Annotated[float, Field(gt=0)] = 30.0  # an idle kept-alive connection is closed
    max_connections: Annotated[int, Field(ge=1)] = 4096  # open client connections; 503 above
    # On SIGTERM: /ready answers 503 at once and new requests are still served for drain_grace_s (so load
    # balancers and Kubernetes endpoints stop sending here first); then the listener closes and requests in
    # flight get up to drain_timeout_s to finish.
    drain_grace_s: Annotated[float, Field(ge=0)] = 5.0
    drain_timeout_s: Annotated[float, Field(gt=0)] = 60.0


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
        return _header_name(name)


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
    retry: Retry = Retry()
    auth: Auth = Auth()
    server: ServerConfig = ServerConfig()
    admission: AdmissionConfig = AdmissionConfig()

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
    items = [(_loc(item["loc"]), item) for item in error.errors()]
    failed = [loc for loc, _ in items]
    lines = []
    for loc, item in items:
        # A list whose every entry failed is also "too short" once the failures are dropped: the entries'
        # own errors already say what is wrong.
        if item["type"] == "too_short" and any(len(f) > len(loc) and f[: len(loc)] == loc for f in failed):
            continue
        message = item["msg"].removeprefix("Value error, ")
        path = _path(loc)
        path = root + ("" if not path else path if path.startswith("[") else "." + path) if root else path
        lines.append(f"{path}: {message}" if path else message)
    return "\n".join(dict.fromkeys(lines))  # each error once


def _loc(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    return tuple(p for p in loc if not str(p).startswith("function-"))


def parse_config(data: Any, checks: Checks | None = None) -> GatewayConfig:
    """Validate a parsed YAML document; raises ConfigError naming every bad path."""
    try:
        return GatewayConfig.model_validate(data, context=checks or Checks())
    except ValidationError as error:
        raise ConfigError(_format(error)) from None


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


def load_config(path: str | Path, checks: Checks | None = None) -> GatewayConfig:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return parse_config(data, checks)
