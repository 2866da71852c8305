"""Generation: a prompt's sampled completions, the same on any rank layout, for the families
that train on what the policy generates (GRPO's groups, PPO's single responses)."""
