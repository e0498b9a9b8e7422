"""What `tilework plan` and `parallelize` print: the plan table, the job's costs, the mesh's stages,
schedule, times and memory."""
