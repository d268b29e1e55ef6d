"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest
import structlog

from tpassd.testing import private_munged


@pytest.fixture(scope="module")
def munge():
    """A private munged for the module's tests (credentials made and checked for real)."""
    with private_munged() as m:
        yield m


@pytest.fixture(autouse=True)
def _structlog_defaults():
    """Each test starts from structlog's defaults: a CLI test configures a level filter (tpassctl's
    default is warning), which would drop the info lines a later test reads with capture_logs."""
    saved = structlog.get_config()
    structlog.reset_defaults()
    yield
    structlog.configure(**saved)
