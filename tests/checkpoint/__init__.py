"""Tests of tilework/checkpoint/."""
