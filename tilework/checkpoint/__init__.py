"""State in single-device layout for any plan (dp, server rows, ZeRO, tp shards, pp stages), the
checkpoint file format, and the atomic writer."""
