# SPDX-License-Identifier: Apache-2.0
"""Print the platform facts bridge depends on (run on a GPU machine)."""

from __future__ import annotations

import time


def main() -> None:
    import bridge
    from bridge._runtime import core

    bridge.unify(cupy=False, torch=False)
    rc, p = core.alloc(0, 1 << 20, 0, 0)
    s0 = bridge.stats(0)
    core.free(p)
    s1 = bridge.stats(0)
    print(f"pool used after alloc {s0.used}, right after free (no sync) {s1.used}")
    n = 100000
    t = time.perf_counter()
    for _ in range(n):
        rc, p = core.alloc(0, 1 << 20, 0, 0)
        core.free(p)
    print(f"core.alloc+free via Python: {(time.perf_counter() - t) / n * 1e9:.0f} ns/pair")
    try:
        import cupy

        print("cupy", cupy.__version__, "get_current_stream_ptr:",
              hasattr(cupy.cuda.stream, "get_current_stream_ptr"),
              "get_device_id:", hasattr(cupy.cuda.device, "get_device_id"))
    except ImportError:
        print("no cupy")


if __name__ == "__main__":
    main()
