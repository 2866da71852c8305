"""LoRA adapters: their settings, first values, loading, and what is saved of them."""
