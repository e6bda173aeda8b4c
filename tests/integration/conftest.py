"""Fixtures of the integration tests: one Prefect test server per module that asks for it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory: pytest.TempPathFactory):
    """The module's Prefect test server; yields its API URL."""
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_HOME,
        PREFECT_LOGGING_LEVEL,
        PREFECT_SERVER_ANALYTICS_ENABLED,
        temporary_settings,
    )
    from prefect.testing.utilities import prefect_test_harness

    home = tmp_path_factory.mktemp("prefect-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PREFECT_HOME", str(home))
        mp.setenv("PREFECT_LOGGING_LEVEL", "WARNING")
        mp.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        with temporary_settings({PREFECT_HOME: str(home), PREFECT_LOGGING_LEVEL: "WARNING",
                                 PREFECT_SERVER_ANALYTICS_ENABLED: False}):
            with prefect_test_harness(server_startup_timeout=120):
                yield PREFECT_API_URL.value()
