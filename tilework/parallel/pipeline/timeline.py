"""Draw pipeline timelines (simulated or measured) as a PNG: one panel per timeline, a row per
rank, a box per action (forward light, backward dark, weight gradient grey), labelled with its
string form.

    draw({"simulated": sim.timeline, "measured": rows}, "docs/pipeline-1f1b.png")

A timeline is a list of (rank, start s, end s, action); matplotlib is needed only here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping

COLOURS = {"F": "#a8c8f0", "B": "#2f6db3", "W": "#9a9a9a"}


def draw(timelines: Mapping[str, Iterable[tuple]], path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {name: list(rows) for name, rows in timelines.items()}
    fig, axes = plt.subplots(len(panels), 1, squeeze=False, sharex=True,
                             figsize=(12, 1.2 + 0.5 * sum(_ranks(r) for r in panels.values())))
    for ax, (name, rows) in zip(axes[:, 0], panels.items()):
        for rank, start, end, action in rows:
            kind = str(action)[len(str(action).rstrip("0123456789")) - 1]
            ax.barh(rank, (end - start) * 1e3, left=start * 1e3, height=0.8,
                    color=COLOURS.get(kind, "#ccc"), edgecolor="white", linewidth=0.5)
            ax.text((start + end) / 2 * 1e3, rank, str(action), ha="center", va="center",
                    fontsize=6, color="black" if kind != "B" else "white")
        ax.set_yticks(range(_ranks(rows)))
        ax.set_yticklabels([f"rank {r}" for r in range(_ranks(rows))])
        ax.invert_yaxis()
        ax.set_title(name, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("ms from the step's start")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _ranks(rows) -> int:
    return 1 + max((r[0] for r in rows), default=0)
