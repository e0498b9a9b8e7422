"""A tiny GPT trained the way karpathy/nanoGPT's train.py trains one, adapted to tilework the way
the README says.

nanoGPT's habits kept here: a GPT with token + position embeddings, causal self-attention, an MLP,
LayerNorm and an lm_head whose weight is tied to the token embedding; AdamW with two parameter
groups (weight decay for the >= 2-D weights, none for biases and norms); gradient accumulation
with `model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)` exactly
as nanoGPT sets it for DDP; `torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)`
behind a (disabled, float32) GradScaler; a warmup + cosine learning rate written by hand into
every `param_group["lr"]` each iteration; `estimate_loss()` under no_grad; a checkpoint dict
{"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), ...} written by the master
process alone, and `--resume` (nanoGPT's init_from='resume'): plain torch.load, then
load_state_dict into the model and the optimizer before the model is parallelized.

What changed for tilework:
- `model, optimizer = tilework.parallelize(model, optimizer)` where nanoGPT has
  `model = DDP(model, device_ids=[ddp_local_rank])` (every parameter is dense here, so all are
  all-reduced; model.state_dict() is this rank's own copy, which rank 0 alone may save);
- the global batch is drawn identically on every rank (a generator seeded by the iteration, so a
  resumed run sees the same batches) and rank r takes its contiguous slice of rows; nanoGPT
  instead seeds each rank differently and divides the accumulation steps by the world size;
- `estimate_loss()` runs on every rank; `--eval_master_only` keeps nanoGPT's own
  `if iter_num % eval_interval == 0 and master_process:` (no collective in a no_grad forward of
  an all-reduced model, so rank 0 may evaluate alone).
The data is a synthetic token stream from a fixed seed: nothing is downloaded.

    python examples/nanogpt_style.py --steps 20
    tilework run -n 2 examples/nanogpt_style.py --steps 20
    tilework run -n 2 examples/nanogpt_style.py --steps 20 --tp 2   # or --pp 2, or --cp 2

With --tp, --pp or --cp (tilework's mesh) a few more lines change, each marked `mesh:`:
- every rank of one model replica takes the same rows: `tilework.data_parallel_rank(model)`
  gives the replica, not the world rank;
- --tp splits the MLP (c_fc column-wise, c_proj row-wise); nanoGPT's attention splits c_attn's
  output by the whole n_embd, so it stays whole (tilework refuses it in one line if asked);
- --pp: one `model.step(X, Y)` runs the accumulation's micro-batches as the pipeline's
  microbatches (forward and backward; the loss on the last stage's rank), `model.evaluate`
  evaluates;
- clipping is `tilework.clip_grad_norm_(model, grad_clip)` (a rank holds a part of the model),
  and the recorded state is `tilework.state_dict(model, optimizer)`, every rank calling it.
"""

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F

import tilework

parser = argparse.ArgumentParser(description="tiny GPT, nanoGPT style")
parser.add_argument("--steps", type=int, default=20, help="max_iters: optimizer steps in all")
parser.add_argument("--out", type=str, default="", help="rank 0 writes losses and final state")
parser.add_argument("--out_dir", type=str, default="", help="where ckpt.pt goes (empty: none)")
parser.add_argument("--resume", action="store_true", help="init_from='resume': load ckpt.pt")
parser.add_argument("--eval_interval", type=int, default=4)
parser.add_argument("--eval_master_only", action="store_true",
                    help="evaluate on rank 0 only, as nanoGPT does (default: every rank)")
parser.add_argument("--plain", action="store_true", help="do not call tilework (one process)")
parser.add_argument("--tp", type=int, default=1, help="tensor parallel ranks (the MLP split)")
parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
parser.add_argument("--cp", type=int, default=1, help="context parallel ranks (the sequence)")
args = parser.parse_args()
on_mesh = max(args.tp, args.pp, args.cp) > 1
if on_mesh and (args.plain or args.resume or args.eval_master_only):
    raise SystemExit("--tp/--pp/--cp: not with --plain, --resume or --eval_master_only")

# -----------------------------------------------------------------------------
# default config values, tiny
eval_iters = 2
always_save_checkpoint = True
gradient_accumulation_steps = 2   # micro-steps per optimizer step
batch_size = 4                    # global micro-batch size (rows), split over the ranks
block_size = 8
vocab_size = 32
n_layer, n_head, n_embd, dropout = 2, 2, 16, 0.0
# nanoGPT's default. With bias=True the key third of c_attn.bias has a gradient that is zero in
# exact arithmetic (softmax ignores a shift shared by all keys): pure rounding noise, which Adam
# turns into lr-sized steps that differ between any two summation orders (here 2e-4 of that
# tensor's largest value after 8 steps, in tensors of values ~5e-6).
bias = False
learning_rate = 6e-3              # max learning rate
max_iters = args.steps
weight_decay = 1e-1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0                   # clip gradients at this value, or disable if == 0.0
decay_lr = True
warmup_iters = 3
lr_decay_iters = 16               # fixed as in nanoGPT (not --steps): a resumed run's lr matches
min_lr = 6e-4
dtype = "float32"
# -----------------------------------------------------------------------------

