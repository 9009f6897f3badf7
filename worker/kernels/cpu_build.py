"""`python -m worker.kernels.cpu_build`: build (or find cached) the llm_cpu extension ahead of use.

Contract: builds the extension exactly as the "cpu" backend would on first use (worker/kernels/
cpu_ext.py: same sources, flags and cache directory, `$LLM_CPU_EXT_DIR` or
~/.cache/llm-serve/torch_extensions), loads it, and prints one line: the library path, the seconds
the build (or the cache check) took, and the SIMD path compiled in. Exit status 0 when the library
loads, 1 with the reason on stderr when it does not. `make install` runs it and only warns on
failure: the "auto" backend then serves with "torch".
Proven by tests/test_cpu_attention.py (runs this module and checks its line).
"""

from __future__ import annotations

import sys


def main() -> int:
    from worker.kernels import cpu_ext

    try:
        path = cpu_ext.load()
    except RuntimeError as exc:
        print(f"cpu attention op: not built: {exc}", file=sys.stderr)
        return 1
    print(f"cpu attention op: {path} ({cpu_ext.build_seconds():.1f}s, {cpu_ext.build_info()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
