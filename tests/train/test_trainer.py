"""The trainer: learning happens, checkpoints are atomic, and resuming is exact."""

import dataclasses
import json
import os

import pytest
import torch

from tilework.checkpoint import file as checkpoint
from tilework.errors import CheckpointError
from tilework.train.job import CNNJob, DataJob, Job, LMJob, RecommenderJob, TrainJob
from tilework.train.trainer import train


def lm_job(tmp_path, **train_kw):
    return Job(workload="lm",
               lm=LMJob(corpus="zipf", vocab=500, embed_dim=16, hidden=16, seq_len=8,
                        zipf_tokens=20_000, num_sampled=32),
               data=DataJob(batch_size=8),
               train=TrainJob(**{"steps": 20, "lr": 0.01, "log_every": 5,
                                 "out_dir": str(tmp_path), **train_kw}))


def test_resume_continues_the_exact_loss_sequence(tmp_path):
    full = train(lm_job(tmp_path / "full", steps=20))
    first = train(lm_job(tmp_path / "split", steps=10, checkpoint_every=10))
    rest = train(lm_job(tmp_path / "split", steps=20, checkpoint_every=10), resume=True)
    assert rest.first_step == 10
    assert first.losses + rest.losses == full.losses  # bit-exact: same ops in the same order


def test_metrics_and_checkpoints_written(tmp_path):
    train(lm_job(tmp_path, steps=10, checkpoint_every=5, keep_checkpoints=1))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [5, 10]
    assert all(r["tokens_per_s"] > 0 for r in records if "loss" in r)
    assert (sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
            == ["latest", "step-00000010.pt"])


@pytest.mark.parametrize("workload", ["lm", "cnn", "recommender"])
def test_each_workload_learns(tmp_path, workload):
    job = Job(workload=workload,
              lm=LMJob(corpus="zipf", vocab=300, embed_dim=16, hidden=16, seq_len=8,
                       zipf_tokens=30_000),
              cnn=CNNJob(samples=512, image_size=8, width=8, blocks=1),
              recommender=RecommenderJob(samples=4096, table_sizes=[200, 50], embed_dim=8),
              data=DataJob(batch_size=32),
              train=TrainJob(steps=40, lr=0.01, log_every=40, out_dir=str(tmp_path)))
    result = train(job)
    metric = "ppl" if workload == "lm" else "eval_loss"
    assert result.evals[-1][metric] < 0.9 * result.evals[0][metric]


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    state = {"w": torch.arange(4.0)}
    checkpoint.save(tmp_path, 1, state, {"f": 1})

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError):
        checkpoint.save(tmp_path, 2, {"w": torch.zeros(4)}, {"f": 1})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001.pt"]
    blob = checkpoint.load(checkpoint.latest(tmp_path), {"f": 1})
    assert torch.equal(blob["state"]["w"], torch.arange(4.0))


def test_damaged_or_foreign_checkpoints_are_refused(tmp_path):
    path = checkpoint.save(tmp_path, 1, {"w": torch.ones(1000)}, {"lm.vocab": 10})
    with pytest.raises(CheckpointError, match="lm.vocab is 10 there, 20 here"):
        checkpoint.load(path, {"lm.vocab": 20})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"truncated checkpoint: [\d,]+ of [\d,]+ bytes"):
        checkpoint.load(path)
    # One flipped bit inside the tensor data: torch.load alone would return the wrong weights.
    flipped = bytearray(data)
    flipped[-2000] ^= 0x01
    path.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="corrupted checkpoint: .* SHA-256"):
        checkpoint.load(path)
    path.write_bytes(b"TILEWORK-CHECKPOINT garbage\n" + data)
    with pytest.raises(CheckpointError, match="damaged checkpoint header"):
        checkpoint.load(path)
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        checkpoint.load(path)


