"""The parameter server: tables whose rows live on servers (pull, push, lookups, prefetch, hot
rows)."""
