"""spillover.dcp: OffloadAdamW's state through torch.distributed.checkpoint — per-rank chunks,
produced when DCP asks for them, loadable at another world size and tier; 2 CPU ranks (gloo)
save and resume bitwise where the sharded path is bitwise."""

import os
import sys
import warnings

import pytest
import torch
from _ranks import run_ranks

import spillover
import spillover.dcp

dcp = pytest.importorskip("torch.distributed.checkpoint")

HERE = os.path.dirname(os.path.abspath(__file__))
POOL = 32 << 20


def _launch(args, world, timeout=150):
    """Run dist_dcp_worker.py as `world` ranks (torchrun's environment)."""
    run_ranks(os.path.join(HERE, "dist_dcp_worker.py"), args, world=world, timeout=timeout)


def test_two_ranks_save_resume_at_world_one_and_two(tmp_path):
    """2 ranks train 3 steps and save (model + optimizer) with DCP; a resume at world size 1
    (unsharded) and one at 2 (sharded) take 3 more steps: parameters equal the uninterrupted
    6-step run bit for bit, host tier (fp32) and NVMe tier (bf16 + master), and with 8-bit
    state (host tier; bf16 parameters without a master on the NVMe tier: the quantized codes,
    their scales and the rounding seed come back exactly)."""
    _launch(["save", str(tmp_path)], world=2)
    _launch(["resume", str(tmp_path)], world=1)
    _launch(["resume", str(tmp_path)], world=2)
    for tier in ("host", "nvme", "host-q8", "nvme-q8-nomaster"):
        if tier in ("host", "nvme"):  # (a rank's 8-bit state may fit in one 4 KiB file)
            assert len(list((tmp_path / f"ckpt-{tier}").glob("__1_*.distcp"))) > 1  # bounded
        ref = torch.load(tmp_path / f"ref-{tier}-rank0.pt")
        for tag in ("ref-{}-rank1", "resumed1-{}-rank0", "resumed2-{}-rank0",
                    "resumed2-{}-rank1"):
            got = torch.load(tmp_path / f"{tag.format(tier)}.pt")
            for a, b in zip(ref, got):
                assert torch.equal(a, b), (tier, tag, (a.float() - b.float()).abs().max())


# ---- one process ------------------------------------------------------------------------------


def _model(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(33, 47), torch.nn.GELU(), torch.nn.Linear(47, 5))
    m.add_module("unused", torch.nn.Linear(4, 4))  # trainable, never gets a gradient
    return m


def _train(m, opt, steps=3):
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(m[:3](torch.randn(8, 33, generator=g)),
                                     torch.randn(8, 5, generator=g)).backward()
        opt.step()


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is a single process"
        yield


def _assert_same_state(a, b):
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)


