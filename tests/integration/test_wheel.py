"""A non-editable install works away from the source tree: the wheel carries every package, the catalogue
(`configs/`) and the traces, and `hetgate` runs from it.

The wheel is built from a copy of the tree (so the build leaves nothing in the checkout), installed into a
fresh virtual environment that sees this interpreter's packages (hetgate's dependencies, not hetgate: the
test asserts that every module it runs comes from the venv), and run from a folder that is not the tree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "scoring", "kvindex", "bench")
# What the build needs; the rest of a checkout (tests, caches, virtual environments) stays behind.
BUILD_INPUTS = ("pyproject.toml", "README.md", "configs", *PACKAGES)


def _copy_tree(dest: Path) -> None:
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in BUILD_INPUTS:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=skip)
        else:
            shutil.copy2(source, dest / name)


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, str]]:
    """(the wheel, the venv, an environment that imports hetgate only from the venv)."""
    base = tmp_path_factory.mktemp("wheel")
    tree, wheels, venv = base / "tree", base / "wheels", base / "venv"
    tree.mkdir()
    _copy_tree(tree)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HETGATE_TRACES", "HETGATE_CONFIG")}
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(tree)], base, env)
    [wheel] = wheels.glob("hetgate-*.whl")
    # --without-pip: this interpreter's pip (visible through --system-site-packages) installs into the venv.
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], base, env)
    python = venv / "bin" / "python"
    # --ignore-installed: an editable hetgate of the outer environment must neither satisfy nor be removed.
    _run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", str(wheel)], base, env
    )
    shutil.rmtree(tree)  # nothing may be read from the build tree
    return wheel, venv, env


def test_the_wheel_holds_every_module_and_data_file(installed: tuple[Path, Path, dict[str, str]]) -> None:
    wheel, _, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {str(p.relative_to(ROOT)) for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    assert modules - names == set()  # a sub-package missing from pyproject's `packages` list shows here
    configs = {f"hetgate_configs/{p.name}" for p in (ROOT / "configs").glob("*.yaml")}
    assert {"hetgate_configs/accelerators.yaml", "hetgate_configs/models.yaml"} <= configs <= names
    traces = {f"bench/data/traces/{p.name}" for p in (ROOT / "bench" / "data" / "traces").iterdir()}
    assert "bench/data/traces/mooncake_synthetic_trace.jsonl" in traces <= names


def test_the_installed_command_checks_configs_and_reads_traces(
    installed: tuple[Path, Path, dict[str, str]], tmp_path: Path
) -> None:
    _, venv, env = installed
    site = venv / "lib"
    config = tmp_path / "cluster.yaml"
    shutil.copy2(ROOT / "configs" / "seed-case.yaml", config)  # a user's own file; names catalogue entries
    out = _run([str(venv / "bin" / "hetgate"), "check-config", str(config)], tmp_path, env)
    assert "OK" in out

    probe = (
        "import gateway, bench.workloads as w, scoring.catalog as c\n"
        "print(gateway.__file__); print(c.CONFIG_DIR); print(w.traces_dir())\n"
        "print(len(w.mooncake_trace(limit=40)), len(w.azure_trace('conv', limit=30)))\n"
        "print(c.load_catalog().accelerator('mi300x').memory_gb)\n"
    )
    lines = _run([str(venv / "bin" / "python"), "-c", probe], tmp_path, env).splitlines()
    module, config_dir, traces, counts, mi300x_memory_gb = lines
    for path in (module, config_dir, traces):
        assert Path(path).is_relative_to(site), f"{path} is not the installed copy under {site}"
    assert counts == "40 30"
    assert float(mi300x_memory_gb) == 192
