"""What a process computes on and in: the run's ``Runtime`` (device, seed, process group and
device mesh), the precision policy, the attention kernels and the CPU thread count. Uses only
``exactga.config``."""