# nanoGPT: ddp = int(os.environ.get('RANK', -1)) != -1; here tilework.parallelize joins the world.
ddp_rank = int(os.environ.get("RANK", "0"))
ddp_world_size = int(os.environ.get("WORLD_SIZE", "1"))
master_process = ddp_rank == 0
if args.plain and ddp_world_size != 1:
    raise SystemExit("--plain runs one process only")
assert batch_size % ddp_world_size == 0
torch.manual_seed(1337)  # the same on every rank: the replicas start equal


# -----------------------------------------------------------------------------
# the model
class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        assert n_embd % n_head == 0
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)  # key, query, value projections
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        k = k.view(B, T, n_head, C // n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, n_head, C // n_head).transpose(1, 2)
        v = v.view(B, T, n_head, C // n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                           dropout_p=dropout if self.training else 0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(dropout),
            h=nn.ModuleList([Block() for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd, bias=bias),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():  # scaled init of the residual projections
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)
        else:  # inference: only the last position
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        # 2-D parameters (matmul weights, embeddings) decay; biases and layernorms do not.
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [{"params": decay_params, "weight_decay": weight_decay},
                        {"params": nodecay_params, "weight_decay": 0.0}]
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas)


# -----------------------------------------------------------------------------
# data: a synthetic stream (each token mostly followed by one of two successors)
def make_stream(n, seed):
    g = torch.Generator().manual_seed(seed)
    rule = torch.Generator().manual_seed(3)  # the same successors in every split
    successors = torch.randint(0, vocab_size, (vocab_size, 2), generator=rule)
    out = torch.empty(n, dtype=torch.long)
    tok = 0
    for i in range(n):
        tok = int(successors[tok, int(torch.randint(0, 2, (), generator=g))])
        if torch.rand((), generator=g) < 0.1:
            tok = int(torch.randint(0, vocab_size, (), generator=g))
        out[i] = tok
    return out


train_data, val_data = make_stream(2000, 1), make_stream(400, 2)


def get_batch(split, seed, rows=None):
    """The global batch for `seed` (the same on every rank), or its rows `rows`."""
    data = train_data if split == "train" else val_data
    g = torch.Generator().manual_seed(seed)
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=g)
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return (x, y) if rows is None else (x[rows], y[rows])


per_rank = batch_size // ddp_world_size
my_rows = slice(ddp_rank * per_rank, (ddp_rank + 1) * per_rank)  # tilework: this rank's slice


def train_batch(it, micro_step):
    return get_batch("train", 100_000 + it * gradient_accumulation_steps + micro_step, my_rows)


# -----------------------------------------------------------------------------
# init: from scratch or resume
iter_num = 0
best_val_loss = 1e9
model = GPT()
ckpt_path = os.path.join(args.out_dir, "ckpt.pt") if args.out_dir else ""
checkpoint = None
if args.resume:
    if master_process:
        print(f"Resuming training from {args.out_dir}")
    checkpoint = torch.load(ckpt_path, map_location="cpu")
    state_dict = checkpoint["model"]
    unwanted_prefix = "_orig_mod."  # as nanoGPT: a torch.compile'd model saves with this prefix
    for k in list(state_dict.keys()):
        if k.startswith(unwanted_prefix):
            state_dict[k[len(unwanted_prefix):]] = state_dict.pop(k)
    model.load_state_dict(state_dict)
    iter_num = checkpoint["iter_num"]
    best_val_loss = checkpoint["best_val_loss"]

scaler = torch.amp.GradScaler("cpu", enabled=(dtype == "float16"))
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2))
if args.resume:
    optimizer.load_state_dict(checkpoint["optimizer"])
checkpoint = None  # free up memory

# tilework: where nanoGPT writes `model = DDP(model, device_ids=[ddp_local_rank])`
if not args.plain:
    mesh = dict(tp=args.tp, pp=args.pp, cp=args.cp, microbatches=gradient_accumulation_steps
                if args.pp > 1 else None)
    if args.tp > 1:   # mesh: the MLP split; the attention stays whole (the docstring says why)
        mesh["layout"] = {"transformer.h.*.mlp.c_fc": "colwise",
                          "transformer.h.*.mlp.c_proj": "rowwise"}
    model, optimizer = tilework.parallelize(model, optimizer, **mesh)
    # mesh: the rows of this model replica (the world's rank and size without tp/pp/cp)
    replica, replicas = tilework.data_parallel_rank(model)
    per_rank = batch_size // replicas
    my_rows = slice(replica * per_rank, (replica + 1) * per_rank)
