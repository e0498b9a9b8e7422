"""Tests of tilework/estimate/."""
