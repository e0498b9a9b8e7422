"""Tests of tilework/plans/."""
