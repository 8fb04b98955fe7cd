"""Where the backend list comes from: the config itself (`static`), a watched file, or Kubernetes.

Every source hands complete snapshots (a tuple of `BackendConfig`) to one callback, `on_backends`; the
caller diffs them against the registry (`gateway/live.py`). A snapshot that cannot be used is logged and
dropped: the backends already known keep serving.

Kubernetes: model-server pods selected by label in one namespace (list+watch, `gateway/kube.py`). A pod
is a backend while it has an IP, is Ready and is not terminating; a terminating pod gets no new request,
and its open streams finish. What the pod is comes from its labels and annotations:

    labels:       hetgate.io/accelerator: mi308x     (required: a key of configs/accelerators.yaml)
                  hetgate.io/gpus: "8"               (default 1)
                  hetgate.io/model: deepseek-r1      (else discovery.kubernetes.model, else /v1/models)
    annotations:  hetgate.io/roles: "prefill,decode" (default both)
                  hetgate.io/kv-connector: nixl      (default none)
                  hetgate.io/port: "8000"            (default discovery.kubernetes.port)
                  hetgate.io/block-size: "16"        hetgate.io/max-num-seqs: "256"
                  hetgate.io/kv-events-port: "5557"  hetgate.io/kv-replay-port: "5558"
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from gateway.config import BackendConfig, ConfigError, GatewayConfig, KubernetesDiscovery, parse_backends
from gateway.kube import Object, Reflector

log = logging.getLogger("hetgate.discovery")

OnBackends = Callable[[tuple[BackendConfig, ...]], None]
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class FileSource:
    """A YAML list of backends, re-read when its modification time or size changes.

    Files are rarely replaced atomically (an editor, `cat >`, a config tool: truncate, then write), and a
    poll can land in between. So a change is applied only once the file has stood still for one poll,
    and an empty file is taken for one being written: the backends known keep serving (write `[]` for
    none). Read mid-write, the list was empty and every backend was dropped; the finished file, if bad,
    was then refused and the empty list kept."""

    def __init__(
        self,
        path: Path,
        poll_s: float,
        config: GatewayConfig,
        on_backends: OnBackends,
        accelerators: Iterable[str] | None,
    ) -> None:
        self.path = path
        self.poll_s = poll_s
        self.config = config
        self.on_backends = on_backends
        self.accelerators = None if accelerators is None else frozenset(accelerators)
        self._seen: tuple[float, int] | None = None  # (mtime, size) last read
        self._changed: tuple[float, int] | None = None  # a change seen, not yet stood still for a poll

    async def run(self) -> None:
        while True:
            self.poll()
            await asyncio.sleep(self.poll_s)

    def poll(self, settle: bool = True) -> None:
        """Read the file if it changed and has stood still since the last poll (`settle`; the first
        snapshot at start-up reads at once)."""
        try:
            stat = self.path.stat()
        except OSError as error:
            log.warning("backends file %s: %s; keeping the backends known", self.path, error.strerror)
            return
        current = (stat.st_mtime, stat.st_size)
        if current == self._seen:
            return
        if settle and current != self._changed:
            self._changed = current
            return
        self._seen, self._changed = current, None
        try:
            text = self.path.read_text()
            if not text.strip():
                log.warning("backends file %s is empty; keeping the backends known ([] for none)", self.path)
                return
            backends = parse_backends(yaml.safe_load(text), self.config, self.accelerators)
        except (ConfigError, yaml.YAMLError, OSError) as error:
            log.error("backends file %s rejected, keeping the backends known:\n%s", self.path, error)
            return
        self.on_backends(backends)


class KubernetesSource:
    """Model-server pods of one namespace, watched by label selector."""

    def __init__(
        self,
        settings: KubernetesDiscovery,
        config: GatewayConfig,
        on_backends: OnBackends,
        accelerators: Iterable[str] | None,
        control: httpx.AsyncClient,
    ) -> None:
        self.settings = settings
        self.config = config
        self.on_backends = on_backends
        self.accelerators = None if accelerators is None else frozenset(accelerators)
        self.control = control  # plain client, for the pods' /v1/models
        self._served: dict[str, str | None] = {}  # pod uid -> configured model it serves (None: none)
        self._rejected: set[str] = set()  # pod uids already logged as unusable
        self._wake = asyncio.Event()
        self._pods: dict[str, Object] = {}
        namespace = settings.namespace or _own_namespace()
        self.api = httpx.AsyncClient(base_url=api_server(settings), verify=_tls(settings))
        self.reflector = Reflector(
            self.api,
            f"/api/v1/namespaces/{namespace}/pods",
            settings.label_selector,
            settings.token_file,
            self._on_pods,
            settings.watch_timeout_s,
        )

    async def run(self) -> None:
        resolver = asyncio.create_task(self._resolve_loop())
        try:
            await self.reflector.run()
        finally:
            resolver.cancel()
            await self.api.aclose()

    def _on_pods(self, pods: dict[str, Object]) -> None:
        self._pods = dict(pods)
        self._publish()

    def _publish(self) -> None:
        backends, unresolved = [], False
        for pod in self._pods.values():
            data = self._backend_data(pod)
            if data is None:
                continue
            if data["model"] is None:
                unresolved = True
                continue
            backends.append(data)
        try:
            snapshot = parse_backends(backends, self.config, self.accelerators)
        except ConfigError as error:
            log.error("discovered pods rejected, keeping the backends known:\n%s", error)
            return
        self.on_backends(snapshot)
        if unresolved:
            self._wake.set()

    def _backend_data(self, pod: Object) -> dict[str, Any] | None:
        if not serving(pod):
            return None
        meta = pod["metadata"]
        data = pod_backend(pod, self.settings)
        if data["accelerator"] is None:
            if meta.get("uid") not in self._rejected:
                self._rejected.add(meta.get("uid", ""))
                log.warning("pod %s has no hetgate.io/accelerator label; not used", meta["name"])
            return None
        if data["model"] is None:
            data["model"] = self._served.get(meta.get("uid", ""))
        return data

    async def _resolve_loop(self) -> None:
        """Ask pods without a model label which model they serve (GET /v1/models), off the watch."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            pending = [
                p for p in self._pods.values() if serving(p) and p["metadata"].get("uid") not in self._served
            ]
            for pod in pending:
                self._served[pod["metadata"]["uid"]] = await self._served_model(pod)
            if pending:
                self._publish()

    async def _served_model(self, pod: Object) -> str | None:
        url = pod_backend(pod, self.settings)["url"]
        try:
            reply = await self.control.get(f"{url}/v1/models", timeout=2.0)
            served = [m.get("id") for m in orjson.loads(reply.content).get("data", ())]
        except (httpx.HTTPError, orjson.JSONDecodeError, AttributeError):
            return None
        for model in self.config.models:
            if model.upstream_name in served:
                return model.name
        return None


