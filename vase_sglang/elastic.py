"""Who loses what under memory pressure, in elastic mode: water-filling over the requests'
private caches. Pure arithmetic on host ints, engine-free (the SGLang side is
patches/step.py's pressure_groups).

In elastic mode a request's budget T is a floor: its private cache grows while the pool has
room, and is cut only when memory is needed (the next decode step does not fit, or a waiting
request the floor-charged admission would take does not). Then the largest caches are cut first,
down to one common level L >= each request's floor, with L the highest level (on the page
grid) whose cuts free what is needed, so quality degrades evenly across requests rather than
falling on a few. Requests of a lower rank (priority) are cut to their floors before any of a
higher rank loses a token.
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


def water_fill(holdings: list[Holding], need: int, page_size: int = 1) -> dict[int, int]:
    """{index: level} of the requests to cut, and the level (tokens it keeps) each is cut to,
    so that the cuts free at least `need` slots where the requests hold that much above their
    floors, else as much as they do. Lowest rank first: a rank whose cuts to the floors free
    less than what is still needed is cut to the floors whole; in the rank that covers the
    rest, every cache above a common level L is cut to max(L, its floor), L the highest
    multiple of the page size that frees enough. A cut that would free no whole page is not
    made (it would lose tokens for nothing)."""
    levels: dict[int, int] = {}
    remaining = need
    for rank in sorted({h.rank for h in holdings}):
        if remaining <= 0:
            break
        members = [i for i, h in enumerate(holdings) if h.rank == rank]

        def freed_at(level: int) -> int:
            return sum(freed_by_cut(holdings[i], level, page_size) for i in members)

        if freed_at(0) >= remaining:
            # Highest level on the page grid that still frees enough: freed_at is
            # non-increasing in the level, and level 0 (every cache at its floor) frees enough.
            lo, hi = 0, max(holdings[i].private for i in members) // page_size + 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if freed_at(mid * page_size) >= remaining:
                    lo = mid
                else:
                    hi = mid - 1
            level = lo * page_size
        else:
            level = 0  # not enough in this rank: all of it to the floors
        for i in members:
            if freed_by_cut(holdings[i], level, page_size) > 0:
                levels[i] = max(level, holdings[i].floor)
        remaining -= freed_at(level)
    return levels
