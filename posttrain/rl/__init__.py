"""Reinforcement learning with verifiable rewards, by role: `algo/` (learner, losses, advantages, critic,
learned rewards), `rollout/` (workers, producer, buffer, episodes, hosts), `tasks/` (domains, task files, scheduler,
eval suites), `envs/`, `verifiers/`, and `reward.py` (a sample's reward from its verdict). The stages that run it
are in `posttrain/stages/`.
"""
