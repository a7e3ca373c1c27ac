"""`shoal serve`'s access log: one line per HTTP request (method, path, status, seconds, and
for streamed answers the time to the end of the stream), on the `shoal.access` logger."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("shoal.access")


class AccessLog:
    """ASGI middleware: it wraps `send` only, so streaming and disconnects pass untouched."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = 0

        async def sending(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            client = scope.get("client") or ("-", 0)
            log.info('%s "%s %s" %s %.3fs', client[0], scope["method"], scope["path"],
                     status or "-", time.monotonic() - started)
