"""The old home of learned retention, kept so that its imports and its command keep working:

    python -m vase_sglang.retention train --model smollm2-135m [--out DIR] [--memory 128]
    python -m vase_sglang.retention info GATES.safetensors

The gates and their file (what the server needs) are vase_sglang.gates; their training is
vase_sglang.training.retention. This module re-exports both.
"""

from .gates import *  # noqa: F401,F403
from .gates import _config_of, _describe, _DictConfig  # noqa: F401
from .training.retention import *  # noqa: F401,F403
from .training.retention import _STATE, _order, _Retention  # noqa: F401
from .training.retention import main

if __name__ == "__main__":
    main()
