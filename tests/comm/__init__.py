"""Tests of tilework/comm/."""
