"""Start an engine in this (fresh) process and print its capture cost as JSON.

    python -m bench.capture_probe capture=graph_first capture.decode.compile.cache_dir=/tmp/c
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    t0 = time.perf_counter()
    from graphexec import Engine

    engine = Engine(overrides=sys.argv[1:] + ["capture.decode.progress=false"])
    stats = engine.runner.backend_stats()["decode"]
    print(json.dumps({"start_seconds": time.perf_counter() - t0, "capture_seconds": stats["capture_seconds"]}))


if __name__ == "__main__":
    main()
