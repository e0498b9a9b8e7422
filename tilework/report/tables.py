"""What is printed for the terminal (rich): the plan that `parallelize` prints (`print_plan`) and
`tilework plan`'s report of any job (`print_report`, on report/job.report's dict).

A parameter's name is what the user searches the model for and copies into `overrides=`, so it is
never cut: rich shrinks a table to the terminal by wrapping cells and, past that, truncating them
with an ellipsis ("_orig_mod.blocks.0.attent…"). Here the other columns wrap first, and a table
that still does not fit is printed wider than the terminal, which wraps its lines instead.
"""

from __future__ import annotations

import io
from collections import defaultdict

from rich.console import Console
from rich.table import Table
from rich.text import Text

_UNBOUNDED = 1 << 16  # wide enough to measure any table's narrowest layout without clamping


def add_name_column(table: Table, header: str = "parameter") -> None:
    table.add_column(header, no_wrap=True)


def name_cell(name: str) -> Text:
    """Text, not markup: a module key may hold "[b]", which rich would take for a tag."""
    return Text(name)


def print_table(table: Table, console: Console | None = None) -> None:
    """On a terminal, the table fits its width where it can; elsewhere (a log file, CI, a
    `tilework run` rank's output) every row is one line at the table's natural width: a cell
    wrapped mid-word in a log ("allreduce (replicate" / "d)") cannot be searched for."""
    console = console or Console()
    widths = console.measure(table, options=console.options.update_width(_UNBOUNDED))
    if not console.is_terminal:
        table.width = widths.maximum
    elif widths.minimum > console.width:
        table.width = widths.minimum
    console.print(table, crop=False)


def _plan_title(plan) -> str:
    return (f"tilework plan: mode={plan.mode}, mesh {plan.mesh}, "
            f"sparse_reduce={plan.sparse_reduce}, local_aggregation={plan.local_aggregation}")


def _plan_table(plan) -> Table:
    """Every parameter on every axis, its placement and predicted cost."""
    table = Table(title=_plan_title(plan), caption=plan.recompute_line())
    add_name_column(table)
    for col in plan.columns()[1:]:
        table.add_column(col, overflow="fold")   # wrap long words too, never cut them
    for name, *rest in plan.table():
        table.add_row(name_cell(name), *rest)
    return table


def print_plan(plan, console=None) -> None:
    """The plan as a table: every parameter on every axis, its placement and predicted cost."""
    print_table(_plan_table(plan), console)


# -- `tilework plan`'s report ---------------------------------------------------------------------

def _shares_lines(out: dict) -> list[str]:
    """Uneven batch shares (report/job.shares_section): who takes what, and the compute pace
    against the even split and the ideal."""
    found = out.get("shares")
    if not found:
        return []
    speeds, shares = found["speeds"], found["batch_shares"]
    per_rank = ", ".join(f"rank {r}: {'even' if shares is None else shares[r]} at speed {s:g}"
                         for r, s in enumerate(speeds))
    return [f"batch shares: {per_rank}",
            f"compute pace (slowest rank, 1 = an even share at speed 1): {found['pace']:.3g}; "
            f"even split {found['even_pace']:.3g}; ideal (the sum of speeds) "
            f"{found['ideal_pace']:.3g}: {found['ideal_pace'] / found['pace']:.0%} of the ideal"]


def print_report(out: dict, title: str, console: Console | None = None) -> None:
    """The report of any job: a head line, the per-parameter table with the recompute line under
    it, the sections the report holds (a data-parallel job's communication per mode; a mesh's
    groups, stages, schedule, step and bytes per rank), then the memory per rank."""
    console = console or Console(soft_wrap=True)
    # Text, not markup: a path may hold "[/b]", which rich would take for a closing tag.
    hosts = f"{out['hosts']} host" + ("s" if out["hosts"] != 1 else "")
    console.print(Text(f"{title}: {hosts}, {out['world_size']} ranks"))
    print_table(_params_table(out), console)
    for line in (_comm_lines(out) + _mesh_lines(out) + _shares_lines(out)
                 + _memory_lines(out["memory"])):
        console.print(Text(line))
    for line in _over_budget_lines(out["memory"]):
        console.print(Text(line, style="bold red"))


