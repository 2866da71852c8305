"""What a run's epoch and step checkpoints hold of its model and optimizer."""
