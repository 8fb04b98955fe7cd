"""The SSE relay's two helpers: cutting a backend stream at event boundaries, and rewriting P/D usage.

`EventCutter` keeps the relay well formed at a cost of one `endswith` per chunk in the common case (vLLM
writes whole events): only whole events (ending in a blank line, vLLM's `\\n\\n`) are passed on, a partial
one waits for the rest, so an error event after a broken backend never lands inside another event. It
also notes the end marker: nothing may follow `data: [DONE]`, and a stream that ends without it was cut.
No JSON is parsed here.

`UsageRewriter`: in P/D the client is told the prefill leg's cached tokens. vLLM's decode server reports
the prompt as cached (it was transferred), which says nothing about the prefix cache; what the client paid
for is what the prefill server found cached. Only P/D responses pass through it, and within a stream only
events that carry `prompt_tokens_details` are parsed.
"""

from __future__ import annotations

from typing import Any

import orjson

_BOUNDARY = b"\n\n"
_DONE = b"data: [DONE]\n\n"
_MARKER = b'"prompt_tokens_details":{'
_MARKER_SPACED = b'"prompt_tokens_details": {'


class EventCutter:
    def __init__(self, max_event_bytes: int) -> None:
        self.max_event_bytes = max_event_bytes
        self.partial = b""  # the start of an event whose end has not arrived
        self.done = False  # `data: [DONE]` went out: nothing else may
        self.overflowed = False  # an event outgrew the limit: the events before it went out, then stop

    def feed(self, chunk: bytes) -> bytes:
        """The whole events completed by `chunk` (b"" when none); raises EventTooLarge."""
        if self.done:
            return b""
        if self.overflowed:
            raise EventTooLarge
        if self.partial:
            chunk = self.partial + chunk
            self.partial = b""
        if not chunk.endswith(_BOUNDARY):
            cut = chunk.rfind(_BOUNDARY) + 2  # 1 when there is no boundary yet: then keep it all
            cut = cut if cut > 1 else 0
            if len(chunk) - cut > self.max_event_bytes:
                if not cut:
                    raise EventTooLarge
                # The whole events that came with it are passed on; the caller then ends the stream.
                self.overflowed = True
                chunk = chunk[:cut]
            else:
                chunk, self.partial = chunk[:cut], chunk[cut:]
        if _ends_with_done(chunk):
            self.done = True
        elif _DONE in chunk:
            # A backend that wrote on after [DONE] within one chunk: cut it there.
            at = chunk.index(_DONE) + len(_DONE)
            if _ends_with_done(chunk[:at]):
                chunk = chunk[:at]
                self.done = True
        return chunk


def _ends_with_done(events: bytes) -> bool:
    """`data: [DONE]` as the last event (at an event start, not inside another line)."""
    return events.endswith(_DONE) and (len(events) == len(_DONE) or events[-len(_DONE) - 1] == 10)


class EventTooLarge(Exception):
    """One SSE event grew past the limit without ending: the stream is treated as broken."""


class UsageRewriter:
    def __init__(self, cached_tokens: int) -> None:
        self.cached_tokens = cached_tokens

    def rewrite_json(self, body: bytes) -> bytes:
        try:
            document = orjson.loads(body)
        except orjson.JSONDecodeError:
            return body
        return orjson.dumps(document) if self._patch(document) else body

    def rewrite_events(self, events: bytes) -> bytes:
        """Whole SSE events in (EventCutter's output), the same events out with usage rewritten."""
        if _MARKER not in events and _MARKER_SPACED not in events:
            return events
        return b"".join(self._event(e) for e in events.split(_BOUNDARY)[:-1])

    def _event(self, event: bytes) -> bytes:
        if event.startswith(b"data: {") and (_MARKER in event or _MARKER_SPACED in event):
            try:
                document = orjson.loads(event[6:])
            except orjson.JSONDecodeError:
                return event + _BOUNDARY
            if self._patch(document):
                return b"data: " + orjson.dumps(document) + _BOUNDARY
        return event + _BOUNDARY

    def _patch(self, document: Any) -> bool:
        usage = document.get("usage") if isinstance(document, dict) else None
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        if not isinstance(details, dict):
            return False
        details["cached_tokens"] = self.cached_tokens
        return True
