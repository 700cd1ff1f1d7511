"""OffloadAdamW with low-bit state (issue 36; Note [state formats] in
spillover/optim/formats.py): bf16 and 8-bit moments and bf16 parameters without an fp32
master, over several steps, on the host and NVMe tiers, on the staged (GPU) path, updated
during backward, and sharded over two gloo ranks — every path bit for bit the same as every
other, close to fp32 AdamW; checkpoints (state_dict and DCP) round-trip the quantized state
exactly and say their format, other formats convert with a warning; stats() and explain()
count the bytes as stored."""

from __future__ import annotations

import copy
import io
import os
import warnings

import pytest
import torch
from _ranks import run_ranks
from dist_optim_worker import LOWBIT, batches, make_model

import spillover
import spillover.dcp
from spillover.optim import formats

POOL = 96 << 20  # the pool test_optim.py uses (pools are shared per capacity)
F = torch.nn.functional
HERE = os.path.dirname(os.path.abspath(__file__))
# (parameter dtype, master_weights): fp32 parameters (their own master), bf16 with a master,
# bf16 without one.
KINDS = [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)]
KIND_IDS = ["fp32", "bf16-master", "bf16-nomaster"]


def offload(params, **kw):
    kw.setdefault("host_pool_bytes", POOL)
    return spillover.OffloadAdamW(params, **kw)


def groups_of(model):
    return [
        {"params": list(model[0].parameters()), "lr": 1e-2, "betas": (0.8, 0.99)},
        {"params": list(model[2].parameters()), "lr": 3e-2, "weight_decay": 0.1},
    ]


