"""OffloadAdamW(update_in_backward=True) in the loops people run (Note [speculative update] in
spillover/optim/inbwd.py): gradient clipping, torch.amp.GradScaler (with inf steps), gradient
accumulation, an LR changed between backward and step(). Each table runs the same plain torch
loop on our optimizer (CPU parameters, the mode's staged path) and on torch's fused AdamW, on
the host and NVMe tiers, with one bucket for the model or one per parameter, and compares
parameters and state with torch.equal (bitwise where the kernel has FMA, as every parity test
of OffloadAdamW); the counters in stats() say which steps were kept from backward, redone or
skipped, and are checked against what the reference loop did."""

from __future__ import annotations

import pytest
import torch
from dist_optim_worker import make_model
from test_optim_lazy import assert_state
from test_optim_staged import assert_params, data

import spillover
from spillover import optim as so

POOL = 72 << 20  # this file's own pool (pools are shared per capacity)
F = torch.nn.functional
STEPS = 7
TIERS = ["host", "nvme"]
# Clip limits for this model and data: the unclipped norms lie between about 1 and 6.
CLIP = {"never": 1e6, "sometimes": 2.5, "always": 1e-3}


@pytest.fixture(params=["one", "each"], ids=["one-bucket", "bucket-per-param"])
def bucket(request, monkeypatch):
    if request.param == "each":
        monkeypatch.setattr(so.layout, "_BUCKET_ELEMS", 1)
    return request.param


def offload(model, tier, tmp_path, **kw):
    return spillover.OffloadAdamW(
        model.parameters(),
        lr=1e-2,
        update_in_backward=True,
        tier=tier,
        nvme_path=str(tmp_path),
        chunk_bytes=4096,
        host_pool_bytes=POOL,
        **kw,
    )


def reference(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)


def batch(s, m=0, inf=False):
    """Micro-batch m of step s; targets of alternating size, so the gradients' norm varies
    (clipping applies at some steps only); `inf`: an inf in the input (every gradient
    becomes inf/NaN during backward, as an overflow would)."""
    x, y = data(s * 8 + m)
    y = y * (1.0 + 3.0 * (s % 2))
    if inf:
        x = x.clone()
        x[0, 0] = float("inf")
    return x, y


def loop(model, opt, steps=STEPS, *, clip=None, scaler=None, unscale=False, inf_at=(), micro=1):
    """The plain torch loop. `clip`: clip_grad_norm_ before the step (after scaler.unscale_
    when `unscale`). `micro`: micro-batches per step (an int, or one count per step).
    Returns the norms clip_grad_norm_ returned, and the scaler's scale at each step."""
    norms, scales = [], []
    for s in range(steps):
        n = micro if isinstance(micro, int) else micro[s]
        opt.zero_grad()
        for m in range(n):
            x, y = batch(s, m, inf=s in inf_at and m == n - 1)
            loss = F.mse_loss(model(x), y) / n
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None and unscale:
            scaler.unscale_(opt)
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        if scaler is not None:
            scales.append(scaler.get_scale())
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return norms, scales


def clipped(norms, limit):
    """Steps after the first (the first is made at step(): Note [lazy state]) whose clipping
    applied, as clip_grad_norm_ decides it."""
    return sum(bool(limit / (n + 1e-6) < 1.0) for n in norms[1:])


def lockstep(ours, opt, ref, ropt, steps, after_backward, each_step=None):
    """Both loops, step by step: zero_grad, one batch's backward, ``after_backward(s, m, o)``
    (what the test does between backward and step()), step(); ``each_step()`` after each."""
    for s in range(steps):
        for m, o in ((ours, opt), (ref, ropt)):
            o.zero_grad()
            x, y = batch(s)
            F.mse_loss(m(x), y).backward()
            after_backward(s, m, o)
            o.step()
        if each_step is not None:
            each_step()


def check(ours, opt, ref, ropt):
    assert_params(ours, ref)
    assert_state(opt.state_dict(), ropt.state_dict())