def format_report(out: dict, title: str) -> str:
    """`print_report` as plain text (no colour), each row of the table on one line."""
    console = Console(file=io.StringIO(), soft_wrap=True, width=100)
    print_report(out, title, console)
    return console.file.getvalue()


def _params_table(out: dict) -> Table:
    """The plan's table; a data-parallel report's entries carry their traffic and cost on this
    cluster (report/job.param_costs), shown instead of the plan's own columns."""
    from ..plans.plan import Plan

    plan = Plan.from_dict(out["plan"])
    if "params" not in out:
        return _plan_table(plan)
    table = Table(title=_plan_title(plan), caption=out["recompute"])
    add_name_column(table)
    for col in ("shape", "rows/step", "method", "partitions", "MB/step", "ms/step", "why"):
        table.add_column(col,
                         justify="right" if col in ("MB/step", "ms/step", "rows/step") else "left")
    for p in out["params"]:
        table.add_row(name_cell(p["name"]), "x".join(map(str, p["shape"])),
                      "-" if p["density"] is None else f"{p['density']:.2%}", p["method"],
                      str(p["partitions"]) if p["method"] == "ps" else "-",
                      f"{p['bytes_sent'] / 1e6:.3f}", f"{p['seconds'] * 1e3:.3f}", p["why"])
    return table


def _comm_lines(out: dict) -> list[str]:
    if "step_comm_seconds" not in out:
        return []
    t, speedup = out["step_comm_seconds"], out["hybrid_speedup_over_allreduce"]
    return [f"predicted communication per step: hybrid {t['hybrid'] * 1e3:.2f} ms, "
            f"all-AllReduce {t['allreduce'] * 1e3:.2f} ms, all-PS {t['ps'] * 1e3:.2f} ms, "
            f"DDP-style sparse all-gather {t['ddp_sparse_allgather'] * 1e3:.2f} ms"
            # None where nothing is sent (one rank): no ratio to give
            + ("" if speedup is None else f"; hybrid speed-up over all-AllReduce {speedup:.2f}x")]


def _mesh_lines(out: dict) -> list[str]:
    if "mesh" not in out:
        return []
    axes = out["mesh"]["axes"]
    lines = ["mesh " + " x ".join(f"{a}={s}" for a, s in axes.items())
             + " (tp fastest: consecutive ranks; dp crosses hosts first)"]
    for axis in ("tp", "cp", "pp", "dp"):
        lines.append(f"  {axis} groups: " + _groups_text(out["mesh"]["groups"][axis], axes[axis]))
    lines += _stage_lines(out)
    if axes["pp"] > 1:
        lines += ["schedule (rank x time, one unit per action):",
                  *("  " + line for line in out["schedule"]["text"].splitlines())]
    lines += _time_lines(out)
    lines.append(f"predicted bytes sent per step (mesh_cost.mesh_step_bytes; "
                 f"{out['batch_per_replica']} sequences of {out['seq_len']} per dp replica):")
    lines += ["  " + line for line in _bytes_lines(out["bytes_per_rank"])]
    if out["bytes_note"]:
        lines.append(f"  ({out['bytes_note']})")
    return lines


def _groups_text(groups: list, size: int, shown: int = 4) -> str:
    if size == 1:
        return "none (size 1)"
    text = " ".join("(" + ", ".join(map(str, g)) + ")" for g in groups[:shown])
    return text + (f" ... {len(groups)} groups in all" if len(groups) > shown else "")


def _stage_lines(out: dict) -> list[str]:
    if out["mesh"]["axes"]["pp"] == 1:
        return ["pipeline: none (pp = 1)"]
    lines = ["pipeline stages (cut by stages.balance on each block's matmul weights):"]
    for s in out["stages"]:
        lines.append(f"  stage {s['stage']} on pp rank {s['pp_rank']}: "
                     f"{', '.join(s['holds'])}; cost share {s['cost_share']:.1%}; forward "
                     f"{s['forward_s'] * 1e3:.3f} ms per microbatch")
    return lines


