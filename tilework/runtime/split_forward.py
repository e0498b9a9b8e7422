"""A module whose children tensor parallelism split runs the user's code on their local widths:
code that assumes the whole width fails there with a message about shapes. Its forward is
wrapped to name the split it met and the fix, in one line (docs/tensor-parallel.md)."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..errors import PlanError, UserError
from .changes import Changes

_SPLIT_STYLES = ("colwise", "colwise_fused", "colwise_gather", "rowwise", "heads")


def name_split_failures(model: nn.Module, layout, changes: Changes) -> None:
    """A module whose children were split runs the user's code on their local widths; code
    that assumes the whole width (nanoGPT's `c_attn(x).split(self.n_embd, dim=2)`, a view to
    the input's width) fails there with a message about shapes. Its forward is given a wrapper
    that says which split it met and how to write it instead, in one line."""
    from ..parallel.tensor.layout import base_style

    split: dict[str, list[str]] = {}
    for p in layout.placements:
        if base_style(p.style) in _SPLIT_STYLES and p.module:
            parent = p.module.rpartition(".")[0]
            split.setdefault(parent, []).append(f"{p.module.rpartition('.')[2]}: {p.style}")
    for name, children in split.items():
        module = model.get_submodule(name)
        if "forward" not in vars(module):
            changes.set_attribute(module, "forward", _SplitParentForward(module, name, children),
                                  f"{name or 'the model'}: forward names a split's shape errors")


class _SplitParentForward:
    """A module's own forward, its shape errors named as the split's doing. Only an error
    raised in that forward's own code (a split, view or unpack of a child's output) is
    renamed: one from deeper down (a lost peer in a collective, a child's own failure) or an
    out-of-memory passes as it is. Holds its module (pickles and copies with it), and shows
    the forward's own signature (code that inspects it: Hugging Face's, RingSDPA's)."""

    def __init__(self, module: nn.Module, name: str, children: list[str]):
        self.module, self.name, self.children = module, name, children
        self.__signature__ = inspect.signature(type(module).forward.__get__(module))

    def __call__(self, *args, **kwargs):
        forward = type(self.module).forward
        try:
            return forward(self.module, *args, **kwargs)
        except (RuntimeError, ValueError, TypeError, IndexError) as e:
            if isinstance(e, (UserError, torch.OutOfMemoryError)) or \
                    not _raised_in(e, forward.__code__):
                raise
            raise PlanError(
                f"tensor parallel: {self.name or 'the model'} ({type(self.module).__name__}) "
                f"failed on its split modules ({', '.join(self.children)}): "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. Its forward "
                "assumes whole widths (a split by a width it keeps, a view to the input's "
                "width); write those with -1 or the local width, as Hugging Face's models "
                "do, or leave these modules out of the layout") from e


def _raised_in(error: BaseException, code) -> bool:
    """The innermost Python frame of `error`'s traceback runs `code`."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code is code
