"""A small deep learning recommendation model (DLRM) trained the way facebookresearch/dlrm's
dlrm_s_pytorch.py trains one, adapted to tilework the way the README says.

DLRM's habits kept here: categorical features looked up in nn.EmbeddingBag(mode="sum",
sparse=True) tables of different sizes, fed as DLRM feeds them (offsets stacked in one tensor
`lS_o` of shape (tables, batch), indices as a list `lS_i` of one tensor per table, multi-hot bags
of varying length); dense features through a bottom MLP; a dot-product interaction of every pair
of feature vectors; a top MLP ending in a sigmoid; BCE loss; SGD with one parameter group per
part (embeddings, bottom MLP, top MLP) as DLRM's distributed mode builds them; a learning-rate
scheduler stepped after every optimizer step (torch.optim.lr_scheduler.StepLR here); a test pass
with metrics all-reduced over ranks; and a checkpoint dict {"state_dict": dlrm.state_dict(),
"opt_state_dict": optimizer.state_dict(), ...}.

What changed for tilework:
- `dlrm, optimizer = tilework.parallelize(dlrm, optimizer)` (hybrid mode: the sparse tables go to
  the parameter server, the MLPs are all-reduced);
- gradient clipping by `tilework.clip_grad_norm_(dlrm, max_norm)`, the drop-in that also sees the
  tables' gradients (torch's own sees only parameters, and refuses sparse gradients);
- `dlrm.state_dict()` gathers the tables, so EVERY rank calls it; rank 0 writes the file;
- rank r trains on its contiguous slice of each global mini-batch (offsets rebuilt for the slice);
- the batches are read through `tilework.prefetch(batches, dlrm)`, which routes the next batch's
  indices to the tables' owners during this step.
The data is synthetic from a fixed seed (labels from a hidden rule): nothing is downloaded.

    python examples/dlrm_style.py --steps 8
    tilework run -n 2 examples/dlrm_style.py --steps 8
"""

import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

import tilework

parser = argparse.ArgumentParser(description="DLRM-style recommender on synthetic data")
parser.add_argument("--arch-sparse-feature-size", type=int, default=4)
parser.add_argument("--arch-embedding-size", type=str, default="50-23-80")
parser.add_argument("--arch-mlp-bot", type=str, default="6-8-4")
parser.add_argument("--arch-mlp-top", type=str, default="10-8-1")
parser.add_argument("--num-indices-per-lookup", type=int, default=3)
parser.add_argument("--mini-batch-size", type=int, default=8, help="global mini-batch")
parser.add_argument("--test-mini-batch-size", type=int, default=16)
parser.add_argument("--learning-rate", type=float, default=0.2)
parser.add_argument("--learning-rate-emb", type=float, default=0.5, help="embedding tables' lr")
parser.add_argument("--lr-step-size", type=int, default=3)
parser.add_argument("--lr-gamma", type=float, default=0.5)
parser.add_argument("--max-norm", type=float, default=0.5, help="gradient clipping")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--numpy-rand-seed", type=int, default=123)
parser.add_argument("--save-model", type=str, default="")
parser.add_argument("--out", type=str, default="", help="rank 0 writes losses and final state")
parser.add_argument("--plain", action="store_true", help="do not call tilework (one process)")
args = parser.parse_args()

rank = int(os.environ.get("RANK", "0"))
world_size = int(os.environ.get("WORLD_SIZE", "1"))
if args.plain and world_size != 1:
    raise SystemExit("--plain runs one process only")
if args.mini_batch_size % world_size or args.test_mini_batch_size % world_size:
    raise SystemExit(f"the mini-batch sizes do not split over {world_size} ranks")
np.random.seed(args.numpy_rand_seed)   # the same on every rank: the replicas start equal
torch.manual_seed(args.numpy_rand_seed)

ln_emb = np.array([int(n) for n in args.arch_embedding_size.split("-")])
ln_bot = np.array([int(n) for n in args.arch_mlp_bot.split("-")])
ln_top = np.array([int(n) for n in args.arch_mlp_top.split("-")])
m_spa = args.arch_sparse_feature_size
num_fea = len(ln_emb) + 1
assert ln_bot[-1] == m_spa, "the bottom MLP must end at the sparse feature size"
assert ln_top[0] == m_spa + num_fea * (num_fea - 1) // 2, "top MLP input: x and the dot pairs"