@pytest.mark.parametrize("tiers", [("host", "nvme"), ("nvme", "host")])
def test_round_trip_across_tiers_lazy_state(tmp_path, tiers):
    """A parameter without state has no entries; the load reads which parameters have state
    from the checkpoint (checkpoint=), names from named_parameters; the state, step counts and
    hyper-parameters come back exactly, across tiers, and the next steps agree."""
    m = _model()
    opt = spillover.OffloadAdamW(m.parameters(), lr=3e-3, tier=tiers[0], chunk_bytes=4096,
                                 host_pool_bytes=POOL)
    _train(m, opt)
    opt.param_groups[0]["lr"] = 7e-3  # a scheduler's value is what comes back
    st = spillover.dcp.optimizer_state(opt, m.named_parameters(), piece_bytes=512)
    dcp.save({"optim": st}, checkpoint_id=str(tmp_path))
    assert st._cache is None  # the last unit's export went with its last piece
    md = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    names = {k.split(".")[2] + "." + k.split(".")[3] for k in md.state_dict_metadata
             if k.startswith("optim.state.")}
    assert names == {"0.bias", "0.weight", "2.bias", "2.weight"}  # none for "unused"
    chunks = md.state_dict_metadata["optim.state.0.weight.exp_avg"].chunks
    assert len(chunks) == -(-33 * 47 // 128) and max(c.sizes[0] for c in chunks) == 128

    m2 = _model(seed=1)
    m2.load_state_dict(m.state_dict())
    opt2 = spillover.OffloadAdamW(m2.parameters(), lr=1e-3, tier=tiers[1], host_pool_bytes=POOL)
    dcp.load({"optim": spillover.dcp.optimizer_state(opt2, m2.named_parameters(),
                                                     checkpoint=tmp_path)},
             checkpoint_id=str(tmp_path))
    assert opt2.param_groups[0]["lr"] == 7e-3 and opt2.param_groups[0]["betas"] == (0.9, 0.999)
    assert opt2.state_steps() == {0: 3.0, 1: 3.0, 2: 3.0, 3: 3.0}
    _assert_same_state(opt, opt2)
    _train(m, opt, 2)
    _train(m2, opt2, 2)
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_load_without_checkpoint_hint_says_what_to_do(tmp_path):
    """By default a load expects state for every trainable parameter; when one had none, DCP
    refuses the plan (a missing key) and the checkpoint= hint loads it."""
    m = _model()
    opt = spillover.OffloadAdamW(m.parameters(), tier="host", host_pool_bytes=POOL)
    _train(m, opt, 1)
    dcp.save({"optim": spillover.dcp.optimizer_state(opt)}, checkpoint_id=str(tmp_path))
    fresh = spillover.OffloadAdamW(_model().parameters(), tier="host", host_pool_bytes=POOL)
    with pytest.raises(BaseException) as err:  # DCP's CheckpointException (a BaseException)
        dcp.load({"optim": spillover.dcp.optimizer_state(fresh)}, checkpoint_id=str(tmp_path))
    assert "Missing key in checkpoint state_dict: optim.state.4.exp_avg" in repr(
        getattr(err.value, "failures", err.value))
    dcp.load({"optim": spillover.dcp.optimizer_state(fresh, checkpoint=tmp_path)},
             checkpoint_id=str(tmp_path))
    _assert_same_state(opt, fresh)


def test_refuses_what_it_cannot_load(tmp_path):
    m = _model()
    opt = spillover.OffloadAdamW(m.parameters(), tier="host", host_pool_bytes=POOL)
    with pytest.raises(TypeError, match="OffloadAdamW"):
        spillover.dcp.optimizer_state(torch.optim.AdamW(m.parameters()))
    with pytest.raises(ValueError, match="not in named_parameters"):
        spillover.dcp.optimizer_state(opt, list(m.named_parameters())[:2])
    _train(m, opt, 1)
    dcp.save({"optim": spillover.dcp.optimizer_state(opt, m.named_parameters())},
             checkpoint_id=str(tmp_path))
    other = _model()
    renamed = [("x" + n, p) for n, p in other.named_parameters()]
    opt2 = spillover.OffloadAdamW(other.parameters(), tier="host", host_pool_bytes=POOL)
    with pytest.raises(ValueError, match="pass named_parameters= naming them"):
        dcp.load({"optim": spillover.dcp.optimizer_state(opt2, renamed, checkpoint=tmp_path)},
                 checkpoint_id=str(tmp_path))
    small = torch.nn.Linear(2, 2)
    opt3 = spillover.OffloadAdamW(small.parameters(), host_pool_bytes=POOL)
    with pytest.raises(BaseException) as err:  # DCP compares the sizes
        dcp.load({"optim": spillover.dcp.optimizer_state(
            opt3, [("0.weight", small.weight), ("0.bias", small.bias)])},
            checkpoint_id=str(tmp_path))
    assert "Size mismatch" in repr(getattr(err.value, "failures", err.value))


# ---- FSDP2 ------------------------------------------------------------------------------------


def test_fsdp2_equal_torch_adamw_and_resumes_at_any_world_size(tmp_path):
    """fully_shard + spillover.wrap + offload_context + OffloadAdamW on 2 CPU ranks (gloo): the
    parameters after 4 steps are within the tolerance torch's AdamW implementations differ by
    (test_optim.py::test_within_tolerance_of_every_torch_adamw) of the same FSDP2 run with
    torch's AdamW; saved through DCP at step 2 (NVMe tier, chunks = the ranges of the local
    shards) and resumed by fresh FSDP2 ranks, bit for bit; resumed by one process without
    FSDP (world size 1, plain tensors), equal within the difference of summing the ranks'
    half-batch gradients instead of the whole batch's."""
    run_ranks(os.path.join(HERE, "dist_fsdp_worker.py"), [str(tmp_path)], timeout=90)
    ref = torch.load(tmp_path / "torch.pt")
    ours = torch.load(tmp_path / "spillover.pt")
    resumed = torch.load(tmp_path / "resumed.pt")
    for n in ref:
        torch.testing.assert_close(ours[n], ref[n], rtol=1e-5, atol=1e-6, msg=n)
        assert torch.equal(resumed[n], ours[n]), n

    sys.path.insert(0, HERE)
    try:
        from dist_fsdp_worker import CFG, CTX, STEPS
    finally:
        sys.path.remove(HERE)
    from spillover.models import GPT, synthetic_batch

    torch.manual_seed(1)
    model = spillover.wrap(GPT(CFG), policy="selective")
    for blk in model.blocks:
        blk.attn.qkv.bias.requires_grad_(False)
    opt = spillover.OffloadAdamW(model.parameters(), lr=1e-3, tier="host", host_pool_bytes=POOL)
    state = {"model": model.state_dict(),
             "optim": spillover.dcp.optimizer_state(opt, model.named_parameters())}
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    model.load_state_dict(state["model"])
    ctx = spillover.offload_context(**CTX)
    for step in range(STEPS // 2, STEPS):
        idx, tgt = synthetic_batch(CFG, batch=4, seed=step)
        with ctx:
            loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ours[n], rtol=1e-4, atol=1e-5, msg=n)


def test_async_save_is_refused_not_saved_empty(tmp_path):
    """async_save stages a copy of every tensor; a copy of a lazy column would be empty, so
    the column refuses it (instead of a checkpoint without the state)."""
    m = _model()
    opt = spillover.OffloadAdamW(m.parameters(), tier="host", host_pool_bytes=POOL)
    _train(m, opt, 1)
    state = {"optim": spillover.dcp.optimizer_state(opt)}
    assert "column exp_avg of parameter '0'" in repr(state["optim"].state_dict())
    with pytest.raises(BaseException, match="use dcp.save"):
        dcp.async_save(state, checkpoint_id=str(tmp_path)).result()


def test_checkpoint_without_master_loads_into_bf16(tmp_path):
    """fp32 CPU parameters are their own master, so their checkpoint has no master column; a
    bf16 optimizer loading it (checkpoint= hint) starts its master from the parameters, as
    OffloadAdamW.load_state_dict does."""
    m = _model()
    opt = spillover.OffloadAdamW(m.parameters(), tier="host", host_pool_bytes=POOL)
    _train(m, opt, 2)
    dcp.save({"optim": spillover.dcp.optimizer_state(opt)}, checkpoint_id=str(tmp_path))
    b = _model().to(torch.bfloat16)
    ob = spillover.OffloadAdamW(b.parameters(), tier="nvme", host_pool_bytes=POOL)
    dcp.load({"optim": spillover.dcp.optimizer_state(ob, checkpoint=tmp_path)},
             checkpoint_id=str(tmp_path))
    got, ref = ob.state_dict()["state"], opt.state_dict()["state"]
    assert sorted(got) == sorted(ref) == [0, 1, 2, 3]
    for i in ref:
        assert torch.equal(got[i]["exp_avg"], ref[i]["exp_avg"])
        assert torch.equal(got[i]["master"], list(b.parameters())[i].float())


def test_staged_path_round_trip(tmp_path):
    """The GPU path's layout (staging buffers, a master column even for fp32), run on CPU
    tensors: saved and loaded back into the same path, state equal and the next steps too."""
    m = _model()
    opt = spillover.OffloadAdamW(m.parameters(), tier="nvme", host_pool_bytes=POOL,
                                 _force_staging=True)
    _train(m, opt, 2)
    dcp.save({"optim": spillover.dcp.optimizer_state(opt, piece_bytes=256)},
             checkpoint_id=str(tmp_path))
    b = _model(seed=3)
    b.load_state_dict(m.state_dict())
    ob = spillover.OffloadAdamW(b.parameters(), tier="host", host_pool_bytes=POOL,
                                _force_staging=True)
    dcp.load({"optim": spillover.dcp.optimizer_state(ob, checkpoint=tmp_path)},
             checkpoint_id=str(tmp_path))
    assert "master" in ob.state_dict()["state"][0]
    _assert_same_state(opt, ob)
    _train(m, opt, 2)
    _train(b, ob, 2)
    for x, y in zip(m.parameters(), b.parameters()):
        assert torch.equal(x, y)
