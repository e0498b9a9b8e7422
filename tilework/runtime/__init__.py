"""Applying a Plan to the user's model and optimizer: the data-parallel engine, the mesh's ordered
apply (tp, cp, pp, dp), the change record and its undo, hooks, clipping, checks."""
