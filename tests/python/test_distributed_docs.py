"""The README's torchrun snippets (DDP, FSDP2, DCP checkpoints) and
examples/train_distributed.py run as written under ``torchrun --nproc-per-node 2`` on CPU
(gloo), each within a bounded time."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
EXAMPLE = ROOT / "examples" / "train_distributed.py"
TIMEOUT = 120


def readme_snippet(title):
    """The python block under ``### {title}`` in the README's "With your training stack"."""
    section = README.read_text().split("## With your training stack", 1)[1].split("\n## ", 1)[0]
    part = section.split(f"### {title}", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", part, flags=re.S)
    assert len(blocks) == 1, f"README: one python block under ### {title}"
    return blocks[0]


def torchrun(args, cwd, nproc=2):
    """Run ``torchrun --standalone --nproc-per-node nproc args``; its output."""
    exe = shutil.which("torchrun")
    cmd = [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]
    env = dict(os.environ, OMP_NUM_THREADS="1", SPILLOVER_HOST_POOL_BYTES="64MiB",
               SPILLOVER_OPTIM_POOL_BYTES="64MiB")
    p = subprocess.run([*cmd, "--standalone", f"--nproc-per-node={nproc}", *map(str, args)],
                       cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    return out


@pytest.mark.parametrize("title", ["torchrun: DDP", "torchrun: FSDP2",
                                   "Checkpoints: torch.distributed.checkpoint (DCP)"])
def test_readme_snippet_runs_under_torchrun(title, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(readme_snippet(title))
    torchrun([script], cwd=tmp_path)
    if title.startswith("Checkpoints"):
        assert (tmp_path / "ckpt" / "step-2" / ".metadata").exists()


def test_torchrun_example_trains_checkpoints_and_resumes(tmp_path):
    """DDP on 2 ranks saves at steps 2 and 4; FSDP2 on 1 rank resumes from step 4."""
    out = torchrun([EXAMPLE, "--steps", "4"], cwd=tmp_path)
    assert "step 4 loss" in out
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-2", "step-4"]
    out = torchrun([EXAMPLE, "--fsdp", "--steps", "5", "--tier", "nvme"], cwd=tmp_path, nproc=1)
    assert "resumed from step 4 at world size 1" in out and "step 5 loss" in out
