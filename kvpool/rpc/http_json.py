"""The HTTP side the OpenAI-style servers share (the router's front door, the reference
engine's server): JSON bodies in, JSON replies or an SSE stream out, over stdlib
``http.server``. One place for the body limit and the wire shapes.

SSE: ``data: <json>\\n\\n`` per event, ``data: [DONE]\\n\\n`` at the end, then the connection
closes (no chunked encoding: a client reads until close, as OpenAI's streaming clients do).
"""

from __future__ import annotations

import json
import logging
from http.server import BaseHTTPRequestHandler
from typing import Any

from kvpool.core.errors import InvalidArgument

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20


def read_json_body(handler: BaseHTTPRequestHandler, limit_bytes: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """``handler``'s request body as a JSON object; ``InvalidArgument`` for an oversized,
    undecodable or non-object body (every JSON endpoint of kvpool reads bodies this way)."""
    n = int(handler.headers.get("Content-Length") or 0)
    if n > limit_bytes:
        raise InvalidArgument(f"request body over {limit_bytes} bytes")
    try:
        body = json.loads(handler.rfile.read(n) or b"{}")
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"body is not JSON: {exc.msg}") from None
    if not isinstance(body, dict):
        raise InvalidArgument("body must be a JSON object")
    return body


class JsonHandler(BaseHTTPRequestHandler):
    """Base of a handler class; subclasses add ``do_GET`` / ``do_POST``."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http: " + format, *args)

    def read_json(self, limit_bytes: int = MAX_BODY_BYTES) -> dict[str, Any]:
        """The request body as a JSON object; ``InvalidArgument`` for anything else."""
        return read_json_body(self, limit_bytes)

    def send_json(self, status: int, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def start_events(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def send_event(self, obj: dict[str, Any]) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()

    def end_events(self) -> None:
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
