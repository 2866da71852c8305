"""PPO: trajectories, their stock rewards and advantages, the policy and value loss terms."""
