"""The symbolic-check worker: a process of its own that answers math-verify equivalence questions.

Started by `symbolic.SymbolicChecker` as `python -c` running `main()` here (also runnable as
`python -m posttrain.rl.verifiers.symbolic_worker`), so it never re-imports the caller's
`__main__` the way multiprocessing's "spawn" does: a verifier works from any script, notebook or
thread. Protocol, one JSON object per line: the worker writes `{"ready": true}` once sympy is
warm; then for each request `{"pred": ..., "ref": ...}` on stdin it writes `{"ok": bool}` or
`{"error": "Type: message"}` on stdout; with `"reduced": true`, `ok` also requires that `pred` is
no quotient whose numerator and denominator share a factor (`(x^2-1)/(x-1)`: work left). An
answer math-verify cannot parse is not equal (`ok` false): the response's fault, not the checker's.
End of stdin (the parent closed its end or exited): exit 0.
Anything sympy or math-verify print goes to stderr, never into the protocol.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys


def _check(parse, verify, pred, ref, reduced=False) -> bool:
    math = [s if s.strip().startswith("$") else f"${s}$" for s in (ref, pred)]
    gold = parse(math[0], parsing_timeout=None, raise_on_error=True)
    try:
        guess = parse(math[1], parsing_timeout=None, raise_on_error=True)
    except Exception:  # the answer is not math that math-verify reads: a wrong answer, not a fault
        return False
    ok = bool(gold and guess and verify(gold, guess, timeout_seconds=None, raise_on_error=True))
    return ok and not (reduced and _common_factor(guess[0]))


def _common_factor(expr) -> bool:
    """Whether a quotient's numerator and denominator share a factor in its variables."""
    import sympy

    if not isinstance(expr, sympy.Expr) or not expr.free_symbols:
        return False
    try:
        num, den = sympy.fraction(expr)
        if den == 1:
            return False
        common = sympy.gcd(num, den)
        return bool(common.free_symbols) or bool(common.is_number and abs(common) not in (0, 1))
    except Exception:  # no polynomial gcd (a function, a radical): nothing this check can say
        return False


def main() -> None:
    """Serve requests on stdin/stdout until stdin closes."""
    # Ctrl-C reaches the terminal's whole process group: the parent decides (finish the step, save,
    # stop: train/interrupt.py) and closes this worker; dying here would fail the step's checks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's channel; fd 1 itself -> stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled": ours is outside
    # sympy imports much of itself on first use: pay that before the first timed check
    _check(parse, verify, "(x+1)^2", "x^2+2x+1")
    out.write('{"ready": true}\n')
    for line in sys.stdin:
        try:
            request = json.loads(line)
            reply = {"ok": _check(parse, verify, request["pred"], request["ref"], request.get("reduced", False))}
        except Exception as e:  # reported to the caller, who raises it
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