def serving(pod: Object) -> bool:
    """Has an address, is Ready, and is not being deleted."""
    status = pod.get("status") or {}
    if pod["metadata"].get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())


def pod_backend(pod: Object, settings: KubernetesDiscovery) -> dict[str, Any]:
    """The `backends[]` entry a pod describes (validated later, with the others)."""
    meta = pod["metadata"]
    labels, notes = meta.get("labels") or {}, meta.get("annotations") or {}
    ip = pod["status"]["podIP"]
    host = f"[{ip}]" if ":" in ip else ip
    data: dict[str, Any] = {
        "id": meta["name"],
        "url": f"http://{host}:{notes.get('hetgate.io/port', settings.port)}",
        "model": labels.get("hetgate.io/model", settings.model),
        "accelerator": labels.get("hetgate.io/accelerator"),
        "gpus": labels.get("hetgate.io/gpus", 1),
        "roles": [r.strip() for r in notes.get("hetgate.io/roles", "prefill,decode").split(",") if r.strip()],
        "kv_connector": notes.get("hetgate.io/kv-connector", "none"),
    }
    for key, field in (("hetgate.io/block-size", "block_size"), ("hetgate.io/max-num-seqs", "max_num_seqs")):
        if key in notes:
            data[field] = notes[key]
    if "hetgate.io/kv-events-port" in notes:
        replay = notes.get("hetgate.io/kv-replay-port")
        data["kv_events"] = {  # `*`: vLLM binds, hetgate connects to the pod (gateway/prefix.py)
            "endpoint": f"tcp://*:{notes['hetgate.io/kv-events-port']}",
            "replay_endpoint": f"tcp://*:{replay}" if replay else None,
        }
    return data


def api_server(settings: KubernetesDiscovery) -> str:
    if settings.api_server:
        return settings.api_server.rstrip("/")
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ConfigError(
            "discovery.kubernetes.api_server: not set and not running in a pod (no KUBERNETES_SERVICE_HOST)"
        )
    return f"https://{'[' + host + ']' if ':' in host else host}:{port}"


def _tls(settings: KubernetesDiscovery) -> ssl.SSLContext | bool:
    if settings.ca_file is not None and settings.ca_file.exists():
        return ssl.create_default_context(cafile=str(settings.ca_file))
    return True


def _own_namespace() -> str:
    try:
        return NAMESPACE_FILE.read_text().strip()
    except OSError:
        raise ConfigError(
            "discovery.kubernetes.namespace: not set and not running in a pod (no service-account namespace)"
        ) from None
