"""MoE routed experts as an engine returns them, turned into a `side_data_recorded` fact.

vLLM (`--enable-return-routed-experts`) puts them on each choice of a completion as
`routed_experts`: a base64-encoded `.npy` array of shape (tokens - 1, layers, top-k), one row per
position of the prompt and completion from `routed_experts_prompt_start` (a request option,
0 by default) on, the last sampled token excluded (it was never forwarded). vLLM 0.32 sends it
on whole answers of the chat and completions APIs; a stream chunk that carries it is taken the
same way. The experts are recorded with the narrowest unsigned dtype their ids fit
(`store.side_data`): uint8 up to 254 experts.

Decoding happens once per choice, when the turn finishes, never per stream chunk. A value that
is not such an array is logged and left out: the turn's tokens stay recorded as they are.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging

import numpy as np

from trajstore.store.events import EventType, NewEvent
from trajstore.store.payloads import SideDataRecorded
from trajstore.store.side_data import EXPERTS, ROUTED_EXPERTS, narrowest_uint, pack

log = logging.getLogger(__name__)


def decode(encoded: str) -> np.ndarray | None:
    """The (positions, layers, top-k) expert ids of vLLM's encoding, or None if it is not one."""
    try:
        array: np.ndarray = np.load(
            io.BytesIO(base64.b64decode(encoded, validate=True)), allow_pickle=False
        )
    except (binascii.Error, ValueError, OSError) as exc:
        log.warning("routed_experts is not a base64 .npy array (%s): not recorded", exc)
        return None
    if array.ndim != 3 or array.dtype.kind not in "iu" or (array.size and array.min() < 0):
        log.warning("routed_experts has shape %s, dtype %s: not recorded", array.shape, array.dtype)
        return None
    return array


def side_data_event(
    encoded: str,
    *,
    request_id: str,
    choice: int,
    session_id: str,
    run_id: str | None,
    engine: str | None,
    start: int = 0,
) -> NewEvent | None:
    """The `side_data_recorded` event of one choice's routed experts (None when unreadable)."""
    experts = decode(encoded)
    if experts is None:
        return None
    narrow = experts.astype(narrowest_uint(int(experts.max(initial=0))), copy=False)
    specs, data = pack({EXPERTS: narrow})
    payload = SideDataRecorded(
        request_id=request_id, choice=choice, kind=ROUTED_EXPERTS, source=engine, start=start,
        n_tokens=int(experts.shape[0]), arrays=specs,
    )  # fmt: skip
    return NewEvent(
        EventType.SIDE_DATA_RECORDED, session_id=session_id, run_id=run_id, payload=payload,
        side_data=data,
    )  # fmt: skip
