"""Tests of tilework/runtime/."""
