"""Requests aiohttp refuses before the API sees them, answered in the API's JSON error shape.

aiohttp's HTTP parser refuses a request whose head breaks its limits (a header name or value over 8,190 bytes,
a request line over 8,190 bytes, more than 128 headers) or that is no HTTP at all. Those requests never reach
the application or its middlewares: aiohttp answers them itself with a plain-text 400 that quotes the first
bytes of the offending value (the start of a bearer token, for an ``Authorization`` header) and logs a
traceback. Here they get ``{"error": {"status": 400, "message": ..., "fields": [{"field": HEADER, "problem":
...}]}}``, as every other bad request does, and one log line without the value. aiohttp's limits are kept as
they are: a header of 8 KiB is already far more than anything the broker reads.

aiohttp has no hook for this (aio-libs/aiohttp#3287), so :class:`BrokerRunner` is an ``AppRunner`` whose
server makes each connection's protocol a :class:`JsonErrorHandler`, aiohttp's ``RequestHandler`` with its
``handle_error`` answering in JSON. Errors of the server itself (5xx) keep aiohttp's answer.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, HttpProcessingError, LineTooLong

log = logging.getLogger(__name__)

# RFC 9110's token: the characters of a header's name.
_HEADER = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):[ \t]*(.*)", re.S)
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_REQUEST_LINE = re.compile(rb"[A-Z]+ ")
_NAME_SHOWN = 64  # characters of an over-long header name the answer shows


def _shown(name: bytes) -> str:
    text = name.decode("latin-1")
    return text if len(text) <= _NAME_SHOWN else text[:_NAME_SHOWN] + "..."


def over_long(head: bytes, max_field_size: int, max_line_size: int) -> dict[str, str] | None:
    """The part of a request head that broke the parser's limits, as ``{"field", "problem"}``: a header (named,
    its value never quoted), or the request line. ``head``: the bytes received up to the point the parser
    refused, from at least the start of the offending line. None where no line of it is over a limit."""
    for raw in head.split(b"\n"):
        line = raw.rstrip(b"\r")
        header = _HEADER.fullmatch(line)
        if header is not None:
            name, value = header.groups()
            if len(name) > max_field_size:
                return {"field": _shown(name), "problem": f"name longer than the limit of {max_field_size} bytes"}
            if len(value) > max_field_size:
                return {"field": _shown(name), "problem": f"value longer than the limit of {max_field_size} bytes"}
        elif len(line) > max_line_size and _REQUEST_LINE.match(line):
            return {"field": "(request line)",
                    "problem": f"longer than the limit of {max_line_size} bytes: shorten the path and query"}
        elif len(line) > max_field_size and _TOKEN.fullmatch(line):  # a name, its colon not received yet
            return {"field": _shown(line), "problem": f"name longer than the limit of {max_field_size} bytes"}
    return None


class JsonErrorHandler(web.RequestHandler):
    """aiohttp's protocol for one connection, but a request its parser refuses (400) is answered as JSON and
    logged in one line. It keeps the bytes it last received (at most two header lines' worth before the
    current chunk) to name the header that was over the limit, which aiohttp's error does not."""

    def data_received(self, data: bytes) -> None:
        # What came before this chunk: enough to hold the start of a line that overflows within it (a name and
        # a value each at most max_field_size, else the parser would have refused an earlier chunk).
        before = getattr(self, "_before", b"")
        self._seen = before + data
        keep = 2 * max(self.max_field_size, self.max_line_size) + 4
        self._before = self._seen[-keep:]
        super().data_received(data)

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500 or not isinstance(exc, HttpProcessingError) or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        problem: dict[str, str] | None = None
        if isinstance(exc, LineTooLong):
            problem = over_long(getattr(self, "_seen", b""), self.max_field_size, self.max_line_size)
        if problem is None and "too many headers" in (exc.message or "").lower():
            problem = {"field": "(headers)", "problem": f"more than {getattr(self, 'max_headers', 128)} headers"}
        if problem is None:
            text = (exc.message or "malformed request").strip()
            problem = {"field": "(request)", "problem": text if len(text) <= 200 else text[:200] + "..."}
        if isinstance(exc, BadHttpMethod):  # no HTTP (TLS to a plain port, a port scan): as aiohttp does
            log.debug("refused a request from %s: %s: %s", request.remote, problem["field"], problem["problem"])
        else:
            log.warning("refused a request from %s: %s: %s", request.remote, problem["field"], problem["problem"])
        said = f"bad request: {problem['field'].strip('()')}: {problem['problem']}"
        body: dict[str, Any] = {"status": status, "message": said, "fields": [problem]}
        response = web.Response(status=status, text=json.dumps({"error": body}), content_type="application/json")
        response.force_close()  # (the parser's state is lost: as aiohttp does, the connection ends)
        return response


class _Server(web.Server):
    def __call__(self) -> web.RequestHandler:  # the protocol factory: one handler per connection
        return JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class BrokerRunner(web.AppRunner):
    """An ``AppRunner`` whose connections answer requests aiohttp's parser refuses as :class:`JsonErrorHandler`
    does; everything else as aiohttp's."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # (the app started, its handler arguments merged in)
        return _Server(server.request_handler, request_factory=server.request_factory,
                       handler_cancellation=server.handler_cancellation, loop=server._loop, **server._kwargs)
