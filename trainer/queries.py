"""Every SQL statement of the trainer, in one place, called by name.

`{where}` is a `Selection.where()` clause (its values are parameters, never text); the other
parameters are numbered after the selection's.
"""

from __future__ import annotations

from trajstore.store.queries import SERVED_SAMPLES_VERSION

#: What a replay needs to order and batch samples, before reading their arrays.
SELECT_INDEX = """
SELECT sample_id, session_id, group_id, reward, octet_length(token_ids) / 4 AS n_tokens,
       policy_version_min, projection_version
FROM samples
WHERE {where}
ORDER BY sample_id
"""

#: The arrays of the given samples, in one projection version.
READ_ARRAYS = """
SELECT sample_id, token_ids, loss_mask, logprobs FROM samples
WHERE projection_version = $1 AND sample_id = ANY($2::uuid[])
"""

#: The turn-level side data of the given samples (`store.side_data`: routed experts).
READ_SIDE = """
SELECT sample_id, side, side_data FROM samples
WHERE projection_version = $1 AND sample_id = ANY($2::uuid[]) AND side IS NOT NULL
"""

#: The given samples in the served projection version (the ledger rebuilds a step from these).
READ_SERVED_SAMPLES = f"""
SELECT sample_id, session_id, group_id, reward, token_ids, loss_mask, logprobs,
       policy_version_min, projection_version
FROM samples
WHERE projection_version = {SERVED_SAMPLES_VERSION}
  AND sample_id = ANY($1::uuid[])
"""

#: The images of the given samples in the served projection version (`trainer.vision`).
READ_SAMPLE_IMAGES = f"""
SELECT sample_id, session_id, images FROM samples
WHERE projection_version = {SERVED_SAMPLES_VERSION}
  AND sample_id = ANY($1::uuid[])
"""

# Samples in the order their projector committed them, never past the oldest transaction still
# in flight: the same rule as the event log's READ_ALL, so a slow commit is never skipped.
TAIL = """
SELECT sample_id, session_id, group_id, reward, token_ids, loss_mask, logprobs,
       policy_version_min, projected_tx, projected_seq
FROM samples
WHERE {where}
  AND (projected_tx, projected_seq) > (${tx}::xid8, ${seq}::int8)
  AND projected_tx < pg_snapshot_xmin(pg_current_snapshot())
ORDER BY projected_tx, projected_seq
LIMIT ${limit}
"""

#: How many steps a training run's ledger stream holds (its last stream version; 0: none).
LEDGER_STEPS = """
SELECT coalesce(max(stream_version), 0) FROM events WHERE stream_id = $1
"""
