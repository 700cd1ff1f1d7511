"""One memory budget per node (Note [node budget] in spillover/_runtime.py): pool sizes that
cannot fit are refused before anything is mapped, defaults divide the node among its ranks,
the activation pool and the optimizer's pool are separate, swap paths take per-rank
placeholders."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import spillover
from spillover import _pools, _runtime, _tiers
from spillover._runtime import NodeMemory, cgroup_memory, check_pool_size, default_pool_bytes

GiB = 1 << 30


def mem(total=64 * GiB, available=60 * GiB, limit=None, usage=0, local=1, in_pools=0):
    return NodeMemory(total, available, limit, usage, local, in_pools)


# ---- sizes that cannot fit are refused, not pre-faulted into the OOM killer --------------------


def test_a_terabyte_activation_pool_is_refused_at_entry():
    ctx = spillover.offload_context(tier="host", host_pool_bytes=1 << 40)
    with pytest.raises(spillover.ConfigError) as e, ctx:
        pass
    msg = str(e.value)
    assert "1.0 TiB activation pool does not fit" in msg
    assert "available now" in msg and "SPILLOVER_HOST_POOL_BYTES" in msg
    assert "this rank's share is" in msg
    assert all(c < 1 << 40 for (_p, c) in _pools.POOLS.sized)  # nothing was mapped


def test_a_terabyte_optimizer_pool_is_refused_from_the_environment(monkeypatch):
    monkeypatch.setenv("SPILLOVER_OPTIM_POOL_BYTES", "1TiB")
    p = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(spillover.ConfigError, match="SPILLOVER_OPTIM_POOL_BYTES") as e:
        spillover.OffloadAdamW([p])
    assert "optimizer pool does not fit" in str(e.value)


def test_the_rank_share_divides_the_node_by_local_world_size(monkeypatch):
    real = _runtime.node_memory()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    m = _runtime.node_memory()
    assert m.local_world == 8 and m.share == real.total // 8
    assert default_pool_bytes(m) == max(64 << 20, min(m.share // 4, 8 * GiB, m.room // 2)
                                        // (1 << 20) * (1 << 20))
    too_big = m.share + (64 << 20)  # fits the host, not this rank's share
    assert too_big < m.room
    ctx = spillover.offload_context(tier="host", host_pool_bytes=too_big)
    with pytest.raises(spillover.ConfigError) as e, ctx:
        pass
    assert "8 local ranks (LOCAL_WORLD_SIZE)" in str(e.value)
    assert spillover.format_size(m.share) in str(e.value)


def test_defaults_per_rank_and_the_cap():
    assert default_pool_bytes(mem(total=64 * GiB, local=8)) == 2 * GiB  # 64 / 8 / 4
    assert default_pool_bytes(mem(total=512 * GiB, local=1)) == 8 * GiB  # capped
    assert default_pool_bytes(mem(total=64 * GiB, available=3 * GiB)) == 1536 << 20  # room / 2
    assert default_pool_bytes(mem(total=1 * GiB, local=8)) == 64 << 20  # the floor


def test_two_pools_of_one_process_count_together():
    check_pool_size(6 * GiB, "optim", mem(local=8))  # share 8 GiB
    with pytest.raises(spillover.ConfigError, match="already holds 4.0 GiB") as e:
        check_pool_size(6 * GiB, "optim", mem(local=8, in_pools=4 * GiB))
    assert "at most 4.0 GiB" in str(e.value) and "SPILLOVER_OPTIM_POOL_BYTES" in str(e.value)


def test_a_size_that_leaves_too_little_warns_once(monkeypatch):
    monkeypatch.setattr(_runtime, "_warned", set())
    m = mem(total=64 * GiB, available=10 * GiB)  # leave < max(1 GiB, 64 / 8 GiB)
    with pytest.warns(RuntimeWarning, match="leaves 2.0 GiB of memory") as w:
        check_pool_size(8 * GiB, "activations", m)
        check_pool_size(8 * GiB, "activations", m)
    assert len([x for x in w if "leaves" in str(x.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monkeypatch.setattr(_runtime, "_warned", set())
        check_pool_size(1 * GiB, "activations", m)  # leaves 9 GiB: quiet


# ---- cgroups -----------------------------------------------------------------------------------


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_cgroup_v2_lowest_room_on_the_path(tmp_path):
    root = tmp_path / "cg"
    write(str(tmp_path / "self"), "0::/job/rank3\n")
    write(str(root / "job" / "rank3" / "memory.max"), "max\n")
    write(str(root / "job" / "rank3" / "memory.current"), "100\n")
    write(str(root / "job" / "memory.max"), str(16 * GiB))
    write(str(root / "job" / "memory.current"), str(4 * GiB))
    assert cgroup_memory(str(tmp_path / "self"), str(root)) == (16 * GiB, 4 * GiB)


def test_cgroup_v1_and_unlimited(tmp_path):
    root = tmp_path / "cg"
    write(str(tmp_path / "self"), "4:memory:/process_api/abc\n3:cpu:/\n")
    write(str(root / "memory" / "process_api" / "abc" / "memory.limit_in_bytes"),
          "9223372036854771712")
    write(str(root / "memory" / "memory.limit_in_bytes"), str(8 * GiB))
    write(str(root / "memory" / "memory.usage_in_bytes"), str(1 * GiB))
    assert cgroup_memory(str(tmp_path / "self"), str(root)) == (8 * GiB, 1 * GiB)
    os.remove(root / "memory" / "memory.limit_in_bytes")
    assert cgroup_memory(str(tmp_path / "self"), str(root)) == (None, 0)
    assert cgroup_memory(str(tmp_path / "missing"), str(root)) == (None, 0)


def test_a_cgroup_limit_below_the_host_sets_the_share():
    m = mem(total=64 * GiB, available=60 * GiB, limit=16 * GiB, usage=2 * GiB, local=2)
    assert m.total == 16 * GiB and m.share == 8 * GiB and m.room == 14 * GiB
    assert "this cgroup's memory" in m.describe()
    with pytest.raises(spillover.ConfigError, match="this cgroup's memory / 2 local ranks"):
        check_pool_size(9 * GiB, "activations", m)


# ---- separate pools ---------------------------------------------------------------------------


def test_activations_and_optimizer_never_share_a_pool(private_pool_bytes):
    size = (32 << 20) + private_pool_bytes % (1 << 16)
    cfg = spillover.Config.load(host_pool_bytes=size, optim_pool_bytes=size)
    act = _pools.host_pool(cfg)
    opt = _pools.host_pool(cfg, purpose="optim")
    assert act is not opt and act.capacity == opt.capacity == size
    assert _pools.host_pool(cfg) is act  # each is made once
    p = torch.nn.Parameter(torch.randn(1 << 16))
    o = spillover.OffloadAdamW([p], host_pool_bytes=size)  # read as optim_pool_bytes
    assert o._pool is opt


# ---- per-rank swap directories ----------------------------------------------------------------


def test_nvme_path_placeholders(monkeypatch, tmp_path):
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setenv("RANK", "13")
    cfg = spillover.Config.load(nvme_path=f"{tmp_path}/d{{local_rank % 2}}/r{{rank}},"
                                          f"{tmp_path}/n{{ local_rank }}")
    assert cfg.nvme_path == (f"{tmp_path}/d1/r13", f"{tmp_path}/n5")
    monkeypatch.setenv("SPILLOVER_NVME_PATH", f"{tmp_path}/x{{local_rank}}")
    assert spillover.Config.load().nvme_path == (f"{tmp_path}/x5",)
    for bad in ("{world}", "{local_rank % 0}"):
        with pytest.raises(spillover.ConfigError, match="placeholder|divides"):
            spillover.Config.load(nvme_path=f"{tmp_path}/{bad}")


def test_ranks_spread_swap_files_over_drives(monkeypatch, tmp_path, private_pool_bytes):
    for d in ("drive0", "drive1"):
        (tmp_path / d).mkdir()
    monkeypatch.setenv("LOCAL_RANK", "3")
    size = (32 << 20) + private_pool_bytes % (1 << 16)
    ctx = spillover.offload_context(tier="nvme", host_pool_bytes=size, min_offload_bytes=0,
                                    nvme_path=f"{tmp_path}/drive{{local_rank % 2}}")
    x = torch.randn(256, 256, requires_grad=True)
    with ctx:
        y = (x * 2).sin().sum()
    y.backward()
    swap = _tiers.opened_swap(ctx.config)
    assert swap is not None
    assert [os.path.realpath(d) for d in swap.dirs] == [os.path.realpath(tmp_path / "drive1")]


# ---- the optimizer's default pool is sized to its parameters ----------------------------------


def test_the_optimizer_pool_defaults_to_what_its_parameters_need(monkeypatch):
    monkeypatch.delenv("SPILLOVER_OPTIM_POOL_BYTES", raising=False)
    small = spillover.OffloadAdamW(torch.nn.Linear(64, 64).parameters())
    assert small._pool.capacity == 64 << 20  # the floor, not a quarter of the machine
    big = torch.nn.Linear(4096, 4096)  # 16.8M fp32 parameters: 128 MiB of exp_avg + exp_avg_sq
    opt = spillover.OffloadAdamW(big.parameters())
    assert opt._pool.capacity == 256 << 20  # 128 MiB + 1/16 + 4 MiB, to a power of two
    nvme = spillover.OffloadAdamW(big.parameters(), tier="nvme", nvme_buffers=4,
                                  chunk_bytes=8 << 20)
    assert nvme._pool.capacity == 64 << 20  # 4 buffers of 8 MiB: the state is on disk
    x = torch.randn(8, 4096)
    big(x).sum().backward()
    opt.step()
    assert opt.stats()["heap_chunks"] == 0  # all of it in the pool
    sized = spillover.OffloadAdamW(big.parameters(), optim_pool_bytes="96MiB")
    assert sized._pool.capacity == 96 << 20  # a size given is a size taken


def test_a_default_context_does_not_take_an_explicit_pool(private_pool_bytes, monkeypatch):
    monkeypatch.delenv("SPILLOVER_HOST_POOL_BYTES", raising=False)
    size = (32 << 20) + private_pool_bytes % (1 << 16)
    explicit = _pools.host_pool(spillover.Config.load(host_pool_bytes=size))
    calls = []

    def small_default(mem=None):  # the real one pre-faults a quarter of the machine
        calls.append(mem)
        return size + 4096

    monkeypatch.setattr(_runtime, "_defaults", {})
    monkeypatch.setattr(_runtime, "default_pool_bytes", small_default)
    default = _pools.host_pool(spillover.Config.load())
    assert default is not explicit and default.capacity == size + 4096
    assert _pools.host_pool(spillover.Config.load()) is default
    assert len(calls) == 1  # computed once: what is available moves, the pool does not


def test_an_explicit_size_above_what_is_available_is_taken_with_a_warning(monkeypatch):
    """Note [an explicit size is taken]: a microVM's MemAvailable starts far below its memory;
    a size the user gave is refused only past this rank's share of the node."""
    monkeypatch.setattr(_runtime, "_warned", set())
    m = mem(total=128 * GiB, available=12 * GiB)  # a VM that has not grown yet
    with pytest.warns(RuntimeWarning, match="more than the memory available now"):
        check_pool_size(16 * GiB, "activations", m, explicit=True)
    with pytest.raises(spillover.ConfigError, match="does not fit"):
        check_pool_size(16 * GiB, "activations", m)  # the default's rule: refused
    with pytest.raises(spillover.ConfigError, match="does not fit"):
        check_pool_size(130 * GiB, "activations", m, explicit=True)  # past the node
