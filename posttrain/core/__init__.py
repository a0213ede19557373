"""The run harness every training stage uses: train state, checkpoints, optimizer, the jitted step, metrics, progress,
alerts, interrupts, the workdir lock, the compilation cache and batch placement (`harness.py`, `loop.py`).
"""
