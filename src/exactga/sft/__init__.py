"""Supervised fine-tuning: the causal language-model loss of one micro-batch over shifted tokens,
and the keys of the full and LoRA fine-tuning recipes."""
