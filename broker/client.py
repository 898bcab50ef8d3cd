"""A small asynchronous client of the HTTP API, used by the CLI, the demo feeder and the benchmarks."""

from __future__ import annotations

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
    def __init__(self, base_url: str, timeout_s: float = 30.0) -> None:
        url = URL(base_url)
        if url.scheme not in ("http", "https") or not url.host:
            raise ApiClientError(
                f"the broker URL must look like http://HOST:PORT, got {base_url!r} (set it with --server or HELIOTROPE_URL)"
            )
        self.base_url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        assert self._session is not None, "use 'async with Client(...)'"
        url = self.base_url + path
        try:
            async with self._session.request(method, url, json=body, params=params, headers=headers) as resp:
                if resp.status == 204:
                    return None
                try:
                    data = await resp.json(content_type=None)
                except ValueError:
                    data = None
                if resp.status >= 400:
                    err = (data or {}).get("error", {}) if isinstance(data, dict) else {}
                    message = err.get("message") or f"HTTP {resp.status}"
                    raise ApiClientError(message, resp.status, err.get("fields"))
                return data
        except aiohttp.ClientConnectionError as e:
            raise ApiClientError(
                f"cannot reach the broker at {self.base_url} ({e.__class__.__name__}); is it running? "
                "Start it with 'heliotrope serve' or 'heliotrope demo', or point --server at it"
            ) from None
        except TimeoutError:
            raise ApiClientError(f"the broker at {self.base_url} did not answer within {self._timeout.total:g} s") from None
        except (aiohttp.ClientError, ValueError) as e:
            raise ApiClientError(f"request to {url} failed: {e.__class__.__name__}: {e}") from None

    async def list_all(self, path: str, params: dict[str, str] | None = None, limit: int | None = None) -> list[Any]:
        """Follow ``next`` cursors; stop after ``limit`` items if given."""
        items: list[Any] = []
        query = dict(params or {})
        while True:
            page = await self.request("GET", path, params=query)
            items.extend(page["items"])
            if page.get("next") is None or (limit is not None and len(items) >= limit):
                return items[:limit] if limit is not None else items
            query["cursor"] = page["next"]
