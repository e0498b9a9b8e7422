"""Tests of cluster and job files (tilework/config/, tilework/cluster/topology.py)."""
