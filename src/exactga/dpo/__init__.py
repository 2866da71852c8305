"""Preference optimisation (DPO, RPO): preference pairs as loss units, the loss step of one
micro-batch, reference log-probs, and the keys of the DPO recipes."""
