"""The old home of vase_sglang.serving.models, kept for its documented command and imports:

    python -m vase_sglang.models fetch qwen2.5-0.5b     # prints the model directory (stdout)
    python -m vase_sglang.models list
"""

from .serving.models import *  # noqa: F401,F403
from .serving.models import main

if __name__ == "__main__":
    main()
