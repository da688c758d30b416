"""The row rewrite of an eviction (vase_sglang/rows.py), checked exhaustively over small shapes
against a brute-force model of a paged row: slots handed out in whole pages, attention reading
position p from the page of row[p - p % ps], the allocator taking back whole pages."""

import itertools
import random

import pytest

from vase_sglang.rows import freed_slots, rewrite_row, round_up_to_pages


def _allocate(length: int, page_size: int, rng: random.Random) -> tuple[list[int], set[int]]:
    """A row of `length` columns on distinct random pages (whole pages, the last one partly
    used), as SGLang's paged allocator hands them out."""
    pages = rng.sample(range(1, 4 * length + 8), round_up_to_pages(length, page_size) // page_size)
    row = [pages[c // page_size] * page_size + c % page_size for c in range(length)]
    return row, set(pages)


def _read(row: list[int], p: int, page_size: int) -> int:
    """The slot paged attention reads for position p."""
    return row[p - p % page_size] // page_size * page_size + p % page_size


def _check(prefix, n, keep, window, page_size, rng):
    length = prefix + n + window
    row, pages = _allocate(length, page_size, rng)
    content = {slot: position for position, slot in enumerate(row)}  # K/V of each position
    kept = sorted(rng.sample(range(prefix, prefix + n), keep))
    for j, position in enumerate(kept):  # the chunk stage: kept K/V into the first K slots
        content[row[prefix + j]] = position

    rw = rewrite_row(prefix, n, keep, window, page_size)
    assert freed_slots(n, keep, window, page_size) == rw.freed
    assert (rw.src, rw.dst, rw.window) == (prefix + n, prefix + keep, window)
    if rw.move_row:
        new_row = row[:rw.dst] + row[rw.src:rw.src + window]
    else:
        for j in range(window):  # in order: a copy never reads a slot an earlier one wrote
            content[row[rw.dst + j]] = content[row[rw.src + j]]
        new_row = row[:rw.dst + window]
    assert len(new_row) == rw.new_length == prefix + keep + window

    expected = list(range(prefix)) + kept + list(range(prefix + n, length))
    for p, want in enumerate(expected):
        slot = _read(new_row, p, page_size)
        assert slot == new_row[p], (p, new_row)  # in-page offsets line up
        assert content[slot] == want, (p, slot)

    # Whole pages freed, none still referenced, none leaked.
    assert rw.free_start <= rw.free_stop <= round_up_to_pages(length, page_size)
    assert rw.freed == 0 or rw.free_start % page_size == 0
    freed = {row[c] // page_size for c in range(rw.free_start, min(rw.free_stop, length), page_size)}
    assert rw.freed == len(freed) * page_size or (rw.freed == 0 and not freed)
    held = {slot // page_size for slot in new_row}
    assert not freed & held
    assert freed | held == pages
    assert len(held) * page_size == round_up_to_pages(rw.new_length, page_size)


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_rewrite_matches_a_brute_force_row(page_size):
    rng = random.Random(page_size)  # which candidates are kept, which pages the row holds
    cases = 0
    for prefix, n, window in itertools.product(range(0, 3 * page_size, page_size), range(13),
                                               range(1, 10)):
        for keep in range(n + 1):
            _check(prefix, n, keep, window, page_size, rng)
            cases += 1
    assert cases == 3 * sum(n + 1 for n in range(13)) * 9


def test_steady_cycle_moves_pages_whole_and_frees_every_dropped_candidate():
    rw = rewrite_row(prefix=32, n=64, keep=48, window=16, page_size=16)
    assert rw.move_row and (rw.free_start, rw.free_stop, rw.freed) == (80, 96, 16)
    rw = rewrite_row(prefix=32, n=63, keep=48, window=16, page_size=16)  # offsets differ: a copy
    assert not rw.move_row and (rw.free_start, rw.free_stop, rw.freed) == (96, 112, 16)


def test_rewrite_refuses_what_no_row_holds():
    with pytest.raises(ValueError, match="page size"):
        rewrite_row(prefix=3, n=8, keep=4, window=4, page_size=2)
    with pytest.raises(ValueError, match="kept 9 of 8"):
        rewrite_row(prefix=0, n=8, keep=9, window=4)
