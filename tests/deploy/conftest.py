"""Deployment artefacts (deploy/): real tools render and check them. A missing tool skips locally and fails
under CI, like the Redis tests: CI can never pass by not checking."""

from __future__ import annotations

import os
import shutil

import pytest


def require_binary(name: str, install: str) -> str:
    path = shutil.which(name)
    if path is None:
        reason = f"{name} is not installed ({install})"
        if os.environ.get("CI"):
            pytest.fail(reason + "; CI must run the deployment checks", pytrace=False)
        pytest.skip(reason)
    return path


@pytest.fixture(scope="session")
def kubectl() -> str:
    return require_binary("kubectl", "kubectl with kustomize")


@pytest.fixture(scope="session")
def promtool() -> str:
    return require_binary("promtool", "apt-get install -y prometheus")


@pytest.fixture(scope="session")
def prometheus() -> str:
    return require_binary("prometheus", "apt-get install -y prometheus")
