"""A recipe's run wired in the order that decides its numbers: the config checked, the resume
point, the model, frozen models, optimizer, loader, checkpoints and step bookkeeping."""
