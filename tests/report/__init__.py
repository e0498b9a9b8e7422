"""Tests of tilework/report/."""
