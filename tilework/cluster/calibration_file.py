"""The calibration file: what `tilework calibrate` measured, written beside the cluster file
(`<cluster stem>.calibration.json`, every collective's fit and the compute rate) and into the
cluster file itself (the all-reduce fit as its link); and read back by `tilework plan`."""

from __future__ import annotations

import datetime
import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint.atomic import write_atomic
from ..comm.wire import COLLECTIVES
from ..config.files import from_dict, read_toml
from ..config.toml_writer import toml_text
from ..errors import UserError
from ..estimate.cost import seconds
from .topology import Cluster, Link

if TYPE_CHECKING:
    from .calibrate import Measurement


# ZeRO's two exchanges, timed by calibrate as the runtime makes them (comm/counted.py), and
# ring attention's shift (parallel/context/comm.py): each a Link's factor.
EXCHANGES = ("reduce_scatter", "all_gather", "ring_shift")


def exchange_factors(points: dict, link: Link, world_size: int) -> dict[str, float]:
    """Each of the `EXCHANGES` timed in `points` (collective -> [(wire bytes, seconds)], as
    calibrate times them on `world_size` ranks): the median over its points of its time over
    what `link` (the all-reduce's fit) prices its bytes and messages at; a Link's
    `reduce_scatter_factor`, `all_gather_factor` and `ring_shift_factor`. Only the points
    whose bytes take the link longer than its latency count, where any do: the factors scale
    large exchanges (ZeRO's buckets, cp's blocks), and the link's latency is what a small call
    costs between computes, which a point timed from a barrier does not pay."""
    out = {}
    for name in EXCHANGES:
        if points.get(name):
            messages = COLLECTIVES[name].messages(world_size)
            large = [(w, t) for w, t in points[name]
                     if w / link.bytes_per_s >= messages * link.latency_s]
            out[f"{name}_factor"] = statistics.median(
                t / seconds(w, link, messages) for w, t in large or points[name])
    return out


# Small calls whose meetings differ from the all-reduce's per message (gloo's all-to-all waits
# once for its n - 1 sends, its all-gather's ring n - 1 times): each a Link's latency factor.
MEETINGS = ("all_to_all", "all_gather")


def latency_factors(small: dict[str, tuple[int, float]], link: Link,
                    world_size: int) -> dict[str, float]:
    """Each of the `MEETINGS` timed in `small` (collective -> (wire bytes, the extra seconds a
    small call costs busy ranks), `calibrate.time_small_calls`): its time less its bytes at the
    link's bandwidth, over what `link` (the all-reduce's fit) charges its messages; a Link's
    `all_to_all_latency_factor` and `all_gather_latency_factor` (the bytes are priced on their
    own). None where there is no latency to scale or nothing is left of the call."""
    out = {}
    for name in MEETINGS:
        charged = COLLECTIVES[name].messages(world_size) * link.latency_s
        if small.get(name) is None or charged <= 0:
            continue
        wire, took = small[name]
        waited = took - wire / link.bytes_per_s
        if waited > 0:
            out[f"{name}_latency_factor"] = waited / charged
    return out


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def calibrated_flops(cluster_path: str | Path) -> tuple[float, str] | None:
    """The compute rate `tilework calibrate` wrote beside the cluster file, and when."""
    path = calibration_path(cluster_path)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    rate = data.get("compute", {}).get("flops_per_s") if isinstance(data, dict) else None
    if not isinstance(rate, (int, float)) or not rate > 0:
        return None
    return float(rate), f"{path.name}, {data.get('when', 'undated')}"


