"""A run around its steps: counters, step bookkeeping and metrics, step checkpoints, resume and
the metric logger."""
