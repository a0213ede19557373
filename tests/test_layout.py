"""The layout's own rules (docs/architecture.md): small modules, and an architecture page whose
file lists match the code. Import layering is `lint-imports` (pyproject.toml), run by .ci/run."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def modules() -> list[Path]:
    return sorted(p.relative_to(ROOT) for p in (ROOT / "posttrain").rglob("*.py"))


def test_no_module_is_over_400_lines():
    long = {str(p): n for p in modules() if (n := len((ROOT / p).read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them): {long}"


def test_the_architecture_page_names_every_module_and_only_real_ones():
    text = ARCHITECTURE.read_text()
    named = set(re.findall(r"posttrain/[\w/]+\.py", text))
    missing = [str(p) for p in modules() if p.name != "__init__.py" and str(p) not in named]
    stale = [p for p in sorted(named) if not (ROOT / p).is_file()]
    assert not missing, f"docs/architecture.md does not list {missing}"
    assert not stale, f"docs/architecture.md names files that do not exist: {stale}"
