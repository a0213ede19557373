"""Verifiers: score a model response against a task (math answers, code with unit tests)."""

from posttrain.rl.verifiers.base import Verdict, Verifier
from posttrain.rl.verifiers.code import CodeResult, CodeTask, CodeVerifier, extract_code
from posttrain.rl.verifiers.math import MathTask, MathVerifier, answers_equal, extract_answer

__all__ = [
    "CodeResult",
    "CodeTask",
    "CodeVerifier",
    "MathTask",
    "MathVerifier",
    "Verdict",
    "Verifier",
    "answers_equal",
    "extract_answer",
    "extract_code",
]