def calibrated_curve(cluster_path: str | Path):
    """The matmul efficiency curve `tilework calibrate` wrote beside the cluster file (None
    where it wrote none, or the file is unreadable)."""
    from .matmul_curve import MatmulCurve

    path = calibration_path(cluster_path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return MatmulCurve.from_dict(data["compute"]["matmul_curve"])
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def calibration_path(cluster_path: str | Path) -> Path:
    p = Path(cluster_path)
    return p.with_name(f"{p.stem}.calibration.json")


def write_calibration(cluster_path: str | Path, results: dict[str, Measurement],
                      spans_hosts: bool, when: str | None = None,
                      flops_per_s: float | None = None, curve=None,
                      speeds: list[float] | None = None) -> tuple[str, Path]:
    """Put the all-reduce fit into the cluster file's `links.inter` (`spans_hosts`) or
    `links.intra`, and every fit into `calibration_path(cluster_path)`. Returns the link's key and
    the JSON's path. Other keys of the file are kept; its comments are not (TOML writers drop
    them), except the leading comment block, which is kept with a line saying what changed."""
    path = Path(cluster_path)
    if "all_reduce" not in results:
        raise ValueError("the cluster file's link comes from the all_reduce fit, which is missing")
    when = when or datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    data = read_toml(path)
    Cluster.load(path)  # a valid file before, or a clear error naming it
    kind = "inter" if spans_hosts else "intra"
    link = results["all_reduce"].link()
    values = {"bandwidth_gbps": _sig(link.bandwidth_gbps), "latency_us": _sig(link.latency_us)}
    timed = {name: m.points for name, m in results.items()}
    n = results["all_reduce"].world_size
    values |= {k: _sig(v) for k, v in exchange_factors(timed, link, n).items()}
    small = {name: m.small_call[1:] for name, m in results.items() if m.small_call is not None}
    values |= {k: _sig(v) for k, v in latency_factors(small, link, n).items()}
    links = data.setdefault("links", {})
    if not isinstance(links, dict):
        raise UserError(f"{path}: links: expected a table")
    link_table = links.setdefault(kind, {})
    for stale in [f"{name}_factor" for name in EXCHANGES] + \
            [f"{name}_latency_factor" for name in MEETINGS]:   # measured against another fit
        link_table.pop(stale, None)
    link_table.update(values)
    hosts = data.get("hosts")
    if speeds is not None and isinstance(hosts, list) and len(hosts) == len(speeds):
        for host, speed in zip(hosts, speeds):   # hosts that differ: their relative speeds
            host["speed"] = speed
    from_dict(Cluster, data, source=str(path))  # still valid after the change

    original = path.read_text(encoding="utf-8")
    header = []
    for line in original.splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith("# tilework calibrate:"):
            header.append(line)
    header.append(f"# tilework calibrate: links.{kind} from {n}-rank all_reduce on {when} "
                  f"(all fits in {calibration_path(path).name})"
                  + (f"; hosts' speed from their matmul rates: {speeds}" if speeds else ""))
    write_atomic(path, "\n".join(header) + "\n" + toml_text(data))

    report = {"cluster": path.name, "when": when, "world_size": n,
              "spans_hosts": spans_hosts, "updated": f"links.{kind}", "link": values,
              "calibration": {name: m.as_dict() for name, m in results.items()}}
    if flops_per_s is not None:
        report["compute"] = {"flops_per_s": _sig(flops_per_s),
                             "how": "one thread's fp32 512x512 matmul, the slowest rank's"}
        if curve is not None:
            report["compute"]["matmul_curve"] = curve.as_dict()
        report["compute"]["host_speeds"] = speeds
    json_path = calibration_path(path)
    write_atomic(json_path, json.dumps(report, indent=2) + "\n")
    return f"links.{kind}", json_path


def summary(results: dict[str, Measurement]) -> str:
    lines = [f"{'collective':<11} {'alpha_us':>9} {'bandwidth_gbps':>14}  points (wire KB: ms)"]
    for name, m in results.items():
        pts = ", ".join(f"{w / 1024:g}: {s * 1e3:.3g}" for w, s in m.points)
        if m.small_call is not None:
            pts += f"; after compute {m.small_call[1] / 1024:g}: {m.small_call[2] * 1e3:.3g}"
        lines.append(f"{name:<11} {m.alpha_us:>9.1f} {m.bandwidth_gbps:>14.3f}  {pts}")
    ring = results.get("all_reduce")
    if ring is not None and ring.alpha_s == 0:
        # Measured: a loopback fit with alpha 0 priced every message of a recommender's step
        # free, and the plan sending the most of them was chosen at 2.35x the fastest.
        lines.append("note: the all_reduce fit gave no latency (alpha clamped at 0: its small "
                     "calls were not slower than its large ones predict), so the planner will "
                     "price every message as free; calibrate again on a quieter machine, or set "
                     "latency_us by hand")
    return "\n".join(lines)
