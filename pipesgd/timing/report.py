"""Tables and figures of the timing model: the ranked configurations, the projection
over p, and the stacked-bar breakdown (the paper's Fig. 4), predicted beside measured."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipesgd.timing.model import BREAKDOWN_KEYS, Config, Prediction, predict
from pipesgd.timing.network import NetworkParams
from pipesgd.timing.profile import Profile

_COLOURS = {
    "update": "#8c8c8c",
    "forward": "#4c72b0",
    "backward": "#55a868",
    "communication": "#c44e52",
    "compression": "#dd8452",
    "staging": "#937860",
    "contention": "#8172b3",
    "measured": "#222222",
}

MeasuredKey = tuple[int, str, str]


def measured_key(entry: dict[str, Any]) -> MeasuredKey:
    return int(entry["staleness"]), str(entry["compression"]), str(entry["overlap"])


def format_ranking(preds: Sequence[Prediction],
                   measured: dict[MeasuredKey, float] | None = None) -> str:
    """The ranked configurations as a text table (milliseconds)."""
    measured = measured or {}
    head = (f"{'#':>2}  {'configuration':<16} {'K':>1} {'compression':<8} {'overlap':<10} "
            f"{'pred ms':>9} {'meas ms':>9} {'err':>7}  {'up':>6} {'fwd':>6} {'bwd':>6} "
            f"{'comm':>6} {'compr':>6} {'stage':>6} {'cont':>6}  bound")
    lines = [head, "-" * len(head)]
    for i, pr in enumerate(preds, 1):
        c = pr.config
        meas = measured.get((c.staleness, c.compression, c.overlap))
        meas_s = f"{meas * 1e3:9.2f}" if meas else f"{'-':>9}"
        err = f"{(pr.predicted_s - meas) / meas:+7.1%}" if meas else f"{'':>7}"
        b = pr.breakdown
        lines.append(
            f"{i:>2}  {c.label:<16} {c.staleness:>1} {c.compression:<8} {c.overlap:<10} "
            f"{pr.predicted_s * 1e3:9.2f} {meas_s} {err}  "
            + " ".join(f"{b[k] * 1e3:6.2f}" for k in BREAKDOWN_KEYS)
            + f"  {pr.bound}"
        )
    best = preds[0]
    lines.append(f"choice: {best.config.label} (K={best.config.staleness}, "
                 f"{best.config.compression}, {best.config.overlap}): {best.reason}")
    return "\n".join(lines)


def projection(profile: Profile, clusters: dict[str, NetworkParams],
               ps: Sequence[int] = (2, 4, 8, 16, 32, 64, 128, 256),
               configs: Sequence[Config] | None = None) -> list[dict[str, Any]]:
    """Predicted iteration time and scaling efficiency over p for each cluster and
    configuration (default: D-Sync and Pipe-SGD, uncompressed and quant8, sequential)."""
    configs = configs or [Config(k, c, "sequential") for k in (1, 2) for c in ("none", "quant8")]
    rows = []
    for name, net in clusters.items():
        for p in ps:
            for c in configs:
                pr = predict(profile, net, p, c.staleness, c.compression, c.overlap)
                rows.append({"cluster": name, "p": p, "label": c.label,
                             "predicted_s": pr.predicted_s,
                             "scaling_efficiency": pr.scaling_efficiency, "bound": pr.bound})
    return rows


def format_projection(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    """One line per (cluster, p): ms and scaling efficiency of each configuration."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    keyed = {(r["cluster"], r["p"], r["label"]): r for r in rows}
    header = ["cluster", "p", *(f"{lab} ms (SE)" for lab in labels)]
    body = []
    for cluster, p in dict.fromkeys((r["cluster"], r["p"]) for r in rows):
        cells = [cluster, str(p)]
        for lab in labels:
            r = keyed[(cluster, p, lab)]
            cells.append(f"{r['predicted_s'] * 1e3:.2f} ({r['scaling_efficiency']:.2f})")
        body.append(cells)
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(cells) + " |" for cells in body]
        return "\n".join(out)
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
                     for row in [header, *body])


def plot_breakdown(preds: Sequence[Prediction], path: str | Path, title: str = "",
                   measured: dict[MeasuredKey, float] | None = None) -> Path:
    """Stacked bars of the predicted breakdown per configuration (Fig. 4 style), with the
    measured iteration time as a dark bar beside each when given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = measured or {}
    fig, ax = plt.subplots(figsize=(max(6.0, 0.75 * len(preds) + 2), 4.2))
    width = 0.38 if measured else 0.6
    for i, pr in enumerate(preds):
        bottom = 0.0
        for key in BREAKDOWN_KEYS:
            value = pr.breakdown[key] * 1e3
            ax.bar(i - (width / 2 if measured else 0), value, width, bottom=bottom,
                   color=_COLOURS[key], label=key if i == 0 else None)
            bottom += value
        c = pr.config
        meas = measured.get((c.staleness, c.compression, c.overlap))
        if meas:
            ax.bar(i + width / 2, meas * 1e3, width, color=_COLOURS["measured"],
                   label="measured" if "measured" not in ax.get_legend_handles_labels()[1]
                   else None)
    ax.set_xticks(range(len(preds)), [pr.config.label for pr in preds], rotation=35,
                  ha="right", fontsize=8)
    ax.set_ylabel("time per iteration (ms)")
    ax.set_title(title or "predicted breakdown per configuration", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
