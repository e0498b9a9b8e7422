"""The pure parts of bench/comm_prediction.py (tilework/bench/comm_prediction.py): traffic from
the ids, fitted links, predictions, the measured communication of a step. No timing."""

import math

import pytest
import torch

from tilework.bench import comm_prediction as cp
from tilework.cluster.topology import Link, Links, Topology
from tilework.comm.wire import ID_BYTES
from tilework.estimate import cost


def test_table_ids_lm_and_recommender():
    tokens, targets, negatives = torch.tensor([[1, 2]]), torch.tensor([[3, 4]]), torch.tensor([5])
    got = cp.table_ids("lm100k", (tokens, targets, negatives))
    assert got["embedding.weight"].tolist() == [1, 2]
    assert got["softmax_weight.weight"].tolist() == [3, 4, 5]
    assert got["softmax_bias.weight"].tolist() == [3, 4, 5]
    ids = torch.tensor([[1, 7], [2, 7]])
    rec = cp.table_ids("recommender", (None, ids, None))
    assert rec["tables.0.weight"].tolist() == [1, 2] and rec["tables.1.weight"].tolist() == [7, 7]
    with pytest.raises(ValueError):
        cp.table_ids("cnn", ())


def test_measured_traffic_counts_distinct_rows():
    t = lambda *x: torch.tensor(x)  # noqa: E731
    steps = [[{"a": t(1, 1, 2)}, {"a": t(2, 3)}],          # step 0: 2 and 2 distinct, world 3
             [{"a": t(5)}, {"a": t(5, 5)}]]                # step 1: 1 and 1, world 1
    got = cp.measured_traffic(steps)["a"]
    assert got.per_rank == pytest.approx(1.5)
    assert got.per_host == pytest.approx(1.5)              # one rank per host
    assert got.world == pytest.approx(2.0)
    two = cp.measured_traffic(steps, ranks_per_host=2)["a"]
    assert two.per_host == pytest.approx(2.0) and two.per_rank == pytest.approx(1.5)
    with pytest.raises(ValueError):
        cp.measured_traffic(steps, ranks_per_host=3)


def test_fitted_link_reproduces_the_line():
    alpha, beta = 2e-3, 5e6   # 2 ms a call, 5 MB/s
    pts = [(b, alpha + b / beta) for b in (10_000, 100_000, 1_000_000)]
    link = cp.fitted_link(pts, "all_to_all", 4)
    assert link.bytes_per_s == pytest.approx(beta)
    # all_to_all on 4 ranks: 3 messages carry the call's alpha
    assert cost.seconds(500_000, link, 3) == pytest.approx(alpha + 500_000 / beta)
    assert cp.fitted_link(pts, "all_reduce", 4).latency_us == pytest.approx(alpha * 1e6 / 6)


class _Plan:
    """The few Plan attributes predict_hybrid reads."""

    def __init__(self, params, bucket_bytes=25 * 2**20, local_aggregation=True):
        self.params, self.bucket_bytes, self.local_aggregation = (params, bucket_bytes,
                                                                  local_aggregation)
        self.grad_compress, self.outer = "none", None   # synchronous, uncompressed

    def of(self, method):
        return [p for p in self.params if p.method == method]


def test_predict_hybrid_is_the_cost_model_on_its_links():
    from tilework.plans.plan import ParamPlan

    table = ParamPlan(name="emb", shape=(1000, 16), dtype="float32", method="ps", partitions=2,
                      kind="sparse")
    dense = ParamPlan(name="w", shape=(160, 160), dtype="float32", method="allreduce")
    traffic = {"emb": cost.TableTraffic(100.0, 100.0, 150.0)}
    ar, a2a = Link(0.1, 100.0), Link(0.05, 0.0)
    links = {"all_reduce": ar, "all_to_all": a2a, "all_gather": ar}
    got = cp.predict_hybrid(_Plan([table, dense]), traffic, 2, links)
    topo = Topology.from_sizes([1, 1])
    want_dense = cost.ring_allreduce(dense.nbytes, topo, Links(inter=ar), 1)
    want_ps = cost.ps_expected(table, traffic["emb"], topo, Links(inter=a2a), True)
    assert got.seconds == pytest.approx(want_dense.seconds + want_ps.seconds)
    assert got.bytes_sent == pytest.approx(want_dense.bytes_sent + want_ps.bytes_sent)
    on_ar = cost.ps_expected(table, traffic["emb"], topo, Links(inter=ar), True)
    assert got.single_link_s == pytest.approx(want_dense.seconds + on_ar.seconds)
    # A bucket small enough rides the push (wire.bucket_rides_push): its bytes on the push's
    # link, no meeting of its own.
    small = ParamPlan(name="w", shape=(64, 64), dtype="float32", method="allreduce")
    rides = cp.predict_hybrid(_Plan([table, small]), traffic, 2, links)
    assert "dense all-reduce" not in rides.terms
    assert rides.terms["dense riding the push"] == pytest.approx(cost.seconds(small.nbytes, a2a, 0))
    assert rides.bytes_sent == pytest.approx(small.nbytes + want_ps.bytes_sent)


