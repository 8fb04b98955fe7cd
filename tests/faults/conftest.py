"""The fault suite runs on the integration fixtures: real gateway processes and simulated backends."""

from tests.integration.conftest import gateway, sim

__all__ = ["gateway", "sim"]
