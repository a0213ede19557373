"""Evaluation helpers: gates, pass@k, long-context problems and their evaluation, the HTML report."""
