"""Who loses what under memory pressure, in elastic mode: water-filling over the requests'
private caches. Pure arithmetic on host ints, engine-free (the SGLang side is
patches/step.py's pressure_groups).

In elastic mode a request's budget T is a floor: its private cache grows while the pool has
room, and is cut only when memory is needed (the next decode step does not fit, or a waiting
request the floor-charged admission would take does not). Then the largest caches are cut first,
down to one common level L >= each request's floor, with L the highest level of `level_grid`
whose cuts free what is needed, so quality degrades evenly across requests rather than falling
on a few. Requests of a lower rank (priority) are cut to their floors before any of a higher
rank loses a token.

The levels are a coarse grid (four per doubling, whole pages): a cut at a level the server has
not cut to before traces the chunk stage's memory cost at that budget on meta tensors (~0.4 s of
host time for Qwen3-4B shapes, vase_sglang/plan.py), so a server cuts to few distinct levels in
its life rather than a new one at every pressure event.
"""

from __future__ import annotations

from typing import NamedTuple

from .rows import freed_slots


class Holding(NamedTuple):
    """One request's private cache as the water-filling sees it."""

    private: int  # private tokens held (not owned by the radix tree)
    floor: int  # its budget T: it is never cut below
    window: int  # R: the newest tokens, never candidates
    rank: int = 0  # lower ranks lose tokens first (priority scheduling)


def freed_by_cut(h: Holding, level: int, page_size: int = 1) -> int:
    """Slots freed by cutting `h` back to max(level, its floor) (0 if it holds no more)."""
    level = max(level, h.floor)
    if h.private <= level:
        return 0
    return freed_slots(h.private - h.window, level - h.window, h.window, page_size)


def over_floor(h: Holding) -> int:
    """Tokens a request holds above its floor (what pressure may take back)."""
    return max(0, h.private - h.floor)


LEVELS_PER_DOUBLING = 4


def level_grid(top: int, page_size: int = 1) -> list[int]:
    """The levels a cut may choose, ascending, up to `top`: 0 (every cache to its floor) and
    2^(k / LEVELS_PER_DOUBLING) rounded down to whole pages."""
    levels, k = {0}, 0
    while (level := int(2 ** (k / LEVELS_PER_DOUBLING)) // page_size * page_size) <= top:
        levels.add(level)
        k += 1
    return sorted(levels)


def water_fill(holdings: list[Holding], need: int, page_size: int = 1) -> dict[int, int]:
    """{index: level} of the requests to cut, and the level (tokens it keeps) each is cut to,
    so that the cuts free at least `need` slots where the requests hold that much above their
    floors, else as much as they do. Lowest rank first: a rank whose cuts to the floors free
    less than what is still needed is cut to the floors whole; in the rank that covers the
    rest, every cache above a common level L is cut to max(L, its floor), L the highest level
    of level_grid that frees enough. A cut that would free no whole page is not made (it would
    lose tokens for nothing)."""
    levels: dict[int, int] = {}
    remaining = need
    for rank in sorted({h.rank for h in holdings}):
        if remaining <= 0:
            break
        members = [i for i, h in enumerate(holdings) if h.rank == rank]

        def freed_at(level: int) -> int:
            return sum(freed_by_cut(holdings[i], level, page_size) for i in members)

        if freed_at(0) >= remaining:
            # Highest level of the grid that still frees enough: freed_at is non-increasing in
            # the level, and level 0 (every cache at its floor) frees enough.
            grid = level_grid(max(holdings[i].private for i in members), page_size)
            lo, hi = 0, len(grid) - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if freed_at(grid[mid]) >= remaining:
                    lo = mid
                else:
                    hi = mid - 1
            level = grid[lo]
        else:
            level = 0  # not enough in this rank: all of it to the floors
        for i in members:
            if freed_by_cut(holdings[i], level, page_size) > 0:
                levels[i] = max(level, holdings[i].floor)
        remaining -= freed_at(level)
    return levels
