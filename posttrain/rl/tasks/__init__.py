"""What RL trains and evaluates on: task domains, the user's task files, the scheduler (mixture, difficulty,
curriculum), the registries of domains and verifiers, and the evaluation suites.
"""
