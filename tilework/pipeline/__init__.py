"""Pipeline parallelism: schedules as data (schedule.py), their simulator (simulate.py), and a
runtime that executes the same schedule on real ranks (runtime.py). docs/pipeline.md."""

from .schedule import (Action, Schedule, build, gpipe, in_flight, interleaved_1f1b, one_f_one_b,
                       split_backward, validate)

__all__ = ["Action", "Schedule", "build", "gpipe", "in_flight", "interleaved_1f1b",
           "one_f_one_b", "split_backward", "validate"]
