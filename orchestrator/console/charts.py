"""Charts as inline SVG, drawn here in Python: the placement's subscores and the utilization heatmap.

No chart library: two kinds of chart, each a few dozen lines of SVG, which every browser draws without a
script, and which the page's first paint already contains (no layout after load)."""

from __future__ import annotations

from html import escape
from typing import Any

from orchestrator.console.live import Sample

SUBSCORES = ("cpu", "memory", "image", "spread", "load", "away")
COLOURS = {
    "cpu": "#4e79a7",
    "memory": "#f28e2b",
    "image": "#59a14f",
    "spread": "#e15759",
    "load": "#b07aa1",
    "away": "#9c755f",
}


def explain(kept: dict[str, Any]) -> str:
    """Each candidate's subscores as a bar around zero (right: for it, left: against), its total beside."""
    candidates = kept.get("candidates", [])
    if not candidates:
        return '<p class="muted">no candidate was kept</p>'
    label_w, bar_w, row_h = 150, 420, 26
    extent = max(
        [sum(max(0.0, v) for v in c.get("subscores", {}).values()) for c in candidates]
        + [sum(-min(0.0, v) for v in c.get("subscores", {}).values()) for c in candidates]
        + [0.01]
    )
    scale = (bar_w / 2) / extent
    zero = label_w + bar_w / 2
    height = row_h * len(candidates) + 30
    out = [
        f'<svg class="explain" role="img" aria-label="placement subscores" viewBox="0 0 {label_w + bar_w + 80} '
        f'{height}" width="{label_w + bar_w + 80}" height="{height}">'
    ]
    for i, c in enumerate(candidates):
        y = i * row_h + 4
        won = c["worker_id"] == kept.get("chosen")
        name = escape(c["worker_id"]) + (" ✓" if won else "")
        weight = "bold" if won else "normal"
        out.append(f'<text x="0" y="{y + 15}" font-weight="{weight}">#{c.get("rank", i + 1)} {name}</text>')
        right, left = zero, zero
        for key in SUBSCORES:
            value = float(c.get("subscores", {}).get(key, 0.0))
            if value == 0:
                continue
            w = abs(value) * scale
            x = right if value > 0 else left - w
            if value > 0:
                right += w
            else:
                left -= w
            out.append(
                f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row_h - 8}" fill="{COLOURS[key]}">'
                f"<title>{key} {value:+.3f}</title></rect>"
            )
        out.append(f'<text x="{label_w + bar_w + 6}" y="{y + 15}">{float(c.get("total", 0)):.3f}</text>')
    axis_y = row_h * len(candidates) + 4
    out.append(f'<line x1="{zero}" y1="0" x2="{zero}" y2="{axis_y}" stroke="#333"/>')
    x = label_w
    for key in SUBSCORES:
        out.append(f'<rect x="{x}" y="{axis_y + 10}" width="10" height="10" fill="{COLOURS[key]}"/>')
        out.append(f'<text x="{x + 14}" y="{axis_y + 20}" font-size="11">{key}</text>')
        x += 70
    out.append("</svg>")
    return "".join(out)


def heatmap(history: list[Sample], workers: list[str]) -> str:
    """Rows: workers; columns: samples, oldest left; colour: the share of the worker's cpus in use."""
    if not history or not workers:
        return '<p class="muted">no samples yet</p>'
    label_w, cell_w, cell_h = 160, 6, 14
    width = max(label_w + cell_w * len(history) + 10, label_w + 160)
    height = cell_h * len(workers) + 24
    out = [
        f'<svg class="heatmap" role="img" aria-label="cpu use per worker over time" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}">'
    ]
    for row, worker in enumerate(workers):
        y = row * cell_h
        out.append(f'<text x="0" y="{y + 11}" font-size="11">{escape(worker)}</text>')
        for col, sample in enumerate(history):
            share = sample.cpu.get(worker)
            fill = "#eee" if share is None else _heat(share)
            out.append(
                f'<rect x="{label_w + col * cell_w}" y="{y}" width="{cell_w}" height="{cell_h - 1}" fill="{fill}"/>'
            )
    span = history[-1].at - history[0].at
    out.append(f'<text x="{label_w}" y="{height - 6}" font-size="11">{span:.0f} s ago</text>')
    end = label_w + cell_w * len(history)
    out.append(f'<text x="{max(end - 24, label_w + 90)}" y="{height - 6}" font-size="11">now</text>')
    out.append("</svg>")
    return "".join(out)


def _heat(share: float) -> str:
    """Light grey (idle) to deep red (full), through yellow."""
    share = max(0.0, min(1.0, share))
    if share < 0.5:
        t = share / 0.5
        return f"rgb({235 + int(t * 20)},{235 - int(t * 10)},{int(235 * (1 - t))})"
    t = (share - 0.5) / 0.5
    return f"rgb({255 - int(t * 75)},{int(225 * (1 - t))},0)"
