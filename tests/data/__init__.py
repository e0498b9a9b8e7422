"""Tests of tilework/data/."""
