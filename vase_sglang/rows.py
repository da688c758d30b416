"""How an eviction rewrites one request's row of the request table: a pure function of the row's
shape, so every case can be checked against a brute-force model (tests/test_rows.py).

A row maps positions to KV pool slots. Before and after an eviction that keeps K of the n
candidates (P = tree-owned prefix, page-aligned and never touched; R = the newest window):

    [0, P) prefix | [P, P+n) candidates            | [P+n, P+n+R) newest R
    [0, P) prefix | [P, P+K) kept (mixed per head) | [P+K, P+K+R) newest R

The chunk stage has already written the kept K/V into the first K candidate slots (columns
P .. P+K-1). What is left is moving the newest R after them and giving back the rest.

Pages (page size ps > 1): paged attention reads position p from the page of row[p - p % ps] at
offset p % ps, and the allocator takes back whole pages only. So:
  * K and n multiples of ps (the steady cycle when T and R are): the newest R's pages move whole
    by rewriting the row (`move_row`), and the dropped candidates' slots are whole pages;
  * otherwise their in-page offsets would not line up: their K/V (every layer and head) is
    copied into the candidate slots at P+K .. P+K+R (`move_row` False: a KV copy, the row keeps
    its entries), and the pages wholly past the new length are freed.
"""

from __future__ import annotations

from typing import NamedTuple


def owned_prompt(prompt_len: int, page_size: int, radix: bool = True) -> int:
    """The prompt tokens the radix tree owns once the prompt is prefilled: its whole pages (the
    partial last page is private), none without the radix cache. The served step and the
    references evict only after them."""
    return prompt_len // page_size * page_size if radix else 0


def round_up_to_pages(tokens: int, page_size: int) -> int:
    """`tokens` rounded up to whole pages: what a row of that many tokens holds."""
    return -(-tokens // page_size) * page_size


class RowRewrite(NamedTuple):
    """What one eviction does to a row, in columns of the row before it.

    The newest R move from columns [src, src + R) to [dst, dst + R): with `move_row` by writing
    row[dst + j] = row[src + j] (the slots move, their K/V stay), else by copying the K/V of slot
    row[src + j] into slot row[dst + j] for every layer and head (the row is unchanged; src >= dst,
    so a copy never reads a slot an earlier one wrote). The slots of columns [free_start,
    free_stop) of the row before the rewrite go back to the allocator (whole pages).
    `new_length` is the row's length after."""

    move_row: bool
    src: int
    dst: int
    window: int
    free_start: int
    free_stop: int
    new_length: int

    @property
    def freed(self) -> int:
        return self.free_stop - self.free_start


def rewrite_row(prefix: int, n: int, keep: int, window: int, page_size: int = 1) -> RowRewrite:
    """The rewrite of a row with a page-aligned `prefix`, n candidates of which `keep` were
    kept, and the newest `window` tokens (module doc). keep == n: nothing changes."""
    if prefix % page_size:
        raise ValueError(f"prefix {prefix} is not a multiple of the page size {page_size}")
    if not 0 <= keep <= n:
        raise ValueError(f"kept {keep} of {n} candidates")
    src, dst = prefix + n, prefix + keep
    end = prefix + n + window
    if keep == n:
        return RowRewrite(True, src, dst, window, end, end, end)
    if n % page_size == 0 and keep % page_size == 0:
        return RowRewrite(True, src, dst, window, dst, src, dst + window)
    return RowRewrite(False, src, dst, window,
                      prefix + round_up_to_pages(keep + window, page_size),
                      prefix + round_up_to_pages(n + window, page_size), dst + window)


def freed_slots(n: int, k: int, window: int, page_size: int) -> int:
    """Slots one request gives back when it keeps k of n candidates (whole pages)."""
    return rewrite_row(0, n, k, window, page_size).freed
