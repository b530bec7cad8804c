"""PNG pictures for `profile`, `replay` and `plan` (--plot FILE.png), drawn with matplotlib (the optional [plot]
extra), written atomically."""

from __future__ import annotations

import importlib.util
import io

import numpy as np

from streamer.errors import StreamerError
from streamer.io import atomic_write, human

STYLE = {
    "lru": ("tab:blue", "-"),
    "lfu": ("tab:orange", "-"),
    "pinned-lru": ("tab:green", ":"),
    "belady": ("black", "--"),
    "uniform": ("tab:purple", "-"),
}
MARKER = {"lru": "o", "lfu": "s", "pinned-lru": "^", "belady": "D", "uniform": "o"}


def require_matplotlib() -> None:
    """Fail before any work when --plot cannot be honoured."""
    if importlib.util.find_spec("matplotlib") is None:
        raise StreamerError("--plot needs matplotlib: pip install 'stream-run[plot]' (or pip install matplotlib)")


def _figure(rows: int, height: float):
    import matplotlib.pyplot as plt  # the optional plot extra: imported by the plots only

    plt.switch_backend("Agg")  # files, never a window
    fig, axes = plt.subplots(rows, 1, figsize=(9, height), squeeze=False)
    return plt, fig, axes[:, 0]


def _save(plt, fig, path) -> None:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write(path, lambda f: f.write(buf.getvalue()))


def plot_profile(report: dict, counts: np.ndarray, path, title: str = "") -> None:
    """Expert usage heatmap (layer x expert) over the run, and per-layer MiB read and I/O stall as bars."""
    plt, fig, (ax_h, ax_b) = _figure(2, 9.5)
    n_layer, n_expert = counts.shape
    share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    im = ax_h.imshow(
        share * n_expert,
        aspect="auto",
        cmap="magma",
        interpolation="nearest",
        vmin=0,
        vmax=max(2.0, float(np.percentile(share * n_expert, 99.5))),
    )
    ax_h.set_xlabel("expert id")
    ax_h.set_ylabel("layer")
    ax_h.set_title(f"{title}expert usage: routed share of each layer's tokens, x{n_expert} (1 = uniform)")
    fig.colorbar(im, ax=ax_h, label="use relative to uniform")
    layers = report["layers"]
    x = np.arange(n_layer)
    mib = np.array([(s["read_bytes"] + s["prefetch_bytes"]) / 2**20 for s in layers])
    stall = np.array([s["stall_s"] for s in layers])
    ax_b.bar(x - 0.2, mib, width=0.4, color="tab:blue", label="MiB read (demand + prefetch)")
    ax_b.set_xlabel("layer")
    ax_b.set_ylabel("MiB read", color="tab:blue")
    ax2 = ax_b.twinx()
    ax2.bar(x + 0.2, stall, width=0.4, color="tab:red", label="I/O stall (s)")
    ax2.set_ylabel("stall s", color="tab:red")
    ax_b.set_title(
        f"per layer: bytes read (blue, left) and time waiting for reads (red, right); {report['tokens']} tokens"
    )
    ax_b.set_xlim(-0.7, n_layer - 0.3)
    _save(plt, fig, path)


def _unit(rows) -> tuple[float, str]:
    top = max((r["budget"] for r in rows if r["budget"] is not None), default=0)
    return (2**30, "GiB") if top >= 2 * 2**30 else (2**20, "MiB")


def _budget_lines(ax, rows, key):
    div, unit = _unit(rows)
    by: dict = {}
    for r in rows:
        if r.get("state") == "too small" or r["budget"] is None:
            continue
        by.setdefault(r["policy"], []).append((r["budget"] / div, r[key]))
    for pol, pts in by.items():
        pts = [(b, v) for b, v in sorted(pts) if v is not None]
        color, ls = STYLE.get(pol, ("gray", "-"))
        ax.plot(
            [b for b, _ in pts],
            [v for _, v in pts],
            ls,
            color=color,
            marker=MARKER.get(pol, "o"),
            ms=6 if pol == "pinned-lru" else 4,
            mfc="none" if pol == "pinned-lru" else color,
            label=pol + (" (offline optimal)" if pol == "belady" else ""),
        )
    ax.set_xlabel(f"RAM budget ({unit})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_replay(r: dict, path) -> None:
    """Hit rate and MiB read per token (decode steps) against budget, one line per policy, Belady dashed."""
    plt, fig, (ax1, ax2) = _figure(2, 7.5)
    rows = [
        dict(x, hit=x["decode"]["hit_rate"], mib=x["decode"]["read_bytes_per_token"] / 2**20)
        for x in r["results"]
        if x.get("state") != "too small"
    ]
    if not any(x["budget"] is not None for x in rows):  # only the recorded cache: bars per policy
        pols = [x["policy"] for x in rows]
        for ax, key, label in ((ax1, "hit", "hit rate (%)"), (ax2, "mib", "MiB read per token")):
            vals = [(100 if key == "hit" else 1) * (x[key] or 0) for x in rows]
            ax.bar(pols, vals, color=[STYLE.get(p, ("gray",))[0] for p in pols])
            ax.set_ylabel(label)
        ax1.set_title(f"replay at the recorded cache ({rows[0]['n_slots']} slots), decode steps")
    else:
        for x in rows:
            x["hit_pct"] = 100 * x["hit"] if x["hit"] is not None else None
        _budget_lines(ax1, rows, "hit_pct")
        ax1.set_ylabel("hit rate, decode (%)")
        ax1.set_title("replay: hit rate (pinned or LRU tier) against budget; Belady dashed is the ceiling")
        _budget_lines(ax2, rows, "mib")
        ax2.set_ylabel("MiB read per decoded token")
        ax2.set_title("bytes read per token (demand + prefetch)")
    _save(plt, fig, path)


def plot_plan(r: dict, path) -> None:
    """Predicted decode tok/s and hit rate against budget, one line per policy (Belady dashed)."""
    plt, fig, (ax1, ax2) = _figure(2, 7.5)
    rows = [dict(x, hit_pct=100 * x["hit_rate"]) for x in r["rows"] if x.get("state") != "too small"]
    fits = [x["budget"] for x in rows if x["state"] == "resident"]
    note = ""
    if fits and len({x["budget"] for x in rows if x["budget"] <= min(fits)}) >= 2:  # beyond: all flat
        rows = [x for x in rows if x["budget"] <= min(fits)]
        note = f"; all experts fit from {human(min(fits))}, this machine has {human(r['machine_memory'])}"
    _budget_lines(ax1, rows, "decode_tok_s")
    ax1.set_ylim(bottom=0)
    ax1.set_ylabel("predicted decode tok/s")
    div, _ = _unit(rows)
    rec = r.get("recommended")
    if rec is not None:
        ax1.axvline(rec["budget"] / div, color="gray", ls=":", lw=1)
        ax1.annotate(
            f"recommended {human(rec['budget'])}",
            (rec["budget"] / div, rec["decode_tok_s"]),
            textcoords="offset points",
            xytext=(6, -14),
            fontsize=8,
        )
    if r["machine_memory"] <= 1.05 * max(x["budget"] for x in rows):
        ax1.axvline(r["machine_memory"] / div, color="red", ls=":", lw=1)
    ax1.set_title(
        f"plan for {r['model'].rsplit('/', 1)[-1]}: predicted decode speed\n(hits: {r['hit_model']}{note})", fontsize=9
    )
    _budget_lines(ax2, rows, "hit_pct")
    ax2.set_ylabel("hit rate, decode (%)")
    ax2.set_title("expert cache hit rate the prediction uses")
    _save(plt, fig, path)
