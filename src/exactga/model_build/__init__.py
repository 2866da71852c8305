"""The models a run computes with: the trained model built, made trainable, cast, compiled,
sharded and loaded in one order, and frozen teacher and reference models."""
