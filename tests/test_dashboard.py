"""The dashboard: its static route on its own, and the page in a real headless Chromium (Debian's
``chromium``, driven by Playwright) against a live broker serving the demo's eight sites.

The browser test opens ``/``, sees every demo site on the map and in the table, clicks a placed job and
reads its decision term by term (the chosen site, the scorers, the rejected sites and their reasons), sees a
job submitted afterwards appear without a reload (the event stream), and saves a screenshot: to pytest's
temporary folder, and to ``$HELIOTROPE_SCREENSHOTS/dashboard.png`` when that names a folder (run once with
``HELIOTROPE_SCREENSHOTS=docs`` to refresh ``docs/dashboard.png``). A second one, against a broker with
authentication on, types a token into the page's form. Without ``/usr/bin/chromium`` the browser tests skip,
and fail under ``CI=true`` (``scripts/test-deps`` installs it).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from broker import dashboard
from broker.config import load_config
from tests.conftest import ROOT, TWO_SITES, ServerProcess, free_port
from tests.services import missing

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
DEMO_CONFIG = ROOT / "config" / "demo.yaml"
DEMO_SITES = ["ashburn", "frankfurt", "london", "losangeles", "saopaulo", "sydney", "tokyo", "toronto"]
TOKEN = "hlt_dashboard-test-token"
TOKEN_ENV = "HELIOTROPE_DASHBOARD_TEST_TOKEN"


# --- the static route, on a bare application --------------------------------------------------------


async def raw_get(server: TestServer, path: str) -> tuple[int, dict[str, str], bytes]:
    """GET ``path`` sent byte for byte (no client normalises ``..`` or percent-escapes away)."""
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    answer = await reader.read()
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


@pytest.fixture
async def static_server(tmp_path: Path) -> Any:
    """The dashboard's routes over a folder like broker/static, with files beside and below it that must
    never be served."""
    folder = tmp_path / "static"
    (folder / "sub").mkdir(parents=True)
    (folder / "index.html").write_text("<!doctype html><title>t</title>")
    (folder / "app.js").write_text("1;")
    (folder / "notes.md").write_text("not a web file")
    (folder / "sub" / "deep.js").write_text("2;")
    (tmp_path / "secret.js").write_text("secret")
    app = web.Application()
    dashboard.add_routes(app, folder)
    async with TestServer(app) as server:
        yield server


@pytest.mark.parametrize("path", [
    "/dashboard/../secret.js", "/dashboard/..%2Fsecret.js", "/dashboard/%2e%2e/secret.js",
    "/dashboard/%2e%2e%2fsecret.js", "/dashboard/sub/deep.js", "/dashboard/sub%2Fdeep.js", "/dashboard//secret.js",
    "/dashboard/notes.md", "/dashboard/missing.js", "/dashboard/.", "/dashboard/%00",
], ids=lambda p: p)
async def test_only_the_dashboards_own_web_files_are_served_and_no_path_leaves_its_folder(static_server, path):
    status, _, body = await raw_get(static_server, path)
    assert status == 404 and b"secret" not in body and b"2;" not in body


@pytest.mark.parametrize("path, content_type", [
    ("/dashboard/", "text/html; charset=utf-8"),
    ("/dashboard/index.html", "text/html; charset=utf-8"),
    ("/dashboard/app.js", "text/javascript; charset=utf-8"),
], ids=["the folder is its index.html", "index.html by name", "a script"])
async def test_the_dashboards_files_have_their_content_types_and_are_revalidated(static_server, path, content_type):
    status, headers, _ = await raw_get(static_server, path)
    assert status == 200
    assert headers["content-type"] == content_type
    assert headers["cache-control"] == "no-cache"


@pytest.mark.parametrize("path", ["/", "/dashboard"])
async def test_the_root_redirects_to_the_dashboard(static_server, path):
    status, headers, _ = await raw_get(static_server, path)
    assert status == 302 and headers["location"] == "/dashboard/"


def test_the_shipped_page_has_its_files_and_fetches_nothing_from_elsewhere():
    files = dashboard.served_files()
    assert {"index.html", "dashboard.js", "dashboard.css", "world.svg"} <= set(files)
    assert {dashboard.CONTENT_TYPES[p.suffix] for p in files.values()} >= {"image/svg+xml", "text/css; charset=utf-8"}
    for name in ("index.html", "dashboard.js", "dashboard.css"):
        text = files[name].read_text()
        urls = set(re.findall(r"(?:https?:)?//[\w.-]+\.\w+[^\s\"')]*", text)) - {"http://www.w3.org/2000/svg"}
        assert not urls, f"{name} refers to {urls}: the page must work without the internet"
    assert 'id="land"' in files["world.svg"].read_text()


# --- the page in Chromium, against the demo's sites ------------------------------------------------


def http(url: str, body: dict[str, Any] | None = None) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.load(r)


def submit(srv: ServerProcess, tenant: str, name: str, gpus: dict[str, Any], duration_s: float = 3600,
           **more: Any) -> str:
    body = {"tenant": tenant, "name": name, "gpus": gpus, "duration_s": duration_s, **more}
    return http(f"{srv.url}/v1/jobs", body)["id"]


def decided(srv: ServerProcess, job_id: str, timeout_s: float = 10) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return http(f"{srv.url}/v1/jobs/{job_id}/decision")
        except urllib.error.HTTPError as e:
            if e.code != 404 or time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def carbon_known(srv: ServerProcess, timeout_s: float = 10) -> None:
    """Wait until routing sees every site's grid intensity (the carbon data loads just after the API is up),
    so that the jobs below are decided on it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sites = http(f"{srv.url}/v1/sites")["items"]
        if all((site.get("signals") or {}).get("carbon_g_per_kwh") is not None for site in sites):
            return
        time.sleep(0.1)
    raise AssertionError(f"the broker did not see every site's carbon intensity within {timeout_s} s")


