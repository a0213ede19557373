"""Rollouts: sampling groups with the current weights and verifying them (`worker.py`), overlapped
production (`producer.py`, `buffer.py`), multi-turn episodes, several processes (`hosts.py`), the rollout log.
"""
