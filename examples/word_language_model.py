"""A word-level LSTM language model, written in the style of pytorch/examples
word_language_model/main.py, adapted to tilework the way the README says.

The habits of the original kept here: no optimizer at all (`model.zero_grad()`,
`loss.backward()`, `torch.nn.utils.clip_grad_norm_`, then `p.data.add_(p.grad, alpha=-lr)`),
truncated BPTT over a batchified token stream with the hidden state carried (detached) from one
chunk to the next, evaluation after every epoch, the learning rate divided by 4 when validation
loss does not improve, `torch.save(model, f)` of the best model and `torch.load` of it for the
final test.

What changed for tilework:
- `tilework.parallelize(model, None)`: no optimizer, so every parameter is all-reduced;
- rank r trains on its contiguous slice of the batchified columns (the global batch is
  `--batch_size` columns on any world size), and carries the hidden state of those columns;
- every rank evaluates (the same whole validation stream), so all ranks take the same
  "divide lr by 4" decision; rank 0 alone writes files.
Dropout defaults to 0: each rank would draw its own masks, which one process cannot reproduce.
The corpus is synthetic (a fixed-seed Markov chain over `--ntokens` words): nothing is downloaded.

    python examples/word_language_model.py --steps 8
    tilework run -n 2 examples/word_language_model.py --steps 8
"""

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import tilework

parser = argparse.ArgumentParser(description="LSTM language model on a synthetic corpus")
parser.add_argument("--ntokens", type=int, default=40, help="vocabulary size")
parser.add_argument("--emsize", type=int, default=16, help="size of word embeddings")
parser.add_argument("--nhid", type=int, default=16, help="hidden units per layer")
parser.add_argument("--nlayers", type=int, default=2, help="number of layers")
parser.add_argument("--lr", type=float, default=20.0, help="initial learning rate")
parser.add_argument("--clip", type=float, default=0.25, help="gradient clipping")
parser.add_argument("--steps", type=int, default=8, help="training batches (BPTT chunks) in all")
parser.add_argument("--chunks-per-epoch", type=int, default=2, help="BPTT chunks per epoch")
parser.add_argument("--batch_size", type=int, default=8, help="global batch size (columns)")
parser.add_argument("--bptt", type=int, default=6, help="sequence length")
parser.add_argument("--dropout", type=float, default=0.0, help="dropout (0: see the docstring)")
parser.add_argument("--seed", type=int, default=1111, help="random seed")
parser.add_argument("--save", type=str, default="", help="where to save the best model")
parser.add_argument("--out", type=str, default="", help="rank 0 writes losses and final state")
parser.add_argument("--plain", action="store_true", help="do not call tilework (one process)")
args = parser.parse_args()

rank = int(os.environ.get("RANK", "0"))
world_size = int(os.environ.get("WORLD_SIZE", "1"))
if args.plain and world_size != 1:
    raise SystemExit("--plain runs one process only")
if args.batch_size % world_size:
    raise SystemExit(f"--batch_size {args.batch_size} does not split over {world_size} ranks")

torch.manual_seed(args.seed)  # the same on every rank: the replicas start equal


###############################################################################
# Load data
###############################################################################

class Corpus:
    """train / valid / test token streams drawn from one fixed random Markov chain."""

    def __init__(self, ntokens, lengths, seed=0):
        g = torch.Generator().manual_seed(seed)
        # Each word has 3 likely successors: something an LSTM can learn in a few steps.
        successors = torch.randint(0, ntokens, (ntokens, 3), generator=g)
        self.train, self.valid, self.test = (self._stream(successors, n, g) for n in lengths)

    @staticmethod
    def _stream(successors, n, g):
        ntokens = successors.size(0)
        out = torch.empty(n, dtype=torch.long)
        word = 0
        for i in range(n):
            if torch.rand((), generator=g) < 0.1:
                word = int(torch.randint(0, ntokens, (), generator=g))
            else:
                word = int(successors[word, torch.randint(0, 3, (), generator=g)])
            out[i] = word
        return out


def batchify(data, bsz):
    """Arrange the stream in bsz columns (as pytorch/examples does): shape (nbatch, bsz)."""
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    return data.view(bsz, -1).t().contiguous()


