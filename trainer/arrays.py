"""The packed arrays of samples: read by id from one projection version, decoded to numpy.

Torch-free, so Ray read tasks (`trainer.ray_data`) use it as the replay does.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import numpy as np
import orjson

from trajstore.store import sample_reads
from trajstore.store.samples import token_versions
from trajstore.store.tokens import decode_logprobs, decode_token_ids
from trajstore.trainer.errors import SampleGone

#: A sample's token ids (int32), loss mask (uint8), behaviour logprobs (float32), and the policy
#: version that generated each token (int32, -1 for prompt and glue, or unknown).
Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def decode_arrays(
    token_ids: bytes, loss_mask: bytes, logprobs: bytes, version_spans: bytes | None = None
) -> Arrays:
    """The stored bytes as numpy views (`store.tokens`), the loss mask as uint8, and the
    per-token versions from the sample's `version_spans` (stored JSON; None: all -1)."""
    tokens = decode_token_ids(token_ids)
    probs = decode_logprobs(logprobs)
    assert tokens is not None and probs is not None
    spans = orjson.loads(version_spans) if version_spans else None
    versions = token_versions(int(tokens.shape[0]), spans).astype(np.int32)
    return tokens, np.frombuffer(loss_mask, dtype=np.uint8), probs, versions


async def read_arrays(
    source: sample_reads.Source, version: int, ids: Sequence[uuid.UUID]
) -> dict[uuid.UUID, Arrays]:
    """The arrays of the given samples (from the store, or one connection); `SampleGone` when
    one was removed meanwhile."""
    rows = await sample_reads.read_arrays(source, version, ids)
    found = {row["sample_id"]: decode_arrays(*row[1:]) for row in rows}
    missing = [i for i in ids if i not in found]
    if missing:
        raise SampleGone(
            f"{len(missing)} selected samples (e.g. {missing[0]}) left projection version "
            f"{version} while they were read (a session discarded, or a rebuild switched "
            "versions); read the selection again"
        )
    return found
