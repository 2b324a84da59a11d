"""The collector tuning of the proxy and the projector leaves the process as it found it."""

from __future__ import annotations

import gc

from trajstore.store.collector import YOUNG_COLLECTION_EVERY, collections_paused, fewer_collections


def test_young_collections_are_rarer_inside_and_restored_after_the_last_exit() -> None:
    before = gc.get_threshold()
    first, second = fewer_collections(), fewer_collections()
    first.__enter__()
    second.__enter__()  # two tasks inside at once, leaving in the order they entered
    assert gc.get_threshold() == (YOUNG_COLLECTION_EVERY, *before[1:])
    first.__exit__(None, None, None)
    assert gc.get_threshold()[0] == YOUNG_COLLECTION_EVERY  # the second is still inside
    second.__exit__(None, None, None)
    assert gc.get_threshold() == before


def test_freezing_hides_what_was_alive_on_entry_until_exit() -> None:
    assert gc.get_freeze_count() == 0
    with fewer_collections(freeze=True):
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_paused_collections_nest_and_restore_the_state_found() -> None:
    assert gc.isenabled()
    first, second = collections_paused(), collections_paused()
    first.__enter__()
    second.__enter__()
    assert not gc.isenabled()
    first.__exit__(None, None, None)
    assert not gc.isenabled()  # the second is still inside
    second.__exit__(None, None, None)
    assert gc.isenabled()
    gc.disable()  # a process that had disabled collection keeps it disabled
    try:
        with collections_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
