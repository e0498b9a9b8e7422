"""Synchronisation: dense all-reduce buckets, the sparse parameter server, and the engine."""
