"""Tests of tilework/parallel/tensor/."""
