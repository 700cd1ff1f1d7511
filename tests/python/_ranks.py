"""Start a script as the ranks of a gloo job, with torchrun's environment (the 2-rank tests)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import List, Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, args: Sequence[str], world: int = 2, timeout: float = 60) -> List[str]:
    """Run ``python script *args`` as `world` ranks on one node (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR/PORT; one OpenMP thread each); wait at most `timeout` seconds
    for each, kill them all on a timeout or error, and fail with a rank's output tail when it
    exits non-zero. Returns their outputs. A world of 1 gets no rendezvous variables (a plain
    process)."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE=str(world))
        if world > 1:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                       LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        procs.append(subprocess.Popen([sys.executable, script, *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{out[-4000:]}"
    return outs
