"""What the numbers run on: the model loaded from its weights, LoRA adapters, frozen teacher and
reference models, and the checkpointer that writes seeded initial weights."""
