#!/usr/bin/env python3
"""Make the dashboard's world map, ``broker/static/world.svg``, from Natural Earth's 110 m land polygons.

Input: ``land-110m.json`` from the npm package ``world-atlas`` (version 2; TopoJSON, quantized and
delta-encoded, longitude and latitude in degrees). Fetch it once with::

    cd /tmp && npm pack world-atlas@2 && tar xzf world-atlas-2.*.tgz    # gives /tmp/package/land-110m.json
    python3 scripts/make-world-map.py /tmp/package/land-110m.json

Output: one SVG path, ``<path id="land" d="...">``, in the equirectangular projection (x = longitude,
y = -latitude, in degrees; viewBox -180 -90 360 180), every point rounded to 0.1 degree and repeated points
dropped; rings that cross the antimeridian are drawn twice, once on each side, and the viewBox clips them;
Antarctica is left out (the sites' map stops at 60 degrees south). The dashboard reads the path and draws
its sites on the same coordinates. Standard library only.

Provenance and licences: Natural Earth (public domain) via world-atlas (ISC, Mike Bostock); see
``broker/static/README.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "broker" / "static" / "world.svg"


def decode_arcs(topology: dict) -> list[list[tuple[float, float]]]:
    """Every arc as absolute (longitude, latitude) points: undo the delta encoding, then the quantization."""
    transform = topology.get("transform")
    arcs = []
    for arc in topology["arcs"]:
        if transform is None:
            arcs.append([(float(x), float(y)) for x, y, *_ in arc])
            continue
        (kx, ky), (dx, dy) = transform["scale"], transform["translate"]
        x = y = 0
        points = []
        for qx, qy, *_ in arc:
            x += qx
            y += qy
            points.append((x * kx + dx, y * ky + dy))
        arcs.append(points)
    return arcs


def ring(arcs: list[list[tuple[float, float]]], indices: list[int]) -> list[tuple[float, float]]:
    """One closed ring from its arc indices; ``~i`` (negative) is arc ``i`` reversed. Arcs share end points,
    so each arc after the first starts at the previous one's last point, which is not repeated."""
    points: list[tuple[float, float]] = []
    for i in indices:
        arc = arcs[i] if i >= 0 else arcs[~i][::-1]
        points.extend(arc[1:] if points else arc)
    return points


def polygons(topology: dict, name: str) -> list[list[list[int]]]:
    """The polygons (lists of rings of arc indices) of the object ``name``, whatever its geometry types."""
    out: list[list[list[int]]] = []

    def walk(geometry: dict) -> None:
        kind = geometry.get("type")
        if kind == "GeometryCollection":
            for g in geometry["geometries"]:
                walk(g)
        elif kind == "Polygon":
            out.append(geometry["arcs"])
        elif kind == "MultiPolygon":
            out.extend(geometry["arcs"])

    walk(topology["objects"][name])
    return out


def unwrap(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The ring with continuous longitudes: a step across the antimeridian (more than 180 degrees) becomes
    the short way round, so the ring may leave -180..180. A ring around a pole (Antarctica) does not come
    back to its first longitude; it is closed along the pole's parallel."""
    out = [points[0]]
    for lon, lat in points[1:]:
        prev = out[-1][0]
        lon += 360 * round((prev - lon) / 360)
        out.append((lon, lat))
    turn = out[-1][0] - out[0][0]
    if abs(turn) > 180:
        pole = -90.0 if sum(lat for _, lat in out) < 0 else 90.0
        out += [(out[-1][0], pole), (out[0][0], pole)]
    return out


def copies(points: list[tuple[float, float]]) -> list[list[tuple[float, float]]]:
    """The ring, and where it crosses the map's edge, its copy shifted by 360 degrees to show the other part
    (the SVG's viewBox clips both at -180 and 180)."""
    lons = [lon for lon, _ in points]
    out = [points]
    if min(lons) < -180:
        out.append([(lon + 360, lat) for lon, lat in points])
    if max(lons) > 180:
        out.append([(lon - 360, lat) for lon, lat in points])
    return out


def path_data(topology: dict, name: str = "land", precision: int = 1, south: float = -60.0) -> str:
    """SVG path data for the object ``name``: x = longitude, y = -latitude, rounded to ``precision`` decimals;
    rings wholly south of ``south`` degrees (Antarctica, which the dashboard's map leaves out) are dropped."""
    arcs = decode_arcs(topology)
    parts = []
    for polygon in polygons(topology, name):
        for indices in polygon:
            points_deg = ring(arcs, indices)
            if max(lat for _, lat in points_deg) < south:
                continue
            for shown in copies(unwrap(points_deg)):
                points: list[str] = []
                for lon, lat in shown:
                    point = f"{round(lon, precision) + 0:g} {round(-lat, precision) + 0:g}"
                    if not points or points[-1] != point:
                        points.append(point)
                if len(points) >= 3:
                    parts.append("M" + "L".join(points) + "Z")
    return "".join(parts)


def svg(d: str) -> str:
    return (
        '<svg xmlns="http://www.w3.org/2000/svg" viewBox="-180 -90 360 180">\n'
        "<!-- Land of the world, Natural Earth 1:110m (public domain), from the npm package world-atlas@2"
        " (ISC, Mike Bostock),\n"
        "     land-110m.json; equirectangular: x = longitude, y = -latitude, degrees, rounded to 0.1."
        " Made by scripts/make-world-map.py. -->\n"
        f'<path id="land" fill="#2a3340" d="{d}"/>\n'
        "</svg>\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("topojson", type=Path, help="world-atlas's land-110m.json")
    parser.add_argument("-o", "--out", type=Path, default=OUT, help=f"the SVG to write (default {OUT})")
    args = parser.parse_args(argv)
    try:
        topology = json.loads(args.topojson.read_text())
    except (OSError, ValueError) as e:
        print(f"make-world-map: cannot read {args.topojson}: {e}", file=sys.stderr)
        return 1
    if topology.get("type") != "Topology" or "land" not in topology.get("objects", {}):
        print(f"make-world-map: {args.topojson} is not world-atlas's land TopoJSON (no objects.land)", file=sys.stderr)
        return 1
    text = svg(path_data(topology))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(text) // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
