"""Tests of tilework/cluster/."""
