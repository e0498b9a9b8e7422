"""Draws docs/step-dataflow.png: one training step of a parallelized model on one rank, in hybrid
mode, as the runtime executes it (docs/architecture.md explains each box).

    .venv/bin/python docs/step_dataflow.py
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

LANES = ["user's loop", "compute", "collectives (gloo / NCCL)", "server rows (owners)"]
# (lane, start, end, label, colour)
BOXES = [
    (0, 0.0, 3.0, "loss = model(batch)", "#dfe7fd"),
    (1, 0.1, 0.9, "ids: unique,\nrange check", "#e8e8e8"),
    (2, 0.9, 1.6, "PULL all-to-all:\nids out, rows back", "#ffd6a5"),
    (1, 1.6, 3.0, "forward with pulled rows\n(dense layers as usual)", "#e8e8e8"),
    (0, 3.1, 8.0, "loss.backward()", "#dfe7fd"),
    (1, 3.2, 6.0, "autograd: grads of dense params;\nrow grads of tables kept locally", "#e8e8e8"),
    (2, 4.0, 5.3, "bucket all-reduces\n(async, in order)", "#caffbf"),
    (2, 6.05, 6.95, "last bucket\n+ check words", "#caffbf"),
    (2, 7.0, 8.0, "PUSH all-to-all:\nids + grad rows", "#ffd6a5"),
    (3, 7.5, 8.4, "summed rows\nheld", "#ffadad"),
    (0, 8.1, 8.9, "clip / inspect\n(.grad = mean)", "#dfe7fd"),
    (0, 9.0, 10.5, "optimizer.step()", "#dfe7fd"),
    (1, 9.1, 10.1, "user's optimizer\non dense params", "#e8e8e8"),
    (3, 9.1, 10.1, "row-wise optimizer\non owned rows", "#ffadad"),
]
MARKS = [(6.0, "end-of-backward callback", 0.55),
         (8.03, "backward() returns:\nevery .grad is the average", 0.05),
         (9.03, "step pre-hook: inputs\nagreed, rows applied", 0.55)]


def draw(path: Path) -> None:
    fig, ax = plt.subplots(figsize=(13, 4.8))
    for lane, start, end, label, colour in BOXES:
        y = len(LANES) - 1 - lane
        ax.add_patch(FancyBboxPatch((start, y + 0.12), end - start, 0.76,
                                    boxstyle="round,pad=0.02", fc=colour, ec="#555555"))
        ax.text((start + end) / 2, y + 0.5, label, ha="center", va="center", fontsize=8)
    for x, label, height in MARKS:
        ax.axvline(x, color="#aa3333", lw=1, ls="--")
        ax.text(x + 0.05, len(LANES) + height, label, fontsize=7.5, color="#aa3333", va="bottom")
    ax.set_yticks([len(LANES) - 1 - i + 0.5 for i in range(len(LANES))], LANES)
    ax.set_xlim(-0.1, 10.7)
    ax.set_ylim(0, len(LANES) + 1.1)
    ax.set_xticks([])
    ax.set_xlabel("time within one step (not to scale)")
    ax.set_title("One step on one rank, hybrid mode: tables on the parameter server, dense "
                 "parameters all-reduced", fontsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    draw(Path(__file__).with_name("step-dataflow.png"))
