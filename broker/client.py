"""A small asynchronous client of the HTTP API, used by the CLI, the demo feeder and the benchmarks.

An ``https://`` broker is verified against the system's CA store, or against ``ca_file`` (a private CA's PEM
bundle; the CLI's ``--ca-file`` or ``$HELIOTROPE_CA_FILE``); ``cert_file`` and ``key_file`` present a client
certificate to a broker that requires one (``broker.tls.client_ca_file``)."""

from __future__ import annotations

import codecs
import contextlib
import json
import ssl
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from yarl import URL


class ApiClientError(RuntimeError):
    """The broker answered with an error, or could not be reached; ``str()`` is a message for a person."""

    def __init__(self, message: str, status: int | None = None, fields: list[dict[str, str]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.fields = fields or []


class Client:
    def __init__(self, base_url: str, timeout_s: float = 30.0, ca_file: str | None = None,
                 cert_file: str | None = None, key_file: str | None = None, token: str | None = None) -> None:
        """``token``: a bearer token (``heliotrope token create``; the CLI's ``--token`` or
        ``$HELIOTROPE_TOKEN``), sent on every request."""
        url = URL(base_url)
        if url.scheme not in ("http", "https") or not url.host:
            raise ApiClientError(
                f"the broker URL must look like http://HOST:PORT, got {base_url!r} (set it with --server or HELIOTROPE_URL)"
            )
        self.base_url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._ssl = _tls_context(ca_file, cert_file, key_file) if url.scheme == "https" else None
        self._session: aiohttp.ClientSession | None = None
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}

    async def __aenter__(self) -> Client:
        connector = aiohttp.TCPConnector(ssl=self._ssl) if self._ssl is not None else None
        self._session = aiohttp.ClientSession(timeout=self._timeout, connector=connector)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: dict[str, str] | list[tuple[str, str]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        assert self._session is not None, "use 'async with Client(...)'"
        url = self.base_url + path
        try:
            async with self._session.request(method, url, json=body, params=params,
                                             headers={**self._auth, **(headers or {})}) as resp:
                if resp.status == 204:
                    return None
                return await _answer(resp)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise self._failed(e, url) from None

    async def text(self, path: str, params: dict[str, str] | None = None) -> tuple[str, dict[str, str]]:
        """``GET path`` answered in ``text/plain`` (a job's logs): the text and the answer's headers;
        :class:`ApiClientError` with the broker's message for an error status."""
        assert self._session is not None, "use 'async with Client(...)'"
        url = self.base_url + path
        try:
            async with self._session.get(url, params=params, headers=self._auth) as resp:
                await _text_answer(resp)
                body = await resp.read()
                return body.decode(resp.charset or "utf-8", errors="replace"), dict(resp.headers)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise self._failed(e, url) from None

    @contextlib.asynccontextmanager
    async def text_stream(self, path: str, params: dict[str, str] | None = None
                          ) -> AsyncIterator[tuple[dict[str, str], AsyncIterator[str]]]:
        """``GET path`` answered with streamed ``text/plain`` (a job's log followed): the answer's headers, and its
        text as it comes (decoded chunk by chunk, a character split between chunks kept whole); no time limit once
        it has begun. :class:`ApiClientError` with the broker's message for an error status, and saying so where
        the broker cut the answer short (the log ended before the attempt did)."""
        assert self._session is not None, "use 'async with Client(...)'"
        url = self.base_url + path
        stream_timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._timeout.total, sock_read=None)
        try:
            async with self._session.get(url, params=params, headers=self._auth, timeout=stream_timeout) as resp:
                await _text_answer(resp)

                async def chunks() -> AsyncIterator[str]:
                    decoder = codecs.getincrementaldecoder(resp.charset or "utf-8")(errors="replace")
                    try:
                        async for data in resp.content.iter_any():
                            yield decoder.decode(data)
                    except aiohttp.ClientPayloadError:  # (cut before its last chunk: the broker's way to say so)
                        raise ApiClientError(
                            "the broker broke off the log before the attempt ended (its site stopped answering, the "
                            "broker stopped, the token was revoked, or it was followed for 24 hours); run the command "
                            "again to follow it on (--tail N for how far back to start)") from None
                    yield decoder.decode(b"", final=True)
                yield dict(resp.headers), chunks()
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise self._failed(e, url) from None

    async def events(self, params: dict[str, str] | None = None,
                     last_event_id: int | None = None) -> AsyncIterator[dict[str, Any]]:
        """Follow ``GET /v1/events``: each event as ``{"id", "type", "data"}``, until the broker ends the
        stream. A redirect is followed on the same origin only (scheme, host and port): a replica relays the
        leader's stream itself, and the bearer token must never go to a server the user did not name (or
        from https to http), as browsers and aiohttp's own redirects also refuse."""
        assert self._session is not None, "use 'async with Client(...)'"
        url = self.base_url + "/v1/events"
        headers = {**self._auth, "Accept": "text/event-stream"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = str(last_event_id)
        stream_timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._timeout.total, sock_read=None)
        try:
            for _ in range(3):
                async with self._session.get(url, params=params, headers=headers, allow_redirects=False,
                                             timeout=stream_timeout) as resp:
                    if resp.status in (301, 302, 307, 308) and resp.headers.get("Location"):
                        target = resp.url.join(URL(resp.headers["Location"]))
                        if target.origin() != resp.url.origin():
                            raise ApiClientError(f"the event stream at {self.base_url} redirected to another "
                                                 f"server, {target.origin()}; not following it (the token is "
                                                 "for this broker only): point --server at that one")
                        url, params = str(target), None
                        continue
                    if resp.status >= 400:
                        await _answer(resp)
                    async for event in _parse_sse(resp.content):
                        yield event
                    return
            raise ApiClientError(f"the event stream at {self.base_url} redirected too many times")
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise self._failed(e, url) from None

    def _failed(self, error: BaseException, url: str) -> ApiClientError:
        """A failed request as a message for a person."""
        try:
            raise error
        except ApiClientError as known:
            return known
        except aiohttp.ClientConnectorCertificateError as e:
            return ApiClientError(
                f"the broker at {self.base_url} presented a certificate that could not be verified "
                f"({getattr(e.certificate_error, 'verify_message', None) or e.certificate_error}): give the CA "
                "that signed it with --ca-file or HELIOTROPE_CA_FILE"
            )
        except aiohttp.ClientSSLError as e:
            return ApiClientError(f"TLS with the broker at {self.base_url} failed: {e}")
        except aiohttp.ServerDisconnectedError:
            if not self.base_url.startswith("https:"):
                return ApiClientError(f"the broker at {self.base_url} closed the connection without an answer")
            return ApiClientError(  # TLS 1.3: a refused client certificate shows only as a closed connection
                f"the broker at {self.base_url} closed the connection without an answer; if it asks for client "
                "certificates (broker.tls.client_ca_file), this client presented none or one it does not accept"
            )
        except aiohttp.ClientConnectionError as e:
            return ApiClientError(
                f"cannot reach the broker at {self.base_url} ({e.__class__.__name__}); is it running? "
                "Start it with 'heliotrope serve' or 'heliotrope demo', or point --server at it"
            )
        except TimeoutError:
            return ApiClientError(f"the broker at {self.base_url} did not answer within {self._timeout.total:g} s")
        except BaseException as e:
            return ApiClientError(f"request to {url} failed: {e.__class__.__name__}: {e}")

    async def list_all(self, path: str, params: dict[str, str] | list[tuple[str, str]] | None = None,
                       limit: int | None = None) -> list[Any]:
        """Follow ``next`` cursors; stop after ``limit`` items if given. ``params``: a dict, or pairs where a
        parameter is repeated (``label``)."""
        items: list[Any] = []
        pairs = list(params.items()) if isinstance(params, dict) else list(params or [])
        cursor: str | None = None
        while True:
            query = pairs + ([("cursor", cursor)] if cursor else [])
            page = await self.request("GET", path, params=query)
            if not isinstance(page.get("items"), list):
                raise ApiClientError(f"{self.base_url} answered GET {path} without the list of items a heliotrope "
                                     "broker sends; is --server (or HELIOTROPE_URL) a heliotrope broker?")
            items.extend(page["items"])
            if page.get("next") is None or (limit is not None and len(items) >= limit):
                return items[:limit] if limit is not None else items
            cursor = page["next"]


async def _text_answer(resp: aiohttp.ClientResponse) -> None:
    """Raise for an answer that is not the text a broker sends for a log: :class:`ApiClientError` with the broker's
    message for an error status, or saying what came instead of ``text/plain`` (another server at --server)."""
    if resp.status >= 400:
        await _answer(resp)
    if resp.content_type != "text/plain":
        raise ApiClientError(f"{resp.url.origin()} answered GET {resp.url.path} with "
                             f"{resp.headers.get('Content-Type') or 'no Content-Type'}, not the text a heliotrope "
                             "broker sends; is --server (or HELIOTROPE_URL) a heliotrope broker?", resp.status)


async def _answer(resp: aiohttp.ClientResponse) -> Any:
    """The JSON body of an answer; :class:`ApiClientError` with the broker's message for an error status."""
    try:
        data = await resp.json(content_type=None)
    except ValueError:
        data = None
    if resp.status >= 400:
        err = (data or {}).get("error", {}) if isinstance(data, dict) else {}
        message = err.get("message") or f"HTTP {resp.status}"
        raise ApiClientError(message, resp.status, err.get("fields"))
    if not isinstance(data, dict):
        # Every answer of the API is a JSON object: anything else is another server (a wrong port, a proxy's
        # login page), which the CLI would otherwise trip over with a traceback.
        raise ApiClientError(f"{resp.url.origin()} answered {resp.method} {resp.url.path} with "
                             f"{resp.headers.get('Content-Type') or 'no Content-Type'}, not the JSON object a "
                             "heliotrope broker sends; is --server (or HELIOTROPE_URL) a heliotrope broker?",
                             resp.status)
    return data


async def _parse_sse(content: aiohttp.StreamReader) -> AsyncIterator[dict[str, Any]]:
    """Server-sent events from a stream: ``{"id", "type", "data"}`` per frame (comments skipped; ``data``
    parsed as JSON)."""
    event: dict[str, str] = {}
    data: list[str] = []
    async for raw in content:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                ident = event.get("id", "")
                yield {"id": int(ident) if ident.isdigit() else None, "type": event.get("event", "message"),
                       "data": json.loads("\n".join(data))}
            event, data = {}, []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            data.append(value)
        elif name in ("id", "event"):
            event[name] = value


def _tls_context(ca_file: str | None, cert_file: str | None, key_file: str | None) -> ssl.SSLContext | None:
    """None (aiohttp's default: the system's CA store) unless a CA bundle or a client certificate is given."""
    if ca_file is None and cert_file is None:
        return None
    try:
        context = ssl.create_default_context(cafile=ca_file)
    except OSError as e:  # ssl.SSLError is one too
        raise ApiClientError(f"the CA file {ca_file} (--ca-file or HELIOTROPE_CA_FILE) cannot be used: "
                             f"{getattr(e, 'strerror', None) or e}") from None
    if cert_file is not None:
        try:
            context.load_cert_chain(cert_file, key_file)
        except OSError as e:
            raise ApiClientError(f"the client certificate {cert_file} (key {key_file or cert_file}) cannot be used: "
                                 f"{getattr(e, 'strerror', None) or e}") from None
    return context
