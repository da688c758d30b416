"""CPU tensor parallel without SGLang's CPU engine: sglang 0.5.23 creates a PyNccl communicator
for every model-parallel group unless SGLANG_USE_CPU_ENGINE=1 (which needs the CPU build of
sgl_kernel, not on PyPI), and PyNccl refuses a CPU device ("Expected a cuda device"). Without
CUDA there is no NCCL to use: turn the hint off, so the group falls back to torch.distributed
(gloo) collectives. Applied only when CUDA is not available."""

from __future__ import annotations

import inspect

TARGET_GROUP_INIT = "sglang.srt.distributed.parallel_state.GroupCoordinator.__init__"


def needed() -> bool:
    import torch

    return not torch.cuda.is_available()


def around_group_init(original, self, *args, **kwargs):
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    bound.arguments["use_pynccl"] = False
    return original(*bound.args, **bound.kwargs)


HOOKS = [(TARGET_GROUP_INIT, "AROUND", around_group_init)]
