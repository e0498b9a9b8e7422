"""Context parallelism: ring attention over the mesh's cp axis, the sequence split into 2*cp
load-balanced chunks, applied to an unmodified model.

    mesh = parallel_mesh(world_size, ranks_per_host, cp=2)        # dp x pp x cp x tp
    groups = build_mesh_groups(mesh)                              # tilework.parallel.tensor's, once
    apply_context_parallel(model, groups.group("cp"), stats)      # then make the optimizer
    tokens, targets = shard_sequence(tokens, targets, groups.coord("cp"), groups.size("cp"))
    loss = model(tokens, targets); loss.backward()
    average_gradients(model, groups.group("cp"), stats, "cp")     # tilework.parallel.tensor's

docs/context-parallel.md says what each piece does and what is not done.
"""

from .apply import RingSelfAttention, ShardedPositions, apply_context_parallel
from .comm import Ring
from .cost import cp_attention_bytes, cp_gradient_bytes, cp_step_bytes, kv_block_bytes
from .layout import chunks_of, local_positions, shard, shard_sequence, unshard
from .ring import ring_attention
from .sdpa import RingForward, RingSDPA

__all__ = ["Ring", "RingForward", "RingSDPA", "RingSelfAttention", "ShardedPositions",
           "apply_context_parallel", "chunks_of", "cp_attention_bytes", "cp_gradient_bytes",
           "cp_step_bytes", "kv_block_bytes", "local_positions", "ring_attention", "shard",
           "shard_sequence", "unshard"]
