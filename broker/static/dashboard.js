// heliotrope dashboard: the sites on a world map, the queue, each job's decision term by term, the carbon
// saved, and a live event log. Plain JavaScript, no dependencies, nothing fetched from outside the broker.
//
// Data: GET /v1/sites, /v1/jobs?state=..., /v1/jobs/{id}/decision, /v1/carbon, /v1/usage (each JSON), a job's log
// (GET /v1/jobs/{id}/logs, text, when its panel is opened), and the live
// stream GET /v1/events (server-sent events, read with fetch() so that it can carry the bearer token).
// Whatever the broker does not offer (a 404) is shown as unavailable and the rest works without it.
//
// Sections: helpers · API and token · carbon colours · map · sites table · queue · decision · events ·
// live stream · refresh scheduling · boot.

"use strict";

// --- helpers ----------------------------------------------------------------------------------------

const BASE = new URL("../", window.location.href); // the broker's root: the page is served at /dashboard/
const TOKEN_KEY = "heliotrope.token";
const SVG_NS = "http://www.w3.org/2000/svg";

const $ = (id) => document.getElementById(id);

/** An HTML element: h("td", {class: "num"}, "12", otherNode). Text is always set as text, never as HTML. */
function h(tag, attrs = {}, ...children) {
  return build(document.createElement(tag), attrs, children);
}

/** An SVG element, as h(). */
function s(tag, attrs = {}, ...children) {
  return build(document.createElementNS(SVG_NS, tag), attrs, children);
}

function build(el, attrs, children) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "onclick") el.addEventListener("click", v);
    else if (k === "dataset") Object.assign(el.dataset, v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** fn, called once ``ms`` after the last of a burst of calls. */
function debounce(fn, ms) {
  let timer = null;
  return () => {
    clearTimeout(timer);
    timer = setTimeout(fn, ms);
  };
}

/** A number for people: 3 significant figures or so, no exponent for everyday values. */
function num(v, digits) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (digits !== undefined) return v.toFixed(digits);
  const a = Math.abs(v);
  if (a === 0) return "0";
  if (a >= 100) return v.toFixed(0);
  if (a >= 10) return v.toFixed(1);
  if (a >= 1) return v.toFixed(2);
  if (a >= 0.01) return v.toFixed(3);
  return v.toPrecision(2);
}

/** Grams of CO2e as g, kg or t. */
function grams(g) {
  if (g === null || g === undefined) return { value: "–", unit: "" };
  const a = Math.abs(g);
  if (a >= 1e6) return { value: (g / 1e6).toFixed(2), unit: "t" };
  if (a >= 1e3) return { value: (g / 1e3).toFixed(a >= 1e5 ? 0 : 1), unit: "kg" };
  return { value: g.toFixed(0), unit: "g" };
}

/** A weight as written in a profile: 0.5, 1, 0.25. */
const weight = (w) => (w === null || w === undefined ? "–" : String(Number(w.toFixed(3))));

function ago(iso) {
  if (!iso) return "";
  const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (s < 60) return `${Math.round(s)} s`;
  if (s < 3600) return `${Math.round(s / 60)} min`;
  if (s < 86400) return `${(s / 3600).toFixed(1)} h`;
  return `${Math.round(s / 86400)} d`;
}

const timeFormats = new Map();
/** The wall-clock time now in an IANA time zone, "14:05", or "" for a zone this browser does not know. */
function localTime(zone, withWeekday = false) {
  const key = `${zone}|${withWeekday}`;
  if (!timeFormats.has(key)) {
    try {
      timeFormats.set(key, new Intl.DateTimeFormat("en-GB", {
        timeZone: zone, hour: "2-digit", minute: "2-digit", hourCycle: "h23", ...(withWeekday ? { weekday: "short" } : {}),
      }));
    } catch {
      timeFormats.set(key, null);
    }
  }
  const f = timeFormats.get(key);
  return f ? f.format(new Date()) : "";
}

function clockTime(iso) {
  const d = iso ? new Date(iso) : new Date();
  return d.toLocaleTimeString("en-GB", { hour12: false });
}

function gpusText(spec) {
  const g = spec.gpus || {};
  const what = g.mig_profile || g.model || "any GPU";
  if (g.milli && g.milli < 1000) return `${g.count} × ${g.milli / 1000} ${what}`;
  if (g.shared && g.memory_gib) return `${g.count} × ${g.memory_gib} GiB of ${what}`;
  return `${g.count} × ${what}`;
}

// --- API and token ----------------------------------------------------------------------------------

class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function token() {
  try {
    return window.localStorage.getItem(TOKEN_KEY) || "";
  } catch {
    return "";
  }
}

function authHeaders() {
  const t = token();
  return t ? { Authorization: `Bearer ${t}` } : {};
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || response.statusText;
  } catch {
    return response.statusText || `HTTP ${response.status}`;
  }
}

/** GET a path under the broker's root as JSON (or text); a 401 asks the user for a token. */
async function api(path, { text = false } = {}) {
  const sent = token();
  const response = await fetch(new URL(path, BASE), {
    headers: { Accept: text ? "text/plain" : "application/json", ...authHeaders() },
    cache: "no-store",
  });
  if (response.status === 401) {
    const message = await errorText(response);
    // Only if the token refused is still the saved one: an answer to a call made with a token the user has
    // since replaced (a wrong one, then the right one) must not ask again; the refresh after the save redoes it.
    if (token() === sent) askForToken(message);
    throw new HttpError(401, message);
  }
  if (!response.ok) throw new HttpError(response.status, await errorText(response));
  return text ? response.text() : response.json();
}

let tokenChanged = null; // resolves when the user saves a token (the live stream waits on it after a 401)
let resolveTokenChanged = () => {};
function newTokenPromise() {
  tokenChanged = new Promise((resolve) => { resolveTokenChanged = resolve; });
}
newTokenPromise();

function askForToken(message) {
  const dialog = $("token-dialog");
  $("token-error").textContent = token() ? `The broker refused the saved token: ${message}` : "";
  if (!dialog.open) {
    dialog.showModal();
    $("token-input").focus();
  }
}