def test_a_tensor_without_its_values_is_refused_before_the_last_good_checkpoint_goes(tmp_path):
    """A value whose storage was freed between uses (ZeRO-3's, read outside a gather) would be
    written as a file torch's own reader refuses: it is named, and nothing is written."""
    good = checkpoint.save(tmp_path, 1, {"w": torch.arange(4.0)}, {"f": 1})
    freed = torch.zeros(8, 2)
    freed.untyped_storage().resize_(0)
    with pytest.raises(CheckpointError, match=r"state\['model'\]\['head.weight'\]: the tensor's "
                                              r"storage holds 0 of its 64 bytes"):
        checkpoint.save(tmp_path, 2, {"model": {"head.weight": freed}}, {"f": 1})
    assert checkpoint.latest(tmp_path) == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001.pt"]
    # Views, empty tensors and meta tensors are whole as they are.
    checkpoint.write(tmp_path / "views.pt", {"v": torch.arange(10.0)[2:5], "e": torch.empty(0),
                                             "t": torch.arange(6.0).view(2, 3).t(),
                                             "s": torch.eye(3).to_sparse()})


def test_format_1_checkpoints_still_load(tmp_path):
    path = tmp_path / "old.pt"
    torch.save({"format": "tilework-checkpoint", "version": 1, "step": 3, "fingerprint": {"f": 1},
                "state": {"w": torch.arange(3.0)}}, path)
    assert torch.equal(checkpoint.load(path, {"f": 1})["state"]["w"], torch.arange(3.0))


def test_resume_refuses_a_different_model(tmp_path):
    train(lm_job(tmp_path, steps=5, checkpoint_every=5))
    other = lm_job(tmp_path, steps=10)
    other.lm = dataclasses.replace(other.lm, vocab=400)
    with pytest.raises(CheckpointError, match="lm.vocab is 500 there, 400 here"):
        train(other, resume=True)


def test_tilework_save_writes_the_same_checked_format(tmp_path):
    import tilework

    model, path = torch.nn.Linear(64, 64), tmp_path / "ckpt.pt"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tilework.save(path, model, opt)
    data = bytearray(path.read_bytes())
    data[-3000] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted checkpoint"):
        tilework.load(path, model, opt)
    # A file from tilework.save before format 2 still loads.
    torch.save({"format": "tilework-state", "state": tilework.state_dict(model, opt)}, path)
    tilework.load(path, model, opt)


# The gpt workload on a dp x pp x cp x tp mesh: `tilework train`'s loop (its sampler, model.step
# under pp, the logged loss, evaluation, checkpoints) gives one process's numbers.
MESH_TOL = 1e-5   # relative: tp's partial sums and the pipeline's microbatch means reorder adds


def gpt_job(out_dir, steps=4, **parallel):
    from tilework.config.parallel import ParallelConfig
    from tilework.train.job import GPTJob

    return Job(workload="gpt",
               gpt=GPTJob(corpus="zipf", vocab=64, dim=16, heads=4, layers=4, seq_len=8,
                          zipf_tokens=20_000, eval_sequences=16),
               data=DataJob(batch_size=8),
               train=TrainJob(steps=steps, optimizer="adam", lr=0.01, log_every=2, eval_every=2,
                              checkpoint_every=steps, out_dir=str(out_dir)),
               parallel=ParallelConfig(**parallel))


def _train_on_ranks(rank, world_size, job, resume):
    import torch.distributed as dist

    from tilework.comm import build_groups

    result = train(job, groups=build_groups(dist.group.WORLD), resume=resume)
    return result.first_step, result.losses, result.evals


def _assert_close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert abs(g - w) <= MESH_TOL * abs(w), (got, want)


def _assert_evals(got, want):
    """Held-out losses at the same steps (evaluated at 0, every 2 steps, and on resuming)."""
    by_step = {e["step"]: e["eval_loss"] for e in want}
    assert got and all(e["step"] in by_step for e in got)
    _assert_close([e["eval_loss"] for e in got], [by_step[e["step"]] for e in got])