def wide_model(dtype=torch.float32):
    """Parameters of several blocks of 256, none a multiple of it, odd sizes."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(33, 47), torch.nn.GELU(), torch.nn.Linear(47, 21))
    return m.to(dtype)


def train(model, opt, dtype, steps=8, seed=0, clip=None):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 33, generator=g).to(dtype)
        y = torch.randn(16, model[2].out_features, generator=g).to(dtype)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_same(a, b, what=""):
    for i, (x, y) in enumerate(zip(a, b)):
        d = (x.float() - y.float()).abs().max()
        assert torch.equal(x, y), f"{what} param {i}: max |d| = {d}"


def assert_same_state(sa, sb):
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys(), i
        for k in sa[i]:
            assert sa[i][k].dtype == sb[i][k].dtype and torch.equal(sa[i][k], sb[i][k]), (i, k)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_every_path_and_tier_agrees_bit_for_bit(bits, kind, tmp_path):
    """In place (CPU parameters), the staged path (the GPU path's buffers on CPU tensors), the
    NVMe tier and small chunks: the same parameters and the same stored state, bit for bit
    (Note [block alignment], Note [stochastic rounding]); the state holds the format's
    dtypes."""
    dtype, master_weights = kind
    runs = []
    for tier, staged, chunk in [("host", False, None), ("host", True, None),
                                ("nvme", False, 4096), ("nvme", True, 8192)]:
        m = wide_model(dtype)
        opt = offload(groups_of(m), tier=tier, state_bits=bits, master_weights=master_weights,
                      _force_staging=staged, chunk_bytes=chunk, nvme_path=str(tmp_path))
        train(m, opt, dtype)
        runs.append((params_of(m), opt.state_dict()["state"], (tier, staged)))
    p0, s0, _ = runs[0]
    for p, s, what in runs[1:]:
        assert_same(p, p0, str(what))
        for i in s0:  # the staged path keeps a master for fp32 parameters: compare the rest
            for k in formats.columns(bits, False):
                assert torch.equal(s[i][k], s0[i][k]), (what, i, k)
    st = s0[0]
    assert st["exp_avg"].dtype == formats.dtype(bits, "exp_avg")
    assert st["exp_avg_sq"].dtype == formats.dtype(bits, "exp_avg_sq")
    assert st["exp_avg"].shape == wide_model().state_dict()["0.weight"].shape
    if bits == 8:
        assert st["exp_avg_scale"].shape == (formats.blocks(33 * 47),)
    assert ("master" in st) == (dtype == torch.bfloat16 and master_weights)


@pytest.mark.parametrize("bits,tol", [(16, 0.03), (8, 0.06)])
def test_low_bit_moments_follow_fp32_adamw(bits, tol):
    """After 30 steps the parameters' change from their start is within `tol` (relative, in
    norm) of torch's fused AdamW's on fp32 parameters: the update is AdamW's, on moments
    rounded to the format."""
    ref, ours = wide_model(), wide_model()
    start = params_of(ref)
    ropt = torch.optim.AdamW(groups_of(ref), fused=True)
    opt = offload(groups_of(ours), state_bits=bits)
    train(ref, ropt, torch.float32, steps=30)
    train(ours, opt, torch.float32, steps=30)
    for s, a, b in zip(start, params_of(ref), params_of(ours)):
        da, db = a - s, b - s
        assert (da - db).norm() <= tol * da.norm(), ((da - db).norm() / da.norm()).item()


def test_state_bits_32_is_the_default_and_torch_fused():
    """state_bits=32 (the default) is unchanged: bitwise torch's fused AdamW where the kernel
    uses FMA (tests/python/test_optim.py covers every mode)."""
    a, b = wide_model(), wide_model()
    oa = offload(groups_of(a), state_bits=32)
    ob = torch.optim.AdamW(groups_of(b), fused=True)
    train(a, oa, torch.float32)
    train(b, ob, torch.float32)
    if spillover._native.AdamState.fma_available():
        assert_same(params_of(a), params_of(b))
    assert oa.state_dict()["state_format"]["state_bits"] == 32


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("save_tier,load_tier", [("host", "nvme"), ("nvme", "host")])
def test_state_dict_round_trips_exactly(bits, kind, save_tier, load_tier, tmp_path):
    """Save after 5 steps, torch.save / torch.load, load into a fresh optimizer on the other
    tier: the stored state comes back exactly (no warning), the checkpoint says its format,
    and the next steps equal never having stopped (the rounding seed comes back too)."""
    dtype, master_weights = kind
    a = wide_model(dtype)
    kw = dict(state_bits=bits, master_weights=master_weights, nvme_path=str(tmp_path))
    oa = offload(groups_of(a), tier=save_tier, chunk_bytes=8192, rounding_seed=123, **kw)
    train(a, oa, dtype, steps=5)
    sd = oa.state_dict()
    fmt = sd["state_format"]
    assert fmt["state_bits"] == bits and fmt["name"] == formats.FORMAT_NAMES[bits]
    assert fmt["rounding_seed"] == 123 and fmt["master_weights"] == master_weights
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    b = copy.deepcopy(a)
    ob = offload(groups_of(b), tier=load_tier, chunk_bytes=4096, **kw)  # seed 0 until loaded
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same format: nothing converted
        ob.load_state_dict(loaded)
    assert_same_state(sd["state"], ob.state_dict()["state"])
    train(a, oa, dtype, steps=4, seed=7)
    train(b, ob, dtype, steps=4, seed=7)
    assert_same(params_of(a), params_of(b))


@pytest.mark.parametrize("src,dst", [(32, 8), (32, 16), (8, 32), (16, 8), (8, 16)])
def test_other_formats_convert_with_a_warning(src, dst):
    """A checkpoint of another state_bits loads through fp32 with one warning naming both
    formats: low-bit into fp32 exactly in value (the kernel's own dequantization), fp32 into
    low-bit within the format's rounding; torch's AdamW checkpoints are fp32 ones."""
    a = wide_model()
    if src == 32:
        oa = torch.optim.AdamW(groups_of(a), fused=True)
    else:
        oa = offload(groups_of(a), state_bits=src)
    train(a, oa, torch.float32, steps=4)
    sd = oa.state_dict()
    b = copy.deepcopy(a)
    ob = offload(groups_of(b), state_bits=dst)
    with pytest.warns(UserWarning, match=f"state_bits={src}.*state_bits={dst}.*converted"):
        ob.load_state_dict(sd)
    got = ob.state_dict()["state"]
    for i, st in sd["state"].items():
        want = formats.to_f32(st, src)
        have = formats.to_f32(got[i], dst)
        for k in formats.MOMENTS:
            w, h = want[k].reshape(-1), have[k].reshape(-1)
            if dst == 32:
                assert torch.equal(w, h), (i, k)
            else:  # one bf16 rounding, or within half an 8-bit code of the block's largest
                tol = 2**-8 * w.abs() if dst == 16 else w.abs().max() / 100
                assert ((w - h).abs() <= tol + 1e-30).all(), (i, k, (w - h).abs().max())
    train(a, oa, torch.float32, steps=2, seed=3)
    train(b, ob, torch.float32, steps=2, seed=3)  # and it steps


def test_checkpoints_of_unknown_formats_are_refused():
    a = wide_model()
    oa = offload(groups_of(a), state_bits=8)
    train(a, oa, torch.float32, steps=1)
    sd = oa.state_dict()
    ob = offload(groups_of(copy.deepcopy(a)), state_bits=8)
    bad = dict(sd, state_format=dict(sd["state_format"], name="q4-v9"))
    with pytest.raises(ValueError, match="q4-v9"):
        ob.load_state_dict(bad)
    st = {i: dict(e) for i, e in sd["state"].items()}
    st[0]["exp_avg"] = st[0]["exp_avg"].to(torch.int16)
    with pytest.raises(ValueError, match="none of OffloadAdamW's state formats"):
        ob.load_state_dict(dict(sd, state=st))
    st = {i: dict(e) for i, e in sd["state"].items()}
    st[0]["exp_avg_scale"] = st[0]["exp_avg_scale"][:-1]
    with pytest.raises(ValueError, match="exp_avg_scale"):
        ob.load_state_dict(dict(sd, state=st))


def test_bf16_without_master_is_reproducible_and_learns_small_steps():
    """master_weights=False: no master column; the same seed gives the same parameters, another
    seed others; updates of 1e-4 on parameters near 1 (a twentieth of a bf16 ulp) still move
    them, where rounding to nearest would not."""
    def run(seed, mw=False):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
        opt = offload([p], lr=1e-4, weight_decay=0.0, state_bits=8, master_weights=mw,
                      rounding_seed=seed)
        for _ in range(50):
            p.grad = torch.ones_like(p)
            opt.step()
        return p.detach().clone(), opt

    a, oa = run(1)
    b, _ = run(1)
    c, _ = run(2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert "master" not in oa.state_dict()["state"][0]
    assert abs(a.float().mean().item() - (1 - 50e-4)) < 5e-4  # 50 steps of lr, on average
    m, _ = run(1, mw=True)  # with a master: the master moves, the bf16 copy rounds to nearest
    assert torch.equal(m, torch.full_like(m, 1 - 50e-4))


@pytest.mark.parametrize("tier", ["host", "nvme"])
@pytest.mark.parametrize("kind", KINDS[1:], ids=KIND_IDS[1:])
def test_update_in_backward_equals_the_default_mode(tier, kind, tmp_path, monkeypatch):
    """update_in_backward=True with 8-bit state: the updates made during backward, kept or
    undone (from the stored undo copy, the output buffer too without a master) and redone when
    clipping applies, give the default mode's parameters and state bit for bit."""
    import spillover.optim as so

    monkeypatch.setattr(so.layout, "_BUCKET_ELEMS", 600)  # several buckets
    dtype, master_weights = kind
    runs = []
    for inbwd in (False, True):
        m = wide_model(dtype)
        opt = offload(groups_of(m), tier=tier, state_bits=8, master_weights=master_weights,
                      update_in_backward=inbwd, nvme_path=str(tmp_path))
        train(m, opt, dtype, steps=6, clip=0.39)  # norms 0.37-0.43: applies at steps 2, 4, 6
        runs.append((params_of(m), opt.state_dict()["state"], opt.stats()))
    assert_same(runs[0][0], runs[1][0])
    assert_same_state(runs[0][1], runs[1][1])
    s = runs[1][2]
    assert s["inbwd_buckets"] > 0 and s["steps_redone"] > 0 and s["steps_in_backward"] > 0, s
    if tier == "nvme":
        assert s["undo_swap_bytes"] > 0
    assert s["undo_bytes"] > 0


def test_stats_and_explain_count_the_state_as_stored():
    """stats()["state_bytes"] is the stored size; explain() and spillover.explain(opt) give
    bytes per parameter per state space (Note [state formats])."""
    torch.manual_seed(0)
    per = {}
    for bits, mw in [(32, True), (8, True), (8, False), (16, True)]:
        p = torch.nn.Parameter(torch.randn(1 << 20, dtype=torch.bfloat16))
        opt = offload([p], state_bits=bits, master_weights=mw)
        before = str(spillover.explain(opt))
        assert "no state yet" in before and f"{formats.bytes_per_param(bits, mw):.2f}" in before
        p.grad = torch.ones_like(p)
        opt.step()
        per[(bits, mw)] = opt.stats()["state_bytes"] / p.numel()
        ex = opt.explain()
        (row,) = ex.rows
        assert row["state_bits"] == bits and row["master"] == mw
        assert row["bytes_per_param"] == pytest.approx(per[(bits, mw)])
        assert f"{row['bytes_per_param']:.2f}" in str(ex)
    assert per[(32, True)] == pytest.approx(12.0, abs=0.01)
    assert per[(16, True)] == pytest.approx(8.0, abs=0.01)
    assert per[(8, True)] <= 6.1 and per[(8, False)] <= 2.1
    assert per[(8, False)] == pytest.approx(2 + 8 / 256, abs=0.01)


def test_nvme_moves_the_stored_bytes(tmp_path):
    """The NVMe tier reads and writes the state as stored: 8-bit moments with a master move
    about half of fp32's bytes per step (6.03 / 12 per parameter)."""
    moved = {}
    for bits in (32, 8):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(1 << 20, dtype=torch.bfloat16))
        opt = offload([p], state_bits=bits, tier="nvme", nvme_path=str(tmp_path))
        for _ in range(3):
            p.grad = torch.ones_like(p)
            opt.step()
        s = opt.stats()
        moved[bits] = (s["bytes_read"] + s["bytes_written"]) / 5  # 2 reads, 3 writes
        assert moved[bits] >= s["state_bytes"] and moved[bits] < s["state_bytes"] + (1 << 16)
    assert moved[8] / moved[32] == pytest.approx(6.03 / 12, abs=0.01)


