"""The RL algorithm: the learner's batch and update, policy-gradient losses, advantages, the PPO critic and
the learned reward model as a reward source.
"""
