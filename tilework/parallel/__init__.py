"""One folder per dimension, each with its modules, communication and bytes model: data (buckets,
ZeRO, offload), rows (the parameter server), tensor, context, pipeline."""