def test_bad_arguments_name_themselves():
    m = wide_model()
    with pytest.raises(ValueError, match=r"state_bits must be 32 .*, 16 .* or 8 .*, got 4"):
        offload(m.parameters(), state_bits=4)
    with pytest.raises(ValueError, match="state_bits"):
        offload(m.parameters(), state_bits=True)
    with pytest.raises(ValueError, match="master_weights must be True or False"):
        offload(m.parameters(), master_weights="no")
    with pytest.raises(ValueError, match="rounding_seed"):
        offload(m.parameters(), rounding_seed=-1)
    pool = spillover._pools.host_pool(spillover.Config.load(optim_pool_bytes=POOL),
                                        purpose="optim")
    state = spillover._native.AdamState(pool, [1], master=False, state_bits=8)
    with pytest.raises(ValueError, match='unknown state form "packed"'):
        state.export_state(b"", form="packed")
    with pytest.raises(ValueError, match="state_bits must be 32, 16 or 8"):
        spillover._native.AdamState(pool, [1], master=False, state_bits=12)


def _reference(scenario):
    """One process: the mean of the two ranks' half-batch gradients (test_optim.py's)."""
    dtype, tier, extra = LOWBIT[scenario]
    model = make_model(dtype)
    groups = [
        {"params": list(model[0].parameters()), "lr": 2e-2},
        {"params": list(model[2].parameters()), "weight_decay": 0.0},
    ]
    opt = offload(groups, lr=1e-2, tier=tier, **extra)
    for x, y in batches(dtype):
        halves = []
        for r in range(2):
            model.zero_grad()
            F.mse_loss(model(x[r * 4 : (r + 1) * 4]), y[r * 4 : (r + 1) * 4]).backward()
            halves.append([p.grad.clone() for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *halves):
            p.grad = (g0 + g1) * 0.5
        opt.step()
    return model, opt


def test_two_ranks_sharded_low_bit_state_equals_one_process(tmp_path):
    """2 gloo ranks sharding 8-bit state (fp32 parameters, host; bf16 parameters without a
    master, NVMe) and bf16 moments: parameters and the gathered state_dict (codes, scales)
    equal a single-process run bit for bit (Note [sharding]: 8-bit layouts pad parameters to
    blocks)."""
    run_ranks(os.path.join(HERE, "dist_optim_worker.py"), [str(tmp_path), ",".join(LOWBIT)],
              timeout=240)
    for scenario in LOWBIT:
        r0 = torch.load(tmp_path / f"{scenario}-rank0.pt")
        r1 = torch.load(tmp_path / f"{scenario}-rank1.pt")
        ref, ropt = _reference(scenario)
        for a, b, c in zip(r0["params"], r1["params"], ref.parameters()):
            assert torch.equal(a, b), scenario
            assert torch.equal(a, c.detach()), (scenario, (a.float() - c.float()).abs().max())
        assert_same_state(ropt.state_dict()["state"], r0["state_dict"]["state"])
        assert_same_state(ropt.state_dict()["state"], r1["state_dict"]["state"])


@pytest.fixture
def quiet_dcp():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        warnings.filterwarnings("ignore", message=".*TypedStorage.*")
        yield


@pytest.mark.parametrize("bits", [16, 8])
def test_dcp_round_trip_is_exact_and_other_formats_need_the_hint(bits, tmp_path, quiet_dcp):
    """spillover.dcp saves the stored columns (codes and scales, in small pieces) and loads
    them exactly into the other tier; a checkpoint of another format loads with
    checkpoint= (converted, with a warning), and without it is refused, naming checkpoint=."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    m = wide_model(torch.bfloat16)
    opt = offload(groups_of(m), state_bits=bits, tier="host", rounding_seed=9)
    train(m, opt, torch.bfloat16, steps=4)
    st = spillover.dcp.optimizer_state(opt, m.named_parameters(), piece_bytes=256)
    dcp.save({"optim": st}, checkpoint_id=str(tmp_path / "a"))
    md = dcp.FileSystemReader(str(tmp_path / "a")).read_metadata().state_dict_metadata
    key = "optim.state.0.weight.exp_avg"
    assert md[key].properties.dtype == formats.dtype(bits, "exp_avg")
    assert ("optim.state.0.weight.exp_avg_scale" in md) == (bits == 8)
    m2 = copy.deepcopy(m)
    o2 = offload(groups_of(m2), state_bits=bits, tier="nvme", nvme_path=str(tmp_path))
    dcp.load({"optim": spillover.dcp.optimizer_state(o2, m2.named_parameters())},
             checkpoint_id=str(tmp_path / "a"))
    assert_same_state(opt.state_dict()["state"], o2.state_dict()["state"])
    train(m, opt, torch.bfloat16, steps=2, seed=4)
    train(m2, o2, torch.bfloat16, steps=2, seed=4)
    assert_same(params_of(m), params_of(m2))

    # Into fp32 state: refused without checkpoint= (named), converted with it (exact in
    # value: the stored state dequantized).
    def load(state_bits, **kw):
        mm = copy.deepcopy(m)
        o = offload(groups_of(mm), state_bits=state_bits)
        dcp.load({"optim": spillover.dcp.optimizer_state(o, mm.named_parameters(), **kw)},
                 checkpoint_id=str(tmp_path / "a"))
        return o

    saved = load(bits)
    with pytest.raises(ValueError, match="checkpoint=<path>"):
        load(32)
    with pytest.warns(UserWarning, match=f"state_bits={bits}.*converted"):
        o4 = load(32, checkpoint=tmp_path / "a")
    got, want = o4.state_dict()["state"], saved.state_dict()["state"]
    for i in want:
        for k in formats.MOMENTS:
            assert torch.equal(formats.to_f32(want[i], bits)[k], got[i][k].reshape(-1)), (i, k)
