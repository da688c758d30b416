"""A request's footprint with eviction on: what SGLang's admission charges it, and what it may
still grow; and the hooks on PrefillAdder that make admission use it.

Stock admission reserves prompt + min(max_new_tokens, CLIP_MAX_NEW_TOKENS) per new request and
the remaining max_new_tokens of every running one, so the slots eviction frees would sit idle.
With eviction on, a request's private cache (tokens not owned by the radix tree) cycles between
budget and budget + window, and the scheduler hook cuts requests back to their budget early
when the next decode step would not fit (scheduler.py). So a capped request is charged
`charge_len(cfg)` private tokens, the middle of its cycle:

  * a new request: prompt + min(its remaining tokens, charge);
  * a running request: only what it can still grow up to that charge. That growth is
    certain, so SGLang's new_token_ratio (its estimate of how many requests stop early on EOS)
    only scales the part of a request's remaining tokens that is not capped;
  * the ignore_eos path with the radix cache off (`add_one_req_ignore_eos`) simulates requests
    finishing one by one and freeing prompt + max_new_tokens each; that model does not hold
    for capped requests, so they take the general path, which sums the capped charges.

Requests for which eviction is off (per-request control) keep the stock figures.

The seam. SGLang 0.5.23 computes a new request's decode reservation inline in add_one_req
(and add_chunked_req), so the hooks sit on the PrefillAdder methods those numbers pass through;
no request field and no SGLang global is changed, even for the duration of a call:

  PrefillAdder._get_running_request_total_token_offset   a running request's growth (replaced)
  PrefillAdder._check_prefill_budget   a new request's total_tokens, less what its reservation
                                       (PrefillAdder._swa_new_tokens) exceeds its charge
  PrefillAdder._update_prefill_budget  the reserved max_new_tokens, at most the charge of the
                                       request being admitted
  PrefillAdder.add_one_req / add_chunked_req   which request is being admitted (a context
                                       variable, since _update_prefill_budget is not told);
                                       add_one_req also routes a capped ignore_eos request past
                                       the no-radix branch by reading the adder through a view
                                       (`_GeneralPath`) whose tree cache reports disable=False.

These depend on the shape of SGLang's code beyond the targets' names; `SHAPES` lists what
they rely on, and `check_shapes` stops the process at load if SGLang differs.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import pkgutil
import re

from vase_sglang.rows import round_up_to_pages

from . import ring, runtime
from .state import request_config

ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
TARGET_ADD_ONE_REQ = ADDER + ".add_one_req"
TARGET_ADD_CHUNKED_REQ = ADDER + ".add_chunked_req"
TARGET_RUNNING_OFFSET = ADDER + "._get_running_request_total_token_offset"
TARGET_CHECK_BUDGET = ADDER + "._check_prefill_budget"
TARGET_UPDATE_BUDGET = ADDER + "._update_prefill_budget"
TARGET_NEW_TOKENS = ADDER + "._swa_new_tokens"

# (target, code it must contain, whitespace ignored, why we rely on it)
SHAPES = [
    (TARGET_ADD_ONE_REQ,
     'if req.sampling_params.ignore_eos and getattr(self.tree_cache, "disable", True):'
     "return self.add_one_req_ignore_eos(req)",
     "the no-radix ignore_eos branch is chosen by the tree cache's `disable`, which the "
     "_GeneralPath view reports False"),
    (TARGET_ADD_ONE_REQ,
     "max_new = min(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0),"
     "CLIP_MAX_NEW_TOKENS,)",
     "a new request's total_tokens holds this reservation, the value _swa_new_tokens returns"),
    (TARGET_NEW_TOKENS,
     "return min(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0),"
     "CLIP_MAX_NEW_TOKENS,)",
     "it returns add_one_req's reservation (its docstring: 'Mirrors ... add_one_req's max_new')"),
    (TARGET_CHECK_BUDGET,
     "def _check_prefill_budget(self, req: Req, *, extend_input_len: int, total_tokens: int,",
     "the new request's total is passed as the keyword total_tokens"),
    (ADDER, "def ceil_paged_tokens(self, tokens: int) -> int:",
     "admission pressure prices a refused request's prompt with it"),
    (ADDER, "self.can_run_list = []",
     "a request waits for a query ring beside the pool counting the rings of those admitted "
     "before it in the round (ring.waits)"),
    (ADDER, "def rem_total_tokens(self):", "admission pressure's shortfall is measured against it"),
    (ADDER, "def cur_rem_tokens(self):", "admission pressure's shortfall is measured against it"),
    (TARGET_UPDATE_BUDGET,
     "def _update_prefill_budget(self, prefix_len: int, extend_input_len: int, "
     "max_new_tokens: int,",
     "the reservation is its third argument"),
]


def charge_len(cfg, page_size: int = 1) -> int:
    """Private tokens admission charges a capped request: the middle of its cycle between
    budget and budget + window, plus the token its next step allocates and one in flight
    under the overlap scheduler, in whole pages (the cycle in pages runs from ceil(T / ps) to
    ceil((T + R) / ps)). Charging the bottom of the cycle admits a few more requests but,
    with them in phase, the pool runs short every few steps and each time forces an early
    eviction round; charging the top leaves up to `window` tokens per request idle."""
    low = round_up_to_pages(cfg.budget, page_size)
    high = round_up_to_pages(cfg.budget + cfg.window, page_size)
    return round_up_to_pages((low + high) // 2 + 2, page_size)


def capped_running_offset(cfg, req, new_token_ratio: float, radix: bool,
                          page_size: int = 1) -> float:
    """Slots a running capped request may still take: up to its charge, the prompt apart when
    the radix tree owns it (whole pages of it: a partial last page is private, inside the
    charge). The prompt is counted from the request itself, not from cache_protected_len:
    under the overlap scheduler a request admitted in the previous round has run its prefill
    but the tree has not taken its prompt yet. A request holds whole pages."""
    remaining = max(req.sampling_params.max_new_tokens - len(req.output_ids), 0)
    kv = req.kv
    prompt_pages = len(req.origin_input_ids) // page_size * page_size
    owned = max(kv.cache_protected_len, prompt_pages) if radix else 0
    held = round_up_to_pages(kv.kv_allocated_len, page_size)
    growth = max(0, owned + charge_len(cfg, page_size) - held)
    if growth < remaining:
        return float(growth)
    ratio = 1.0 if req.sampling_params.ignore_eos else new_token_ratio
    return remaining * ratio


# -- hooks -------------------------------------------------------------------------------------

# The capped request whose add_one_req / add_chunked_req call is running (the scheduler admits
# one request at a time on one thread), and its charge.
_ADMITTING: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("vase_admitting",
                                                                         default=None)


def _radix(adder) -> bool:
    return not getattr(adder.tree_cache, "disable", True)  # SGLang's own test in add_one_req


def around_add_one_req(original, self, req, *args, **kwargs):
    """AROUND PrefillAdder.add_one_req."""
    cfg = request_config(req)
    charge = None if cfg is None else charge_len(cfg, self.page_size)
    rt = runtime.RUNTIME
    if charge is not None and rt is not None and ring.waits(rt, req, _radix(self),
                                                            self.can_run_list):
        # No ring left beside the pool for it: it waits in the queue, as for a full pool
        # (SGLang reopens admission when a running request leaves, which frees its ring).
        from sglang.srt.managers.schedule_policy import AddReqResult

        return AddReqResult.NO_TOKEN
    if charge is None:
        result = original(self, req, *args, **kwargs)
    else:
        token = _ADMITTING.set((req, charge))
        try:
            if req.sampling_params.ignore_eos and not _radix(self):
                result = original(_GeneralPath(self), req, *args, **kwargs)
            else:
                result = original(self, req, *args, **kwargs)
        finally:
            _ADMITTING.reset(token)
    _record_shortfall(self, req, result, charge)
    return result


# Slots the first request a scheduling round could not admit for want of memory lacked
# (scheduler.around_get_new_batch_prefill reclaims them from elastic requests).
_SHORTFALL: contextvars.ContextVar[list | None] = contextvars.ContextVar("vase_shortfall",
                                                                        default=None)


@contextlib.contextmanager
def recording_shortfall():
    """For the duration of one scheduling round: a list that receives the shortfall of the
    first request admission refuses with NO_TOKEN (empty if none)."""
    holder: list[int] = []
    token = _SHORTFALL.set(holder)
    try:
        yield holder
    finally:
        _SHORTFALL.reset(token)


def _record_shortfall(adder, req, result, charge: int | None) -> None:
    from sglang.srt.managers.schedule_policy import AddReqResult

    holder = _SHORTFALL.get()
    if result is not AddReqResult.NO_TOKEN or holder is None or holder:
        return
    reserved = adder._swa_new_tokens(req)
    if charge is not None:
        reserved = min(reserved, charge)
    extend = len(req.full_untruncated_fill_ids) - req.prefix_len
    cost = adder.ceil_paged_tokens(extend) + reserved + adder.page_size
    if charge is not None:
        cost += ring_charge(req, _radix(adder))
    shortfall = cost - min(adder.rem_total_tokens, adder.cur_rem_tokens)
    if shortfall > 0:
        holder.append(int(shortfall))


def around_add_chunked_req(original, self, req):
    """AROUND PrefillAdder.add_chunked_req: the last chunk reserves the decode tokens too."""
    cfg = request_config(req)
    if cfg is None:
        return original(self, req)
    token = _ADMITTING.set((req, charge_len(cfg, self.page_size)))
    try:
        return original(self, req)
    finally:
        _ADMITTING.reset(token)


def around_check_prefill_budget(original, self, req, *args, total_tokens, **kwargs):
    """AROUND PrefillAdder._check_prefill_budget: a capped request's total holds its charge,
    not SGLang's reservation."""
    admitting = _ADMITTING.get()
    if admitting is not None and admitting[0] is req:
        reserved = self._swa_new_tokens(req)
        total_tokens -= reserved - min(reserved, admitting[1])
        total_tokens += ring_charge(req, _radix(self))
    return original(self, req, *args, total_tokens=total_tokens, **kwargs)