def test_gpt_at_tp2_and_pp2_trains_as_one_process_and_resumes_at_another_mesh(tmp_path):
    from tilework.testing import spawn

    one = train(gpt_job(tmp_path / "one", steps=6))
    for name, options in (("tp", {"tp": 2}), ("pp", {"pp": 2, "microbatches": 4})):
        job = gpt_job(tmp_path / name, steps=4, **options)
        for first, losses, evals in spawn(_train_on_ranks, 2, (job, False), timeout=240):
            _assert_close(losses, one.losses[:4])   # every rank logs the batch's loss
            _assert_evals(evals, one.evals)
    # The pipeline's checkpoint (one-process layout) resumed at tp=2 for two more steps.
    job = gpt_job(tmp_path / "pp", steps=6, tp=2)
    for first, losses, evals in spawn(_train_on_ranks, 2, (job, True), timeout=240):
        assert first == 4
        _assert_close(losses, one.losses[4:])
        _assert_evals(evals, one.evals)


def test_gpt_at_dp2_x_pp2_each_replica_reads_its_slice(tmp_path):
    """4 ranks: each dp replica trains on its half of the global batch (the sampler shards by
    the dp coordinate, a pipeline's two ranks reading the same half), so the losses are one
    process's on the whole batch; the bytes rank 0 logs are the cost model's."""
    from tilework.estimate.step_bytes import mesh_step_bytes
    from tilework.testing import spawn
    from tilework.train.planning import meta_model

    one = train(gpt_job(tmp_path / "one", steps=2))
    job = gpt_job(tmp_path / "mesh", steps=2, pp=2, microbatches=2)
    for _, losses, evals in spawn(_train_on_ranks, 4, (job, False), timeout=300):
        _assert_close(losses, one.losses)
        _assert_evals(evals, one.evals)
    logged = [json.loads(line) for line in (tmp_path / "mesh" / "metrics.jsonl").read_text()
              .splitlines()]
    sent = {k.removeprefix("bytes_"): v for k, v in logged[-2].items()
            if k.startswith("bytes_") and k != "bytes_all_dense_allreduce"}
    assert sent == mesh_step_bytes(meta_model(job), job.parallel, 4, 0, batch=4, seq=8)


def test_job_file_gpt_and_mesh_fields_are_checked(tmp_path):
    from tilework.errors import ConfigError

    job = Job.load("docs/examples/gpt-mesh.toml")
    assert (job.workload, job.parallel.tp, job.parallel.pp, job.parallel.microbatches) == \
        ("gpt", 2, 2, 4)
    assert job.parallel.layout["blocks.layers.*.self_attn"] == "heads"
    bad = {'workload = "gpt"\n[gpt]\nwidth = 8\n': "gpt.width: unknown key",
           'workload = "gpt"\n[gpt]\ndim = 10\nheads = 4\n': "gpt.heads: expected a divisor",
           'workload = "lm"\n[parallel]\npp = 2\n': "parallel.pp: expected 1 for the 'lm'",
           'workload = "gpt"\n[parallel]\ntp = 3\n': "parallel.tp: expected a divisor of gpt.heads",
           'workload = "gpt"\n[parallel]\nschedule = "zb"\n': "parallel.schedule: expected",
           'workload = "gpt"\n[parallel]\npp = 4\nschedule = "interleaved"\n':
               r"parallel.pp: expected at most gpt.layers \(2\) pipeline stages",
           'workload = "gpt"\n[parallel]\ntp = 2\n[parallel.layout]\nhead = "colwize"\n':
               "parallel.layout.head: expected one of colwise",
           'workload = "gpt"\n[gpt]\nseq_len = 6\n[parallel]\ncp = 2\n': "parallel.cp: expected"}
    for text, message in bad.items():
        path = tmp_path / "job.toml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            Job.load(path)


GPT_TOML = """workload = "gpt"
[gpt]
corpus = "zipf"
vocab = 64
dim = 16
heads = 4
layers = 4
seq_len = 8
zipf_tokens = 20000
eval_sequences = 16
[data]
batch_size = 8
[train]
steps = {steps}
lr = 0.01
log_every = 1
checkpoint_every = 2
out_dir = "{out}"
[parallel]
{parallel}
"""


