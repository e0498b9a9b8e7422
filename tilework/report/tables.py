"""Tables of parameters for the terminal (rich): the plan that `parallelize` prints (`print_plan`)
and `tilework plan`'s report.

A parameter's name is what the user searches the model for and copies into `overrides=`, so it is
never cut: rich shrinks a table to the terminal by wrapping cells and, past that, truncating them
with an ellipsis ("_orig_mod.blocks.0.attent…"). Here the other columns wrap first, and a table
that still does not fit is printed wider than the terminal, which wraps its lines instead.
"""

from __future__ import annotations

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


def print_plan(plan, console=None) -> None:
    """The plan as a table: every parameter on every axis, its placement and predicted cost."""
    table = Table(title=f"tilework plan: mode={plan.mode}, mesh {plan.mesh}, "
                        f"sparse_reduce={plan.sparse_reduce}, "
                        f"local_aggregation={plan.local_aggregation}",
                  caption=plan.recompute_line())
    add_name_column(table)
    for col in plan.columns()[1:]:
        table.add_column(col, overflow="fold")   # wrap long words too, never cut them
    for name, *rest in plan.table():
        table.add_row(name_cell(name), *rest)
    print_table(table, console)