def settled_capacity(srv: ServerProcess, timeout_s: float = 10) -> tuple[int, int]:
    """Free and total GPUs over all sites once every running job's GPUs show as used in the sites' reports."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = http(f"{srv.url}/v1/jobs?state=running&limit=1000")["items"]
        held = sum(j["spec"]["gpus"]["count"] for j in running)
        capacity = [c for s in http(f"{srv.url}/v1/sites")["items"] for c in s["status"]["capacity"]]
        free, total = sum(c["free_gpus"] for c in capacity), sum(c["total_gpus"] for c in capacity)
        if free == total - held or time.monotonic() > deadline:
            assert free == total - held, f"the sites report {total - free} GPUs in use, the running jobs hold {held}"
            return free, total
        time.sleep(0.1)


@pytest.fixture(scope="module")
def demo_broker(tmp_path_factory) -> Iterator[ServerProcess]:
    """``heliotrope serve`` with config/demo.yaml (its carbon data, eight sites), on a free port and a
    temporary database, with a few jobs of different profiles already decided."""
    tmp = tmp_path_factory.mktemp("dashboard")
    port = free_port()
    srv = ServerProcess(f"http://127.0.0.1:{port}", port, tmp / "broker.db", ROOT / "config" / "demo.yaml",
                        log=tmp / "server.log")
    srv.start()
    try:
        carbon_known(srv)
        jobs = {
            "explained": submit(srv, "vision", "resnet50-finetune", {"count": 2, "model": "a100-80gb"},
                                profile="balanced", origin_region="gcp:europe-west1"),
            "green": submit(srv, "nlp", "llm-eval", {"count": 4, "model": "h100-80gb"}, profile="green"),
            "cheap": submit(srv, "speech", "whisper-batch", {"count": 2, "model": "l4"}, profile="cheap"),
            "fast": submit(srv, "research", "sweep-07", {"count": 1}, profile="fast", origin_region="gcp:us-east1"),
            "too-big": submit(srv, "nlp", "pretrain-70b", {"count": 64, "model": "h100-80gb"}),
        }
        for job_id in jobs.values():
            decided(srv, job_id)
        srv.jobs = jobs  # type: ignore[attr-defined]
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        missing("chromium", f"{CHROMIUM} is not installed (scripts/test-deps installs Debian's chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("chromium", "the playwright package is not installed (pip install -e '.[test]')")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


class Watched:
    """A page with its console errors and every URL it asked for."""

    def __init__(self, browser: Any, **options: Any) -> None:
        self.page = browser.new_page(viewport={"width": 1600, "height": 1000}, **options)
        self.page.set_default_timeout(8000)
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))


def save_screenshot(page: Any, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    page.screenshot(path=str(path), full_page=True, animations="disabled")
    folder = os.environ.get("HELIOTROPE_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(folder) / name)
    return path


@pytest.mark.slow
def test_the_dashboard_shows_the_sites_explains_a_decision_and_updates_live(browser, demo_broker, tmp_path):
    from playwright.sync_api import expect

    srv = demo_broker
    explained = srv.jobs["explained"]
    decision = http(f"{srv.url}/v1/jobs/{explained}/decision")
    assert decision["outcome"] == "placed"
    placed = {"vision", "nlp", "speech", "research"}  # the tenants of the jobs placed (not of the one too big)
    deadline = time.monotonic() + 10
    while {i["tenant"] for i in http(f"{srv.url}/v1/usage?by=tenant")["items"]} != placed:
        assert time.monotonic() < deadline, "the placed jobs' sites did not admit them within 10 s"
        time.sleep(0.1)
    w = Watched(browser)
    page = w.page

    def usage_with_a_note(route: Any) -> None:  # (the demo's jobs were all placed at recorded prices)
        answer = route.fetch()
        body = answer.json()
        body["notes"] = [*body.get("notes", []), "cost_usd: 1.5 GPU-hours were placed before prices were recorded "
                         "(before this release, or where their site had no price then) and are charged at today's "
                         "price"]
        route.fulfill(response=answer, json=body)

    page.route("**/v1/usage?by=tenant", usage_with_a_note)
    page.goto(srv.url + "/")  # redirected to /dashboard/
    assert page.url == srv.url + "/dashboard/"
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    expect(page.locator("#token-dialog")).not_to_be_visible()  # the demo has no authentication

    # Every site: a circle and a label on the map, a row in the table.
    expect(page.locator("#map g.site")).to_have_count(len(DEMO_SITES))
    for name in DEMO_SITES:
        expect(page.locator(f'#map g.label[data-site="{name}"]')).to_contain_text(name)
        expect(page.locator(f'#sites-table tr[data-site="{name}"]')).to_contain_text(name)
    expect(page.locator('#sites-table tr[data-site="toronto"]')).to_contain_text("CA-ON")
    expect(page.locator('#map g.label[data-site="london"]')).to_contain_text(re.compile(r"\d+ g/kWh"))
    # Each site's label: its local time (the site's time zone, not the browser's) and its price per GPU-hour.
    for spec in load_config(DEMO_CONFIG).sites:
        label = page.locator(f'#map g.label[data-site="{spec.name}"]')
        expect(label).to_contain_text(f"${min(spec.usd_per_gpu_hour.values()):.2f}")
        shown = label.locator("tspan.time").text_content()
        now = datetime.now(ZoneInfo(spec.timezone))
        near = {(now + timedelta(minutes=m)).strftime("%H:%M") for m in (-1, 0, 1)}
        assert shown in near, (spec.name, spec.timezone, shown, near)

    # The queue: the placed jobs and the one nothing can fit.
    expect(page.locator(f'li.job[data-job-id="{srv.jobs["too-big"]}"]')).to_have_attribute("data-state", "queued")

    # A placed job's decision, term by term.
    page.locator(f'li.job[data-job-id="{explained}"]').click()
    terms = page.locator("#decision-terms")
    chosen = terms.locator("tr.chosen")
    expect(chosen).to_have_attribute("data-site", decision["site"])
    expect(chosen).to_contain_text("chosen")
    for scorer in ("carbon", "cost", "latency", "free_gpus"):
        expect(terms.locator(f'th[data-scorer="{scorer}"]')).to_contain_text(scorer)
        expect(chosen.locator(f'td[data-scorer="{scorer}"]')).to_have_count(1)
    best = next(v for v in decision["sites"] if v["site"] == decision["site"])
    expect(chosen.locator("td.score")).to_have_text(f"{best['score']:.3f}")
    feasible = [v["site"] for v in decision["sites"] if v["feasible"]]
    expect(terms.locator("tbody tr")).to_have_count(len(feasible))
    rejected = page.locator("#decision-rejected")
    expect(rejected.locator("li")).to_have_count(len(decision["sites"]) - len(feasible))
    expect(rejected).to_contain_text("gpus-do-not-fit")
    expect(page.locator('#map g.label.chosen')).to_have_attribute("data-site", decision["site"])

    # Its log, read from its site when the panel is opened (the demo's sites simulate one).
    page.locator("#decision-log summary").click()
    log = page.locator("#decision-log-text")
    expect(log).to_have_attribute("data-state", "ok")
    expect(log).to_contain_text(f"heliotrope simulated site {decision['site']}")

    # The carbon headline, from /v1/carbon.
    expect(page.locator("#carbon")).to_have_attribute("data-state", "ok")
    expect(page.locator("#carbon-saved")).to_have_text(re.compile(r"^-?\d"))

    # Usage by tenant, from /v1/usage: a row per tenant whose jobs hold GPUs, costed at the demo sites' prices,
    # and the total.
    expect(page.locator("#usage")).to_have_attribute("data-state", "ok")
    usage = page.locator("#usage-table tbody tr")
    expect(usage).to_have_count(len(placed) + 1)
    for tenant in [*placed, "total"]:
        cells = page.locator(f'#usage-table tr[data-tenant="{tenant}"] td')
        expect(cells.nth(1)).to_have_text(re.compile(r"^\d[\d.e+-]*$"))  # GPU-hours
        expect(cells.nth(4)).to_have_text(re.compile(r"^\d+\.\d\d$"))  # cost
    # A report's notes are said under it, in short (whole in its title)
    expect(page.locator("#usage-note")).to_have_text(
        "1.5 GPU-hours were placed before prices were recorded and are charged at today's price")

    # Live: a job submitted now shows up in the queue and the log, without a reload (the page polls the
    # queue only every 30 s while the stream is live).
    expect(page.locator("#live")).to_have_attribute("data-state", "live")
    page.evaluate("window.__sameDocument = true")
    new = submit(srv, "vision", "live-check", {"count": 1, "model": "l4"}, profile="green")
    expect(page.locator(f'li.job[data-job-id="{new}"]')).to_be_visible(timeout=5000)
    expect(page.locator("#events li").first).to_be_visible()
    expect(page.locator("#events")).to_contain_text("vision/live-check")
    assert page.evaluate("window.__sameDocument") is True

    # The sites follow too: once the sites report the new job's GPUs in use, so does the page.
    free, total = settled_capacity(srv)
    expect(page.locator("#stat-gpus")).to_have_text(f"{free}/{total}")

    shot = save_screenshot(page, tmp_path, "dashboard.png")
    assert shot.stat().st_size > 50_000
    assert not w.errors, w.errors
    outside = [u for u in w.requests if not u.startswith(srv.url + "/") and not u.startswith("data:")]
    assert not outside, f"the page fetched from outside the broker: {outside}"


@pytest.mark.slow
def test_a_broker_that_asks_for_a_token_gets_one_from_a_form_and_every_call_then_carries_it(
        browser, server_factory, monkeypatch):
    """A broker with ``broker.auth.enabled`` and an admin token from the environment: the page asks for a
    token, says so when one is refused, and once given a good one sends it on every call, the stream too."""
    from playwright.sync_api import expect

    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    srv = server_factory({**TWO_SITES, "broker": {**TWO_SITES["broker"],
                                                  "auth": {"enabled": True, "admin_token_env": TOKEN_ENV}}})
    srv.start()
    w = Watched(browser)
    page = w.page
    calls: list[tuple[str, str | None]] = []
    page.on("request", lambda r: calls.append((r.url, r.headers.get("authorization"))))

    page.goto(srv.url + "/dashboard/")  # the page itself needs no token
    dialog = page.locator("#token-dialog")
    expect(dialog).to_be_visible()
    page.fill("#token-input", "hlt_not-a-token")
    page.click("#token-dialog button[type=submit]")
    expect(dialog).to_be_visible()  # refused: asked again, saying why
    expect(page.locator("#token-error")).to_contain_text("refused")
    page.fill("#token-input", TOKEN)
    page.click("#token-dialog button[type=submit]")
    expect(dialog).not_to_be_visible()
    expect(page.locator("#sites-table tbody tr")).to_have_count(2)
    expect(page.locator("#live")).to_have_attribute("data-state", "live")
    expect(page.locator("#token-button")).to_contain_text("admin")
    assert page.evaluate("localStorage.getItem('heliotrope.token')") == TOKEN

    api = [(u.removeprefix(srv.url).split("?")[0], auth) for u, auth in calls if "/v1/" in u]
    first_good = next(i for i, (_, auth) in enumerate(api) if auth == f"Bearer {TOKEN}")
    assert all(auth == f"Bearer {TOKEN}" for _, auth in api[first_good:]), api[first_good:]
    assert {path for path, _ in api[first_good:]} >= {"/v1/sites", "/v1/jobs", "/v1/events", "/v1/carbon"}
    page.close()