def _time_lines(out: dict) -> list[str]:
    link, pipelined = out["pp_link"], out["mesh"]["axes"]["pp"] > 1
    where = "between hosts" if link["between_hosts"] else "inside a host"
    bubbles = ", ".join(f"{b:.3f}" for b in out["bubbles"])
    first = (f"predicted step {out['predicted_step_s'] * 1e3:.3f} ms: "
             + (f"schedule {out['pipeline_step_s'] * 1e3:.3f} ms (pipeline.simulate)"
                if pipelined else f"forward and backward {out['pipeline_step_s'] * 1e3:.3f} ms")
             + (f" at the slowest's pace x{out['pace']:.3g}"
                if out.get("pace", 1.0) != 1.0 else "")
             + f" + dp all-reduce {out['dp_allreduce_s'] * 1e3:.3f} ms"
             + (f"; bubble {out['bubble']:.3f} (per pp rank {bubbles})" if pipelined else ""))
    pp_link = (f"pp link {where}: {link['bandwidth_gbps']:g} Gbit/s, {link['latency_us']:g} us, "
               f"{out['activation_bytes']:,} bytes per boundary; " if pipelined else "")
    exchanges = ", ".join(f"{axis} {out[f'{axis}_s'] * 1e3:.3f} ms" for axis in ("tp", "cp")
                          if out[f"{axis}_s"])
    return [first, f"  compute {out['flops_per_s'] / 1e9:,.1f} GFLOP/s per rank "
                   f"({out['flops_source']}); {pp_link}"
                   + (f"exchanges on the critical path, in the stages' times: {exchanges}"
                      if exchanges else "no tp or cp exchanges")]


def _bytes_lines(per_rank: list[dict]) -> list[str]:
    """Ranks with the same bytes on one line."""
    rows: dict[tuple, list[int]] = defaultdict(list)
    for b in per_rank:
        rows[tuple((k, v) for k, v in b.items() if k != "rank")].append(b["rank"])
    return [f"{_ranks(ranks)}: " + (", ".join(f"{k} {_kb(v)}" for k, v in axes) or "nothing")
            for axes, ranks in rows.items()]


# Shown on every line; an estimate's other parts (buckets, temporaries, ...) where not zero.
_MEMORY_PARTS = ("parameters", "gradients", "optimizer_state", "activations")
_NOT_PARTS = ("rank", "peak", "budget", "over_budget")


def _memory_lines(memory: list[dict]) -> list[str]:
    """Ranks whose estimates print the same on one line (a data-parallel job's ranks differ
    only in their shards of the servers' tables, a mesh's by their (pp, cp, tp) coordinate); a
    rank over its budget says so."""
    rows: dict[str, list[int]] = defaultdict(list)
    for m in memory:
        parts = ", ".join(f"{k.replace('_', ' ')} {_kb(v)}" for k, v in m.items()
                          if k not in _NOT_PARTS and (k in _MEMORY_PARTS or v))
        text = f"peak {_kb(m['peak'])} ({parts})"
        if m["budget"] is not None:
            text += (f"; OVER its budget of {_kb(int(m['budget']))} (80% of memory_gb)"
                     if m["over_budget"] else f"; budget {_kb(int(m['budget']))}")
        rows[text].append(m["rank"])
    return ["estimated memory per rank (tilework.estimate_memory; docs/memory.md says how the "
            "parts combine):", *(f"  {_ranks(ranks)}: {text}" for text, ranks in rows.items())]


def _over_budget_lines(memory: list[dict], shown: int = 5) -> list[str]:
    over = [m for m in memory if m["over_budget"]]
    lines = [f"rank {m['rank']}: estimated peak {_kb(m['peak'])} is over its budget of "
             f"{_kb(int(m['budget']))} (80% of the cluster file's memory_gb for its host)"
             for m in over[:shown]]
    return lines + ([f"... and {len(over) - shown} more ranks over budget"]
                    if len(over) > shown else [])


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:8])) + (f" ... ({len(ranks)})" if len(ranks) > 8
                                                         else "")


def _kb(n: int) -> str:
    return f"{n:,} B" if n < 10_000 else f"{n / 1e3:,.1f} kB" if n < 10_000_000 else \
        f"{n / 1e6:,.1f} MB"
