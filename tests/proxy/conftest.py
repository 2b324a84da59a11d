"""Fixtures of the proxy's tests that more than one module uses."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.proxy.fake_engine import FakeEngine
from tests.proxy.switching_support import DELAY


@pytest.fixture
async def versioned() -> AsyncIterator[FakeEngine]:
    async with FakeEngine(versioned=True, token_delay=DELAY) as fake:
        yield fake


@pytest.fixture
async def two_versioned() -> AsyncIterator[tuple[FakeEngine, FakeEngine]]:
    """Two versioned engines, for a proxy that spreads its sessions over both."""
    async with (
        FakeEngine(versioned=True, token_delay=DELAY) as first,
        FakeEngine(versioned=True, token_delay=DELAY) as second,
    ):
        yield first, second