function setupTokenForm() {
  $("token-form").addEventListener("submit", (e) => {
    const value = $("token-input").value.trim();
    if (!value) { e.preventDefault(); return; }
    try { window.localStorage.setItem(TOKEN_KEY, value); } catch { /* private mode: kept for this page only */ }
    $("token-input").value = "";
    $("token-dialog").close();
    $("token-button").hidden = false;
    resolveTokenChanged();
    newTokenPromise();
    refreshAll();
  });
  $("token-clear").addEventListener("click", () => {
    try { window.localStorage.removeItem(TOKEN_KEY); } catch { /* nothing kept */ }
    $("token-button").hidden = true;
    $("token-error").textContent = "Token forgotten.";
  });
  $("token-button").addEventListener("click", () => askForToken(""));
  $("token-button").hidden = !token();
}

// --- carbon colours ---------------------------------------------------------------------------------

// Grid carbon intensity, g CO2e/kWh, to a colour: green (clean) through yellow to red (600 and above).
// The same stops as the legend's gradient in dashboard.css.
const CARBON_STOPS = [[0, 140, 65, 45], [150, 93, 65, 47], [300, 47, 80, 50], [450, 23, 80, 52], [600, 0, 72, 52]];
const UNKNOWN_COLOUR = "#6b7380";

function carbonColour(g) {
  if (g === null || g === undefined || !Number.isFinite(g)) return UNKNOWN_COLOUR;
  const v = Math.max(0, Math.min(600, g));
  for (let i = 1; i < CARBON_STOPS.length; i++) {
    const [x1, h1, s1, l1] = CARBON_STOPS[i];
    const [x0, h0, s0, l0] = CARBON_STOPS[i - 1];
    if (v <= x1) {
      const t = (v - x0) / (x1 - x0);
      return `hsl(${h0 + (h1 - h0) * t} ${s0 + (s1 - s0) * t}% ${l0 + (l1 - l0) * t}%)`;
    }
  }
  return "hsl(0 72% 52%)";
}

// --- state ------------------------------------------------------------------------------------------

const state = {
  sites: [],             // /v1/sites items, each with .view (what the page shows: carbon, prices, free GPUs)
  jobs: { running: [], queued: [], finished: [] },
  jobsById: new Map(),
  shownJobIds: new Set(),
  selected: null,        // job id whose decision is shown
  follow: true,          // the decision panel follows the latest placement until the user picks a job
  followedAt: 0,
  decision: null,
  worldPath: null,
  live: "connecting",
};

// --- sites: what routing sees -----------------------------------------------------------------------

/** Live signals from /metrics, for brokers whose /v1/sites does not carry ``signals`` yet. */
async function metricsSignals() {
  let text;
  try {
    text = await api("metrics", { text: true });
  } catch {
    return null;
  }
  const out = new Map();
  const get = (site) => {
    if (!out.has(site)) out.set(site, { carbon_g_per_kwh: null, usd_per_gpu_hour: {} });
    return out.get(site);
  };
  for (const line of text.split("\n")) {
    const m = line.match(/^(heliotrope_site_carbon_intensity_grams_per_kwh|heliotrope_site_price_usd_per_gpu_hour)\{([^}]*)\}\s+(\S+)/);
    if (!m) continue;
    const labels = Object.fromEntries([...m[2].matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)].map((x) => [x[1], x[2]]));
    const value = Number(m[3]);
    if (!labels.site || !Number.isFinite(value)) continue;
    if (m[1].includes("carbon")) get(labels.site).carbon_g_per_kwh = value;
    else if (labels.model) get(labels.site).usd_per_gpu_hour[labels.model] = value;
  }
  return out;
}

function siteView(site, fallback) {
  const status = site.status || {};
  const signals = site.signals || (fallback && fallback.get(site.name)) || null;
  const capacity = status.capacity && status.capacity.length
    ? status.capacity
    : (site.gpus || []).map((g) => ({ model: g.model, total_gpus: g.gpus_per_node * g.nodes, free_gpus: null }));
  const total = capacity.reduce((a, c) => a + (c.total_gpus || 0), 0);
  const free = capacity.some((c) => c.free_gpus === null) ? null : capacity.reduce((a, c) => a + (c.free_gpus || 0), 0);
  const prices = { ...(site.usd_per_gpu_hour || {}), ...((signals && signals.usd_per_gpu_hour) || {}) };
  const priceValues = Object.values(prices).filter(Number.isFinite);
  return {
    carbon: signals ? signals.carbon_g_per_kwh : null,
    prices,
    minPrice: priceValues.length ? Math.min(...priceValues) : null,
    maxPrice: priceValues.length ? Math.max(...priceValues) : null,
    capacity,
    total,
    free,
    health: status.health || "unknown",
    running: status.running_jobs ?? null,
    reason: status.reason || null,
    cordoned: Boolean(site.cordoned),
    cordonReason: site.cordon_reason || null,
  };
}

async function refreshSites() {
  const body = await api("v1/sites");
  const sites = body.items || [];
  const fallback = sites.some((x) => !x.signals) ? await metricsSignals() : null;
  for (const site of sites) site.view = siteView(site, fallback);
  state.sites = sites.sort((a, b) => a.name.localeCompare(b.name));
  renderSites();
}

function renderSites() {
  renderMap();
  renderSitesTable();
  renderStats();
}

function renderStats() {
  const sites = state.sites;
  const healthy = sites.filter((x) => x.view.health === "healthy").length;
  $("stat-sites").textContent = sites.length ? `${healthy}/${sites.length}` : "–";
  const total = sites.reduce((a, x) => a + x.view.total, 0);
  const free = sites.reduce((a, x) => a + (x.view.free ?? 0), 0);
  $("stat-gpus").textContent = sites.length ? `${free}/${total}` : "–";
  $("subtitle").textContent = `federated GPU job broker · ${sites.length} sites · ${BASE.host}`;
}

// --- map --------------------------------------------------------------------------------------------

