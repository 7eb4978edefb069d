"""``kvverify bench`` for people: the event-timed and end-to-end tables, and the plot."""

from __future__ import annotations

from typing import Any

from kvverify.measure.bench_plan import REPEAT_CHECK_MIN_PAGE, REPEAT_TOLERANCE
from kvverify.terms import COPY_KINDS, ORDERS
from kvverify.units import format_size


def _cell(method: dict[str, Any] | None, key: str = "gbps") -> str:
    if method is None:
        return "—"
    if method.get("error") and method[key]["n"] == 0:
        return "error"
    med = method[key]["median"]
    if med is None or med != med:
        return "—"
    text = f"{med:.1f}"
    if key == "gbps" and method["hold_covered"] < method[key]["n"]:
        text += "*"
    return text


def _ratio_text(r: dict[str, Any] | None) -> str:
    if not r:
        return "—"
    if r["low"] is None:
        return f"{r['median']:.3f} (n={r['n']}: no CI)"
    return f"{r['median']:.3f} [{r['low']:.3f}, {r['high']:.3f}]"


def _pct(x: float | None) -> str:
    return "—" if x is None or x != x else f"{100 * x:.1f}%"


def render_tables(document: dict[str, Any], console) -> None:
    """Print the platform line, the event-timed table and the end-to-end table."""
    from rich.markup import escape
    from rich.table import Table

    from kvverify.device import platform_info

    cfg = document["config"]
    orders = [m for m in cfg["methods"] if m in ORDERS]
    baselines = [m for m in cfg["methods"] if m == "loop"]
    platform_info.render(document["platform"], console)
    ci = f"{100 * cfg['confidence']:g}%"
    t = Table(
        title=f"kvverify bench — GB/s (1e9 B/s), event-timed behind a stream hold, {cfg['host_memory']} host memory",
        caption=(
            f"median of {cfg['reps']} reps per cell; * some reps' calls outlasted the hold (call gaps included). "
            f"spread = (max−min)/median of the STREAM reps; repeat Δ = |2nd − 1st| / 1st of two STREAM series "
            f"(checked against {100 * REPEAT_TOLERANCE:g}% from {format_size(REPEAT_CHECK_MIN_PAGE)})."
            + (" Cut short by --max-seconds." if document["truncated"] else "")
        ),
    )
    for name in ["dir", "page", "pages/call", "ceiling", *orders, *baselines, f"ANY/STREAM [{ci} CI]", "STREAM spread", "repeat Δ"]:
        t.add_column(escape(name), justify="left" if name in ("dir", "page") else "right")
    for p in document["points"]:
        m = p["methods"]
        rep = p["repeat"]
        rep_text = "—" if rep is None else _pct(rep["rel_delta"]) + ("" if rep["within_tolerance"] in (None, True) else " !")
        row = (
            p["direction"], p["label"], str(p["pages_per_call"]), _cell(m.get("ceiling")),
            *[_cell(m.get(o)) for o in orders], *[_cell(m.get(b)) for b in baselines],
            _ratio_text(p["any_over_stream"]),
            _pct(m["STREAM"]["gbps"]["rel_spread"]) if "STREAM" in m else "—",
            rep_text,
        )
        t.add_row(*(escape(x) for x in row))
    console.print(t)
    for p in document["points"]:
        for name, m in p["methods"].items():
            if m.get("error"):
                console.print(escape(f"{p['direction']} {p['label']} {name}: stopped after {m['gbps']['n']} reps: {m['error']}"))
    e = Table(title="end-to-end GB/s (host clock from before the first call to the completion of the last copy, no hold)")
    for name in ["dir", "page", "ceiling", *orders, *baselines, f"ANY/STREAM [{ci} CI]"]:
        e.add_column(escape(name), justify="left" if name in ("dir", "page") else "right")
    for p in document["points"]:
        m = p["methods"]
        row = (
            p["direction"], p["label"], _cell(m.get("ceiling"), "e2e_gbps"),
            *[_cell(m.get(o), "e2e_gbps") for o in orders], *[_cell(m.get(b), "e2e_gbps") for b in baselines],
            _ratio_text(p["any_over_stream_e2e"]),
        )
        e.add_row(*(escape(x) for x in row))
    console.print(e)


def plot(document: dict[str, Any], path: str) -> None:
    """Write a PNG: event-timed GB/s against page size (log2 axis), one line per order and direction
    (the loop baseline dotted), each direction's ceiling as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"STREAM": "tab:blue", "DURING_API_CALL": "tab:green", "ANY": "tab:orange", "loop": "tab:gray"}
    styles = {"h2d": "-", "d2h": "--"}
    markers = {"h2d": "o", "d2h": "s"}
    fig, ax = plt.subplots(figsize=(11, 5.5), dpi=120)
    top = 0.0
    all_pages: set[int] = set()
    for direction in COPY_KINDS:
        points = sorted((p for p in document["points"] if p["direction"] == direction), key=lambda p: p["page_bytes"])
        if not points:
            continue
        for method in document["config"]["methods"]:
            if method == "ceiling":
                continue
            xs, ys = [], []
            for p in points:
                m = p["methods"].get(method)
                if m is not None and m["gbps"]["median"] == m["gbps"]["median"]:
                    xs.append(p["page_bytes"])
                    ys.append(m["gbps"]["median"])
                    top = max(top, ys[-1])
            if xs:
                all_pages.update(xs)
                ax.plot(xs, ys, linestyle=styles[direction] if method != "loop" else ":", marker=markers[direction],
                        color=colors.get(method, "black"), label=f"{direction.upper()} {method}", markersize=4)
        ceiling = document["ceiling_gbps"].get(direction)
        if ceiling is not None and ceiling == ceiling:
            top = max(top, ceiling)
            ax.axhline(ceiling, color="black", linestyle=styles[direction], linewidth=1, alpha=0.6,
                       label=f"{direction.upper()} ceiling (one contiguous copy) {ceiling:.1f} GB/s")
    ax.set_xscale("log", base=2)
    if all_pages:
        ticks = sorted(all_pages)
        ax.set_xticks(ticks)
        ax.set_xticklabels([format_size(t) for t in ticks], rotation=45, ha="right")
    ax.set_xlabel("page size")
    ax.set_ylabel("GB/s (1e9 bytes/s), event-timed")
    ax.set_ylim(0, top * 1.1 if top > 0 else 1)
    ax.grid(True, which="major", alpha=0.3)
    plat = document["platform"]
    ax.set_title(
        f"swap_blocks_batch bandwidth — {plat.get('gpu_name', 'unknown')}, {document['config']['host_memory']} host memory",
        fontsize=10,
    )
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