# ---- clipping ----


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("applies", list(CLIP))
@pytest.mark.parametrize("how", ["clip_grad_norm_", "max_grad_norm"])
def test_clipping_matches_torch(tier, applies, how, bucket, tmp_path):
    """clip_grad_norm_ between backward and step() (or max_grad_norm= on the optimizer):
    equal to torch's loop with clip_grad_norm_; the steps whose clipping applied are redone,
    the others keep the update made during backward."""
    limit = CLIP[applies]
    ours, ref = make_model(), make_model()
    if how == "max_grad_norm":
        opt = offload(ours, tier, tmp_path, max_grad_norm=limit)
        loop(ours, opt)
    else:
        opt = offload(ours, tier, tmp_path)
        loop(ours, opt, clip=limit)
    ropt = reference(ref)
    norms, _ = loop(ref, ropt, clip=limit)
    check(ours, opt, ref, ropt)
    n = clipped(norms, limit)
    assert {"never": n == 0, "sometimes": 0 < n < STEPS - 1, "always": n == STEPS - 1}[applies]
    st = opt.stats()
    assert st["steps"] == STEPS
    assert st["steps_redone"] == n
    assert st["steps_in_backward"] == STEPS - 1 - n
    assert st["inbwd_buckets_redone"] == n * len(opt._spaces[0].buckets)
    if how == "max_grad_norm":
        assert torch.equal(opt.grad_norm, norms[-1])


# ---- GradScaler ----


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("flow", ["scale-step", "unscale-clip", "max_grad_norm"])
def test_grad_scaler_with_inf_steps_matches_torch(tier, flow, bucket, tmp_path):
    """GradScaler with a scale that grows every 3 steps and inf/NaN gradients at two steps
    (the updates made during backward then ran on them and are undone; the scaler backs off):
    equal to torch's loop with its own identical scaler. scale-step: scale, backward,
    scaler.step; a step whose scale is not the last step's is redone. unscale-clip:
    scaler.unscale_ and clip_grad_norm_ before scaler.step (every update is redone: the
    gradients were rewritten). max_grad_norm: the optimizer unscales and clips, against
    torch's unscale-clip loop; redone when the scale changed or clipping applied."""
    inf_at = (3, 5)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3) for _ in "ab"]
    ours, ref = make_model(), make_model()
    ropt = reference(ref)
    limit = CLIP["sometimes"]
    if flow == "max_grad_norm":
        opt = offload(ours, tier, tmp_path, max_grad_norm=limit)
        loop(ours, opt, scaler=scalers[0], inf_at=inf_at)
        norms, scales = loop(ref, ropt, scaler=scalers[1], inf_at=inf_at, unscale=True, clip=limit)
    else:
        opt = offload(ours, tier, tmp_path)
        clip = limit if flow == "unscale-clip" else None
        unscale = flow == "unscale-clip"
        loop(ours, opt, scaler=scalers[0], inf_at=inf_at, unscale=unscale, clip=clip)
        norms, scales = loop(
            ref, ropt, scaler=scalers[1], inf_at=inf_at, unscale=unscale, clip=clip
        )
    assert scalers[0].get_scale() == scalers[1].get_scale()
    check(ours, opt, ref, ropt)
    st = opt.stats()
    assert st["steps_skipped"] == len(inf_at)
    assert st["steps"] == STEPS - len(inf_at)
    stepped = [s for s in range(STEPS) if s not in inf_at]
    redo = 0
    for prev, s in zip(stepped, stepped[1:]):  # the first step is made at step()
        clip_applied = flow == "max_grad_norm" and limit / (norms[s] + 1e-6) < 1.0
        redo += flow == "unscale-clip" or scales[s] != scales[prev] or clip_applied
    assert st["steps_redone"] == redo
    assert st["steps_in_backward"] == len(stepped) - 1 - redo
    if flow != "unscale-clip":
        assert 0 < redo < len(stepped) - 1


def test_inf_step_leaves_parameters_and_state_unchanged(bucket, tmp_path):
    """A skipped step undoes the updates made during backward (on inf/NaN gradients):
    parameters, state and step counts are exactly those before it."""
    model = make_model()
    opt = offload(model, "host", tmp_path)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    loop(model, opt, steps=3, scaler=scaler)
    params = [p.detach().clone() for p in model.parameters()]
    sd = opt.state_dict()
    opt.zero_grad()
    x, y = batch(3, inf=True)
    scaler.scale(F.mse_loss(model(x), y)).backward()
    assert opt._spaces[0].in_round()  # updated during backward, on NaN gradients
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), params))
    after = opt.state_dict()
    for i, st in sd["state"].items():
        for k, v in st.items():
            assert torch.equal(after["state"][i][k], v), (i, k)
    n = len(opt._spaces[0].buckets)
    assert opt.stats()["inbwd_buckets_undone"] == n and opt.stats()["steps_skipped"] == 1


