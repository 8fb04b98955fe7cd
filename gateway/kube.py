"""A Kubernetes list+watch client for one kind of object, as client-go's reflector does it, on httpx.

The loop: LIST (remember the list's `resourceVersion`), then WATCH from that version with bookmarks;
every event moves the version on, and a watch that the server ends (its `timeoutSeconds`) is resumed from
the last version. When the version is too old the server answers 410 Gone (as the watch's HTTP status or
as an ERROR event): then LIST again. Errors back off exponentially. The bearer token is read from its file
on every connection, since projected service-account tokens rotate.

The control plane only: nothing here is on the request path.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson

log = logging.getLogger("hetgate.kube")

Object = dict[str, Any]


class Gone(Exception):
    """The resource version we hold is too old: list again."""


class ApiError(Exception):
    """The API server refused a call (status and reason only; bodies may echo request data)."""


class Reflector:
    """Keeps `objects` (name -> object) equal to the server's set and calls `on_change` after each change."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        path: str,
        label_selector: str,
        token_file: Path | None,
        on_change: Callable[[dict[str, Object]], None],
        watch_timeout_s: int = 300,
        max_backoff_s: float = 30.0,
    ) -> None:
        self.client = client
        self.path = path
        self.label_selector = label_selector
        self.token_file = token_file
        self.on_change = on_change
        self.watch_timeout_s = watch_timeout_s
        self.max_backoff_s = max_backoff_s
        self.objects: dict[str, Object] = {}
        self.lists = 0  # how many times it listed (a restart from scratch after 410 counts here)

    async def run(self) -> None:
        backoff = 0.5
        while True:
            try:
                version = await self._list()
                backoff = 0.5
                while True:
                    version = await self._watch(version)
            except Gone:
                log.info("kubernetes watch of %s: resource version expired, listing again", self.path)
            except (httpx.HTTPError, ApiError, ValueError) as error:
                log.warning(
                    "kubernetes watch of %s failed (%s); retrying in %.1f s", self.path, error, backoff
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)

    async def _list(self) -> str:
        response = await self.client.get(
            self.path, params={"labelSelector": self.label_selector}, headers=self._auth()
        )
        _raise_for(response.status_code, response.reason_phrase)
        listing = orjson.loads(response.content)
        self.objects = {item["metadata"]["name"]: item for item in listing.get("items") or ()}
        self.lists += 1
        self.on_change(self.objects)
        return str(listing["metadata"]["resourceVersion"])

    async def _watch(self, version: str) -> str:
        params = {
            "labelSelector": self.label_selector,
            "watch": "true",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.watch_timeout_s),
        }
        timeout = httpx.Timeout(10.0, read=self.watch_timeout_s + 30.0)
        async with self.client.stream(
            "GET", self.path, params=params, headers=self._auth(), timeout=timeout
        ) as response:
            _raise_for(response.status_code, response.reason_phrase)
            async for line in response.aiter_lines():
                if line.strip():
                    version = self._apply(orjson.loads(line), version)
        return version

    def _apply(self, event: Object, version: str) -> str:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone
            raise ApiError(f"watch error {obj.get('code')}: {obj.get('reason')}")
        meta = obj.get("metadata") or {}
        version = str(meta.get("resourceVersion") or version)
        if kind == "BOOKMARK":
            return version
        if kind in ("ADDED", "MODIFIED"):
            self.objects[meta["name"]] = obj
        elif kind == "DELETED":
            self.objects.pop(meta["name"], None)
        else:
            raise ValueError(f"unknown watch event type {kind!r}")
        self.on_change(self.objects)
        return version

    def _auth(self) -> dict[str, str]:
        if self.token_file is None or not self.token_file.exists():
            return {}
        return {"Authorization": f"Bearer {self.token_file.read_text().strip()}"}


def _raise_for(status: int, reason: str) -> None:
    if status == 410:
        raise Gone
    if status != 200:
        raise ApiError(f"HTTP {status} {reason}")
