"""User-facing errors: things the user can fix (a file, a key, a flag), reported in one line.

The CLI turns a `UserError` into that line on stderr and exit code 2, never a traceback. Anything
else that escapes is a bug in tilework and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input: the message names the file/field and what was expected."""

    exit_code = 2

    def __str__(self) -> str:
        # One line whatever the input held: a line break in a key, a path or an argument is
        # shown escaped, as repr() shows it.
        return "".join(c if c.isprintable() else repr(c)[1:-1] for c in super().__str__())


class ConfigError(UserError):
    """A TOML file (job, cluster) or a value in it is wrong."""

    def __init__(self, where: str, problem: str):
        self.where = where
        self.problem = problem
        super().__init__(f"{where}: {problem}" if where else problem)


class PlanError(UserError, ValueError):
    """A parallel plan cannot be applied to this model (names the parameter, and the ranks), or
    a model's call is one the plan cannot run. A ValueError too, as torch's own refusals of a
    bad argument are, so code that catches those catches these."""


class UnsupportedCall(PlanError, TypeError):
    """A call on a parallelized tensor or module that the layout cannot give one process's
    answer to (a loss other than cross-entropy on vocabulary-split logits, say)."""


class CheckpointError(UserError):
    """A checkpoint is missing, truncated, corrupted or from a different model."""


class InputError(UserError):
    """What a rank fed the model is wrong (ids out of range, a non-finite loss, batches that
    differ across ranks). `ranks` are the ranks at fault: the others stop because of them."""

    def __init__(self, message: str, ranks: tuple[int, ...]):
        self.ranks = tuple(ranks)
        super().__init__(message)


class IdOutOfRange(InputError, IndexError):
    """An embedding id outside its table (an IndexError too, as nn.Embedding raises)."""


def use_allreduce_hint(name: str) -> str:
    """The call that keeps parameter `name` off the parameter server, for refusals it fixes."""
    return f"parallelize(model, opt, overrides={{{name!r}: 'allreduce'}})"
