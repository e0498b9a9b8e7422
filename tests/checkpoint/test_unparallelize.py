"""unparallelize: every change parallelize made is listed and undone; the plain model and
optimizer that come back are what one process holds after the same steps, and train on as it
does."""

import torch
from torch import nn

import tilework
from tilework.testing import spawn

BATCH, STEPS, MORE = 8, 3, 2


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 4, sparse=True)
        self.dense = nn.Embedding(20, 4)          # dense-layout gradient: all-reduced
        self.head = nn.Linear(8, 1)

    def forward(self, a, b):
        return self.head(torch.cat([self.emb(a), self.dense(b)], 1)).squeeze(1)


def batch(step):
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, 50, (BATCH,), generator=g),
            torch.randint(0, 20, (BATCH,), generator=g),
            torch.randn(BATCH, generator=g))


def make():
    model = Tiny()
    return model, torch.optim.Adagrad(model.parameters(), lr=0.1)


def train(model, opt, steps, rank=0, world_size=1):
    for step in steps:
        a, b, y = (t.chunk(world_size)[rank] for t in batch(step))
        opt.zero_grad()
        nn.functional.mse_loss(model(a, b), y).backward()
        opt.step()


def _run(rank, world_size):
    model, opt = make()
    hooks_before = (len(model._forward_pre_hooks), len(opt._optimizer_step_pre_hooks))
    tilework.parallelize(model, opt, mode="hybrid", log=False)
    listed = model._tilework_engine.changes.listing()
    train(model, opt, range(STEPS), rank, world_size)
    tilework.unparallelize(model, opt)
    plain = (type(model.emb) is nn.Embedding and not hasattr(model, "_tilework_engine")
             and not hasattr(model, "no_sync") and "zero_grad" not in vars(opt)
             and (len(model._forward_pre_hooks), len(opt._optimizer_step_pre_hooks))
             == hooks_before and all(not p._post_accumulate_grad_hooks
                                     for p in model.parameters()))
    train(model, opt, range(STEPS, STEPS + MORE))   # on as one process, on the whole batch
    return listed, plain, {k: v.clone() for k, v in model.state_dict().items()}


def test_unparallelize_gives_back_what_one_process_holds():
    out = spawn(_run, world_size=2, timeout=90)
    model, opt = make()
    train(model, opt, range(STEPS + MORE))
    for rank in range(2):
        listed, plain, state = out[rank]
        assert plain, "a hook, attribute or module of tilework's is still there"
        assert any("emb: replaced by a ShardedEmbedding" in line for line in listed), listed
        assert any("optimizer.zero_grad" in line for line in listed), listed
        for key, value in model.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)
