"""Quantisation-aware training: fake quantisation put into the model, and switched on at a
step."""
