"""Model families beyond torchtune 0.6.1's builders, one package each, in torchtune's
component-builder style (a builder taking every shape argument, sized builders beside it); their
Hugging Face configs, formats and checkpointers, the checkpointer that writes seeded initial
weights, and loading a state dict into a model."""
