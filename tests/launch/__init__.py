"""Tests of tilework/launch/."""
