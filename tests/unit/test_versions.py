import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.rollout.versions import NoFreeSlot, SlotTable, VersionBook


def test_slot_table_assigns_reuses_and_runs_out():
    table = SlotTable(2)
    assert table.assign(0) == 0
    assert table.assign(1) == 1
    with pytest.raises(NoFreeSlot, match="lora_keep_versions"):
        table.assign(2)
    assert table.release(0) == 0
    assert table.assign(2) == 0
    assert table.versions() == [1, 2]
    with pytest.raises(ValueError, match="already loaded"):
        table.assign(1)
    with pytest.raises(KeyError, match="not loaded"):
        table.slot_of(0)


def test_keep_window_and_pins():
    book = VersionBook(keep=2)
    for v in range(4):
        book.mark_loaded(v)
    book.pin(0)
    assert book.window() == [2, 3]
    assert book.to_unload() == [1]  # 0 is pinned
    with pytest.raises(RuntimeError, match="pinned"):
        book.mark_unloaded(0)
    book.unpin(0)
    assert book.to_unload() == [0, 1]
    with pytest.raises(RuntimeError, match="without a matching pin"):
        book.unpin(0)


def test_choose_prefers_grant_then_head():
    book = VersionBook(keep=3)
    with pytest.raises(LookupError):
        book.choose()
    book.mark_loaded(1)
    book.mark_loaded(2)
    assert book.choose() == 2
    assert book.choose(1) == 1
    with pytest.raises(KeyError, match="granted version 7"):
        book.choose(7)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("load"), st.integers(0, 12)),
        st.tuples(st.just("pin"), st.integers(0, 12)),
        st.tuples(st.just("unpin"), st.integers(0, 12)),
        st.tuples(st.just("gc"), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(keep=st.integers(1, 4), ops=ops)
def test_pinned_version_is_never_unloaded(keep, ops):
    book = VersionBook(keep=keep)
    pins: dict[int, int] = {}
    for op, v in ops:
        if op == "load":
            book.mark_loaded(v)
        elif op == "pin" and v in book.loaded():
            book.pin(v)
            pins[v] = pins.get(v, 0) + 1
        elif op == "unpin" and pins.get(v):
            book.unpin(v)
            pins[v] -= 1
        elif op == "gc":
            for gone in book.to_unload():
                assert not pins.get(gone), f"pinned version {gone} chosen for unload"
                assert gone not in book.window()
                book.mark_unloaded(gone)
        # invariants after every step
        for pinned, count in pins.items():
            if count:
                assert pinned in book.loaded()
        assert set(book.window()) <= set(book.loaded())
        assert book.in_flight() == sum(pins.values())
