"""Rewriting usage in P/D responses: the client is told the prefill leg's cached tokens.

vLLM's decode server reports the prompt as cached (it was transferred), which says nothing about the
prefix cache; what the client paid for is what the prefill server found cached. Only P/D responses pass
through here, and within a stream only events that carry `prompt_tokens_details` are parsed.
"""

from __future__ import annotations

from typing import Any

import orjson

_MARKER = b'"prompt_tokens_details":{'
_MARKER_SPACED = b'"prompt_tokens_details": {'


class UsageRewriter:
    def __init__(self, cached_tokens: int) -> None:
        self.cached_tokens = cached_tokens
        self._pending = b""

    def rewrite_json(self, body: bytes) -> bytes:
        try:
            document = orjson.loads(body)
        except orjson.JSONDecodeError:
            return body
        return orjson.dumps(document) if self._patch(document) else body

    def feed(self, chunk: bytes) -> bytes:
        """Whole SSE events out (rewritten where needed); a partial event waits for the next chunk."""
        data = self._pending + chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._pending = data
            return b""
        complete, self._pending = data[: cut + 2], data[cut + 2 :]
        if _MARKER not in complete and _MARKER_SPACED not in complete:
            return complete
        return b"".join(self._event(e) for e in complete.split(b"\n\n")[:-1])

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest

    def _event(self, event: bytes) -> bytes:
        if event.startswith(b"data: {") and (_MARKER in event or _MARKER_SPACED in event):
            try:
                document = orjson.loads(event[6:])
            except orjson.JSONDecodeError:
                return event + b"\n\n"
            if self._patch(document):
                return b"data: " + orjson.dumps(document) + b"\n\n"
        return event + b"\n\n"

    def _patch(self, document: Any) -> bool:
        usage = document.get("usage") if isinstance(document, dict) else None
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        if not isinstance(details, dict):
            return False
        details["cached_tokens"] = self.cached_tokens
        return True
