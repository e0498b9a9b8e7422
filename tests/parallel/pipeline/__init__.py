"""Tests of tilework/parallel/pipeline/."""
