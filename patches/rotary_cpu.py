"""CPU serving without vllm: sglang 0.5.23's RotaryEmbedding.__init__ imports
`vllm._custom_ops.rotary_embedding` on any non-CUDA device that is not its AMX "cpu engine",
although forward_native is what runs there. Hide that import during __init__ and turn the
never-used fallback kernel off. Applied only when vllm is absent and CUDA is not available."""

from __future__ import annotations

import sys
import types

TARGET_ROTARY_INIT = "sglang.srt.layers.rotary_embedding.base.RotaryEmbedding.__init__"


def needed() -> bool:
    import importlib.util

    import torch

    return importlib.util.find_spec("vllm") is None and not torch.cuda.is_available()


def around_rotary_init(original, self, *args, **kwargs):
    stub = types.ModuleType("vllm._custom_ops")
    stub.rotary_embedding = None
    added = {}
    for name, module in (("vllm", types.ModuleType("vllm")), ("vllm._custom_ops", stub)):
        if name not in sys.modules:
            sys.modules[name] = added[name] = module
    try:
        original(self, *args, **kwargs)
    finally:
        for name in added:
            sys.modules.pop(name, None)
    if getattr(self, "fallback_rotary_embedding", 0) is None:
        self.use_fallback_kernel = False


HOOKS = [(TARGET_ROTARY_INIT, "AROUND", around_rotary_init)]
