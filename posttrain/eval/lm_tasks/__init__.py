"""lm-eval task definitions (YAML) over the data posttrain has offline: GSM8K and HumanEval from the
shared data folder, the held-out split of the synthetic arithmetic problems (`data.py`)."""