// Equirectangular: K map units per degree; x from longitude -180, y from latitude 90 down. The view stops
// at 84° N and 58° S (Antarctica is left out). world.svg's path is in degrees (x = lon, y = -lat).
const K = 3;
const VIEW = { x: 0, y: (90 - 84) * K, w: 360 * K, h: (84 + 58) * K };
const px = (lon) => (lon + 180) * K;
const py = (lat) => (90 - lat) * K;

async function loadWorld() {
  try {
    const response = await fetch(new URL("world.svg", window.location.href), { cache: "no-cache" });
    const doc = new DOMParser().parseFromString(await response.text(), "image/svg+xml");
    const land = doc.getElementById("land");
    state.worldPath = land ? land.getAttribute("d") : null;
  } catch {
    state.worldPath = null;
  }
}

/** The subsolar point now: latitude = the sun's declination, longitude where it is solar noon (degrees). */
function subsolar(date = new Date()) {
  const start = Date.UTC(date.getUTCFullYear(), 0, 0);
  const day = (date.getTime() - start) / 86400000;
  const b = (2 * Math.PI * (day - 81)) / 365;
  const declination = 23.44 * Math.sin(b);
  const eotMinutes = 9.87 * Math.sin(2 * b) - 7.53 * Math.cos(b) - 1.5 * Math.sin(b);
  const utcHours = date.getUTCHours() + date.getUTCMinutes() / 60 + date.getUTCSeconds() / 3600;
  let lon = (12 - utcHours - eotMinutes / 60) * 15;
  lon = ((lon + 540) % 360) - 180;
  return { lat: declination, lon };
}

/** The night side as a polygon in map units: the terminator, closed over the pole in darkness. */
function nightPath() {
  const sun = subsolar();
  const dec = Math.abs(sun.lat) < 0.1 ? 0.1 * Math.sign(sun.lat || 1) : sun.lat;
  const rad = Math.PI / 180;
  const points = [];
  for (let lon = -180; lon <= 180; lon += 2) {
    const lat = Math.atan(-Math.cos((lon - sun.lon) * rad) / Math.tan(dec * rad)) / rad;
    points.push(`${px(lon).toFixed(1)} ${py(lat).toFixed(1)}`);
  }
  const pole = dec > 0 ? py(-90) : py(90); // sun north of the equator: the south pole is dark
  return `M${px(-180)} ${pole}L${points.join("L")}L${px(180)} ${pole}Z`;
}

function renderMap() {
  const svg = $("map");
  svg.setAttribute("viewBox", `${VIEW.x} ${VIEW.y} ${VIEW.w} ${VIEW.h}`);
  svg.replaceChildren();
  const graticule = [];
  for (let lon = -150; lon <= 150; lon += 30) graticule.push(`M${px(lon)} ${VIEW.y}V${VIEW.y + VIEW.h}`);
  for (let lat = -30; lat <= 60; lat += 30) if (lat !== 0) graticule.push(`M0 ${py(lat)}H${VIEW.w}`);
  svg.append(s("path", { class: "graticule", d: graticule.join("") }));
  svg.append(s("path", { class: "graticule equator", d: `M0 ${py(0)}H${VIEW.w}` }));
  if (state.worldPath) {
    svg.append(s("path", { class: "land", d: state.worldPath, transform: `translate(${180 * K} ${90 * K}) scale(${K})` }));
  }
  svg.append(s("path", { class: "night", d: nightPath() }));

  const chosen = state.decision && state.decision.outcome === "placed" ? state.decision.site : null;
  const sites = state.sites.filter((x) => Number.isFinite(x.latitude) && Number.isFinite(x.longitude));
  const radius = (x) => 6 + Math.sqrt(x.view.total || 1) * 1.1;
  const markers = s("g", { class: "markers" });
  const labels = s("g", { class: "labels" });
  svg.append(markers, labels);

  // Circles first, so that labels can be kept off every one of them.
  const obstacles = [];
  for (const site of sites) {
    const cx = px(site.longitude);
    const cy = py(site.latitude);
    const r = radius(site);
    const used = site.view.free === null || !site.view.total ? 0 : 1 - site.view.free / site.view.total;
    const colour = carbonColour(site.view.carbon);
    const g = s("g", {
      class: `site${site.name === chosen ? " chosen" : ""}`,
      dataset: { site: site.name, health: site.view.health },
    },
    s("title", {}, `${site.name}: ${site.region}, grid ${site.grid_zone}`),
    s("circle", { class: "halo", cx, cy, r: r + 4, stroke: colour }),
    s("circle", {
      class: "busy", cx, cy, r: r + 4, fill: "none", stroke: "#e6edf3", "stroke-width": 2.5, pathLength: 100,
      "stroke-dasharray": `${(used * 100).toFixed(1)} 100`, transform: `rotate(-90 ${cx} ${cy})`, opacity: used > 0 ? 0.9 : 0,
    }),
    s("circle", { class: "dot", cx, cy, r, fill: colour }));
    markers.append(g);
    obstacles.push({ x: cx - r - 5, y: cy - r - 5, w: 2 * r + 10, h: 2 * r + 10, site: site.name });
  }

  // Labels, placed greedily: right, left, above, below the circle, then further out, on a spot that
  // overlaps no circle and no label placed before.
  const placed = [];
  for (const site of sites) {
    const cx = px(site.longitude);
    const cy = py(site.latitude);
    const r = radius(site);
    const v = site.view;
    const carbon = v.carbon === null || v.carbon === undefined ? "carbon unknown" : `${num(v.carbon, 0)} g/kWh`;
    const price = v.minPrice === null ? "no price"
      : v.minPrice === v.maxPrice ? `$${v.minPrice.toFixed(2)}/GPU-h` : `$${v.minPrice.toFixed(2)}–${v.maxPrice.toFixed(2)}/GPU-h`;
    const free = v.free === null ? `${v.total} GPUs` : `${v.free}/${v.total} GPUs free`;
    const label = s("g", { class: "label" },
      s("rect", { x: 0, y: 0, width: 10, height: 10 }),
      s("text", { x: 9, y: 19 },
        s("tspan", { class: "name" }, site.name), "  ",
        s("tspan", { class: "time" }, localTime(site.timezone))),
      s("text", { x: 9, y: 37, class: "sub" }, `${carbon} · ${price}`),
      s("text", { x: 9, y: 54, class: "sub" }, free));
    labels.append(label);
    const texts = [...label.querySelectorAll("text")].map((t) => t.getBBox());
    const w = Math.ceil(Math.max(...texts.map((b) => b.x + b.width))) + 9;
    const hgt = 62;
    const spot = placeLabel(cx, cy, r, w, hgt, obstacles.filter((o) => o.site !== site.name), placed);
    placed.push(spot);
    label.firstChild.setAttribute("width", w);
    label.firstChild.setAttribute("height", hgt);
    label.setAttribute("transform", `translate(${spot.x} ${spot.y})`);
    const [lx, ly] = nearestPoint(cx, cy, spot);
    const d = Math.hypot(lx - cx, ly - cy);
    if (d > r + 12) {
      const ex = cx + ((lx - cx) / d) * (r + 4);
      const ey = cy + ((ly - cy) / d) * (r + 4);
      labels.insertBefore(s("line", { class: "leader", x1: ex, y1: ey, x2: lx, y2: ly }), labels.firstChild);
    }
    label.dataset.site = site.name;
    if (site.name === chosen) label.classList.add("chosen");
  }
}

