import gc

import pytest

from effdl.gc_pause import GCPause, gc_paused


def test_gc_paused_nests_and_restores_on_exit_and_error():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # only the last exit turns it back on
    assert gc.isenabled()
    with pytest.raises(KeyError), gc_paused():
        raise KeyError("boom")
    assert gc.isenabled()


def test_gc_paused_leaves_a_collector_the_user_switched_off():
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_unmatched_release_is_an_error():
    with pytest.raises(RuntimeError, match="without a matching acquire"):
        GCPause().release()
