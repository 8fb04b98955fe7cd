"""A small Kubernetes API server for pods, speaking the real list+watch wire format on loopback.

What a reflector meets on a real API server, and nothing more: `GET /api/v1/namespaces/NS/pods` with a
`labelSelector` (equality terms), a PodList carrying `metadata.resourceVersion`; the same path with
`watch=true&resourceVersion=RV` answers a chunked stream of JSON lines (`ADDED`, `MODIFIED`, `DELETED`,
`BOOKMARK` when `allowWatchBookmarks`, and `ERROR` with a 410 Status when RV was compacted away),
ended after `timeoutSeconds`; a bearer token is required on every call (401 otherwise).

Tests drive it from their own thread: `add`, `modify`, `delete`, `compact` (forget history, so resuming
from an old version gets 410), `end_watches` (the server closes open watches, as on its timeout).
"""

from __future__ import annotations

import asyncio
import copy
import threading
from typing import Any

import orjson
from aiohttp import web

from bench.ports import free_port

Pod = dict[str, Any]


def make_pod(
    name: str,
    port: int,
    labels: dict[str, str],
    annotations: dict[str, str] | None = None,
    ready: bool = True,
    ip: str = "127.0.0.1",
) -> Pod:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "llm",
            "uid": f"uid-{name}",
            "labels": labels,
            "annotations": {"hetgate.io/port": str(port), **(annotations or {})},
        },
        "status": {
            "podIP": ip,
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


class FakeKubeApi:
    def __init__(self, token: str, bookmark_every_s: float = 0.3) -> None:
        self.token = token
        self.bookmark_every_s = bookmark_every_s
        self.version = 100
        self.pods: dict[str, Pod] = {}
        self.history: list[tuple[int, str, Pod]] = []  # (version, type, object) since `oldest`
        self.oldest = 100
        self.lists = 0
        self.watch_versions: list[int] = []  # the resourceVersion each watch resumed from
        self.bookmarks: list[int] = []  # the resourceVersion of each BOOKMARK event sent
        self.unauthorized = 0
        self._loop = asyncio.new_event_loop()
        self._changed: asyncio.Condition | None = None
        self._generation = 0  # bumped by end_watches
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="fake-kube")
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> FakeKubeApi:
        self._thread.start()
        self._call(self._start())
        return self

    def stop(self) -> None:
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()  # its self-pipe sockets, which would otherwise be left to the GC

    async def _start(self) -> None:
        self._changed = asyncio.Condition()
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5)
        await self._runner.setup()
        self.port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _stop(self) -> None:
        await self._end_watches()
        assert self._runner is not None
        await self._runner.cleanup()

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=10)

    # -- what tests do --------------------------------------------------------------------------------------

    def add(self, pod: Pod) -> None:
        self._call(self._event("ADDED", pod))

    def modify(self, pod: Pod) -> None:
        self._call(self._event("MODIFIED", pod))

    def delete(self, name: str) -> None:
        self._call(self._event("DELETED", self.pods[name]))

    def compact(self) -> None:
        """Forget the history: a watch resuming from any version seen so far gets 410 Gone."""
        self._call(self._compact())

    def end_watches(self) -> None:
        self._call(self._end_watches())

    # -- the server -----------------------------------------------------------------------------------------

    async def _event(self, kind: str, pod: Pod) -> None:
        assert self._changed is not None
        self.version += 1
        pod = copy.deepcopy(pod)
        pod["metadata"]["resourceVersion"] = str(self.version)
        if kind == "DELETED":
            self.pods.pop(pod["metadata"]["name"], None)
        else:
            self.pods[pod["metadata"]["name"]] = pod
        self.history.append((self.version, kind, pod))
        async with self._changed:
            self._changed.notify_all()

    async def _compact(self) -> None:
        self.history.clear()
        self.version += 1
        self.oldest = self.version

    async def _end_watches(self) -> None:
        assert self._changed is not None
        self._generation += 1
        async with self._changed:
            self._changed.notify_all()

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            self.unauthorized += 1
            return web.json_response(_status(401, "Unauthorized"), status=401)
        selector = _selector(request.query.get("labelSelector", ""))
        if request.query.get("watch") in ("true", "1"):
            return await self._watch(request, selector)
        self.lists += 1
        items = [p for p in self.pods.values() if _matches(p, selector)]
        body = {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.version)}}
        return web.json_response({**body, "items": items})

    async def _watch(self, request: web.Request, selector: dict[str, str]) -> web.StreamResponse:
        assert self._changed is not None
        since = int(request.query.get("resourceVersion", "0"))
        self.watch_versions.append(since)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if since < self.oldest:
            await _line(response, {"type": "ERROR", "object": _status(410, "Expired")})
            return response
        generation = self._generation
        timeout = float(request.query.get("timeoutSeconds", "300"))
        deadline = self._loop.time() + timeout
        bookmarks = request.query.get("allowWatchBookmarks") == "true"
        sent = since  # the last version the client heard of
        while self._generation == generation and self._loop.time() < deadline:
            for version, kind, pod in [h for h in self.history if h[0] > since]:
                since = version  # events the selector filters out still move the version on
                if _matches(pod, selector):
                    sent = version
                    await _line(response, {"type": kind, "object": pod})
            if any(h[0] > since for h in self.history):
                continue  # more arrived while writing
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), self.bookmark_every_s)
                except TimeoutError:
                    if bookmarks and since > sent:
                        sent = since
                        marker = {"kind": "Pod", "metadata": {"resourceVersion": str(since)}}
                        await _line(response, {"type": "BOOKMARK", "object": marker})
                        self.bookmarks.append(since)
        return response


async def _line(response: web.StreamResponse, event: dict[str, Any]) -> None:
    await response.write(orjson.dumps(event) + b"\n")


def _status(code: int, reason: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason}


def _selector(text: str) -> dict[str, str]:
    terms = [t.split("=", 1) for t in text.split(",") if "=" in t]
    return {k.strip(): v.strip() for k, v in terms}


def _matches(pod: Pod, selector: dict[str, str]) -> bool:
    labels = pod["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())
