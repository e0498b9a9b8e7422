"""Tests of tilework/bench/ and the scripts in bench/."""
