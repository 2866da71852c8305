"""GRPO: prompts, rollouts, rewards, completions as loss units, the policy loss of one micro-batch,
one rollout step, and the keys of the GRPO recipe."""