def around_update_prefill_budget(original, self, prefix_len, extend_input_len, max_new_tokens,
                                 *args, **kwargs):
    """AROUND PrefillAdder._update_prefill_budget: reserve at most the charge."""
    admitting = _ADMITTING.get()
    if admitting is not None:
        max_new_tokens = (min(max_new_tokens, admitting[1])
                          + ring_charge(admitting[0], _radix(self)))
    return original(self, prefix_len, extend_input_len, max_new_tokens, *args, **kwargs)


def ring_charge(req, radix: bool) -> int:
    """Pool slots the query ring of `req` takes when it is admitted (ring.charge: 0 where its
    policy reads no queries, it holds its ring already, or the rings live beside the pool):
    charged like prompt tokens, since they are allocated with its prefill
    (scheduler.after_prepare_for_extend)."""
    rt = runtime.RUNTIME
    return 0 if rt is None else ring.charge(rt, req, radix)


def around_running_offset(original, self, req):
    """AROUND PrefillAdder._get_running_request_total_token_offset."""
    cfg = request_config(req)
    if cfg is None:
        return original(self, req)
    return capped_running_offset(cfg, req, self.new_token_ratio, _radix(self), self.page_size)


class _GeneralPath:
    """A PrefillAdder as add_one_req's body sees it for a capped ignore_eos request without a
    radix tree: every read and write goes to the adder (methods called on it run on the adder
    itself), except `tree_cache`, whose `disable` reads False so that the branch to
    add_one_req_ignore_eos is not taken. Nothing is changed on the adder or its tree."""

    def __init__(self, adder):
        object.__setattr__(self, "_adder", adder)
        object.__setattr__(self, "tree_cache", _EnabledView(adder.tree_cache))

    def __getattr__(self, name):
        return getattr(self._adder, name)

    def __setattr__(self, name, value):
        setattr(self._adder, name, value)


