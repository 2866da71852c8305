"""Validation during training: the held-out set, read alike by every family, and the exact sums
of its losses over every rank (exactga.validation.held_out). Each family's figure is its own
(exactga.sft.validation, exactga.kd.validation)."""
