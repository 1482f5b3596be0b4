"""The runtime tests' devices (``devices.py`` states the rule; importing it first turns on
Triton's interpreter where there is no GPU, before any test module imports Triton)."""

import pytest
from devices import DEVICES


@pytest.fixture(scope="session", params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """Each device the torch code runs on under test: the CPU, and CUDA where there is one."""
    return request.param
