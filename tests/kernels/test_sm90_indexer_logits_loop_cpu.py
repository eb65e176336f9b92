"""A model of the SM90 logits kernels' tile loop (RunTiles in ffi/sm90/indexer_logits.cuh), checked
on CPU: for every count of tiles a CTA
loads, the loop as written (two accumulator sets, one set of key fragments, the last one or two
tiles peeled) issues every tile's MMAs once and in order, finishes every tile once and in order,
reads a tile's accumulators only after a wait retired its MMAs, reloads the key fragments only when
no MMA in flight reads them, never issues into an accumulator set whose tile is not yet finished,
and leaves no MMA in flight at the end.
"""

from __future__ import annotations

import pytest


class Warpgroup:
    """The warpgroup's MMA state as the loop sees it: batches in flight, in issue order."""

    def __init__(self):
        self.in_flight: list[tuple[int, str]] = []  # (tile, accumulator set)
        self.events: list[tuple[str, int]] = []
        self.accumulator_tile = {"even": None, "odd": None}  # tile accumulating, not yet finished
        self.keys_tile = None  # tile whose key fragments the registers hold

    def issue(self, tile: int, accumulators: str):
        # Issue loads the key fragments first: no MMA in flight may still read them.
        assert not self.in_flight, "key fragments reloaded under MMAs in flight"
        assert self.accumulator_tile[accumulators] is None, "accumulators of an unfinished tile"
        self.keys_tile = tile
        self.accumulator_tile[accumulators] = tile
        self.in_flight.append((tile, accumulators))
        self.events.append(("issue", tile))

    def wait(self, pending: int):
        # warpgroup_wait<pending>: the oldest batches retire until `pending` remain.
        del self.in_flight[:max(0, len(self.in_flight) - pending)]

    def sums_and_finish(self, tile: int, accumulators: str):
        assert self.accumulator_tile[accumulators] == tile
        assert all(t != tile for t, _ in self.in_flight), "accumulators read under their MMAs"
        self.accumulator_tile[accumulators] = None
        self.events.append(("finish", tile))


def overlapped_loop(num_loads: int) -> Warpgroup:
    """RunTiles, statement for statement."""
    wg = Warpgroup()
    wg.issue(0, "even")
    i = 0
    while i + 2 < num_loads:
        wg.wait(0)
        wg.issue(i + 1, "odd")
        wg.sums_and_finish(i, "even")
        wg.wait(0)
        wg.issue(i + 2, "even")
        wg.sums_and_finish(i + 1, "odd")
        i += 2
    wg.wait(0)
    if i + 1 < num_loads:
        wg.issue(i + 1, "odd")
        wg.sums_and_finish(i, "even")
        wg.wait(0)
        wg.sums_and_finish(i + 1, "odd")
    else:
        wg.sums_and_finish(i, "even")
    return wg


@pytest.mark.parametrize("num_loads", range(1, 18))
def test_every_tile_issued_and_finished_once_in_order(num_loads):
    wg = overlapped_loop(num_loads)
    issued = [t for kind, t in wg.events if kind == "issue"]
    finished = [t for kind, t in wg.events if kind == "finish"]
    assert issued == list(range(num_loads))
    assert finished == list(range(num_loads))
    assert not wg.in_flight
    # The overlap itself: from the second tile on, each tile's MMAs are issued before the previous
    # tile's epilogue.
    for tile in range(1, num_loads):
        assert wg.events.index(("issue", tile)) < wg.events.index(("finish", tile - 1))


def test_the_model_catches_a_wrong_loop():
    """The checks can fail: waiting for one batch instead of none before the reload is caught."""
    wg = Warpgroup()
    wg.issue(0, "even")
    wg.wait(1)
    with pytest.raises(AssertionError, match="key fragments"):
        wg.issue(1, "odd")