class _EnabledView:
    """A tree cache whose `disable` reads False; everything else is the tree's own (its methods
    run on the tree, which still reads its own `disable`)."""

    disable = False

    def __init__(self, tree):
        object.__setattr__(self, "_tree", tree)

    def __getattr__(self, name):
        return getattr(self._tree, name)

    @property
    def __class__(self):  # isinstance checks see the tree's class
        return type(self._tree)


def check_shapes(shapes=SHAPES) -> list[str]:
    """What of SHAPES the installed SGLang does not match: `target: why`."""
    missing = []
    for target, code, why in shapes:
        try:
            source = inspect.getsource(pkgutil.resolve_name(target))
        except (ImportError, AttributeError, OSError, TypeError) as err:
            missing.append(f"{target}: {type(err).__name__}: {err}")
            continue
        if _squeeze(code) not in _squeeze(source):
            missing.append(f"{target} no longer contains `{code}` ({why})")
    return missing


def _squeeze(text: str) -> str:
    return re.sub(r"\s+", "", text)


HOOKS = [
    (TARGET_ADD_ONE_REQ, "AROUND", around_add_one_req),
    (TARGET_ADD_CHUNKED_REQ, "AROUND", around_add_chunked_req),
    (TARGET_CHECK_BUDGET, "AROUND", around_check_prefill_budget),
    (TARGET_UPDATE_BUDGET, "AROUND", around_update_prefill_budget),
    (TARGET_RUNNING_OFFSET, "AROUND", around_running_offset),
]