eval_batch_size = 4
train_len = (args.chunks_per_epoch * args.bptt + 1) * args.batch_size  # whole chunks only
corpus = Corpus(args.ntokens, (train_len, 30 * eval_batch_size, 30 * eval_batch_size), seed=7)
train_data = batchify(corpus.train, args.batch_size)
# tilework: this rank's contiguous slice of the global batch's columns.
per_rank = args.batch_size // world_size
train_data = train_data[:, rank * per_rank:(rank + 1) * per_rank].contiguous()  # get_batch views it
val_data = batchify(corpus.valid, eval_batch_size)    # every rank evaluates all of it
test_data = batchify(corpus.test, eval_batch_size)


###############################################################################
# Build the model
###############################################################################

class RNNModel(nn.Module):
    """Container module with an encoder, a recurrent module, and a decoder."""

    def __init__(self, ntoken, ninp, nhid, nlayers, dropout=0.0):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid, self.nlayers = nhid, nlayers
        self.init_weights()

    def init_weights(self):
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid),
                weight.new_zeros(self.nlayers, bsz, self.nhid))


model = RNNModel(args.ntokens, args.emsize, args.nhid, args.nlayers, args.dropout)
if not args.plain:
    model, _ = tilework.parallelize(model, None)  # tilework: the one changed line
criterion = nn.NLLLoss()


###############################################################################
# Training code
###############################################################################

def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def get_batch(source, i):
    seq_len = min(args.bptt, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].view(-1)
    return data, target


def global_mean(values):
    """The mean over the global batch of per-rank means (equal slices): for the record only."""
    t = torch.tensor(values, dtype=torch.float64)
    if world_size > 1:
        dist.all_reduce(t)
        t /= world_size
    return t.tolist()


def evaluate(data_source):
    model.eval()  # turn on evaluation mode which disables dropout
    total_loss = 0.0
    hidden = model.init_hidden(eval_batch_size)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, args.bptt):
            data, targets = get_batch(data_source, i)
            output, hidden = model(data, hidden)
            hidden = repackage_hidden(hidden)
            total_loss += len(data) * criterion(output, targets).item()
    return total_loss / (len(data_source) - 1)


losses, lrs, val_losses, clip_norms = [], [], [], []


def train(steps_left):
    model.train()  # turn on training mode which enables dropout
    hidden = model.init_hidden(per_rank)
    done, step_losses = 0, []
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        if done == steps_left:
            break
        data, targets = get_batch(train_data, i)
        # Starting each batch, we detach the hidden state from how it was previously produced.
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()
        # `clip_grad_norm` helps prevent the exploding gradient problem in RNNs / LSTMs.
        clip_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)))
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        step_losses.append(loss.item())
        lrs.append(lr)
        done += 1
    losses.extend(global_mean(step_losses))
    return done


lr = args.lr
best_val_loss = None
steps_done, epoch = 0, 0
while steps_done < args.steps:
    epoch += 1
    steps_done += train(args.steps - steps_done)
    val_loss = evaluate(val_data)   # on every rank: each takes the same lr decision
    val_losses.append(val_loss)
    if rank == 0:
        print(f"| end of epoch {epoch:3d} | lr {lr:6.3f} | valid loss {val_loss:5.2f} | "
              f"valid ppl {math.exp(val_loss):8.2f}")
    # Save the model if the validation loss is the best we've seen so far.
    if not best_val_loss or val_loss < best_val_loss:
        if args.save and rank == 0:
            with open(args.save, "wb") as f:
                torch.save(model, f)
        best_val_loss = val_loss
    else:
        # Anneal the learning rate if no improvement has been seen in the validation dataset.
        lr /= 4.0

final_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
test_loss = None
if args.save:
    if world_size > 1:
        dist.barrier()  # rank 0 has written the file
    # Load the best saved model (a plain module: the pickled copy carries no tilework state).
    with open(args.save, "rb") as f:
        model = torch.load(f, weights_only=False)
        model.rnn.flatten_parameters()
    test_loss = evaluate(test_data)
    if rank == 0:
        print(f"| End of training | test loss {test_loss:5.2f} | "
              f"test ppl {math.exp(test_loss):8.2f}")

if args.out and rank == 0:
    torch.save({"losses": losses, "state": final_state, "lrs": lrs, "val_losses": val_losses,
                "clip_norms": clip_norms, "test_loss": test_loss}, args.out)
