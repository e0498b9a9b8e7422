"""Tensor and sequence parallelism (Megatron-LM), applied to an unmodified model by a layout.

    mesh = parallel_mesh(world_size, ranks_per_host, tp=2)     # dp x pp x cp x tp
    groups = build_mesh_groups(mesh)                            # every rank, once
    tp = TensorParallel.from_mesh(groups, stats, sequence_parallel=True)
    plan = apply_layout(model, layout_for(model), tp)           # then make the optimizer
    loss = model(tokens, targets); loss.backward()
    average_gradients(model, groups.group("dp"), stats)         # data parallel across dp
    full_state_dict(model, plan, tp)                            # one-process checkpoint

docs/tensor-parallel.md says what each piece does and why it is built on our own counted
autograd functions rather than DTensor.
"""

from ...comm.groups import MeshGroups, build_mesh_groups
from .apply import apply_layout, average_gradients, full_state_dict, load_full_state_dict
from .cost import dp_step_bytes, step_bytes, tp_step_bytes
from .layout import GPT_LAYOUT, STYLES, LayoutPlan, Placement, layout_for, plan_layout
from .loss import vocab_parallel_cross_entropy
from .regions import TensorParallel

__all__ = ["GPT_LAYOUT", "STYLES", "LayoutPlan", "MeshGroups", "Placement", "TensorParallel",
           "apply_layout", "average_gradients", "build_mesh_groups", "dp_step_bytes",
           "full_state_dict", "layout_for", "load_full_state_dict", "plan_layout", "step_bytes",
           "tp_step_bytes", "vocab_parallel_cross_entropy"]
