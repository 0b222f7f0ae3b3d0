"""A small hand-written SVG chart for the affinity comparison (no plotting library: the drivers
run on a bare python3). One block per configuration, one row per policy, two bars per row:
token hit rate as a share of the oracle's, and max/mean requests per rank. Goal lines are drawn
at 0.97 x oracle and 1.15 max/mean."""

from xml.sax.saxutils import escape

ROW = 22
LABEL_W = 230
BAR_W = 260
GAP = 40
HIT_GOAL = 0.97
BALANCE_GOAL = 1.15
BALANCE_MAX = 2.0  # the balance axis runs 1.0 .. 2.0 (worse is clipped, value still printed)


def _text(x, y, s, anchor="start", size=12, weight="normal", fill="#222"):
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
        f'font-weight="{weight}" fill="{fill}" font-family="sans-serif">{escape(s)}</text>'
    )


def _bar(x, y, w, color):
    return f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.1f}" height="{ROW - 8}" fill="{color}"/>'


def _vline(x, y0, y1, color="#c00"):
    return f'<line x1="{x:.1f}" y1="{y0:.1f}" x2="{x:.1f}" y2="{y1:.1f}" stroke="{color}" stroke-dasharray="4,3"/>'


def chart(groups, title):
    """groups: [(config label, [(policy label, hit_share or None, max_mean or None, is_ours)])]."""
    hit_x = LABEL_W
    bal_x = LABEL_W + BAR_W + GAP
    width = bal_x + BAR_W + 20
    out = []
    y = 30
    out.append(_text(10, 20, title, size=14, weight="bold"))
    for label, rows in groups:
        y += 14
        out.append(_text(10, y, label, size=13, weight="bold"))
        out.append(_text(hit_x, y, "token hit rate ÷ oracle (goal ≥ 0.97)", size=11, fill="#555"))
        out.append(_text(bal_x, y, "max/mean requests per rank (goal ≤ 1.15)", size=11, fill="#555"))
        y += 6
        top = y
        for name, hit, bal, ours in rows:
            color = "#2a6fb0" if ours else "#999"
            out.append(_text(10, y + ROW - 10, name, size=12))
            if hit is not None:
                out.append(_bar(hit_x, y, BAR_W * min(hit, 1.0), color))
                out.append(_text(hit_x + BAR_W * min(hit, 1.0) + 4, y + ROW - 10, f"{hit:.3f}", size=11))
            if bal is not None:
                share = (min(bal, BALANCE_MAX) - 1.0) / (BALANCE_MAX - 1.0)
                out.append(_bar(bal_x, y, BAR_W * share, color))
                out.append(_text(bal_x + BAR_W * share + 4, y + ROW - 10, f"{bal:.2f}", size=11))
            y += ROW
        out.append(_vline(hit_x + BAR_W * HIT_GOAL, top - 2, y))
        out.append(_vline(bal_x + BAR_W * (BALANCE_GOAL - 1.0) / (BALANCE_MAX - 1.0), top - 2, y))
        out.append(_vline(hit_x, top - 2, y, "#444"))
        out.append(_vline(bal_x, top - 2, y, "#444"))
        y += 10
    height = y + 10
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">\n<rect width="100%" height="100%" fill="white"/>\n'
        + "\n".join(out)
        + "\n</svg>\n"
    )
