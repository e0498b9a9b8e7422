"""Tensor and sequence parallelism (Megatron-LM), applied to an unmodified model by a layout."""