# ---- accumulation ----


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("micro", [2, 4, [3, 2, 2, 4, 1, 3, 3]], ids=["2", "4", "varying"])
def test_accumulation_matches_torch(tier, micro, bucket, tmp_path):
    """2 or 4 micro-batches per step, or a varying number, with clipping: equal to torch's
    loop. From the third step on (the second learns the count) a steady loop updates each
    bucket once per step, during the last micro-batch's backward; a step with more
    micro-batches than the last undoes the early update from the extra micro-batch's hook, one
    with fewer updates at step()."""
    limit = 1.0  # the loss is averaged over the micro-batches: smaller norms (0.4 to 2.3)
    ours, ref = make_model(), make_model()
    opt = offload(ours, tier, tmp_path)
    ropt = reference(ref)
    loop(ours, opt, micro=micro, clip=limit)
    norms, _ = loop(ref, ropt, micro=micro, clip=limit)
    check(ours, opt, ref, ropt)
    st = opt.stats()
    nb = len(opt._spaces[0].buckets)
    n = clipped(norms, limit)
    assert 0 < n < STEPS - 1
    assert st["steps_redone"] == n
    if isinstance(micro, int):
        assert st["steps_in_backward"] == STEPS - 1 - n
        # the second step updates at every micro-batch and undoes all but the last one's
        assert st["inbwd_buckets_undone"] == (micro - 1) * nb
        assert st["inbwd_buckets"] == (STEPS - 1 + micro - 1) * nb
    else:
        assert st["inbwd_buckets_undone"] > (micro[1] - 1) * nb  # more undone later (2 -> 4)


# ---- hyper-parameters changed between backward and step() ----


def test_lr_changed_between_backward_and_step_is_redone(bucket, tmp_path):
    """A scheduler stepped before step() (warm-up written that way) changes the lr the update
    used: redone with the new one, as torch would use it."""
    ours, ref = make_model(), make_model()
    opt = offload(ours, "host", tmp_path)
    ropt = reference(ref)
    def new_lr(s, m, o):
        if s == 2:
            o.param_groups[0]["lr"] = 3e-3

    lockstep(ours, opt, ref, ropt, 4, new_lr)
    check(ours, opt, ref, ropt)
    st = opt.stats()
    assert st["steps_redone"] == 1 and st["steps_in_backward"] == 2


@pytest.mark.parametrize("tier", TIERS)
def test_undo_copy_is_counted(tier, bucket, tmp_path):
    """stats(): the undo copy holds 12 bytes per parameter once every bucket was updated
    during backward (fp32 master, exp_avg, exp_avg_sq): in host memory on the host tier, on
    the swap files on the NVMe tier (host memory: two bounce buffers of the largest bucket),
    whose I/O counts in bytes_read and bytes_written."""
    model = make_model()
    opt = offload(model, tier, tmp_path)
    loop(model, opt, steps=2)
    n = sum(p.numel() for p in model.parameters())
    padded = sum(-(-p.numel() // 16) * 16 for p in model.parameters())
    st = opt.stats()
    if tier == "host":
        assert n * 12 <= st["undo_bytes"] <= padded * 12 and st["undo_swap_bytes"] == 0
        return
    biggest = max(f_hi - f_lo for _, f_lo, f_hi, _, _ in opt._spaces[0].buckets)
    assert st["undo_bytes"] == biggest * 12  # saving's (restoring's is made at an undo)
    assert n * 12 <= st["undo_swap_bytes"]
    state_io = opt._spaces[0].state.stats()
    assert st["bytes_written"] > state_io["bytes_written"]  # the copy's writes count


def test_max_grad_norm_is_checked():
    model = make_model()
    with pytest.raises(ValueError, match="max_grad_norm"):
        spillover.OffloadAdamW(model.parameters(), max_grad_norm=0.0, host_pool_bytes=POOL)


# ---- transformers.Trainer: clipping (max_grad_norm=1.0, its default) and accumulation ----


def test_hf_trainer_matches_torch_adamw(tmp_path):
    """The README's one argument: Trainer(optimizers=(OffloadAdamW(..., update_in_backward=
    True), None)) with Trainer's own clipping (max_grad_norm) at a limit that applies at some
    steps, 2 micro-batches per step and its LR schedule gives the parameters of the same
    Trainer with torch's fused AdamW."""
    transformers = pytest.importorskip("transformers")

    def train(make_opt):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=64,
        )
        model = transformers.LlamaForCausalLM(cfg)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 128, (16, 32), generator=g)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path),
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=4,
            learning_rate=1e-2,
            max_grad_norm=1.2,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            seed=0,
            data_seed=0,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        opt = make_opt(model)
        trainer = transformers.Trainer(
            model=model,
            args=args,
            optimizers=(opt, None),
            train_dataset=[{"input_ids": x, "labels": x.clone()} for x in ids],
        )
        trainer.train()
        return model, opt

    ours, opt = train(
        lambda m: spillover.OffloadAdamW(
            m.parameters(), lr=1e-2, update_in_backward=True, host_pool_bytes=POOL
        )
    )
    ref, _ = train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True))
    assert_params(ours, ref)
    st = opt.stats()
    assert st["steps"] == 4 and st["inbwd_buckets"] > 0
    assert st["steps_in_backward"] + st["steps_redone"] == 3  # the first made at step()
    assert st["steps_in_backward"] > 0 and st["steps_redone"] > 0  # clipping applied at some


