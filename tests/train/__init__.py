"""Tests of tilework/train/."""
