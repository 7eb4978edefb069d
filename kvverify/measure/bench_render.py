"""``kvverify bench`` for people: the event-timed, end-to-end and compute-slowdown tables, the
calibration table, and the crossover plot."""

from __future__ import annotations

from typing import Any

from kvverify.measure.bench_plan import CEILING, DIRECTIONS, KERNEL, LOOP, REPEAT_CHECK_MIN_PAGE, REPEAT_TOLERANCE
from kvverify.terms import ORDERS
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
    baselines = [m for m in cfg["methods"] if m in (LOOP, KERNEL)]
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
    for name in ["dir", "page", "pages/call", CEILING, *orders, *baselines, f"ANY/STREAM [{ci} CI]", "STREAM spread", "repeat Δ"]:
        t.add_column(escape(name), justify="left" if name in ("dir", "page") else "right")
    for p in document["points"]:
        m = p["methods"]
        rep = p["repeat"]
        rep_text = "—" if rep is None else _pct(rep["rel_delta"]) + ("" if rep["within_tolerance"] in (None, True) else " !")
        row = (
            p["direction"], p["label"], str(p["pages_per_call"]), _cell(m.get(CEILING)),
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
    for name in ["dir", "page", CEILING, *orders, *baselines, f"ANY/STREAM [{ci} CI]"]:
        e.add_column(escape(name), justify="left" if name in ("dir", "page") else "right")
    for p in document["points"]:
        m = p["methods"]
        row = (
            p["direction"], p["label"], _cell(m.get(CEILING), "e2e_gbps"),
            *[_cell(m.get(o), "e2e_gbps") for o in orders], *[_cell(m.get(b), "e2e_gbps") for b in baselines],
            _ratio_text(p["any_over_stream_e2e"]),
        )
        e.add_row(*(escape(x) for x in row))
    console.print(e)
    if cfg.get("compute"):
        _render_compute(document, cfg["methods"], console)


def _slowdown_text(compute: dict[str, Any] | None) -> str:
    if compute is None or compute["n"] == 0:
        return "—"
    text = f"{100 * compute['slowdown']['median']:+.1f}%"
    if compute["overlapped"] < compute["n"]:
        text += "?"
    return text + f" ({compute['copy_gbps_during']['median']:.1f})"


def _render_compute(document: dict[str, Any], methods: list[str], console) -> None:
    """The compute slowdown table: per point and method, the matmuls' slowdown and the copies' GB/s meanwhile."""
    from rich.markup import escape
    from rich.table import Table

    cfg = document["config"]["compute"]
    n = cfg["matmul_size"]
    mm = cfg["matmul_s"]
    t = Table(
        title=f"compute slowdown: {n}x{n} bf16 matmuls on another stream while each path copies "
              f"(one matmul alone: {mm * 1e3:.3f} ms)" if mm else "compute slowdown",
        caption="slowdown = matmul time during the copies / alone − 1, median of "
                f"{cfg['reps']}; (GB/s of the copies meanwhile); ? the copies did not share the whole matmul window in some reps",
    )
    for name in ["dir", "page", *methods]:
        t.add_column(escape(name), justify="left" if name in ("dir", "page") else "right")
    for p in document["points"]:
        row = [p["direction"], p["label"]] + [_slowdown_text((p["methods"].get(m) or {}).get("compute")) for m in methods]
        t.add_row(*(escape(x) for x in row))
    console.print(t)


def _figure_text(figure: dict[str, Any] | None) -> str:
    return "—" if figure is None else f"{figure['path']} {figure['gbps']:.1f}"


def render_calibration(paths: dict[str, Any], console) -> None:
    """The calibration table: per direction, page size and pages per call, the fastest safe path
    and the runner-up (end-to-end GB/s), ANY where it would win for untouched host sources, the ceiling."""
    from rich.markup import escape
    from rich.table import Table

    t = Table(
        title=f"kvverify bench --calibrate: fastest safe path per shape, {paths['host_memory']} host memory",
        caption=f"GB/s by {paths['ranked_by']} (1e9 B/s; 'both' counts both directions). Safe: "
                f"{', '.join(paths['safe_paths'])} (stream-ordered). ANY: safe only for loads whose host "
                "source stays untouched until the copy completes.",
    )
    for name in ["dir", "page", "pages/call", "best", "runner-up", "ANY if source untouched", "ceiling"]:
        t.add_column(escape(name), justify="left" if name in ("dir", "page", "best", "runner-up") else "right")
    for e in paths["entries"]:
        ceiling = e["ceiling_gbps"]
        t.add_row(*(escape(x) for x in (
            e["direction"], format_size(e["page_bytes"]), str(e["pages_per_call"]), _figure_text(e["best"]),
            _figure_text(e["runner_up"]), _figure_text(e["if_host_source_untouched"]),
            "—" if ceiling is None else f"{ceiling:.1f}")))
    console.print(t)
    for where in paths["unmeasured"]:
        console.print(escape(f"no safe path measured: {where}"))


def _groups(document: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
    """Panels of the plot: one per pages-per-call value with ``--pages-per-call``, else one."""
    points = document["points"]
    counts = document["config"].get("pages_per_call")
    if not counts:
        return [("", points)]
    return [(f"{n} pages per call", [p for p in points if p["pages_per_call"] == n]) for n in counts]


def crossovers(points: list[dict[str, Any]], first: str, second: str) -> list[tuple[int, int]]:
    """Neighbouring page sizes (in bytes) between which ``first`` and ``second`` swap places
    (event-timed GB/s; ``points`` of one direction and pages-per-call)."""
    def gbps(p: dict[str, Any], m: str) -> float | None:
        method = p["methods"].get(m)
        value = None if method is None else method["gbps"]["median"]
        return value if value is not None and value == value else None

    ordered = sorted(points, key=lambda p: p["page_bytes"])
    out, last = [], None
    for p in ordered:
        a, b = gbps(p, first), gbps(p, second)
        if a is None or b is None or a == b:
            continue
        sign = a > b
        if last is not None and sign != last[1]:
            out.append((last[0], p["page_bytes"]))
        last = (p["page_bytes"], sign)
    return out


def plot(document: dict[str, Any], path: str) -> None:
    """Write a PNG: event-timed GB/s against page size (log2 axis), one row of panels per direction
    and one column per pages-per-call value; a line per method (loop dotted, kernel thick), each
    panel's ceiling as a horizontal line, and a shaded band where the kernel path and the STREAM
    batch cross over."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"STREAM": "tab:blue", "DURING_API_CALL": "tab:green", "ANY": "tab:orange", LOOP: "tab:gray",
              KERNEL: "tab:red"}
    styles = {LOOP: ":", KERNEL: "-", "ANY": "-."}
    directions = [d for d in DIRECTIONS if any(p["direction"] == d for p in document["points"])] or ["h2d"]
    groups = _groups(document)
    fig, axes = plt.subplots(len(directions), len(groups), figsize=(5.5 * len(groups) + 2, 3.6 * len(directions)),
                             dpi=110, squeeze=False)
    plat = document["platform"]
    for row, direction in enumerate(directions):
        for col, (title, group) in enumerate(groups):
            ax = axes[row][col]
            points = sorted((p for p in group if p["direction"] == direction), key=lambda p: p["page_bytes"])
            top, pages = 0.0, set()
            for method in document["config"]["methods"]:
                xs, ys = [], []
                for p in points:
                    m = p["methods"].get(method)
                    if m is not None and m["gbps"]["median"] == m["gbps"]["median"] and m["gbps"]["median"] is not None:
                        xs.append(p["page_bytes"])
                        ys.append(m["gbps"]["median"])
                if not xs:
                    continue
                pages.update(xs)
                top = max(top, *ys)
                if method == CEILING:
                    ax.plot(xs, ys, color="black", linewidth=1, alpha=0.6, label="ceiling (one contiguous copy)")
                    continue
                ax.plot(xs, ys, linestyle=styles.get(method, "--"), marker="o", markersize=3,
                        linewidth=2.2 if method == KERNEL else 1.2, color=colors.get(method, "black"), label=method)
            for low, high in crossovers(points, KERNEL, "STREAM"):
                ax.axvspan(low, high, color="tab:red", alpha=0.08)
                ax.annotate("kernel / STREAM\ncrossover", xy=((low * high) ** 0.5, top * 0.05), ha="center", fontsize=7)
            ax.set_xscale("log", base=2)
            if pages:
                ticks = sorted(pages)
                ax.set_xticks(ticks)
                ax.set_xticklabels([format_size(t) for t in ticks], rotation=45, ha="right", fontsize=7)
            ax.set_ylim(0, top * 1.1 if top > 0 else 1)
            ax.grid(True, which="major", alpha=0.3)
            ax.set_title(f"{direction.upper()}{', ' + title if title else ''}", fontsize=9)
            if col == 0:
                ax.set_ylabel("GB/s, event-timed")
            if row == len(directions) - 1:
                ax.set_xlabel("page size")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="center right")
    fig.suptitle(f"copy paths — {plat.get('gpu_name', 'unknown')}, {document['config']['host_memory']} host memory",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 1 - 2.4 / fig.get_figwidth(), 1))
    fig.savefig(path)
    plt.close(fig)
