"""The dashboard: a static web page the broker serves at ``/dashboard/`` (and ``/`` redirects there).

The page itself (``broker/static/``: ``index.html``, ``dashboard.css``, ``dashboard.js``, ``world.svg``) is
hand-written HTML, CSS and JavaScript with no build step and nothing fetched from elsewhere: it reads the
same JSON API as every other client (``/v1/sites``, ``/v1/jobs``, ``/v1/jobs/{id}/decision``,
``/v1/carbon``, ``/v1/usage``) and follows ``/v1/events`` for live updates, sending the user's bearer token
when the broker asks for one. The files hold no data, so they are served to anyone who can reach the broker.

Only the files in ``broker/static/`` whose type is listed in :data:`CONTENT_TYPES` are served, by name, one
level deep: anything else under ``/dashboard/`` (other names, other folders, ``..``) is a 404. Every answer
carries ``Cache-Control: no-cache``, so a browser revalidates and an upgraded broker's page is seen at once.
To turn the dashboard off, leave ``add_routes`` out of :func:`broker.api.create_app`.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

STATIC = Path(__file__).resolve().parent / "static"

CONTENT_TYPES: dict[str, str] = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
    ".json": "application/json",
    ".png": "image/png",
    ".ico": "image/x-icon",
}

INDEX = "index.html"


def served_files(folder: Path = STATIC) -> dict[str, Path]:
    """The files the dashboard serves, by name: the plain files of ``folder`` with a type we know."""
    if not folder.is_dir():
        return {}
    return {p.name: p for p in folder.iterdir() if p.is_file() and p.suffix in CONTENT_TYPES}


def _file_response(path: Path) -> web.Response:
    return web.Response(
        body=path.read_bytes(),
        headers={"Content-Type": CONTENT_TYPES[path.suffix], "Cache-Control": "no-cache",
                 "X-Content-Type-Options": "nosniff"},
    )


def add_routes(app: web.Application, folder: Path = STATIC) -> None:
    """Serve the dashboard on ``app``: ``GET /`` and ``GET /dashboard`` redirect to ``/dashboard/``, which
    answers ``index.html``; ``GET /dashboard/{name}`` answers one of :func:`served_files`, else 404."""
    files = served_files(folder)

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound("/dashboard/")

    async def index(request: web.Request) -> web.Response:
        if INDEX not in files:
            raise web.HTTPNotFound()
        return _file_response(files[INDEX])

    async def static_file(request: web.Request) -> web.Response:
        path = files.get(request.match_info["name"])
        if path is None or not path.is_file():
            raise web.HTTPNotFound()
        return _file_response(path)

    app.router.add_get("/", redirect)
    app.router.add_get("/dashboard", redirect)
    app.router.add_get("/dashboard/", index)
    app.router.add_get("/dashboard/{name}", static_file)
