"""The layout's own rules (docs/architecture.md): small modules, an architecture page whose file
lists match the code, and a tests/ that mirrors the package. Import layering is `lint-imports`
(pyproject.toml), run by .ci/run."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400
MAX_FUNCTION_LINES = 80  # a declarative table (a dict, a list of cases) may be longer: none is a function
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def modules() -> list[Path]:
    return sorted(p.relative_to(ROOT) for p in (ROOT / "posttrain").rglob("*.py"))


def test_no_module_is_over_400_lines():
    long = {str(p): n for p in modules() if (n := len((ROOT / p).read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them): {long}"


def test_no_function_is_over_80_lines():
    long = {}
    for p in modules():
        for node in ast.walk(ast.parse((ROOT / p).read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long[f"{p}:{node.lineno} {node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them): {long}"


def test_the_architecture_page_names_every_module_and_only_real_ones():
    text = ARCHITECTURE.read_text()
    named = set(re.findall(r"posttrain/[\w/]+\.py", text))
    missing = [str(p) for p in modules() if p.name != "__init__.py" and str(p) not in named]
    stale = [p for p in sorted(named) if not (ROOT / p).is_file()]
    assert not missing, f"docs/architecture.md does not list {missing}"
    assert not stale, f"docs/architecture.md names files that do not exist: {stale}"


# --- tests/ mirrors the package ------------------------------------------------------------------

TESTS = ROOT / "tests"
# Test modules that cover the repository rather than one module, and so stay at the top of tests/:
ROOT_LEVEL = {
    "test_golden.py": "golden metrics of the tiny stages (issue 41 keeps it where it is)",
    "test_layout.py": "this file: the layout of posttrain/, docs/architecture.md and tests/",
    "test_configs.py": "every shipped config in configs/ and every command of the README",
}
UNMIRRORED = {"e2e": "whole runs through posttrain.main and the stages", "support": "helpers, no tests"}


def files_of_tests() -> list[Path]:
    return sorted(p.relative_to(TESTS) for p in TESTS.rglob("test_*.py"))


def covered_module(test: Path) -> Path | None:
    """The module a test file names by its path: tests/a/b/test_c.py covers posttrain/a/b/c.py or the
    package posttrain/a/b/c/; a suffix names the aspect (tests/a/b/test_c_images.py → c.py) when c has
    several files; tests/tools/ mirrors tools/; a `redteam/` folder holds the red-team suites of its
    parent's modules (tests/rl/verifiers/redteam/test_code.py attacks posttrain/rl/verifiers/code.py)."""
    folders = [p for p in test.parts[:-1] if p != "redteam"]
    base = ROOT / "tools" / Path(*folders[1:]) if folders[:1] == ["tools"] else ROOT / "posttrain" / Path(*folders)
    words = test.stem.removeprefix("test_").split("_")
    for n in range(len(words), 0, -1):
        name = "_".join(words[:n])
        if (base / f"{name}.py").is_file() or (base / name / "__init__.py").is_file():
            return base / name
    return None


def test_every_test_module_sits_at_the_path_of_the_module_it_covers():
    tests = [t for t in files_of_tests() if t.parts[0] not in UNMIRRORED and str(t) not in ROOT_LEVEL]
    orphans = [str(t) for t in tests if covered_module(t) is None]
    assert not orphans, (
        f"test modules whose path names no module (tests/a/b/test_c.py ↔ posttrain/a/b/c.py or c/; "
        f"whole runs go to tests/e2e/): {orphans}"
    )
    assert all((TESTS / name).is_file() for name in ROOT_LEVEL), "a declared root-level test module is gone"


def test_test_folders_are_packages_and_hold_only_tests():
    """Every folder of tests/ is a package (equal basenames in two folders collect as two modules);
    beside test modules a folder holds only conftest.py and __init__.py: helpers live in support/."""
    folders = {p.parent for p in TESTS.rglob("*.py")}
    not_packages = [str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").is_file()]
    assert not not_packages, f"folders of tests/ without __init__.py: {not_packages}"
    helpers = [
        str(p.relative_to(ROOT))
        for p in TESTS.rglob("*.py")
        if p.relative_to(TESTS).parts[0] != "support"
        and not p.name.startswith("test_")
        and p.name not in ("conftest.py", "__init__.py")
    ]
    assert not helpers, f"helper modules outside tests/support/: {helpers}"


def test_test_modules_import_helpers_from_support_not_from_each_other():
    """A test file imports what it shares from tests/support/; tests/test_golden.py's recorded runs
    (what other files compare with) are the one test module others may read."""
    found = []
    for t in files_of_tests():
        for n, line in enumerate((TESTS / t).read_text().splitlines(), 1):
            m = re.match(r"\s*from (tests\.[\w.]+) import", line)
            if m and not m.group(1).startswith(("tests.support", "tests.test_golden")):
                found.append(f"tests/{t}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
