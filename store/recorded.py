"""One session as recorded, read back from the log: its record and the samples it makes.

What an orchestrator reads the moment a session is finished (`trajstore.client`, the verl and TRL
rollouts): every event is durable once the proxy answered the finish, so the samples are built
here from the log with the projector's own function (`store.samples.build_samples`), token for
token what the projector writes into `samples`, without waiting for the projector.
"""

from __future__ import annotations

from trajstore.store.connection import unavailable_as_store_error
from trajstore.store.eventstore import EventStore
from trajstore.store.samples import Sample, build_samples
from trajstore.store.sessions import SessionRecord, rebuild_session


async def recorded_session(store: EventStore, session_id: str) -> SessionRecord:
    """The session rebuilt from its events, token ids and logprobs packed (`rebuild_session`)."""
    async with unavailable_as_store_error():
        events = await store.read_session(session_id)
    return rebuild_session(session_id, events, packed=True)


async def recorded_samples(store: EventStore, session_id: str) -> list[Sample]:
    """The samples the projector makes of the session, built from its log now."""
    return build_samples(await recorded_session(store, session_id))
