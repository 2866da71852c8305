"""Supervised fine-tuning: the causal language-model loss of one micro-batch over shifted tokens.
The keys of the full and LoRA fine-tuning recipes, which the other families extend, are
exactga.config.schemas'."""
