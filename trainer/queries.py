"""Every SQL statement of the trainer, in one place, called by name.

The samples are read through the store's samples read API (`store.sample_reads`), the one owner
of that table's queries; what is left here reads the trainer's own streams of the event log.
"""

from __future__ import annotations

#: How many steps a training run's ledger stream holds (its last stream version; 0: none).
LEDGER_STEPS = """
SELECT coalesce(max(stream_version), 0) FROM events WHERE stream_id = $1
"""