def test_predict_ddp_sparse_all_gathers_each_table():
    traffic = {"t": cost.TableTraffic(100.0, 100.0, 300.0)}
    link = Link(0.08, 0.0)   # 10 MB/s, no latency
    links = {"all_reduce": link, "all_to_all": link, "all_gather": link}
    got = cp.predict_ddp_sparse(0, {"t": 64}, traffic, 4, links)
    # (n - 1) times a rank's row count (gloo's sparse all-reduce gathers each rank's sizes
    # first, as parallel/rows/gather.py does), ids and rows
    sent = 3 * (8 + 100 * (ID_BYTES + 64))
    assert got.bytes_sent == pytest.approx(sent)
    assert got.seconds == pytest.approx(sent / 1e7)
    with_dense = cp.predict_ddp_sparse(4_000_000, {"t": 64}, traffic, 4, links)
    assert with_dense.terms["dense all-reduce"] == pytest.approx(2 * 3 / 4 * 4e6 / 1e7)


def test_measured_comm_and_lead():
    assert cp.measured_comm([0.10, 0.30, 0.20], [0.05, 0.05, 0.10]) == pytest.approx(0.10)
    with pytest.raises(ValueError):
        cp.measured_comm([0.1], [])
    assert cp.lead(0.3, 0.1) == pytest.approx(3.0)
    assert cp.within(1.25) and cp.within(0.75) and not cp.within(1.26)


def test_markdown_rows():
    row = {"hosts": 2, "workload": "lm100k", "system": "hybrid", "step_s": 0.2, "compute_s": 0.05,
           "measured_s": 0.15, "predicted_s": 0.1, "single_link_s": 0.12,
           "predicted_bytes": 7e5, "counted_bytes": None}
    lines = cp.markdown_rows([row])
    assert len(lines) == 3 and "| 1.50 | NO |" in lines[2] and "0.700 / -" in lines[2]
    assert not math.isnan(float(lines[2].split("|")[8]))


def test_hybrid_exact_uses_the_busiest_ranks_replayed_bytes():
    from tilework.plans.plan import ParamPlan

    table = ParamPlan(name="emb", shape=(100, 4), dtype="float32", method="ps", partitions=2,
                      kind="sparse")
    link = Link(0.08, 0.0)
    links = {"all_reduce": link, "all_to_all": link, "all_gather": link}
    # rank 0 owns rows 0-49: every id is its own, so the two ranks send unlike amounts
    steps = [[{"emb": torch.tensor([0, 1])}, {"emb": torch.tensor([0, 1, 2])}]]
    t, per_rank = cp.hybrid_exact(_Plan([table]), steps, 2, links)
    topo = Topology.from_sizes([1, 1])
    want = cost.ps_table_bytes(table, [s["emb"] for s in steps[0]], topo, True)
    assert per_rank == pytest.approx(want) and per_rank[0] != per_rank[1]
    assert t == pytest.approx(max(want) / 1e7)


