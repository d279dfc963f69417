"""Per-rank action timeline: Chrome trace JSON and a PNG schedule diagram.

Every rank records (action, start, end) of each schedule step; `write` gathers them on
rank 0 and writes `timeline.json` (open in chrome://tracing or Perfetto) and
`timeline.png` (ranks as rows; forward, backward, communication and update as coloured
boxes, like PipeDream's Fig. 4), so bubbles and the slow stage show at a glance.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

COLOURS = {
    "F": "#4c72b0",  # forward
    "B": "#55a868",  # backward
    "U": "#c44e52",  # optimizer step
    "AR": "#dd8452",  # replica all-reduce
    "RF": "#b0b0b0",
    "RB": "#b0b0b0",
    "SF": "#d8d8d8",
    "SB": "#d8d8d8",
}
CATEGORY = {"F": "forward", "B": "backward", "U": "update", "AR": "allreduce",
            "RF": "comm", "RB": "comm", "SF": "comm", "SB": "comm"}


class Timeline:
    """Timestamps of one rank's actions (seconds from the epoch's common start)."""

    def __init__(self, rank: int, label: str) -> None:
        self.rank = rank
        self.label = label
        self.events: list[tuple[str, str, int, float, float]] = []  # text, kind, epoch, t0, t1
        self.origin = time.perf_counter()
        self.epoch = 0

    def start_epoch(self, epoch: int) -> None:
        """Call right after a barrier: all ranks share the origin."""
        self.epoch = epoch
        self.origin = time.perf_counter()

    def record(self, text: str, kind: str, start: float, end: float) -> None:
        self.events.append((text, kind, self.epoch, start - self.origin, end - self.origin))

    def busy(self, kinds: tuple[str, ...] = ("F", "B", "U")) -> float:
        """Seconds spent in `kinds` during the current epoch."""
        return sum(t1 - t0 for _, k, e, t0, t1 in self.events if k in kinds and e == self.epoch)

    def clear(self) -> None:
        self.events.clear()


def chrome_trace(rows: list[tuple[int, str, list]]) -> dict:
    events = []
    for rank, label, evs in rows:
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                       "args": {"name": f"rank {rank} {label}"}})
        for text, kind, epoch, t0, t1 in evs:
            events.append({
                "name": text, "cat": CATEGORY.get(kind, kind), "ph": "X", "pid": 0,
                "tid": rank, "ts": round(t0 * 1e6, 3), "dur": round((t1 - t0) * 1e6, 3),
                "args": {"epoch": epoch},
            })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def plot(rows: list[tuple[int, str, list]], path: Path, epoch: int | None = None,
         title: str = "pipeline schedule") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig_h = 0.6 + 0.55 * len(rows)
    fig, ax = plt.subplots(figsize=(12, fig_h))
    for rank, _label, evs in rows:
        chosen = [e for e in evs if epoch is None or e[2] == epoch]
        for kind in COLOURS:
            boxes = [(t0 * 1e3, (t1 - t0) * 1e3) for _, k, _, t0, t1 in chosen if k == kind]
            if boxes:
                ax.broken_barh(boxes, (rank - 0.4, 0.8), facecolors=COLOURS[kind],
                               edgecolor="white", linewidth=0.3)
        for text, kind, _, t0, t1 in chosen:
            if kind in ("F", "B") and (t1 - t0) * 1e3 > 0:
                ax.text((t0 + t1) / 2 * 1e3, rank, text, ha="center", va="center",
                        fontsize=5, color="white", clip_on=True)
    ax.set_yticks([r for r, _, _ in rows])
    ax.set_yticklabels([f"rank {r}\n{label}" for r, label, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    legend = [Patch(color=COLOURS[k], label=CATEGORY[k]) for k in ("F", "B", "U", "AR", "RF")]
    ax.legend(handles=legend, loc="upper right", fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write(timeline: Timeline, comm, directory: str | Path, *, epoch: int | None = None,
          title: str = "pipeline schedule") -> Path | None:
    """Gather every rank's events to rank 0 and write timeline.json and timeline.png.

    Args:
        epoch: draw only this epoch in the PNG (the trace always holds all of them).

    Returns:
        The directory on rank 0, None elsewhere.
    """
    rows = comm.gather((timeline.rank, timeline.label, timeline.events), root=0)
    if comm.Get_rank() != 0:
        return None
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    rows = sorted(rows)
    (out / "timeline.json").write_text(json.dumps(chrome_trace(rows)))
    plot(rows, out / "timeline.png", epoch=epoch, title=title)
    return out
