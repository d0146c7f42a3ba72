"""Shared test configuration: deterministic hypothesis, and the ``--full`` switch for heavy runs."""

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "deterministic",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("deterministic")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        default=False,
        help="also run the heavy tests (markers 'statistical' and 'slow'); CI runs them",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--full"):
        return
    skip = pytest.mark.skip(reason="heavy test: run with --full")
    for item in items:
        if "statistical" in item.keywords or "slow" in item.keywords:
            item.add_marker(skip)
