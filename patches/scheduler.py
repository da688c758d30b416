"""Hooks on sglang.srt.managers: run the eviction step on the running decode batch, and reset
eviction state when a request is retracted."""

from __future__ import annotations

import torch

from . import runtime

TARGET_UPDATE_RUNNING_BATCH = "sglang.srt.managers.scheduler.Scheduler.update_running_batch"
TARGET_RESET_FOR_RETRACT = "sglang.srt.managers.schedule_batch.Req.reset_for_retract"


def around_update_running_batch(original, self, batch):
    """AROUND Scheduler.update_running_batch: evict before the original checks decode memory,
    so freed slots avert needless retraction and prepare_for_decode sees the new lengths."""
    rt = runtime.RUNTIME
    if rt is not None and not batch.is_empty():
        finishing = ()
        if self.enable_overlap:
            finishing = set(self._reqs_finishing_inflight(batch))
            if getattr(self, "forward_stream", None) is not None and torch.cuda.is_available():
                # The previous forward may still read (attention) or write (its token's slot)
                # this KV on the forward stream: order the compaction after it on the device,
                # without a host sync. run_batch then makes the next forward wait for us.
                torch.cuda.current_stream().wait_stream(self.forward_stream)
        rt.evict(batch, skip=finishing)
    return original(self, batch)


def after_reset_for_retract(result, req):
    runtime.reset_request(req)


HOOKS = [
    (TARGET_UPDATE_RUNNING_BATCH, "AROUND", around_update_running_batch),
    (TARGET_RESET_FOR_RETRACT, "AFTER", after_reset_for_retract),
]
