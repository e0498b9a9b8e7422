"""Pipeline parallelism: schedules as data (schedule.py), their simulator (simulate.py), and a
runtime that executes the same schedule on real ranks (runtime.py). docs/pipeline.md."""

from .runtime import PipelineRunner
from .schedule import (
                       Action,
                       Schedule,
                       build,
                       gpipe,
                       in_flight,
                       interleaved_1f1b,
                       one_f_one_b,
                       split_backward,
                       validate,
)
from .simulate import Simulation, p2p_bytes, simulate
from .stages import GPTStage, split_stages

__all__ = ["Action", "GPTStage", "PipelineRunner", "Schedule", "Simulation", "build", "gpipe",
           "in_flight", "interleaved_1f1b", "one_f_one_b", "p2p_bytes", "simulate",
           "split_backward", "split_stages", "validate"]
