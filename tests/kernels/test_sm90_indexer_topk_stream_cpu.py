"""A model of the one-CTA top-k's StreamReader (ffi/sm90/indexer_topk.cuh, the build of kernel name
"sm90_topk_stream"), its arithmetic and its schedule, checked against their definitions on CPU
before the GPU runs the kernel:

- each chunk's bulk copy covers exactly the chunk's whole groups (a group is whole when all four of
  its positions lie in the row), so no copy reads a byte outside the row's 16-byte words, every
  other group of the slice is loaded by its lane, and the copy fits its 4 KB stage;
- the two stages of a warp: a chunk is copied into a stage only after the chunk before it in that
  stage was visited, at most two are in flight, each stage's barrier completes once per copy and the
  walk waits for it in the parity it tracks, and a walk that stops early waits for what it issued,
  so the next walk starts with both stages free and the parities in step.
"""

from __future__ import annotations

import numpy as np
import pytest

# ffi/sm90/indexer_topk.cuh: kStreamGroups, kStreamStages, kWarps.
STREAM_GROUPS = 256
STREAM_STAGES = 2
WARPS = 16


def chunk_copies(length: int, lead: int, begin: int, end: int) -> list[tuple[int, int, int, int]]:
    """StreamReader::Slice's issue(chunk) for every chunk of groups [begin, end): (c0, c1, w0, w1),
    the chunk's groups and the whole ones it copies (w1 <= w0: no copy)."""
    whole_begin = 0 if lead == 0 else 1
    whole_end = (length + lead) // 4
    chunks = -(-(end - begin) // STREAM_GROUPS) if end > begin else 0
    out = []
    for chunk in range(chunks):
        c0 = begin + chunk * STREAM_GROUPS
        c1 = min(c0 + STREAM_GROUPS, end)
        out.append((c0, c1, max(c0, whole_begin), min(c1, whole_end)))
    return out


def warp_slices(length: int, lead: int) -> list[tuple[int, int]]:
    groups = -(-(length + lead) // 4)
    per_warp = -(-groups // WARPS)
    return [(min(groups, w * per_warp), min(groups, min(groups, w * per_warp) + per_warp))
            for w in range(WARPS)]


@pytest.mark.parametrize("lead", [0, 1, 2, 3])
@pytest.mark.parametrize("length", [2, 3, 4, 5, 7, 1023, 1024, 1025, 4096 * 16 + 3, 65536, 131071])
def test_copies_cover_exactly_the_whole_groups(length, lead):
    row_words = set()  # 16-byte words holding a position of the row: group g holds 4 g - lead ...
    seen = []
    for begin, end in warp_slices(length, lead):
        for c0, c1, w0, w1 in chunk_copies(length, lead, begin, end):
            assert begin <= c0 < c1 <= end and c1 - c0 <= STREAM_GROUPS
            copied = range(w0, w1) if w1 > w0 else range(0)
            if copied:
                assert c0 <= w0 and w1 <= c1
                assert 16 * (w1 - w0) <= 16 * STREAM_GROUPS and (w1 - w0) * 16 % 16 == 0
                assert 0 <= w0 - c0 and (w0 - c0) + (w1 - w0) <= STREAM_GROUPS  # inside the stage
            for g in range(c0, c1):
                positions = np.arange(4 * g - lead, 4 * g - lead + 4)
                whole = bool(((positions >= 0) & (positions < length)).all())
                assert (g in copied) == whole, (g, c0, c1, w0, w1)
                assert ((positions >= 0) & (positions < length)).any()  # every group meets the row
                seen.append(g)
            for g in copied:
                row_words.add(g)
    groups = -(-(length + lead) // 4)
    assert seen == list(range(groups))  # every group once, in position order across the warps


def walk(chunks: int, stop_after: int | None, phases: list[int], barrier_phase: list[int]):
    """StreamReader::Slice's schedule for one warp: returns the events; `phases` is the walk's
    parity per stage (the reader's state), `barrier_phase` the barriers' completed phase counts."""
    events = []
    in_flight = {}  # stage -> chunk
    issued = min(STREAM_STAGES, chunks)
    for chunk in range(issued):
        stage = chunk % STREAM_STAGES
        assert stage not in in_flight
        in_flight[stage] = chunk
        events.append(("issue", chunk))
    consumed, go = 0, True

    def wait(chunk):
        stage = chunk % STREAM_STAGES
        assert in_flight.pop(stage) == chunk  # the copy it waits for is the one in that stage
        # The copy completes the barrier's current phase; try_wait.parity(p) returns once the
        # phase of parity p has completed: p must be the parity of the phase this copy completes.
        assert phases[stage] == barrier_phase[stage] % 2
        barrier_phase[stage] += 1
        phases[stage] ^= 1

    while go and consumed < chunks:
        wait(consumed)
        events.append(("visit", consumed))
        go = stop_after is None or consumed < stop_after
        consumed += 1
        if go and issued < chunks:
            stage = issued % STREAM_STAGES
            assert stage not in in_flight  # refilled only after its last chunk was visited
            in_flight[stage] = issued
            events.append(("issue", issued))
            issued += 1
    while consumed < issued:
        wait(consumed)
        consumed += 1
    assert not in_flight  # both stages free for the next walk
    return events


@pytest.mark.parametrize("chunks", [0, 1, 2, 3, 4, 7])
def test_schedule_keeps_stages_and_phases_in_step(chunks):
    rng = np.random.default_rng(chunks)
    phases, barrier_phase = [0] * STREAM_STAGES, [0] * STREAM_STAGES
    # Several walks in a row (the passes and gathers of one row), some stopping early.
    for _ in range(12):
        stop_after = None if rng.random() < 0.5 else int(rng.integers(0, max(chunks, 1)))
        events = walk(chunks, stop_after, phases, barrier_phase)
        visited = [c for kind, c in events if kind == "visit"]
        expected = chunks if stop_after is None else min(chunks, stop_after + 1)
        assert visited == list(range(expected))
        for position, (kind, chunk) in enumerate(events):
            if kind == "issue" and chunk >= STREAM_STAGES:
                # chunk c is issued right after chunk c - 2 (same stage) was visited
                assert ("visit", chunk - STREAM_STAGES) in events[:position]
