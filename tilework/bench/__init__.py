"""Benchmarks and the environments they run in (emulated multi-host clusters on one machine)."""