def test_tilework_train_cli_runs_a_pipeline_then_resumes_it_at_tp2(tmp_path):
    """The launcher's path (`tilework train job.toml -n 2`, the job through the worker's spec):
    pp=2 for 2 steps, then --resume at tp=2 to 4; metrics.jsonl holds one process's losses."""
    import subprocess
    import sys

    out = tmp_path / "out"
    one = train(Job.load(_write(tmp_path / "one.toml", GPT_TOML.format(
        steps=4, out=tmp_path / "one", parallel=""))))
    for name, steps, parallel, extra in (("pp", 2, "pp = 2\nmicrobatches = 4", []),
                                         ("tp", 4, "tp = 2", ["--resume"])):
        path = _write(tmp_path / f"{name}.toml",
                      GPT_TOML.format(steps=steps, out=out, parallel=parallel))
        done = subprocess.run([sys.executable, "-m", "tilework", "train", str(path), "-n", "2",
                               *extra], capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    _assert_close([r["loss"] for r in records if "loss" in r], one.losses)
    assert "resumed from" in done.stdout and "step-00000002.pt" in done.stdout


def _write(path, text):
    path.write_text(text)
    return path


def test_pipeline_batch_that_does_not_split_into_microbatches_is_refused(tmp_path):
    from tilework.testing import RankFailed, spawn

    job = gpt_job(tmp_path, steps=1, pp=2, microbatches=3)
    with pytest.raises(RankFailed, match="data.batch_size: expected each data-parallel "
                                         "replica's 8 sequences to split into"):
        spawn(_train_on_ranks, 2, (job, False), timeout=120)


def test_tilework_train_with_plan_auto_trains_as_one_process(tmp_path):
    """A job file with [parallel] plan = "auto" and the mesh axes opted in: whatever the search
    chooses on these 2 ranks (printed with its runner-up), metrics.jsonl holds one process's
    losses."""
    import subprocess
    import sys

    one = train(Job.load(_write(tmp_path / "one.toml", GPT_TOML.format(
        steps=3, out=tmp_path / "one", parallel=""))))
    out = tmp_path / "auto"
    path = _write(tmp_path / "auto.toml", GPT_TOML.format(
        steps=3, out=out, parallel='plan = "auto"\ntp = "auto"\npp = "auto"'))
    done = subprocess.run([sys.executable, "-m", "tilework", "train", str(path), "-n", "2"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "plan='auto'" in done.stdout and "runner-up" in done.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    _assert_close([r["loss"] for r in records if "loss" in r], one.losses)


def _train_on_hosts(rank, world_size, job, cluster):
    import torch.distributed as dist

    from tilework.cluster.topology import Topology
    from tilework.comm import build_groups

    groups = build_groups(dist.group.WORLD, Topology.uniform(len(cluster.hosts), 1))
    result = train(job, groups=groups, cluster=cluster)
    return result.losses, result.evals


def test_hosts_of_different_speeds_get_batch_shares_and_train_as_one_process(tmp_path):
    """A cluster file whose hosts differ in speed: `tilework train` gives each rank its share
    of the global batch by speed (6 and 2 of 8 at speeds 3 and 1), written in plan.json, and
    the logged losses (the ranks' means weighted by their shares) are one process's."""
    from tilework.cluster.topology import Cluster, Host
    from tilework.testing import spawn

    one = train(gpt_job(tmp_path / "one", steps=4))
    cluster = Cluster([Host("fast", 1, speed=3.0), Host("slow", 1, speed=1.0)])
    job = gpt_job(tmp_path / "uneven", steps=4)
    for losses, evals in spawn(_train_on_hosts, 2, (job, cluster), timeout=240):
        _assert_close(losses, one.losses)
        _assert_evals(evals, one.evals)
    plan = json.loads((tmp_path / "uneven" / "plan.json").read_text())
    assert plan["batch_shares"] == [6, 2]
    # plan="auto" weighs the shares against the even split, live, and takes them.
    job = gpt_job(tmp_path / "auto", steps=4, plan="auto")
    for losses, evals in spawn(_train_on_hosts, 2, (job, cluster), timeout=240):
        _assert_close(losses, one.losses)
    plan = json.loads((tmp_path / "auto" / "plan.json").read_text())
    assert plan["batch_shares"] == [6, 2]


def test_a_pipeline_over_hosts_of_different_speeds_gives_the_faster_more_blocks(tmp_path):
    """pp=2 over hosts of speeds 3 and 1: the plan cuts the 4 blocks 3 and 1 (balance over
    each stage's speed, as AMP cuts them), the runtime runs that cut, and the losses are one
    process's. stage_weights (as the planner sets them from memory) override the speeds: 1
    and 3 cut the blocks 1 and 3, and train as one process too."""
    from tilework.cluster.topology import Cluster, Host
    from tilework.testing import spawn

    one = train(gpt_job(tmp_path / "one", steps=4))
    cluster = Cluster([Host("fast", 1, speed=3.0), Host("slow", 1, speed=1.0)])
    job = gpt_job(tmp_path / "pp", steps=4, pp=2, microbatches=4)
    for losses, evals in spawn(_train_on_hosts, 2, (job, cluster), timeout=240):
        _assert_close(losses, one.losses)
    from tilework.cluster.topology import Topology
    from tilework.train.planning import job_cluster, job_plan

    ran_on = job_cluster(Topology.uniform(2, 1), cluster)
    assert job_plan(job, ran_on).parallel.stages == ((0, 3), (3, 4))
    weighed = gpt_job(tmp_path / "weighed", steps=4, pp=2, microbatches=4, stage_weights=[1, 3])
    for losses, evals in spawn(_train_on_hosts, 2, (weighed, cluster), timeout=240):
        _assert_close(losses, one.losses)
    assert job_plan(weighed, ran_on).parallel.stages == ((0, 1), (1, 4))


def _train_on_two_hosts_of_two(rank, world_size, job, cluster):
    import torch.distributed as dist

    from tilework.cluster.topology import Topology
    from tilework.comm import build_groups

    result = train(job, groups=build_groups(dist.group.WORLD, Topology.uniform(2, 2)),
                   cluster=cluster)
    return result.losses


def test_pipeline_replicas_take_their_shares_and_train_as_one_process(tmp_path):
    """pp=2 inside each of two hosts of speeds 3 and 1, a host one replica's pipeline, with
    `[parallel] batch_shares = [6, 2]` (each a multiple of the 2 microbatches): each replica
    reads its share, and the logged losses (the last stages' means, weighted by their
    shares) are one process's."""
    from tilework.cluster.topology import Cluster, Host
    from tilework.testing import spawn

    one = train(gpt_job(tmp_path / "one", steps=4))
    cluster = Cluster([Host("fast", 2, speed=3.0), Host("slow", 2, speed=1.0)])
    job = gpt_job(tmp_path / "pp", steps=4, pp=2, microbatches=2, batch_shares=[6, 2])
    for losses in spawn(_train_on_two_hosts_of_two, 4, (job, cluster), timeout=240):
        _assert_close(losses, one.losses)
    assert json.loads((tmp_path / "pp" / "plan.json").read_text())["batch_shares"] == [6, 2]


def test_local_sgd_trains_and_resumes_bit_exact_from_a_sync(tmp_path):
    """`[parallel] sync = "diloco"`: 2 ranks, a sync every 2 steps in two fragments and in
    int4, Adam inside. A run stopped at step 2 (a sync, and a checkpoint) and resumed to step 4
    logs the uninterrupted run's losses bit for bit: the checkpoint holds both ranks' Adam
    moments, parameters and error feedback, and the outer state. A checkpoint_every off the
    syncs is refused by name."""
    from tilework.errors import ConfigError
    from tilework.testing import spawn

    options = {"sync": "diloco", "sync_every": 2, "outer_fragments": 2, "outer_compress": "int4"}
    whole = spawn(_train_on_ranks, 2, (gpt_job(tmp_path / "whole", steps=4, **options), False),
                  timeout=240)
    spawn(_train_on_ranks, 2, (gpt_job(tmp_path / "cut", steps=2, **options), False),
          timeout=240)
    resumed = spawn(_train_on_ranks, 2, (gpt_job(tmp_path / "cut", steps=4, **options), True),
                    timeout=240)
    for (_, all_losses, _), (first, losses, _) in zip(whole, resumed):
        assert first == 2 and losses == all_losses[2:]
    with pytest.raises(ConfigError, match="train.checkpoint_every: expected a multiple of "
                                          "parallel.sync_every"):
        gpt_job(tmp_path / "x", steps=3, **options)
