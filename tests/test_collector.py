"""jaxckpt.core.collector: the collector paused for a block, across threads, and what the block made left out of
the young generations (real threads, Python's own collector)."""
import gc
import threading

from jaxckpt.core import collector


def _young() -> int:
    return len(gc.get_objects(0)) + len(gc.get_objects(1))


def test_objects_made_in_a_paused_block_leave_the_young_generations_and_the_collector_comes_back_on():
    assert gc.isenabled()
    gc.collect()
    before = _young()
    with collector.paused():
        assert not gc.isenabled()
        made = [[i] for i in range(20_000)]  # tracked objects, all alive after the block
    assert gc.isenabled()
    assert _young() - before < 1_000, f"{_young() - before} young objects after a block that made 20,000"
    assert sum(len(x) for x in made) == 20_000


def test_two_threads_inside_at_once_the_collector_stays_off_until_the_last_leaves():
    entered, release = threading.Event(), threading.Event()
    states: list[bool] = []

    def other() -> None:
        with collector.paused():
            entered.set()
            release.wait(30)
            states.append(gc.isenabled())

    t = threading.Thread(target=other)
    t.start()
    assert entered.wait(30)
    with collector.paused():
        pass
    states.append(gc.isenabled())  # the other thread is still inside
    release.set()
    t.join(30)
    assert states == [False, False]
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off_and_objects_it_froze_stay_frozen():
    gc.disable()
    try:
        with collector.paused():
            made = [[i] for i in range(2_000)]
        assert not gc.isenabled()
    finally:
        gc.enable()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with collector.paused():
            made += [[i] for i in range(2_000)]
        assert gc.get_freeze_count() >= frozen  # released by unfreeze, it would be 0
    finally:
        gc.unfreeze()
    assert len(made) == 4_000
