"""Tests of tilework/parallel/data/."""