function overlaps(a, b) {
  return a.x < b.x + b.w && b.x < a.x + a.w && a.y < b.y + b.h && b.y < a.y + a.h;
}

function placeLabel(cx, cy, r, w, hgt, circles, placed) {
  const candidates = [];
  for (const far of [0, 34, 70, 110]) {
    const gap = r + 8 + far;
    candidates.push(
      { x: cx + gap, y: cy - hgt / 2 },
      { x: cx - gap - w, y: cy - hgt / 2 },
      { x: cx - w / 2, y: cy - gap - hgt },
      { x: cx - w / 2, y: cy + gap },
      { x: cx + gap * 0.7, y: cy - gap * 0.7 - hgt },
      { x: cx + gap * 0.7, y: cy + gap * 0.7 },
      { x: cx - gap * 0.7 - w, y: cy - gap * 0.7 - hgt },
      { x: cx - gap * 0.7 - w, y: cy + gap * 0.7 },
    );
  }
  let best = null;
  let bestCost = Infinity;
  for (const [i, c] of candidates.entries()) {
    const box = { x: c.x, y: c.y, w, h: hgt };
    let cost = i * 0.01; // prefer the earlier, nearer spots
    if (box.x < VIEW.x + 2 || box.y < VIEW.y + 2 || box.x + w > VIEW.x + VIEW.w - 2 || box.y + hgt > VIEW.y + VIEW.h - 2) cost += 100;
    for (const o of [...circles, ...placed]) if (overlaps(box, o)) cost += 10;
    if (cost < bestCost) { best = box; bestCost = cost; }
    if (cost < 1) break;
  }
  return best;
}

function nearestPoint(x, y, box) {
  return [Math.max(box.x, Math.min(x, box.x + box.w)), Math.max(box.y, Math.min(y, box.y + box.h))];
}

// --- sites table ------------------------------------------------------------------------------------

function renderSitesTable() {
  const tbody = $("sites-table").querySelector("tbody");
  tbody.replaceChildren(...state.sites.map((site) => {
    const v = site.view;
    const models = Object.keys(v.prices).sort();
    return h("tr", { dataset: { site: site.name } },
      h("td", { class: "site" }, h("b", {}, site.name), h("span", { class: "region" }, `${site.region} · ${site.grid_zone}`)),
      h("td", { class: "mono" }, localTime(site.timezone, true), h("span", { class: "region" }, site.timezone)),
      h("td", { class: "num" }, h("span", { class: "carbon" },
        h("span", { class: "swatch", style: `background:${carbonColour(v.carbon)}` }),
        v.carbon === null || v.carbon === undefined ? "–" : num(v.carbon, 0))),
      h("td", {}, h("div", { class: "prices" }, models.map((m) =>
        h("span", {}, h("span", { class: "model" }, m), `$${num(v.prices[m], 2)}`)))),
      h("td", {}, h("div", { class: "gpus" }, v.capacity.map((c) => h("span", { class: "gpu-row" },
        h("span", { class: "model" }, c.model),
        h("span", { class: "meter" }, h("span", {
          style: `width:${c.total_gpus && c.free_gpus !== null ? (100 * c.free_gpus) / c.total_gpus : 0}%`,
        })),
        `${c.free_gpus ?? "?"}/${c.total_gpus}`)))),
      h("td", { class: "num" }, v.running ?? "–"),
      h("td", { title: v.reason || "" }, h("span", { class: `pill ${v.health}` }, v.health),
        v.cordoned ? h("span", { class: "pill cordoned", title: v.cordonReason || "cordoned by its operator" },
          "cordoned") : null));
  }));
}

// --- queue ------------------------------------------------------------------------------------------

const ACTIVE = ["dispatching", "admitted", "running"];
const FINISHED = new Set(["succeeded", "failed", "cancelled"]);
const SHOW = { queued: 12, running: 16, finished: 6 };

async function refreshJobs() {
  const page = (q) => api(`v1/jobs?${q}`).then((b) => b.items || []);
  const [queued, recent, ...active] = await Promise.all([
    page("state=queued&limit=200"),
    page("limit=40"),
    ...ACTIVE.map((st) => page(`state=${st}&limit=200`)),
  ]);
  const byNewest = (a, b) => (b.updated_at || "").localeCompare(a.updated_at || "");
  state.jobs.running = active.flat().sort(byNewest);
  state.jobs.queued = queued.sort((a, b) => (a.created_at || "").localeCompare(b.created_at || ""));
  state.jobs.finished = recent.filter((j) => FINISHED.has(j.state)).sort(byNewest);
  for (const j of [...queued, ...recent, ...state.jobs.running]) state.jobsById.set(j.id, j);
  renderQueue();
  nameJobRefs();
  followLatest();
}