# ---- against the default mode: bf16 parameters, parameters on a GPU ----


def _against_default_mode(dtype, device, use_scaler):
    """The same loop (2 micro-batches; without a scaler, clipping that applies at some steps;
    with GradScaler, an inf step and scaler.unscale_ + clipping at some steps) with
    update_in_backward and with the default mode (itself equal to torch's recipes:
    test_optim.py, test_optim_staged.py): bitwise equal parameters and state."""
    runs = []
    for inbwd in (True, False):
        model = make_model(dtype).to(device)
        opt = spillover.OffloadAdamW(
            model.parameters(),
            lr=1e-2,
            update_in_backward=inbwd,
            host_pool_bytes=POOL,
            _force_staging=True,
        )
        scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=3)
        for s in range(STEPS):
            opt.zero_grad()
            for m in range(2):
                x, y = batch(s, m, inf=use_scaler and s == 3 and m == 1)
                loss = F.mse_loss(model(x.to(device, dtype)), y.to(device, dtype)) / 2
                (scaler.scale(loss) if use_scaler else loss).backward()
            if not use_scaler:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                continue
            if s % 3 == 2:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        if device != "cpu":
            torch.cuda.synchronize()
        runs.append((model, opt))
    (ours, opt), (ref, ropt) = runs
    for i, (a, b) in enumerate(zip(ours.parameters(), ref.parameters())):
        assert torch.equal(a, b), (i, (a.float() - b.float()).abs().max())
    sd, rsd = opt.state_dict()["state"], ropt.state_dict()["state"]
    for i, st in rsd.items():
        for k, v in st.items():
            assert torch.equal(sd[i][k], v), (i, k)
    st = opt.stats()
    assert st["steps_in_backward"] > 0 and st["steps_redone"] > 0
    assert st["steps_skipped"] == use_scaler


@pytest.mark.parametrize("use_scaler", [False, True], ids=["clip", "scaler"])
def test_bf16_parameters_match_the_default_mode(use_scaler, bucket):
    _against_default_mode(torch.bfloat16, "cpu", use_scaler)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_scaler", [False, True], ids=["clip", "scaler"])
def test_cuda_parameters_match_the_default_mode(dtype, use_scaler):
    """Parameters on the GPU: staging copies and fingerprints on the device, updates on the
    worker, parameters written at step() by asynchronous copies the compute stream waits for."""
    _against_default_mode(dtype, "cuda", use_scaler)


def test_lightning_matches_torch_adamw():
    """Lightning: configure_optimizers returns OffloadAdamW(..., update_in_backward=True);
    Trainer(gradient_clip_val=..., accumulate_grad_batches=2) clips with clip_grad_norm_ at a
    limit that applies at some steps: the parameters of the same fit with torch's fused
    AdamW."""
    L = pytest.importorskip("lightning")
    import warnings

    class Lit(L.LightningModule):
        def __init__(self, make_opt):
            super().__init__()
            self.net, self.make_opt = make_model(), make_opt

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            self.opt = self.make_opt(self.net.parameters())
            return self.opt

    def fit(make_opt):
        xs, ys = zip(*(batch(s, m) for s in range(5) for m in range(2)))
        loader = torch.utils.data.DataLoader(list(zip(xs, ys)), batch_size=None, shuffle=False)
        lit = Lit(make_opt)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=5,
            accumulate_grad_batches=2,
            gradient_clip_val=1.5,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's advice on num_workers and the like
            trainer.fit(lit, train_dataloaders=loader)
        return lit

    ours = fit(
        lambda ps: spillover.OffloadAdamW(
            ps, lr=1e-2, update_in_backward=True, host_pool_bytes=POOL
        )
    )
    ref = fit(lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True))
    assert_params(ours.net, ref.net)
    st = ours.opt.stats()
    assert st["steps"] == 5 and st["steps_in_backward"] + st["steps_redone"] == 4
    assert st["steps_in_backward"] > 0 and st["steps_redone"] > 0


