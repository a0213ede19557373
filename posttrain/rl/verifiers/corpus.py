"""The math verifier's two corpora (issue 42): gaming answers that must score 0 and honest answers
that must score 1, as rows (corpora/README.md says what they hold and how they are built)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

CORPORA = Path(__file__).resolve().parent / "corpora"
EXPECTED = {"attacks": 0.0, "honest": 1.0}  # the score every row of a corpus must get


@dataclasses.dataclass(frozen=True)
class CorpusRow:
    """One response, the task's reference answer, its family and why it must score as it does."""

    id: str
    response: str
    reference: str
    family: str
    reason: str
    source: str


def load_corpus(name: str) -> list[CorpusRow]:
    """The rows of corpus `name` ("attacks" or "honest"), in file order."""
    if name not in EXPECTED:
        raise ValueError(f"no math verifier corpus {name!r}; valid: {sorted(EXPECTED)}")
    path = CORPORA / f"{name}.jsonl"
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                rows.append(CorpusRow(**json.loads(line)))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}:{n}: expected a JSON object with the fields of CorpusRow: {e}") from None
    return rows
