"""Tests of tilework/parallel/context/."""
