"""Tests of tilework/planner/."""
