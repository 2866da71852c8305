"""Exact gradient accumulation: loss units counted on the host, the normaliser that weighs each
micro-batch by its share of the window over every rank, the forward that computes logits only at
loss positions, and one optimizer step over a window."""
