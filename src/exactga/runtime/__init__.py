"""What a process computes on and in: the process group and device mesh, the precision policy,
the attention kernels. Uses only ``exactga.config``."""
