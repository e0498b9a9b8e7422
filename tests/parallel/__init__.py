"""Tests of tilework/parallel/."""
