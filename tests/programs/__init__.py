"""Tests on public programs and models, adapted as a user would."""
