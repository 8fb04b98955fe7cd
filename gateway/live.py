"""Changes while serving: a new backend set (discovery) and a new configuration (SIGHUP or file change).

`LiveBackends.apply` is the one place a backend set changes: the registry (routing sees the new pools on
the next request), the metrics (series of removed backends go, new ones start at 0) and the prefix
services (KV-event subscriptions, hashing block sizes). Requests in flight keep the backend objects they
hold, so a removed backend's streams finish on it.

`ConfigReloader` re-reads the configuration file on SIGHUP or when it changes, validates it as `serve`
does, and applies what can change in place: backends (static discovery), routing policy and knobs (a
policy's learnt corrections start over), limits and health settings. `listen`, `models`, `index`,
`discovery`, `timeouts` and `auth` need a restart; a change there is reported and ignored, and so is a
routing change that would need a prefix index the gateway did not build (or no longer needs one). A
file that fails validation is rejected with its path-named errors and the running configuration keeps
serving.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.config import BackendConfig, ConfigError, GatewayConfig, load_config
from gateway.prefix import needs_prefix

if TYPE_CHECKING:
    from gateway.app import GatewayState
    from gateway.prefix import PrefixServices

log = logging.getLogger("hetgate.live")

RESTART_ONLY = ("listen", "models", "index", "discovery", "timeouts", "auth")


class LiveBackends:
    def __init__(self, state: GatewayState, prefix: PrefixServices | None) -> None:
        self.state = state
        self.prefix = prefix
        self._lock = asyncio.Lock()  # snapshots apply one at a time, in arrival order
        self._pending: set[asyncio.Task[None]] = set()

    def submit(self, backends: tuple[BackendConfig, ...]) -> None:
        """For sources that call back synchronously: apply in a task of its own."""
        task = asyncio.get_running_loop().create_task(self.apply(backends))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def apply(self, backends: Iterable[BackendConfig]) -> None:
        async with self._lock:
            state = self.state
            added, removed = state.registry.update_backends(tuple(backends))
            if not added and not removed:
                return
            metrics = state.metrics
            for backend in removed:
                metrics.forget_backend(backend.id)
            for backend in added:
                metrics.watch_backend(backend, partial(state.registry.available, backend))
            if self.prefix is not None:
                await self.prefix.backends_changed(state.registry, added, removed, metrics)
            log.info(
                "backends changed: +%s -%s",
                ",".join(b.id for b in added) or "none",
                ",".join(b.id for b in removed) or "none",
            )


class ConfigReloader:
    def __init__(
        self,
        path: Path,
        state: GatewayState,
        backends: LiveBackends,
        read: Callable[[Path], GatewayConfig] = load_config,
        poll_s: float = 1.0,
    ) -> None:
        self.path = path
        self.state = state
        self.backends = backends
        self.read = read
        self.poll_s = poll_s
        self.reloads = 0
        self._seen = _stamp(path)
        self._pending: set[asyncio.Task[bool]] = set()

    def install_signal(self) -> None:
        """SIGHUP reloads (one process; with `--workers N` each worker follows the file itself)."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, self._on_signal)

    def _on_signal(self) -> None:
        task = asyncio.get_running_loop().create_task(self.reload())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            stamp = _stamp(self.path)
            if stamp != self._seen:
                self._seen = stamp
                await self.reload()

    async def reload(self) -> bool:
        try:
            config = self.read(self.path)
        except ConfigError as error:
            log.error("configuration %s rejected; the running one stays:\n%s", self.path, error)
            return False
        old = self.state.config
        if needs_prefix(config) != needs_prefix(old):
            log.error(
                "configuration %s rejected: its routing needs %s prefix index (restart to change that)",
                self.path,
                "a" if needs_prefix(config) else "no",
            )
            return False
        for section in RESTART_ONLY:
            if getattr(config, section) != getattr(old, section):
                log.warning("configuration %s: `%s` changes only on restart; ignored", self.path, section)
        config = config.model_copy(update={name: getattr(old, name) for name in RESTART_ONLY})
        self.state.reconfigure(config)
        if config.discovery.source == "static":
            await self.backends.apply(config.backends)
        self.reloads += 1
        log.info("configuration %s reloaded", self.path)
        return True


def _stamp(path: Path) -> tuple[float, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime, stat.st_size
