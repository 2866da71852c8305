"""Knowledge distillation: the teacher, the combined loss of one micro-batch and its units, and the
keys of the distillation recipes."""
