"""The machines: cluster files (hosts, links, memory), the topology of ranks, the device mesh and
its named axes, the worker's environment, and calibration."""
