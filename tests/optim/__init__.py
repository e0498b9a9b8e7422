"""Tests of tilework/optim/."""