function renderQueue() {
  const fresh = (id) => state.shownJobIds.size > 0 && !state.shownJobIds.has(id);
  const shown = new Set();
  for (const [key, list] of Object.entries(state.jobs)) {
    const items = list.slice(0, SHOW[key]).map((job) => {
      shown.add(job.id);
      return jobRow(job, fresh(job.id));
    });
    if (list.length > SHOW[key]) items.push(h("li", { class: "more" }, `and ${list.length - SHOW[key]}${list.length >= 200 ? "+" : ""} more`));
    if (!list.length) items.push(h("li", { class: "more" }, key === "finished" ? "none yet" : `no ${key} jobs`));
    $(`jobs-${key}`).replaceChildren(...items);
  }
  state.shownJobIds = shown;
  $("count-running").textContent = state.jobs.running.length;
  $("count-queued").textContent = state.jobs.queued.length;
  $("stat-running").textContent = state.jobs.running.length;
  $("stat-queued").textContent = state.jobs.queued.length;
}

function jobRow(job, isFresh) {
  const spec = job.spec || {};
  const meta = [job.id, gpusText(spec), `${ago(job.state === "queued" ? job.created_at : job.updated_at)} ago`];
  const classes = ["job", job.id === state.selected ? "selected" : "", isFresh ? "fresh" : ""].filter(Boolean).join(" ");
  return h("li", {
    class: classes, tabindex: 0, dataset: { jobId: job.id, state: job.state },
    title: job.reason || "", onclick: () => selectJob(job.id, true),
  },
  h("span", { class: "title" }, spec.name || job.id, " ", h("span", { class: "tenant" }, spec.tenant ? `· ${spec.tenant}` : "")),
  h("span", { class: "meta" }, job.state === "queued" && job.reason ? job.reason : meta.join(" · ")),
  h("span", { class: "where" }, h("span", { class: `pill ${job.state}` }, job.state),
    job.site ? h("span", { class: "site" }, job.site) : null));
}

// --- decision ---------------------------------------------------------------------------------------

// Each scorer's raw units and a colour for its share of the score (policies/scorers/).
const SCORERS = {
  carbon: { unit: "kg CO₂e", colour: "#3fb950", raw: (v) => (Math.abs(v) < 1 ? `${num(v * 1000)} g CO₂e` : `${num(v)} kg CO₂e`) },
  cost: { unit: "$", colour: "#f2b134", raw: (v) => `$${num(v)}` },
  latency: { unit: "ms", colour: "#58a6ff", raw: (v) => `${num(v)} ms` },
  free_gpus: { unit: "GPUs", colour: "#d2a8ff", raw: (v) => `${num(v)} free` },
  least_loaded: { unit: "share free", colour: "#a371f7", raw: (v) => `${num(v * 100, 0)}% free` },
  follow_sun_offpeak: { unit: "share off-peak", colour: "#ffa657", raw: (v) => `${num(v * 100, 0)}% off-peak` },
  follow_sun_solar: { unit: "sun", colour: "#ffdf5d", raw: (v) => `sun ${num(v)}` },
  telemetry: { unit: "penalty", colour: "#768390", raw: (v) => `penalty ${num(v)}` },
  carbon_now: { unit: "g/kWh", colour: "#56d364", raw: (v) => `${num(v)} g/kWh` },
  cheapest: { unit: "$/GPU-h", colour: "#e3b341", raw: (v) => `$${num(v)}/GPU-h` },
  round_robin: { unit: "steps", colour: "#8b949e", raw: (v) => `step ${num(v)}` },
  spillover: { unit: "position", colour: "#8b949e", raw: (v) => `#${num(v)}` },
};
const scorerInfo = (name) => SCORERS[name] || { unit: "", colour: "#8b949e", raw: (v) => num(v) };

async function selectJob(id, byUser) {
  if (byUser) {
    state.follow = false;
    $("follow-latest").hidden = false;
  }
  state.selected = id;
  for (const li of document.querySelectorAll("li.job")) li.classList.toggle("selected", li.dataset.jobId === id);
  await loadDecision();
}

async function loadDecision() {
  const id = state.selected;
  if (!id) return;
  let decision = null;
  let problem = null;
  try {
    decision = await api(`v1/jobs/${encodeURIComponent(id)}/decision`);
  } catch (e) {
    problem = e.status === 404 ? e.message : `could not load the decision: ${e.message}`;
  }
  if (id !== state.selected) return; // another job was picked meanwhile
  let job = state.jobsById.get(id);
  if (!job) {
    try { job = await api(`v1/jobs/${encodeURIComponent(id)}`); state.jobsById.set(id, job); } catch { /* shown without it */ }
  }
  state.decision = decision;
  renderDecision(job, decision, problem);
  renderMap();
}

