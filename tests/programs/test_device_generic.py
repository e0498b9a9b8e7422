"""Device-generic (issue 11, item 7): every tensor tilework creates follows the device of the
parameter, buffer or input it works with, so one code path runs NCCL on CUDA and gloo on the CPU.

A static check keeps it so: an AST walk over tilework/ finds each call of a torch tensor factory
that creates a tensor from nothing and fails, naming file:line, for any without `device=`.
What counts:

- flagged without `device=`: torch.zeros, ones, empty, full, tensor, as_tensor, arange, rand,
  randn, randint, randperm, linspace, logspace, eye, empty_strided, scalar_tensor (they
  land on the CPU, or the default device, whatever the surrounding tensors' device);
- always flagged: the legacy constructors (torch.Tensor(...), torch.LongTensor(...), ...),
  which cannot take a device;
- not flagged: torch.*_like and tensor.new_* (they follow their input's device), and
  operations on existing tensors.

`device="cpu"` written out is allowed: it says at the call site that the CPU is meant. Whole
places that are host-side by design are in ALLOWED below, each with its reason; an entry that
no longer matches anything fails too, so the list cannot rot.

The checks that need CUDA itself are in tests/gpu/ (skipped without a GPU; tests/gpu/run.sh runs
them on a machine with one). Below, what the CPU can check of device propagation.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tilework"

FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "rand", "randn",
             "randint", "randperm", "linspace", "logspace", "eye", "empty_strided",
             "scalar_tensor"}
LEGACY = {"Tensor", "FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "ByteTensor",
          "CharTensor", "ShortTensor", "IntTensor", "LongTensor", "BoolTensor"}

# (path under the repo, enclosing function or "*" for the whole file) -> why the CPU is meant.
ALLOWED = {
    ("tilework/data/synthetic.py", "*"):
        "datasets are generated on the host from seeded CPU generators, so every rank draws the "
        "same bytes whatever its device; the training loop moves batches to the model",
    ("tilework/bench/workloads.py", "*"):
        "benchmark batches, generated on the host from seeded CPU generators (the benchmark "
        "suite runs gloo on the CPU)",
    ("tilework/bench/comm_prediction.py", "*"):
        "the communication-prediction bench runs gloo on the CPU inside emulated hosts: its "
        "timings and buffers are host numbers",
    ("tilework/bench/worker.py", "*"):
        "the benchmark worker joins a gloo world on the CPU: its timing and memory figures "
        "are host numbers reduced over gloo",
}


def _torch_names(tree: ast.Module) -> tuple[set[str], dict[str, str]]:
    """Names bound to the torch module, and factory names imported from it (alias -> name)."""
    modules, imported = {"torch"}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name == "torch" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            imported |= {a.asname or a.name: a.name for a in node.names
                         if a.name in FACTORIES | LEGACY}
    return modules, imported


def _factory(call: ast.Call, modules: set[str], imported: dict[str, str]) -> str | None:
    f = call.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in modules:
        return f.attr if f.attr in FACTORIES | LEGACY else None
    if isinstance(f, ast.Name):
        return imported.get(f.id)
    return None


def _calls(path: Path):
    """(line, enclosing function, factory) for each factory call in `path` without device=."""
    tree = ast.parse(path.read_text(), filename=str(path))
    modules, imported = _torch_names(tree)
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                else function
            if isinstance(child, ast.Call):
                name = _factory(child, modules, imported)
                given = any(k.arg == "device" for k in child.keywords)
                if name is not None and (name in LEGACY or not given):
                    found.append((child.lineno, function, name))
            visit(child, inner)

    visit(tree, "<module>")
    return found


def _offenders():
    """(file:line message, allow-list key or None) for every factory call without device=."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for line, function, name in _calls(path):
            key = next((k for k in ((rel, function), (rel, "*")) if k in ALLOWED), None)
            out.append((f"{rel}:{line}: torch.{name}(...) in {function}() without device=", key))
    return out


def test_tensor_factories_in_tilework_say_their_device():
    missing = [where for where, key in _offenders() if key is None]
    assert not missing, (
        "tensor factories without device= (pass the device of the parameter, buffer or input "
        "the tensor works with; device='cpu' where the host is meant; or add a reasoned entry "
        "to ALLOWED):\n  " + "\n  ".join(missing))


def test_every_allow_list_entry_is_used_and_reasoned():
    used = {key for _, key in _offenders() if key is not None}
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"allow-list entries that match no factory call any more: {stale}"
    assert all(len(reason) > 20 for reason in ALLOWED.values())


