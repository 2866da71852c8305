"""A run around its steps: counters, step bookkeeping and metrics, step checkpoints, resume,
the metric logger and the CPU thread count."""
