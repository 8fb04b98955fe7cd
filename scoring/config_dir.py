"""Where the shipped YAML files (`configs/`: the catalogue, the example and seed-case configs) are.

In a source tree (a clone, an editable install) they are the repository's `configs/` folder beside the
packages; a built wheel carries the same files as the data-only package `hetgate_configs` (see
`pyproject.toml`), because a wheel can only install files that belong to a package.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

_SOURCE_ROOT = Path(__file__).resolve().parents[1]
INSTALLED_PACKAGE = "hetgate_configs"


@functools.cache
def config_dir() -> Path:
    """The folder holding `accelerators.yaml`, `models.yaml`, `example.yaml` and `seed-case.yaml`."""
    # The source tree wins: with PYTHONPATH pointing at a checkout, its own files must be used even when
    # another copy of hetgate is installed. `pyproject.toml` tells a checkout from site-packages, where a
    # stray top-level `configs` folder of some other distribution could sit beside our packages.
    source = _SOURCE_ROOT / "configs"
    if (_SOURCE_ROOT / "pyproject.toml").is_file() and (source / "accelerators.yaml").is_file():
        return source
    spec = importlib.util.find_spec(INSTALLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"hetgate's configs/ was not found: neither {source} nor an installed {INSTALLED_PACKAGE} package"
        )
    return Path(next(iter(spec.submodule_search_locations)))
