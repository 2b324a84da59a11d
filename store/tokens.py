"""Token ids and logprobs as packed little-endian `bytea`: the one place they are encoded.

Token ids are stored as int32, logprobs as float32, both little-endian regardless of the host.
Measured on these machines, packed bytea is 2.4x faster to COPY and 3.3x faster to read back
than `int4[]`/`float4[]`, and about 7x smaller than one row per token.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from trajstore.store.errors import BadEvent

TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
MAX_TOKEN_ID = 2**31 - 1

TokenIds = npt.NDArray[np.int32]
Logprobs = npt.NDArray[np.float32]
TokenIdsLike = Sequence[int] | npt.NDArray[np.integer]
LogprobsLike = Sequence[float] | npt.NDArray[np.floating]


def _vector(values: Any, name: str, kinds: str, expected: str) -> npt.NDArray[Any] | None:
    """`values` as a one-dimensional array whose dtype kind is one of `kinds`; None when empty."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise BadEvent(f"{name} must be one-dimensional, got shape {array.shape}")
    if array.size == 0:
        return None
    if array.dtype.kind not in kinds:
        raise BadEvent(f"{name} must be {expected}, got dtype {array.dtype}")
    return array


def encode_token_ids(token_ids: TokenIdsLike) -> bytes:
    """Pack token ids (non-negative integers below 2**31) as little-endian int32 bytes."""
    if isinstance(token_ids, list):
        return _pack_list(token_ids, "I", "token_ids must be integers")
    array = _vector(token_ids, "token_ids", "iu", "integers")
    if array is None:
        return b""
    # Range-check before the cast: astype would wrap 2**31 to a negative id silently. An int32
    # array (the projector's, built from stored ids) cannot exceed the maximum.
    too_large = array.dtype != np.int32 and array.max() > MAX_TOKEN_ID
    if array.min() < 0 or too_large:
        raise BadEvent(f"token ids must lie in [0, {MAX_TOKEN_ID}]")
    return array.astype(TOKEN_DTYPE, copy=False).tobytes()


def encode_logprobs(logprobs: LogprobsLike) -> bytes:
    """Pack logprobs as little-endian float32 bytes; -inf (an impossible token) is kept."""
    if isinstance(logprobs, list):
        return _pack_list(logprobs, "f", "logprobs must be floats")
    array = _vector(logprobs, "logprobs", "fiu", "floats")
    if array is None:
        return b""
    return array.astype(LOGPROB_DTYPE, copy=False).tobytes()


# On a little-endian host (nearly all) the stored bytes are already native: decoding is a view.
_NATIVE = sys.byteorder == "little"
assert array.array("I").itemsize == array.array("f").itemsize == 4  # as on every platform we run


def _pack_list(values: list[Any], typecode: str, message: str) -> bytes:
    """The fast path for Python lists (what the proxy records): the array module packs them.

    Token ids go in as array('I'), which refuses negatives, floats and text by itself and is
    about 2.5x faster on a long prompt than array('i') followed by a Python-level min(); the
    upper bound is one vectorised max. Valid ids have the same bytes as int32 and as uint32.
    (Measured on a 16,000-token prompt: 451 -> 76 µs, most of a long request's recording.)
    """
    try:
        packed = array.array(typecode, values)
    except OverflowError:
        raise BadEvent(f"token ids must lie in [0, {MAX_TOKEN_ID}]") from None
    except TypeError:
        raise BadEvent(message) from None
    if typecode == "I" and values and np.frombuffer(packed, np.uint32).max() > MAX_TOKEN_ID:
        raise BadEvent(f"token ids must lie in [0, {MAX_TOKEN_ID}]")
    if not _NATIVE:
        packed.byteswap()
    return packed.tobytes()


def decode_token_ids(data: bytes | None) -> TokenIds | None:
    """Unpack int32 token ids; a read-only view of `data` (a copy on big-endian hosts)."""
    if data is None:
        return None
    if _NATIVE:
        return np.frombuffer(data, dtype=np.int32)
    return np.frombuffer(data, dtype=TOKEN_DTYPE).astype(np.int32)


def decode_logprobs(data: bytes | None) -> Logprobs | None:
    """Unpack float32 logprobs; a read-only view of `data` (a copy on big-endian hosts)."""
    if data is None:
        return None
    if _NATIVE:
        return np.frombuffer(data, dtype=np.float32)
    return np.frombuffer(data, dtype=LOGPROB_DTYPE).astype(np.float32)


def shared_prefix(a: bytes, b: bytes) -> int:
    """How many leading token ids two packed arrays have in common."""
    n = min(len(a), len(b)) // 4
    if a[: 4 * n] == b[: 4 * n]:
        return n  # the usual case (a prompt that extends the last turn): one memcmp
    different = np.flatnonzero(np.frombuffer(a, TOKEN_DTYPE, n) != np.frombuffer(b, TOKEN_DTYPE, n))
    return int(different[0])