def test_dcp_reads_the_master_update_in_backward_keeps():
    """update_in_backward stages the gradients of fp32 CPU parameters, so their state keeps a
    master copy (OffloadAdamW.keeps_master); a DCP load plans to read it, as a save writes it.
    The default mode keeps none there."""
    def planned(inbwd):
        opt = spillover.OffloadAdamW(
            make_model().parameters(), lr=1e-2, update_in_backward=inbwd, host_pool_bytes=POOL
        )
        return {frozenset(c) for c in spillover.dcp.optimizer_state(opt).state_dict()["state"]
                .values()}

    assert planned(True) == {frozenset({"master", "exp_avg", "exp_avg_sq"})}
    assert planned(False) == {frozenset({"exp_avg", "exp_avg_sq"})}


@pytest.mark.parametrize("resume_inbwd", [True, False], ids=["resume-inbwd", "resume-default"])
def test_dcp_resume_matches_an_unbroken_run(resume_inbwd, tmp_path):
    """A torch.distributed.checkpoint save of an update_in_backward run (whose fp32 CPU
    parameters keep a master copy in this mode), resumed in either mode, continues exactly as
    the run that was not interrupted (clipping applying at some steps)."""
    import torch.distributed.checkpoint as dcp

    def run(model, opt, first, steps=3):
        for s in range(first, first + steps):
            opt.zero_grad()
            x, y = batch(s)
            F.mse_loss(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP["sometimes"])
            opt.step()

    def make(inbwd):
        model = make_model()
        opt = spillover.OffloadAdamW(
            model.parameters(), lr=1e-2, update_in_backward=inbwd, host_pool_bytes=POOL
        )
        return model, opt

    model, opt = make(True)
    run(model, opt, 0)
    state = {"model": model.state_dict(), "optim": spillover.dcp.optimizer_state(opt)}
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))
    run(model, opt, 3)
    resumed, ropt = make(resume_inbwd)
    state = {"model": resumed.state_dict(), "optim": spillover.dcp.optimizer_state(ropt)}
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    resumed.load_state_dict(state["model"])
    run(resumed, ropt, 3)
    assert_params(resumed, model)
    # loaded units are updated during backward from the first step after the load: steps 3
    # and 5 (larger targets) are clipped and redone, step 4 is kept
    assert ropt.stats()["steps_in_backward"] == (1 if resume_inbwd else 0)


# ---- other changes between backward and step() ----


def test_gradient_set_to_none_after_backward(bucket, tmp_path):
    """A gradient set to None after backward (the parameter is skipped, as by torch): its
    bucket's update is undone; the bucket's other members are updated at step() from their
    staged copies; equal to torch."""
    ours, ref = make_model(), make_model()
    opt = offload(ours, "host", tmp_path)
    ropt = reference(ref)
    def drop_grad(s, m, o):
        if s >= 2:
            m[2].weight.grad = None

    lockstep(ours, opt, ref, ropt, 4, drop_grad, lambda: assert_params(ours, ref))
    check(ours, opt, ref, ropt)
    st = opt.stats()
    assert st["steps_redone"] == 2 and st["inbwd_buckets_redone"] == 2


def test_abandoned_backward_is_undone(bucket, tmp_path):
    """A backward whose step() never comes (zero_grad and a new batch: a loss spike skipped by
    hand) leaves no trace: the next backward's hooks undo its updates; equal to torch, where
    that backward only produced gradients."""
    ours, ref = make_model(), make_model()
    opt = offload(ours, "host", tmp_path)
    ropt = reference(ref)
    def abandon(s, m, o):
        if s == 2:  # abandoned
            o.zero_grad()
            x, y = batch(s, 1)
            F.mse_loss(m(x), y).backward()

    lockstep(ours, opt, ref, ropt, 5, abandon)
    check(ours, opt, ref, ropt)
    assert opt.stats()["inbwd_buckets_undone"] == len(opt._spaces[0].buckets)
