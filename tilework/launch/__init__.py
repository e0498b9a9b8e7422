"""Starting and ending ranks: the launcher, the worker entry, `tilework run`'s script runner, and
what a failed run tells its user."""