function renderDecision(job, d, problem) {
  const body = $("decision-body");
  $("decision-mode").textContent = state.follow ? "following the latest placement" : "";
  const spec = (job && job.spec) || {};
  const head = h("div", { class: "decision-summary" },
    h("span", { class: "job-name" }, spec.name || state.selected),
    spec.tenant ? h("span", { class: "hint" }, spec.tenant) : null,
    h("span", { class: "mono hint" }, state.selected),
    job ? h("span", { class: `pill ${job.state}` }, job.state) : null,
    job ? h("span", { class: "hint" }, gpusText(spec)) : null,
    d ? h("span", { class: `pill ${d.outcome}` }, d.outcome) : null,
    d ? h("span", { class: "when" }, `attempt ${d.attempt}, decided ${clockTime(d.decided_at)}`) : null,
    h("span", { class: "summary" }, d ? d.summary : problem));
  if (!d) {
    body.replaceChildren(head);
    return;
  }
  const feasible = d.sites.filter((x) => x.feasible).sort((a, b) => (b.score ?? -Infinity) - (a.score ?? -Infinity));
  const rejected = d.sites.filter((x) => !x.feasible);
  const scorers = [];
  const weights = new Map();
  for (const v of feasible) for (const t of v.terms) if (!weights.has(t.scorer)) { scorers.push(t.scorer); weights.set(t.scorer, t.weight); }
  const maxScore = Math.max(1e-9, [...weights.values()].reduce((a, w) => a + w, 0));

  const parts = [head];
  if (feasible.length) {
    parts.push(h("h3", {}, `feasible sites, best first (${feasible.length} of ${d.sites.length})`));
    parts.push(h("div", { class: "table-wrap" }, h("table", { class: "terms", id: "decision-terms" },
      h("thead", {}, h("tr", {},
        h("th", {}, "site"),
        scorers.map((name) => h("th", { class: "scorer", dataset: { scorer: name } }, name,
          h("span", { class: "weight" }, `× ${weight(weights.get(name))} · ${scorerInfo(name).unit}`))),
        h("th", { class: "num" }, "score"),
        h("th", {}, ""))),
      h("tbody", {}, feasible.map((v) => {
        const terms = new Map(v.terms.map((t) => [t.scorer, t]));
        const isChosen = d.outcome === "placed" && v.site === d.site;
        return h("tr", { class: isChosen ? "chosen" : "", dataset: { site: v.site } },
          h("td", {}, h("b", {}, v.site), isChosen ? h("span", { class: "chosen-mark" }, "chosen") : null,
            v.passed_over ? h("div", { class: "reason passed-over" }, `turned away now: ${v.passed_over}`) : null),
          scorers.map((name) => {
            const t = terms.get(name);
            if (!t) return h("td", { class: "term" }, "–");
            return h("td", { class: "term", dataset: { scorer: name }, title: `${name}: raw ${t.raw}, normalised ${t.normalised}, weight ${t.weight}, weighted ${t.weighted}` },
              h("span", { class: "weighted" }, num(t.weighted, 3)),
              h("span", { class: "calc" }, `${num(t.normalised, 2)} × ${weight(t.weight)}`),
              h("span", { class: "raw" }, t.raw === null ? "raw –" : scorerInfo(name).raw(t.raw)));
          }),
          h("td", { class: "score" }, num(v.score, 3)),
          h("td", {}, h("span", { class: "score-bar", title: "each scorer's weighted term, of the most a site could score" },
            v.terms.filter((t) => t.weighted > 0).map((t) => h("span", {
              style: `width:${(100 * t.weighted) / maxScore}%;background:${scorerInfo(t.scorer).colour}`,
            })))));
      })))));
    parts.push(h("div", { class: "scorer-key" },
      h("span", {}, "each cell: weighted term = normalised (0..1, 1 best) × weight; raw value in the scorer's units"),
      scorers.map((name) => h("span", {}, h("span", { class: "swatch", style: `background:${scorerInfo(name).colour}` }), name))));
  }
  if (d.outcome === "deferred" && d.deferred_until) {
    parts.push(h("p", { class: "empty" }, `held until ${new Date(d.deferred_until).toLocaleString("en-GB")} for a cleaner or cheaper window`));
  }
  if (rejected.length) {
    parts.push(h("div", { class: "rejected", id: "decision-rejected" },
      h("h3", {}, `rejected sites (${rejected.length})`),
      h("ul", {}, rejected.map((v) => h("li", { dataset: { site: v.site } },
        h("span", { class: "site" }, v.site),
        h("span", {}, v.reasons.map((r) => {
          const i = r.indexOf(": ");
          return h("div", { class: "reason" }, i > 0 ? [h("code", {}, r.slice(0, i)), ` ${r.slice(i + 2)}`] : r);
        })))))));
  }
  if (job && job.attempt > 0) parts.push(logPanel(job));
  body.replaceChildren(...parts);
}

const LOG_TAIL = 200; // lines of a job's log the panel shows

/** A job's log (GET /v1/jobs/{id}/logs: of its latest attempt a site admitted), read when the panel is opened,
 * and again each time it is opened: a closed panel fetches nothing. */
function logPanel(job) {
  const pre = h("pre", { class: "log", id: "decision-log-text" }, "");
  const panel = h("details", { class: "log-panel", id: "decision-log" },
    h("summary", {}, `log: its last ${LOG_TAIL} lines, as its site gives them`), pre);
  panel.addEventListener("toggle", async () => {
    if (!panel.open) return;
    pre.textContent = "reading the log…";
    pre.dataset.state = "loading";
    try {
      const text = await api(`v1/jobs/${encodeURIComponent(job.id)}/logs?tail=${LOG_TAIL}`, { text: true });
      pre.textContent = text || "(the log is empty)";
      pre.dataset.state = "ok";
    } catch (e) {
      pre.textContent = e.message;
      pre.dataset.state = "error";
    }
  });
  return panel;
}

/** In follow mode, show the newest placed job's decision (at most every 8 s, so a busy wall stays readable). */
function followLatest(jobId) {
  if (!state.follow) return;
  if (Date.now() - state.followedAt < 8000 && state.selected) return;
  const id = jobId || (state.jobs.running[0] || state.jobs.finished.find((j) => j.site) || {}).id;
  if (!id || id === state.selected) return;
  state.followedAt = Date.now();
  selectJob(id, false);
}

// --- carbon headline --------------------------------------------------------------------------------