### define dlrm in PyTorch ###
class DLRM_Net(nn.Module):
    def create_mlp(self, ln, sigmoid_layer):
        layers = nn.ModuleList()
        for i in range(ln.size - 1):
            n, m = int(ln[i]), int(ln[i + 1])
            LL = nn.Linear(n, m, bias=True)
            # DLRM's initialisation (Glorot-like normal weights, normal biases), from numpy
            W = np.random.normal(0.0, np.sqrt(2 / (m + n)), size=(m, n)).astype(np.float32)
            bt = np.random.normal(0.0, np.sqrt(1 / m), size=m).astype(np.float32)
            LL.weight.data = torch.tensor(W, requires_grad=True)
            LL.bias.data = torch.tensor(bt, requires_grad=True)
            layers.append(LL)
            layers.append(nn.Sigmoid() if i == sigmoid_layer else nn.ReLU())
        return torch.nn.Sequential(*layers)

    def create_emb(self, m, ln):
        emb_l = nn.ModuleList()
        for n in ln:
            EE = nn.EmbeddingBag(int(n), m, mode="sum", sparse=True)
            W = np.random.uniform(low=-np.sqrt(1 / n), high=np.sqrt(1 / n),
                                  size=(int(n), m)).astype(np.float32)
            EE.weight.data = torch.tensor(W, requires_grad=True)
            emb_l.append(EE)
        return emb_l

    def __init__(self, m_spa, ln_emb, ln_bot, ln_top, sigmoid_top):
        super().__init__()
        self.emb_l = self.create_emb(m_spa, ln_emb)
        self.bot_l = self.create_mlp(ln_bot, -1)
        self.top_l = self.create_mlp(ln_top, sigmoid_top)

    def apply_emb(self, lS_o, lS_i):
        ly = []
        for k, sparse_index_group_batch in enumerate(lS_i):
            sparse_offset_group_batch = lS_o[k]
            E = self.emb_l[k]
            ly.append(E(sparse_index_group_batch, sparse_offset_group_batch))
        return ly

    def interact_features(self, x, ly):
        # dot product interaction, the pairs below the diagonal
        (batch_size, d) = x.shape
        T = torch.cat([x] + ly, dim=1).view((batch_size, -1, d))
        Z = torch.bmm(T, torch.transpose(T, 1, 2))
        _, ni, nj = Z.shape
        li = torch.tensor([i for i in range(ni) for j in range(i)])
        lj = torch.tensor([j for i in range(nj) for j in range(i)])
        Zflat = Z[:, li, lj]
        return torch.cat([x] + [Zflat], dim=1)

    def forward(self, dense_x, lS_o, lS_i):
        x = self.bot_l(dense_x)
        ly = self.apply_emb(lS_o, lS_i)
        z = self.interact_features(x, ly)
        return self.top_l(z)


### synthetic data, in DLRM's input format ###
class SyntheticData:
    """Global mini-batches as per-sample records; `batch(step, part)` turns a slice of one into
    DLRM's (X, lS_o, lS_i, T). Labels follow a hidden rule, so the loss can fall."""

    def __init__(self, seed):
        rng = np.random.default_rng(seed)
        self.seed = seed
        self.w_dense = rng.normal(size=ln_bot[0])
        self.w_rows = [rng.normal(size=int(n)) for n in ln_emb]

    def samples(self, key, n):
        rng = np.random.default_rng([self.seed, key])
        dense = rng.random((n, ln_bot[0])).astype(np.float32)
        most = args.num_indices_per_lookup
        bags = [[np.unique(rng.integers(0, int(rows), size=rng.integers(1, most + 1)))
                 for _ in range(n)] for rows in ln_emb]
        score = (dense - 0.5) @ self.w_dense + sum(
            np.array([w[b].sum() for b in table]) for w, table in zip(self.w_rows, bags))
        labels = (score > 0).astype(np.float32)
        return dense, bags, labels

    @staticmethod
    def to_dlrm(dense, bags, labels, part, parts):
        n = len(labels) // parts
        rows = slice(part * n, (part + 1) * n)   # this rank's contiguous slice
        lS_o, lS_i = [], []
        for table in bags:
            mine = table[rows]
            starts = np.cumsum([0] + [len(b) for b in mine[:-1]])
            lS_o.append(torch.tensor(starts, dtype=torch.long))
            lS_i.append(torch.tensor(np.concatenate(mine), dtype=torch.long))
        return (torch.tensor(dense[rows]), torch.stack(lS_o), lS_i,
                torch.tensor(labels[rows]).view(-1, 1))


