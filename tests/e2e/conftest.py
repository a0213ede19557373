"""Fixtures of the whole runs."""

import pytest


@pytest.fixture(scope="session")
def sft_cli_run(tmp_path_factory):
    """The workdir of one uninterrupted tiny SFT run through the command line
    (tests/support/cli_runs.py): test_cli reads its metrics, test_resume resumes against it. Treat
    it as read-only."""
    from tests.support.cli_runs import run_sft

    return run_sft(tmp_path_factory.mktemp("sft_cli_run") / "full")