async function refreshCarbon() {
  const box = $("carbon");
  let c;
  try {
    c = await api("v1/carbon");
  } catch (e) {
    if (e.status === 401) return;
    box.dataset.state = "unavailable";
    $("carbon-saved").textContent = e.status === 404 ? "not available" : "–";
    $("carbon-unit").textContent = "";
    $("carbon-pct").textContent = "";
    $("carbon-detail").textContent = e.status === 404 ? "this broker does not account for carbon" : e.message;
    return;
  }
  box.dataset.state = "ok";
  const saved = grams(c.saved_grams);
  $("carbon-saved").textContent = saved.value;
  $("carbon-unit").textContent = `${saved.unit} CO₂e`;
  const fraction = Number.isFinite(c.saved_fraction) ? c.saved_fraction
    : c.agnostic_grams > 0 ? c.saved_grams / c.agnostic_grams : null;
  const emitted = grams(c.grams);
  const agnostic = grams(c.agnostic_grams);
  const moved = Number.isFinite(c.moved_jobs) ? `${c.moved_jobs} of ${c.jobs} jobs moved` : `${c.jobs} jobs`;
  $("carbon-pct").textContent = fraction === null || c.jobs === 0 ? ""
    : Math.abs(fraction) < 0.0005 ? "0%" : fraction > 0 ? `−${num(100 * fraction, 1)}%` : `+${num(-100 * fraction, 1)}%`;
  $("carbon-detail").textContent = c.jobs
    ? `${emitted.value} ${emitted.unit} emitted instead of ${agnostic.value} ${agnostic.unit} · ${moved} · ${num(c.energy_kwh)} kWh`
    : "no jobs placed yet";
  box.title = c.baseline || box.title;
}

// --- usage by tenant ---------------------------------------------------------------------------------

/** GPU-hours, energy, cost and emissions per tenant over the last 30 days (GET /v1/usage), for chargeback. A
 * broker of an earlier release (404) or a token that may not read it (403: an operator's) hides the card. */
async function refreshUsage() {
  const card = $("usage");
  let u;
  try {
    u = await api("v1/usage?by=tenant");
  } catch (e) {
    if (e.status === 401) return;
    card.dataset.state = "unavailable";
    card.hidden = e.status === 404 || e.status === 403;
    $("usage-note").textContent = e.message;
    return;
  }
  card.hidden = false;
  card.dataset.state = "ok";
  const when = (t) => t.slice(0, 16).replace("T", " ");
  $("usage-window").textContent = `${when(u.from)} to ${when(u.to)} UTC`;
  const cell = (v, digits) => h("td", { class: "num" }, v === undefined || v === null ? "–" : num(v, digits));
  const row = (item, name, cls) => h("tr", { "data-tenant": name, class: cls },
    h("td", {}, name), cell(item.gpu_hours), cell(item.attempts, 0), cell(item.energy_kwh),
    cell(item.cost_usd, 2), cell(item.co2e_kg));
  const body = $("usage-table").querySelector("tbody");
  body.replaceChildren(...u.items.map((i) => row(i, i.tenant, "")),
    ...(u.items.length ? [row(u.total, "total", "total")] : []));
  // (each note names a zone whose intensity could not be had: the zones here, the whole notes in the title)
  const zones = (u.notes || []).map((n) => (n.match(/zone ([^:]+):/) || [])[1]).filter(Boolean);
  // (and the others in words: GPU-hours charged at today's price, or held on a model nobody recorded)
  const others = (u.notes || []).filter((n) => !/zone [^:]+:/.test(n))
    .map((n) => n.replace(/^[a-z_, ]+: /, "").replace(/ \(.*?\)/g, ""));
  const note = $("usage-note");
  note.textContent = !u.items.length ? "no GPU time used in the window"
    : [zones.length ? `kg CO₂e unknown where GPUs ran in ${zones.join(", ")}: no intensity for those hours` : "",
      ...others].filter(Boolean).join("; ");
  note.title = (u.notes || []).join("\n");
}

// --- events log -------------------------------------------------------------------------------------

const MAX_EVENTS = 150;

function jobName(id) {
  const job = state.jobsById.get(id);
  return job && job.spec ? `${job.spec.tenant}/${job.spec.name}` : null;
}

/** A job in the log: its tenant/name when the page knows the job, else its id until the next refresh. */
function jobRef(id) {
  const name = jobName(id);
  return h("span", { class: `jobref${name ? "" : " unnamed"}`, title: id, dataset: { jobId: id }, onclick: () => selectJob(id, true) }, name || id);
}

function nameJobRefs() {
  for (const el of document.querySelectorAll(".jobref.unnamed")) {
    const name = jobName(el.dataset.jobId);
    if (name) {
      el.textContent = name;
      el.classList.remove("unnamed");
    }
  }
}

function logEvent(type, data, text) {
  const list = $("events");
  const at = data && data.at ? clockTime(data.at) : clockTime();
  list.prepend(h("li", { class: "fresh", dataset: { type } }, h("span", { class: "at" }, at), h("span", { class: `type ${type}` }, type), h("span", { class: "text" }, text)));
  while (list.children.length > MAX_EVENTS) list.lastElementChild.remove();
}

function describe(type, d) {
  switch (type) {
    case "transition":
      return [jobRef(d.job_id), ` ${d.previous ? `${d.previous} → ` : ""}${d.state}${d.site ? ` on ${d.site}` : ""}`,
        d.reason && d.state !== "running" ? ` (${d.reason})` : ""];
    case "decision":
    case "deferral":
      return [jobRef(d.job_id), `: ${d.summary || d.outcome || ""}`];
    case "preemption":
      return [jobRef(d.job_id), ` preempted on ${d.site}${d.reason ? `: ${d.reason}` : ""}`];
    case "site":
      return [h("b", {}, d.site), ` ${d.previous ? `${d.previous} → ` : ""}${d.health}${d.reason ? `: ${d.reason}` : ""}`];
    case "gap":
      return "some events were no longer held by the broker; the page was refreshed";
    case "lost":
      return "this page fell behind the stream; reconnecting";
    default:
      return JSON.stringify(d);
  }
}

const soonJobs = debounce(() => refreshJobs().catch(noteError), 300);
// Sites report capacity on their own beat (about a second after a job starts), so after a burst of events
// the sites are read twice: soon, and once more when their reports have caught up.
const sitesSoon = debounce(() => refreshSites().catch(noteError), 1000);
const sitesSettled = debounce(() => refreshSites().catch(noteError), 3000);
const soonSites = () => { sitesSoon(); sitesSettled(); };
const soonCarbon = debounce(() => refreshCarbon(), 2000);

