"""Every third-party module the shipped code imports is declared in pyproject.toml, so a clean install of
hetgate (plus the extra a part needs) runs it: `gateway`, `scoring`, `kvindex` and `bench` need only the
base dependencies, except the parts that name their extra below; the tests need base + `test`.

Import names are mapped to distributions by `importlib.metadata.packages_distributions()` (yaml -> PyYAML),
so the check follows what is installed, not a hand-kept table.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCAL = {"gateway", "scoring", "kvindex", "bench", "hetgate_configs", "tests"}
# Imported only inside `try: ... except ImportError` with a fallback: not a requirement.
OPTIONAL = {"uvloop"}
# Files that run in another environment or need an extra, and what they may use beyond the base.
# A key ending in "/" covers a folder.
EXTRA_FOR = {
    "bench/locustfile.py": ("bench",),  # `hetgate bench` load generation with locust
    "bench/seed_case.py": ("bench",),  # --plot draws with matplotlib
    "bench/policies.py": ("bench",),  # --plot draws with matplotlib
    "bench/fidelity.py": ("bench",),  # --plot draws with matplotlib
    "gateway/epp/": ("epp",),  # `hetgate epp`: gRPC, Envoy's protos (pip install 'hetgate[epp]')
    "bench/epp_floor.py": ("epp",),  # the floor EPP of `hetgate bench overhead`: the same gRPC stack
    "tests/epp/": ("test", "epp"),
    "tests/unit/test_epp_protocol.py": ("test", "epp"),
}
OTHER_ENVIRONMENT = {"tests/e2e/build_tiny_model.py"}  # runs in the vLLM venv (torch, transformers)


def _name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group(0)).lower()


def _declared() -> dict[str, set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"": {_name(r) for r in project["dependencies"]}}
    for extra, requirements in project["optional-dependencies"].items():
        groups[extra] = groups[""] | {_name(r) for r in requirements}
    return groups


def _imports(path: Path, local: set[str]) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in local | OPTIONAL}


def _undeclared(folders: tuple[str, ...], default_group: str) -> list[str]:
    declared, providers = _declared(), packages_distributions()
    missing = []
    for folder in folders:
        # Test helpers (tests/redis_server.py, ...) are imported by their bare names through sys.path.
        local = LOCAL | {p.stem for p in (ROOT / folder).rglob("*.py")}
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel in OTHER_ENVIRONMENT:
                continue
            allowed = _allowed(declared, rel, default_group)
            for module in sorted(_imports(path, local)):
                dists = {_name(d) for d in providers.get(module, [])}
                if not dists & allowed:
                    missing.append(f"{rel}: {module} (installed from {sorted(dists) or 'nothing'})")
    return missing


def _allowed(declared: dict[str, set[str]], rel: str, default_group: str) -> set[str]:
    for key, extras in EXTRA_FOR.items():
        if rel == key or (key.endswith("/") and rel.startswith(key)):
            return set().union(*(declared[e] for e in extras))
    return declared[default_group]


def test_shipped_code_imports_only_base_dependencies() -> None:
    assert _undeclared(("gateway", "scoring", "kvindex", "bench"), "") == []


def test_tests_import_only_base_and_test_dependencies() -> None:
    assert _undeclared(("tests",), "test") == []
