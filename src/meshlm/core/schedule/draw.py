"""Draw a simulated Timeline, so a schedule's bubble can be seen, not just counted.

Text rows read like the pictures in papers: one row per rank, time flowing
right, ``[F3]`` a forward of micro-batch 3, ``[B3]`` its backward (``I``/``W``
when split), ``.`` idle. With v > 1 chunks the label gains ``c<chunk>``.
"""
from __future__ import annotations

from .simulate import Timeline

LEGEND = "F=forward  B=backward  I=backward(input grad)  W=backward(weight grad)  .=idle"
_KIND_COLOR = {"F": "#4c9be8", "B": "#e8734c", "I": "#f0a35e", "W": "#8bc34a"}


def _label(a, v: int) -> str:
    return f"{a.kind}{a.mb}" + (f"c{a.chunk}" if v > 1 else "")


def _scale(tl: Timeline, width: int | None) -> float:
    """Characters per unit of time: wide enough that the shortest box shows '[label]'."""
    if tl.makespan <= 0:
        return 1.0
    if width is not None:
        return max(width, 1) / tl.makespan
    need = 1.0
    for row in tl.rows:
        for s, e, a in row:
            if e > s:
                need = max(need, (len(_label(a, tl.v)) + 2) / (e - s))
    return need


def _box(label: str, n: int) -> str:
    if n >= len(label) + 2:
        return "[" + label.center(n - 2) + "]"
    return (label + " " * n)[:n] if n > 0 else ""


def render_text(timeline: Timeline, width: int | None = None) -> str:
    """One line per rank plus a time ruler, legend, bubble and peak in-flight.

    `width` fits the time axis into that many characters (labels are then
    truncated); by default each box is just wide enough for its label.
    """
    tl = timeline
    scale = _scale(tl, width)
    ncols = round(tl.makespan * scale)

    def col(t: float) -> int:
        return min(ncols, round(t * scale + 1e-9))

    head = len(f"rank {tl.p - 1}")
    lines = []
    title = f"{tl.name or 'schedule'}: p={tl.p} m={tl.m} v={tl.v}"
    if tl.costs:
        c = tl.costs
        split = any(a.kind == "W" for row in tl.rows for _, _, a in row)
        title += f"  (cost F={c['cost_f']:g} B={c['cost_b']:g}" + (f" of which W={c['cost_w']:g})" if split else ")")
    lines.append(title)
    ruler = [" "] * (ncols + 1)
    step = max(1, round(6 / scale)) if scale > 0 else 1
    t = 0
    while col(t) <= ncols and t <= tl.makespan:
        mark = str(t)
        c0 = col(t)
        if all(ch == " " for ch in ruler[c0:c0 + len(mark) + 1]):
            ruler[c0:c0 + len(mark)] = list(mark)
        t += step
    lines.append("t".rjust(head) + " |" + "".join(ruler).rstrip())
    for r, row in enumerate(tl.rows):
        cells = ["."] * ncols
        for s, e, a in row:
            a0, a1 = col(s), col(e)
            cells[a0:a1] = list(_box(_label(a, tl.v), a1 - a0))
        lines.append(f"rank {r}".rjust(head) + " |" + "".join(cells) + "|")
    lines.append(LEGEND)
    lines.append(f"bubble {tl.bubble:.1%} (idle share of p x makespan)   makespan {tl.makespan:g}   "
                 f"peak in-flight per rank {tl.peak_inflight}")
    return "\n".join(lines)


def render_png(timeline: Timeline, path) -> None:
    """Coloured box chart of the timeline written to `path` (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    tl = timeline
    fig_w = min(40.0, max(8.0, tl.makespan * 0.35 + 2))
    fig, ax = plt.subplots(figsize=(fig_w, 0.6 * tl.p + 1.6))
    for r, row in enumerate(tl.rows):
        for s, e, a in row:
            shade = 1.0 - 0.45 * (a.chunk / max(1, tl.v - 1)) if tl.v > 1 else 1.0
            ax.barh(r, e - s, left=s, height=0.8, color=_KIND_COLOR[a.kind], alpha=shade,
                    edgecolor="black", linewidth=0.5)
            ax.text((s + e) / 2, r, str(a.mb) if tl.v == 1 else f"{a.mb}c{a.chunk}",
                    ha="center", va="center", fontsize=7)
    ax.set_yticks(range(tl.p), [f"rank {r}" for r in range(tl.p)])
    ax.invert_yaxis()
    ax.set_xlim(0, tl.makespan)
    ax.set_xlabel("time")
    kinds = sorted({a.kind for row in tl.rows for _, _, a in row}, key="FBIW".index)
    ax.legend(handles=[Patch(color=_KIND_COLOR[k], label=k) for k in kinds], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_title(f"{tl.name or 'schedule'} p={tl.p} m={tl.m} v={tl.v}: bubble {tl.bubble:.1%}, "
                 f"peak in-flight {tl.peak_inflight}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