raw_model = model  # nanoGPT: model.module if ddp else model


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split, 7_000 + k)   # the same whole batches on every rank
            if args.pp > 1:   # mesh: forward only, the loss on the last stage's rank
                losses[k] = holders_mean(model.evaluate(X, Y))
            else:
                logits, loss = model(X, Y)
                losses[k] = holders_mean(loss.item()) if on_mesh else loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    """Learning rate decay scheduler (cosine with warmup)."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


def holders_mean(value):
    """mesh: the mean over the ranks that hold a loss (under cp each its part of the
    sequence's tokens, equal in number; under pp the last stage's ranks)."""
    t = torch.tensor([0.0 if value is None else float(value), float(value is not None)],
                     dtype=torch.float64)
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def global_mean(values):
    """Mean over the ranks' means (equal slices: the global batch's mean), for the record."""
    t = torch.tensor(values, dtype=torch.float64)
    if ddp_world_size > 1:
        dist.all_reduce(t)
        t /= ddp_world_size
    return t.tolist()


# -----------------------------------------------------------------------------
# training loop
record = {"losses": [], "lrs": [], "evals": [], "grad_norms": []}
X, Y = train_batch(iter_num, 0)  # fetch the very first batch
while True:
    # determine and set the learning rate for this iteration
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr

    # evaluate the loss on train/val sets and write checkpoints (every rank evaluates, unless
    # --eval_master_only: nanoGPT's own `and master_process`, fine for an all-reduced model)
    evaluates = master_process or not args.eval_master_only
    if (iter_num % args.eval_interval == 0 or iter_num == max_iters) and evaluates:
        losses = estimate_loss()
        record["evals"].append((iter_num, float(losses["train"]), float(losses["val"])))
        if master_process:
            print(f"step {iter_num}: train loss {losses['train']:.4f}, "
                  f"val loss {losses['val']:.4f}")
        if losses["val"] < best_val_loss or always_save_checkpoint:
            best_val_loss = float(losses["val"])
            if iter_num > 0 and master_process and ckpt_path:
                checkpoint = {
                    "model": raw_model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "model_args": dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                                       block_size=block_size, vocab_size=vocab_size),
                    "iter_num": iter_num,
                    "best_val_loss": best_val_loss,
                }
                print(f"saving checkpoint to {args.out_dir}")
                torch.save(checkpoint, ckpt_path)
    if iter_num >= max_iters:
        break

    # forward backward update, with optional gradient accumulation to simulate larger batch size
    micro_losses = []
    if args.pp > 1:   # mesh: the accumulation's micro-batches are the pipeline's microbatches
        batches = [train_batch(iter_num, m) for m in range(gradient_accumulation_steps)]
        loss = model.step(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
        micro_losses = [holders_mean(None if loss is None else loss.item())]
        X, Y = train_batch(iter_num + 1, 0)
    for micro_step in range(gradient_accumulation_steps if args.pp == 1 else 0):
        # nanoGPT: "in DDP training we only need to sync gradients at the last micro step"
        model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
        logits, loss = model(X, Y)
        loss = loss / gradient_accumulation_steps  # scale the loss to account for accumulation
        micro_losses.append(loss.item() * gradient_accumulation_steps)
        if on_mesh:   # mesh: this replica's loss, as the ranks that hold it saw it
            micro_losses[-1] = holders_mean(micro_losses[-1])
        # immediately async prefetch next batch while model is doing the forward pass
        X, Y = train_batch(iter_num + (micro_step + 1) // gradient_accumulation_steps,
                           (micro_step + 1) % gradient_accumulation_steps)
        scaler.scale(loss).backward()
    # clip the gradient
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        norm = (tilework.clip_grad_norm_(model, grad_clip) if on_mesh   # mesh: the whole norm
                else torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
        record["grad_norms"].append(float(norm))
    # step the optimizer and scaler if training in fp16
    scaler.step(optimizer)
    scaler.update()
    # flush the gradients as soon as we can, no need for this memory anymore
    optimizer.zero_grad(set_to_none=True)

    if on_mesh:   # mesh: already the batch's mean
        record["losses"].append(sum(micro_losses) / len(micro_losses))
    else:
        record["losses"].append(sum(global_mean(micro_losses)) / gradient_accumulation_steps)
    record["lrs"].append(lr)
    if master_process:
        print(f"iter {iter_num}: loss {record['losses'][-1]:.4f}, lr {lr:.2e}")
    iter_num += 1

final = tilework.state_dict(model, optimizer)["model"] if on_mesh else None   # every rank
if args.out and master_process:
    record["state"] = final if on_mesh else {k: v.detach().clone()
                                             for k, v in raw_model.state_dict().items()}
    record["iter_num"] = iter_num
    torch.save(record, args.out)