def test_the_walk_sees_what_it_must(tmp_path):
    """The checker itself: aliases, from-imports and legacy constructors are caught."""
    source = ("import torch\nimport torch as t\nfrom torch import zeros as z\n"
              "def f(x):\n"
              "    a = torch.zeros(3)\n"                      # 5: flagged
              "    b = t.arange(4, device=x.device)\n"        # fine
              "    c = z(2)\n"                                # 7: flagged
              "    d = torch.LongTensor([1], )\n"             # 8: flagged (legacy)
              "    e = torch.zeros_like(x)\n"                 # fine: follows x
              "    g = torch.tensor(1.0, device='cpu')\n"     # fine: the host, said so
              "    return a, b, c, d, e, g\n")
    path = tmp_path / "m.py"
    path.write_text(source)
    assert [(line, fn) for line, fn, _ in _calls(path)] == [(5, "f"), (7, "f"), (8, "f")]


# -- device propagation, on what the CPU has ---------------------------------------------------

def test_layout_tensors_live_on_the_tables_device():
    from tilework.plans.plan import ParamPlan
    from tilework.plans.rows import TableLayout

    plan = ParamPlan("t", (10, 2), "ps", 3, "contiguous")
    layout = TableLayout(plan, 2, device="meta")
    ids = torch.arange(10, device="meta")
    for t in (layout.starts, layout.offsets, layout.servers, layout.shard_rows(0),
              layout.owner_of(ids), layout.local_index(ids)):
        assert t.device.type == "meta"
    assert TableLayout(plan, 2).shard_rows(1).device.type == "cpu"  # the cost model's replay


def test_input_check_words_and_empty_norms_go_where_asked():
    from tilework.parallel.data.checks import InputChecks
    from tilework.runtime.clip import total_norm

    groups = type("G", (), {"world_size": 2, "device": torch.device("meta")})()
    assert InputChecks(groups, None, False).words(torch.device("meta")).device.type == "meta"
    assert total_norm([], 2.0, device=torch.device("meta")).device.type == "meta"
    assert total_norm([], 2.0).device.type == "cpu"  # torch's own clip_grad_norm_: the CPU


def test_models_buffers_follow_their_parameters():
    from tilework.models.gpt import TinyGPT

    with torch.device("meta"):
        model = TinyGPT(vocab=50, dim=16, heads=2, layers=1, seq_len=8)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}


def test_a_model_split_over_devices_is_refused_before_any_collective():
    from tilework.errors import PlanError
    from tilework.runtime.preflight import check_device, model_device

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(PlanError, match="several devices"):
        model_device(model)
    groups = type("G", (), {"world_size": 1})()
    check_device(model, groups)  # one rank: nothing is communicated, nothing to refuse
    assert model_device(nn.Linear(2, 2)) == torch.device("cpu")
    assert model_device(nn.ReLU()) is None


class _Hybrid(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(50, 4, sparse=True)
        self.extra = nn.Embedding(20, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, ids):
        return self.head(self.table(ids).mean(1) + self.extra(ids % 20).mean(1)).pow(2).mean()


def _train(rank, world_size, config: dict, stand_in: bool):
    """Three steps with clipping and state dicts; with `stand_in`, the default device is meta
    from parallelize on."""
    model = _Hybrid()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 50, (4, 3), generator=g).chunk(world_size)[rank]
               for _ in range(3)]
    if stand_in:
        torch.set_default_device("meta")
    try:
        import tilework

        tilework.parallelize(model, opt, log=False, **config)
        losses = []
        for ids in batches:
            loss = model(ids)
            loss.backward()
            tilework.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        opt.load_state_dict(opt.state_dict())
        state = tilework.state_dict(model, opt)["model"]
    finally:
        torch.set_default_device(None)
    return losses, state


def _plain_and_stood_in(rank, world_size, config: dict):
    return _train(rank, world_size, config, False), _train(rank, world_size, config, True)


@pytest.mark.parametrize("config", [{"overrides": {"extra.weight": "ps"}}, {"mode": "ps"}],
                         ids=["hybrid", "ps"])
def test_tensors_follow_their_inputs_not_the_default_device(config):
    """A stand-in for CUDA on a machine without one: with the default device set to meta, a
    tensor tilework created without following its parameter's or input's device would be a meta
    tensor, and the step would fail or differ (it did, before item 7: the layout's lookups)."""
    from tilework.testing import spawn

    ranks = spawn(_plain_and_stood_in, 2, args=(config,))
    for (want_losses, _), (losses, _) in ranks:
        assert losses == want_losses
    (_, want_state), (_, state) = ranks[0]
    assert {t.device.type for t in state.values()} == {"cpu"}
    for key, value in want_state.items():
        assert torch.equal(state[key], value), key