def test_hybrid_exact_meets_once_a_step_for_every_table():
    """The runtime pulls and pushes every server table in one exchange: three all-to-alls a
    step however many tables (it charged three per table), the bytes replayed together."""
    from tilework.plans.plan import ParamPlan

    tables = [ParamPlan(name=name, shape=(100, 4), dtype="float32", method="ps", partitions=2,
                        kind="sparse") for name in ("a", "b")]
    link = Link(0.08, 1000.0)
    links = {"all_reduce": link, "all_to_all": link, "all_gather": link}
    steps = [[{"a": torch.tensor([0, 1]), "b": torch.tensor([60])},
              {"a": torch.tensor([0, 1, 2]), "b": torch.tensor([3, 70])}]]
    t, per_rank = cp.hybrid_exact(_Plan(tables), steps, 2, links)
    topo = Topology.from_sizes([1, 1])
    want = cost.ps_step_bytes(tables, [[s[p.name] for s in steps[0]] for p in tables], topo,
                              True)
    assert per_rank == pytest.approx(want)
    assert t == pytest.approx(max(want) / 1e7 + cost.ps_meetings(2, link))


def test_measured_ids_give_the_busiest_servers_share():
    """Ids crowded into the low rows (a frequency-sorted table) load partition 0's server
    beyond 1/servers; hashed rows (row % partitions) spread them; each id is counted where it
    lands under either map."""
    t = lambda *x: torch.tensor(x)  # noqa: E731
    steps = [[{"a": t(0, 1, 2, 90)}, {"a": t(0, 3, 50, 99)}]]
    got = cp.measured_traffic(steps, rows={"a": 100})["a"]
    # 8 distinct ids over 2 (rank, step)s: rows [0, 50) hold 5 of them, [50, 100) 3; the even
    # rows (0, 2, 90, 0, 50) 5 too.
    assert got.busiest_share(2, 2, "contiguous") == pytest.approx(5 / 8)
    assert got.busiest_share(2, 2, "hashed") == pytest.approx(5 / 8)
    crowded = cp.measured_traffic([[{"a": t(0, 1, 2, 3)}, {"a": t(0, 1, 4, 5)}]],
                                  rows={"a": 100})["a"]
    assert crowded.busiest_share(2, 2, "contiguous") == 1.0
    assert crowded.busiest_share(2, 2, "hashed") == pytest.approx(1 / 2)
    assert cp.measured_traffic(steps)["a"].busiest_share(2, 2, "contiguous") == 0.5


def _gated(rank, world_size, gate):
    import time as _time

    cp.wait_at_gate(gate, rank)
    return _time.time()


def test_ranks_wait_at_the_gate_until_the_driver_says_go(tmp_path):
    """Set-up unshaped, steps shaped (bench/comm_prediction.py): every rank leaves the gate only
    after the driver answers rank 0's `ready` with `go`; no gate, no wait."""
    import threading
    import time

    from tilework.testing import spawn

    opened = []

    def driver():
        while not (tmp_path / "ready").exists():
            time.sleep(0.01)
        time.sleep(0.3)   # the links being shaped
        opened.append(time.time())
        (tmp_path / "go").touch()

    t = threading.Thread(target=driver)
    t.start()
    left = spawn(_gated, 2, (str(tmp_path),))
    t.join()
    assert all(when >= opened[0] for when in left)
    cp.wait_at_gate(None, 0)   # no process group needed without a gate


def _torchrec_step_bytes(rank, world_size):
    from tilework.bench.worker import _setup, timed_steps

    workload = cp.bench_workload("recommender", 256)
    torch.set_num_threads(1)
    model, opt, counter, extra = _setup(workload, "torchrec", world_size)
    _, sent = timed_steps(workload, "torchrec", model, opt, counter, rank, world_size, 2, 1)
    return sent, extra["sharding"]


def test_torchrec_table_wise_bytes_equal_its_counted_collectives():
    """The TorchRec term of the prediction: what each rank sends, exactly as the peer's own
    collectives count it (2 ranks, the planner's table-wise sharding)."""
    from tilework.bench import torchrec_peer
    from tilework.testing import spawn

    if torchrec_peer.missing():
        pytest.skip(torchrec_peer.missing())
    out = spawn(_torchrec_step_bytes, 2, timeout=180)
    sharding = out[0][1]
    with torch.device("meta"):
        model = cp.bench_workload("recommender", 256).make(True)
    dense = sum(p.numel() * 4 for name, p in model.named_parameters()
                if not name.startswith("tables."))
    want = cp.torchrec_bytes(sharding, 128, [t.embedding_dim for t in model.tables], dense, 2)
    assert [sent for sent, _ in out] == [[w] * 2 for w in want]
