"""For test modules that launch Triton kernels: `DEVICE` is "cuda" where there is a GPU, else "cpu",
where the kernels run in the Triton interpreter. `TRITON_INTERPRET=1` has to be set before triton is
first imported (triton decorates its own `tl.*` helpers at import): tests/conftest.py sets it for
the whole session before any test module is imported; this checks that it took effect, and refuses
to go on, with that explanation, if triton was imported without it."""

import os
import sys

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set, so its kernels "
            "cannot run on CPU: set it in the environment or in tests/conftest.py"
        )
    os.environ["TRITON_INTERPRET"] = "1"
