"""The old home of vase_sglang.serving.gpu_check, kept for its documented command:

    python -m vase_sglang.gpu_check --out results/gpu_check.json     (scripts/gpu_check.sh)
"""

import sys

from .serving.gpu_check import *  # noqa: F401,F403
from .serving.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
