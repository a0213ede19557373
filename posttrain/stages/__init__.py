"""One module per stage (`config.stage`), and `registry.py`: the one list of stages that the CLI, the pipeline,
the config checks and the gates read.
"""
