"""Communication: process groups built once from the topology, and counted collectives."""

from .groups import Groups, build_groups, exit_worker, init_from_env

__all__ = ["Groups", "build_groups", "exit_worker", "init_from_env"]
