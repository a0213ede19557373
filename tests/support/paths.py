"""Where the repository is, whatever the depth of the test file asking."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
