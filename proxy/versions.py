"""The policy version engines serve, named by the admin outside a switch, and recorded.

A trainer that syncs weights itself (not through `proxy.switching`) tells the proxy which version
the engines now serve: `POST /admin/engines/policy-version`. Every turn started from then on
records that version; the log also keeps the statement itself, as a `policy_version_set` event
(what, which engines, what they served before, when), so "when did engine E start claiming
version V" has an answer after the fact. The call returns once the event is durable.

An engine in the middle of a switch is refused (409): the switch names its version when it goes
live, and a second word at the same time would leave the log saying two things.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence

from trajstore.proxy.engines import Engine
from trajstore.proxy.switching import VersionSwitches
from trajstore.store.events import version_set_stream
from trajstore.store.payloads import PolicyVersionSet


async def set_policy_version(
    switches: VersionSwitches, version: str, urls: Sequence[str] | None
) -> list[Engine]:
    """Name `version` as what the engines at `urls` (all when None) serve, and record it.
    `KeyError` for an unknown engine, `SwitchConflict` for one that is switching."""
    engines = switches.not_switching(urls)
    previous = {e.url: e.policy_version for e in engines}
    for engine in engines:
        switches.engines.set_policy_version(engine.url, version)
    payload = PolicyVersionSet(
        version=version, engines=[e.url for e in engines], previous=previous, set_at=time.time()
    )
    await switches.record(version_set_stream(secrets.token_hex(8)), 1, payload)
    return engines
