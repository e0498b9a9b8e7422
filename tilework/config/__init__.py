"""Configuration: `ParallelConfig` (how to parallelize), the typed TOML loader of job and cluster
files, and a TOML writer."""
