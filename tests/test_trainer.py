"""The trainer: learning happens, checkpoints are atomic, and resuming is exact."""

import dataclasses
import json
import os

import pytest
import torch

from tilework.errors import CheckpointError
from tilework.train import checkpoint
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
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-00000010.pt"]


@pytest.mark.parametrize("workload", ["lm", "cnn", "recommender"])
def test_each_workload_learns(tmp_path, workload):
    job = Job(workload=workload,
              lm=LMJob(corpus="zipf", vocab=300, embed_dim=16, hidden=16, seq_len=8, zipf_tokens=30_000),
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