data = SyntheticData(seed=2024)

### the model, the optimizer, the scheduler ###
dlrm = DLRM_Net(m_spa, ln_emb, ln_bot, ln_top, sigmoid_top=ln_top.size - 2)
parameters = [
    {"params": [p for emb in dlrm.emb_l for p in emb.parameters()], "lr": args.learning_rate_emb},
    {"params": dlrm.bot_l.parameters(), "lr": args.learning_rate},
    {"params": dlrm.top_l.parameters(), "lr": args.learning_rate},
]
optimizer = torch.optim.SGD(parameters, lr=args.learning_rate)
if not args.plain:
    dlrm, optimizer = tilework.parallelize(dlrm, optimizer)  # tilework: prints its plan
lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.lr_step_size,
                                               gamma=args.lr_gamma)
loss_fn = torch.nn.BCELoss(reduction="mean")


def all_sum(values):
    t = torch.tensor(values, dtype=torch.float64)
    if world_size > 1:
        dist.all_reduce(t)
    return t.tolist()


### main loop ###
losses, norms, lrs = [], [], []
batches = (data.to_dlrm(*data.samples(it, args.mini_batch_size), rank, world_size)
           for it in range(args.steps))
if not args.plain:
    batches = tilework.prefetch(batches, dlrm)   # tilework: next batch's ids routed meanwhile
for it, (X, lS_o, lS_i, T) in enumerate(batches):
    optimizer.zero_grad()
    Z = dlrm(X, lS_o, lS_i)
    E = loss_fn(Z, T)
    E.backward()
    norms.append(float(tilework.clip_grad_norm_(dlrm, args.max_norm)))  # tables included
    lrs.append([g["lr"] for g in optimizer.param_groups])
    optimizer.step()
    lr_scheduler.step()
    losses.append(all_sum([E.item()])[0] / world_size)  # ranks' means of equal slices
    if rank == 0:
        print(f"Finished training it {it + 1}/{args.steps}, loss {losses[-1]:.6f}, "
              f"lr {lrs[-1]}, grad norm {norms[-1]:.4f}")

### test: every rank scores its slice of the test set; the sums are all-reduced ###
with torch.no_grad():
    X, lS_o, lS_i, T = data.to_dlrm(*data.samples(10**6, args.test_mini_batch_size), rank,
                                    world_size)
    Z = dlrm(X, lS_o, lS_i)
    loss_sum = torch.nn.functional.binary_cross_entropy(Z, T, reduction="sum").item()
    correct = float((Z.round() == T).sum())
    loss_sum, correct, count = all_sum([loss_sum, correct, float(len(T))])
test_loss, test_acc = loss_sum / count, correct / count
if rank == 0:
    print(f"Testing: loss {test_loss:.6f}, accuracy {100 * test_acc:.2f} %")

### checkpoint: dlrm.state_dict() gathers the tables: every rank calls it, rank 0 writes ###
state_dict = dlrm.state_dict()
if rank == 0 and args.save_model:
    torch.save({"iter": args.steps, "state_dict": state_dict,
                "opt_state_dict": optimizer.state_dict(), "test_loss": test_loss,
                "test_acc": test_acc}, args.save_model)
if args.out and rank == 0:
    torch.save({"losses": losses, "state": {k: v.detach().clone() for k, v in state_dict.items()},
                "norms": norms, "lrs": lrs, "test_loss": test_loss, "test_acc": test_acc,
                "stats": None if args.plain else tilework.stats(dlrm)},
               args.out)
