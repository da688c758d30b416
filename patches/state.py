"""A request's eviction state: one object on SGLang's Req (`Req._vase`), its settings (derived
once, at the scheduler's intake) and the key of its random draws."""

from __future__ import annotations

import logging
import zlib
from array import array
from dataclasses import dataclass

from vase_sglang import EvictionConfig

from . import runtime

logger = logging.getLogger("vase_sglang.eviction")

_UNSET = object()


@dataclass
class RequestEviction:
    """One request's eviction state: the only attribute this plugin keeps on sglang's Req
    (`Req._vase`; Req has no __slots__, Req.kv does). Created on first use (`state`)."""

    config: object = _UNSET  # effective EvictionConfig, None = off (request_config); cached
    pos_offset: int = 0  # tokens removed from the KV so far: true position - KV length
    evicted: int = 0  # tokens evicted per (layer, KV head) over the request's life (meta_info)
    rounds: int = 0  # evictions since the request was (re)admitted
    # crc32 of the request's first `hashed` tokens (prompt, then output): its draws' key
    hashed: int = 0
    token_crc: int = 0
    min_budget: int | None = None  # the smallest budget it was cut to (meta_info), None: never
    failed: bool = False  # an eviction step failed on it: never evicted again, being finished
    failed_stage: str | None = None  # where (commit.STAGES), told to the other TP ranks
    ring_row: int | None = None  # the request-table row whose query-ring slots it holds
    # under a shared budget scope: who owns each cell of its K older slots (cells.CellMap;
    # patches/shared_scope.py); None: the plain layout
    cells: object = None


STATE = "_vase"


def state(req) -> RequestEviction:
    """The request's eviction state, created on first use."""
    st = getattr(req, STATE, None)
    if st is None:
        st = RequestEviction()
        setattr(req, STATE, st)
    return st


def pos_offset(req) -> int:
    st = getattr(req, STATE, None)
    return 0 if st is None else st.pos_offset


def evicted_tokens(req) -> int:
    st = getattr(req, STATE, None)
    return 0 if st is None else st.evicted


def compacted(req) -> bool:
    """Whether eviction has rewritten this request's cache since it was (re)admitted: its
    slots no longer hold the true tokens at their positions, so they must never reach the
    radix tree (scheduler.around_release_kv_cache)."""
    st = getattr(req, STATE, None)
    return st is not None and (st.rounds > 0 or st.failed)


def failed(req) -> bool:
    st = getattr(req, STATE, None)
    return st is not None and st.failed


def mark_failed(req, message: str) -> None:
    """An eviction step failed on `req` after it may have moved part of its K/V: finish it at
    its next step with `message` (HTTP 500: the server's fault, not the request's), as an
    abort would; its cache no longer holds its tokens, so it must not reach the radix tree."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    state(req).failed = True
    req.to_finish = FINISH_ABORT(message, 500, "InternalServerError")


def min_budget(req) -> int | None:
    st = getattr(req, STATE, None)
    return None if st is None else st.min_budget


def record_eviction(req, dropped: int, budget: int) -> None:
    """After a round that cut the request back to `budget` private tokens, dropping `dropped`
    per (layer, KV head)."""
    st = state(req)
    st.min_budget = budget if st.min_budget is None else min(st.min_budget, budget)
    st.pos_offset += dropped
    st.evicted += dropped
    st.rounds += 1


def reset_request(req) -> None:
    """A retracted request re-prefills its true length: it starts over, uncompacted."""
    st = getattr(req, STATE, None)
    if st is not None:
        st.pos_offset = st.rounds = 0  # `evicted` counts over the request's whole life
        st.cells = None


def request_config(req) -> EvictionConfig | None:
    """The eviction settings that apply to `req`: its `custom_params.kv_evict` merged over the
    server's, or None where eviction is off (server or request). Cached on the Req."""
    rt = runtime.RUNTIME
    if rt is None:
        return None
    st = state(req)
    cached = st.config
    if cached is _UNSET and getattr(req, "beam_group", None) is not None:
        # Beam search (BeamCoordinator.validate_and_init) replaces the leader's sampling
        # params with neutral ones, custom_params lost; its member rows alias the leader's
        # slots, so the group is never evicted. The tokenizer manager already refused beam
        # requests that would evict (request_control.refuse_beam_search).
        cached = st.config = None
    if cached is _UNSET:
        try:
            cached = rt.request_settings(req.sampling_params.custom_params)
        except ValueError as err:
            # The tokenizer manager rejects these with HTTP 400 and the scheduler aborts them
            # at intake (check_new_request); never serve other settings than asked.
            _abort(req, err, running=True)
            cached = None
        st.config = cached
    return cached


def check_new_request(req) -> None:
    """At the scheduler's intake: derive the request's settings once; settings this scheduler
    cannot apply (which the tokenizer manager let through) abort it with HTTP 400."""
    rt = runtime.RUNTIME
    if rt is None:
        return
    st = state(req)
    try:
        st.config = rt.request_settings(req.sampling_params.custom_params)
    except ValueError as err:
        st.config = None
        _abort(req, err, running=False)


def _abort(req, err, running: bool) -> None:
    message = (f"{err} (this server cannot apply the request's eviction settings: "
               f"the request is aborted, not served with other settings)")
    if running:  # the request holds KV: finish it at its next step, as a stop would
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        logger.error("request %s: %s", req.rid, message)
        req.to_finish = FINISH_ABORT(message, 400, "BadRequestError")
    else:
        req.set_finish_with_abort(message)


def request_key(req, cfg: EvictionConfig) -> int:
    """A request's key for its random draws at this eviction (the Draws also mix the seed,
    layer, KV head and round). The user's `sampling_seed` if set; else the crc32 of every
    token older than the window: the prompt and the outputs up to the oldest window query.
    So the same request draws the same on every run, replica, TP/DP rank and scheduler mode
    (those tokens are on the host in overlap mode too: only the newest token can be in
    flight), and n > 1 samples of one prompt draw alike only while their outputs agree."""
    seed = getattr(req.sampling_params, "sampling_seed", None)
    if seed is not None:
        return int(seed) & 0x7FFFFFFF
    st = state(req)
    # The true length minus the window: the position of the oldest window query. It only
    # grows (a retracted request re-prefills its whole true length), so the crc is extended.
    upto = req.kv.kv_allocated_len + st.pos_offset - cfg.window
    tokens = _tokens(req, st.hashed, upto)
    st.token_crc = zlib.crc32(array("q", tokens).tobytes(), st.token_crc)
    st.hashed += len(tokens)
    return st.token_crc & 0x7FFFFFFF


def _tokens(req, start: int, stop: int) -> list[int]:
    """Token ids at positions [start, stop) of prompt + output (fewer if the host does not
    hold them all, which the schedule above rules out; warned, not fatal)."""
    origin = req.origin_input_ids
    n = len(origin)
    out = list(origin[start:min(stop, n)]) if start < n else []
    if stop > n:
        out += req.output_ids[max(start, n) - n: stop - n]
    if len(out) < stop - start and "tokens" not in _WARNED:
        _WARNED.add("tokens")
        logger.warning("request %s: tokens [%d, %d) are not all on the host (%d prompt + %d "
                       "output tokens); its draws are keyed by the ones that are", req.rid,
                       start, stop, n, len(req.output_ids))
    return out


_WARNED: set[str] = set()
