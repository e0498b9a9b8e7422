"""Data parallelism: dense all-reduce buckets, input checks, ZeRO 1-3 and offload."""
