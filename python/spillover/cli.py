"""``python -m spillover <command>``."""

from __future__ import annotations

import sys
from typing import List, Optional

USAGE = """usage: python -m spillover <command> [options]

commands:
  demo     train a small built-in GPT in several offload modes and compare them
  doctor   check io_uring, O_DIRECT, free space, memlock, huge pages, CUDA; show the config
  bench    calibrate bandwidths and compute for the planner; --compare runs the engine vs fio
  fit      will a transformers model's step fit, per mode, from its config.json (no weights):
           python -m spillover fit --hf-config PATH --seq N --batch N --device h200
"""


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    if cmd == "bench":
        from .benchcmd import main as bench_main

        return bench_main(rest)
    if cmd == "fit":
        from .estimate.fit import main as fit_main

        return fit_main(rest)
    if cmd == "doctor":
        from .doctor import main as doctor_main

        return doctor_main(rest)
    print(f"spillover: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2
