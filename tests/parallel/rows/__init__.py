"""Tests of tilework/parallel/rows/."""