function onEvent(type, data) {
  if (["transition", "decision", "deferral", "preemption", "site", "gap", "lost"].includes(type)) logEvent(type, data, describe(type, data));
  switch (type) {
    case "transition":
      soonJobs();
      soonSites();
      break;
    case "decision":
    case "deferral":
      soonJobs();
      soonCarbon();
      if (data.job_id === state.selected) loadDecision();
      else if (type === "decision" && data.outcome === "placed") followLatest(data.job_id);
      break;
    case "preemption":
      soonJobs();
      soonSites();
      break;
    case "site":
      soonSites();
      break;
    case "gap":
      refreshAll();
      break;
    default:
      break;
  }
}

let lastError = "";
function noteError(e) {
  if (e && e.status === 401) return;
  const message = `cannot reach the broker: ${e && e.message ? e.message : e}`;
  if (message !== lastError) logEvent("note", null, message);
  lastError = message;
}

// --- live stream (server-sent events over fetch) ----------------------------------------------------

function setLive(mode, text) {
  state.live = mode;
  $("live").dataset.state = mode;
  $("live-text").textContent = text || mode;
}

/** Split a growing text buffer into SSE events: returns the rest that is not yet a whole line. */
function parseSse(buffer, pending, dispatch) {
  let rest = buffer;
  for (;;) {
    const m = rest.match(/\r\n|\r|\n/);
    if (!m) break;
    if (m[0] === "\r" && m.index === rest.length - 1) break; // maybe the first half of \r\n
    const line = rest.slice(0, m.index);
    rest = rest.slice(m.index + m[0].length);
    if (line === "") {
      if (pending.data.length) dispatch(pending.event || "message", pending.data.join("\n"), pending.id);
      pending.event = "";
      pending.data = [];
      continue;
    }
    if (line.startsWith(":")) continue; // a comment: keepalive
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "event") pending.event = value;
    else if (field === "data") pending.data.push(value);
    else if (field === "id" && !value.includes("\0")) pending.id = value;
    else if (field === "retry" && /^\d+$/.test(value)) pending.retry = Number(value);
  }
  return rest;
}

let streamAbort = null;

async function followEvents() {
  let lastEventId = "";
  let backoff = 1000;
  for (;;) {
    const controller = new AbortController();
    streamAbort = controller;
    let watchdog = null;
    const kick = () => {
      clearTimeout(watchdog);
      watchdog = setTimeout(() => controller.abort(), 45000); // the broker sends a keepalive every 15 s
    };
    try {
      const sent = token();
      const headers = { Accept: "text/event-stream", ...authHeaders() };
      if (lastEventId) headers["Last-Event-ID"] = lastEventId;
      kick();
      const response = await fetch(new URL("v1/events", BASE), { headers, cache: "no-store", signal: controller.signal });
      if (response.status === 401) {
        clearTimeout(watchdog);
        if (token() !== sent) continue; // refused a token the user has since replaced: try the new one
        setLive("reconnecting", "needs a token");
        askForToken(await errorText(response));
        await tokenChanged;
        continue;
      }
      if (response.status === 404) {
        clearTimeout(watchdog);
        setLive("polling");
        $("events-hint").textContent = "this broker has no event stream; polling every 5 s";
        return false;
      }
      if (!response.ok || !response.body) throw new HttpError(response.status, await errorText(response));
      setLive("live");
      $("events-hint").textContent = "";
      if (backoff > 1000) refreshAll(); // we were away: catch up on what the stream did not replay
      backoff = 1000;
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      const pending = { event: "", data: [], id: lastEventId, retry: null };
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        kick();
        buffer = parseSse(buffer + value, pending, (type, data, id) => {
          if (id) lastEventId = id;
          let parsed = {};
          try { parsed = JSON.parse(data); } catch { parsed = { text: data }; }
          onEvent(type, parsed);
        });
        if (pending.retry) { backoff = pending.retry; pending.retry = null; }
      }
    } catch (e) {
      if (!(e && e.name === "AbortError")) noteError(e);
    } finally {
      clearTimeout(watchdog);
    }
    setLive("reconnecting");
    await sleep(backoff + Math.random() * 500);
    backoff = Math.min(backoff * 2, 30000);
  }
}

// --- refresh scheduling -----------------------------------------------------------------------------

/** Who the saved token belongs to, on the token button (brokers without /v1/whoami: just "token"). */
async function refreshWhoami() {
  if (!token()) return;
  try {
    const who = await api("v1/whoami");
    $("token-button").textContent = `${who.name} (${who.role})`;
    $("token-button").title = "change or forget the token";
  } catch {
    $("token-button").textContent = "token";
  }
}

function refreshAll() {
  return Promise.all([
    refreshWhoami(),
    refreshSites().catch(noteError),
    refreshJobs().catch(noteError),
    refreshCarbon(),
    refreshUsage().catch(noteError),
    state.selected ? loadDecision() : null,
  ]);
}

/** Run fn every ms (or every liveMs while the stream is live), one at a time. */
function every(fn, ms, liveMs = ms) {
  const loop = async () => {
    try { await fn(); } catch (e) { noteError(e); }
    setTimeout(loop, state.live === "live" ? liveMs : ms);
  };
  setTimeout(loop, state.live === "live" ? liveMs : ms);
}

function tick() {
  const now = new Date();
  $("clock").textContent = `${now.toISOString().slice(11, 19)} UTC`;
}

// --- boot -------------------------------------------------------------------------------------------

async function boot() {
  setupTokenForm();
  $("follow-latest").addEventListener("click", () => {
    state.follow = true;
    state.followedAt = 0;
    $("follow-latest").hidden = true;
    followLatest();
  });
  tick();
  setInterval(tick, 1000);
  await loadWorld();
  renderMap();
  await refreshAll();
  document.body.dataset.ready = "true";
  every(refreshSites, 10000, 30000);
  every(refreshJobs, 5000, 30000);
  every(refreshCarbon, 15000, 30000);
  every(refreshUsage, 60000);
  setInterval(() => { renderMap(); renderSitesTable(); }, 30000); // local times and the night side move on
  followEvents();
}

window.addEventListener("DOMContentLoaded", boot);
