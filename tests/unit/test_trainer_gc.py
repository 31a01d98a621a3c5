"""The trainer freezes what its start-up built out of the cyclic collector's sight."""

import gc

import pytest

pytestmark = pytest.mark.unit


def test_start_up_objects_are_frozen_out_of_full_collections():
    from services.trainer.__main__ import freeze_startup

    gc.unfreeze()
    built = [[i] for i in range(1000)]  # start-up's objects, tracked by the collector
    try:
        freeze_startup()
        assert gc.get_freeze_count() >= len(built)
        scanned = {id(o) for o in gc.get_objects()}  # what a full collection scans: not the frozen
        assert gc.is_tracked(built[0]) and id(built[0]) not in scanned
    finally:
        gc.unfreeze()
