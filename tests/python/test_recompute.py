"""spillover.checkpoint / wrap: gradients bitwise equal to the plain model in every policy, with
and without offload_context; saved op outputs reach the offload context; the sharp edges
(random ops, in-place ops, retain_graph, views, compile)."""

import contextlib
import copy
import inspect

import pytest
import torch
from conftest import assert_bitwise, gpt_step, grads, same_loss_ref
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import spillover
from spillover import recompute
from spillover.models import GPT, GPTConfig, synthetic_batch
from spillover.planner import SKIPPED_REASON, Machine

aten = torch.ops.aten

# Skipping unread ops and dropping what follows the last save need torch to show a region what
# autograd saves (torch 2.8+; README "Which torch").
needs_top_hooks = pytest.mark.skipif(recompute.modes.top_hooks is None,
                                     reason="torch < 2.8: no _top_saved_tensors_default_hooks")

# Fixed rates, so no test calibrates the machine.
MACHINE = Machine({"float32": 1e11}, 5e9, 6e9, 6e9, 3e9, 2e9)


def _save_matmuls(op, inputs, output):
    return "save" if op in (aten.addmm.default, aten.mm.default, aten.bmm.default) else "recompute"


POLICIES = {
    "full": "full",
    "selective": "selective",
    "selective16": spillover.SelectivePolicy(min_flops_per_byte=16),
    "offload": "offload",
    "callable": _save_matmuls,
    "auto": "auto",
}


def _ctx(tier, pool_bytes=None):
    if tier is None:
        return None
    return spillover.offload_context(tier, min_offload_bytes=4096, host_pool_bytes=pool_bytes)


def _wrapped(base, policy, **kw):
    m = copy.deepcopy(base)
    if policy == "auto":
        # A budget below what the model holds: the planner must recompute and offload.
        spillover.wrap(m, policy=spillover.Planner(budget_bytes=1, machine=MACHINE), **kw)
    else:
        spillover.wrap(m, policy=POLICIES.get(policy, policy) if isinstance(policy, str)
                       else policy, **kw)
    return m


@pytest.mark.parametrize("tier", [None, "host", "nvme"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_gpt_gradients_bitwise(tiny_gpt_cl, policy, tier, private_pool_bytes):
    base, batch = tiny_gpt_cl
    model = _wrapped(base, policy)
    # auto: the first step learns, the next ones follow the plan (at this budget, with a
    # smaller loss chunk: the plain reference uses the same one).
    for _ in range(3 if policy == "auto" else 2):
        got = gpt_step(model, batch, _ctx(tier, private_pool_bytes))
        assert_bitwise(same_loss_ref(base, batch, model), got)
    if policy == "auto" and model._spillover_state.policy.loss_cap() is not None:
        # the budget capped the loss chunk (Note [loss chunk under a budget]): within torch's
        # tolerance of the speed rule's (test_planner_budget.py checks the cap is applied)
        assert "loss chunk" in spillover.explain(model).summary
        for a, b in zip(gpt_step(base, batch), got):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tier", [None, "host"])
@pytest.mark.parametrize("policy", ["selective16", "callable"])
def test_gpt_gradients_bitwise_without_torchs_top_hooks(tiny_gpt_cl, policy, tier,
                                                        private_pool_bytes, monkeypatch):
    """torch below 2.8 has no _top_saved_tensors_default_hooks, so a region cannot see what
    autograd saves: nothing may then be skipped as unread (Note [outputs only saved ops read]).
    Skipping anyway gave nan gradients on torch 2.5 and 2.6 under policies that save matmuls;
    here the newest torch is made to look like those."""
    from spillover.recompute import auto, blocks, modes

    for mod in (modes, auto, blocks):
        monkeypatch.setattr(mod, "top_hooks", None)
    base, batch = tiny_gpt_cl
    model = _wrapped(base, policy)
    for _ in range(2):
        got = gpt_step(model, batch, _ctx(tier, private_pool_bytes))
        assert_bitwise(same_loss_ref(base, batch, model), got)
    ops = model._spillover_state.last_records()[0].ops
    assert ops and not any(op.reason == SKIPPED_REASON for op in ops)


@pytest.mark.parametrize("policy", ["selective16", "callable", "auto"])
def test_backward_inside_the_with_block(tiny_gpt_cl, policy, private_pool_bytes):
    base, batch = tiny_gpt_cl
    model = _wrapped(base, policy)
    for _ in range(2):
        got = gpt_step(model, batch, _ctx("host", private_pool_bytes), outside=False)
        assert_bitwise(same_loss_ref(base, batch, model), got)


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func] = self.calls.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def _backward_ops(model, batch, ctx=None):
    idx, tgt = batch
    model.zero_grad(set_to_none=True)
    with ctx or contextlib.nullcontext():
        loss = model(idx, tgt)
    counter = _Counter()
    with counter:
        loss.backward()
    return counter.calls


def test_saved_outputs_are_not_recomputed(tiny_gpt_cl):
    """A saved matmul output comes back in recompute; an unsaved one runs again."""
    base, batch = tiny_gpt_cl
    full = _backward_ops(_wrapped(base, "full"), batch)
    sel = _backward_ops(_wrapped(base, "callable"), batch)
    plain = _backward_ops(copy.deepcopy(base), batch)
    n_blocks = len(base.blocks)
    # Forward has 4 addmm per block (qkv, proj, up, down); full reruns those before the last
    # saved tensor (down's output is never needed: Note [after the last save]).
    assert full.get(aten.addmm.default, 0) == 3 * n_blocks
    assert sel.get(aten.addmm.default, 0) == 0
    assert plain.get(aten.addmm.default, 0) == 0
    # softmax is recomputed by both (the scores bmm too, except where it is saved).
    assert full[aten._softmax.default] == sel[aten._softmax.default] == n_blocks
    assert aten.bmm.default not in sel or sel[aten.bmm.default] == plain.get(aten.bmm.default)


def test_saved_outputs_reach_the_offload_context(tiny_gpt_cl, private_pool_bytes):
    """Note [SAC bypasses saved-tensor hooks]: what the policy saves goes through ctx.pack and
    comes back through ctx.unpack (torch's own SAC would keep it on the device)."""
    base, batch = tiny_gpt_cl
    model = _wrapped(base, "callable")
    ctx = _ctx("host", private_pool_bytes)
    packed, unpacked = [], []
    orig_pack, orig_unpack = ctx.pack, ctx.unpack
    ctx.pack = lambda t: packed.append(tuple(t.shape)) or orig_pack(t)
    ctx.unpack = lambda h: unpacked.append(h) or orig_unpack(h)
    ref = gpt_step(base, batch)
    assert_bitwise(ref, gpt_step(model, batch, ctx))
    d, s, b = base.cfg.d_model, base.cfg.seq, batch[0].shape[0]
    # Per block: qkv, scores, attention x v, proj, up and down (packed as forward runs; down is
    # dropped when the region ends, Note [after the last save]); all but down come back.
    n = len(base.blocks)
    assert packed.count((b * s, 3 * d)) == n
    assert packed.count((b * s, 4 * d)) == n
    assert len(packed) == 6 * n and len(unpacked) == 5 * n
    st = ctx.stats()
    assert st.tensors_offloaded >= len(packed) and st.tensors_unpacked >= len(packed)

    # The same policy through torch's own selective checkpointing: the hooks see none of them.
    seen = []

    def pack(t):
        seen.append(tuple(t.shape))
        return t

    policy = _save_matmuls

    def torch_policy(_ctx, op, *a, **k):
        if policy(op, a, None) == "save":
            return torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
        return torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    idx, tgt = batch
    plain = copy.deepcopy(base)
    # torch 2.13+ can be asked to respect the hooks; below it SAC always bypasses them
    kw = ({"respect_saved_tensors_hooks": False}
          if "respect_saved_tensors_hooks" in inspect.signature(torch.utils.checkpoint.checkpoint)
          .parameters else {})
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        x = plain.tok(idx) + plain.pos(torch.arange(idx.shape[1]))
        for blk in plain.blocks:
            x = torch.utils.checkpoint.checkpoint(
                blk, x, use_reentrant=False, **kw,
                context_fn=lambda: torch.utils.checkpoint.create_selective_checkpoint_contexts(
                    torch_policy),
            )
    assert (b * s, 3 * d) not in seen


def test_without_context_saved_outputs_are_plain_references(tiny_gpt_cl):
    base, batch = tiny_gpt_cl
    model = _wrapped(base, "callable")
    kinds = []
    orig = recompute._Saved.__init__

    def spy(self, x, ctx):
        orig(self, x, ctx)
        kinds.append((ctx is None, isinstance(self.value, torch.Tensor)))

    recompute._Saved.__init__ = spy
    try:
        assert_bitwise(gpt_step(base, batch), gpt_step(model, batch))
    finally:
        recompute._Saved.__init__ = orig
    assert kinds and all(k == (True, True) for k in kinds)


@needs_top_hooks
def test_outputs_after_the_last_save_are_dropped(tiny_gpt_cl):
    """Note [after the last save]: the MLP's down projection is never needed in recompute."""
    base, batch = tiny_gpt_cl
    refs = []

    def policy(op, inputs, output):
        if op is aten.addmm.default:
            refs.append(StorageWeakRef(output.untyped_storage()))
            return "save"
        return "recompute"

    model = _wrapped(base, policy)
    idx, tgt = batch
    loss = model(idx, tgt)
    # Per block: qkv, proj, up kept (their storages alive); down dropped at the region's end.
    alive = [not r.expired() for r in refs]
    assert alive == [True, True, True, False] * len(base.blocks)
    loss.backward()
    recs = model._spillover_state.last_records()
    downs = [o for r in recs for o in r.ops if o.name == "aten.addmm.default"][3::4]
    assert all(o.after_stop and o.action == "recompute" for o in downs)


class _Noisy(nn.Module):
    """Dropout between matmuls, and an in-place op on a saved matmul output."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 32)

    def forward(self, x):
        y = self.a(x)
        y = torch.nn.functional.dropout(y, 0.5, True)
        z = self.b(y)
        z.mul_(2.0)  # modifies the saved output of b in place
        z = torch.nn.functional.dropout(torch.tanh(z), 0.3, True)
        return self.a(z[..., :32].repeat(1, 1)) + z.sum()


def _noisy_grads(model, x, seed, ctx=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with ctx or contextlib.nullcontext():
        out = model(x).square().sum()
    out.backward()
    return grads(model)


@pytest.mark.parametrize("tier", [None, "host"])
def test_random_and_inplace_ops(tier, private_pool_bytes):
    """Note [never saved]: random ops replay in order; an output modified in place is
    recomputed instead of raising."""
    torch.manual_seed(1)
    x = torch.randn(64, 32)
    base = _Noisy()
    ref = _noisy_grads(base, x, seed=5)
    blocks = nn.ModuleList([copy.deepcopy(base)])
    for policy in ("full", "selective", spillover.SelectivePolicy(1), _save_matmuls):
        wrapped = copy.deepcopy(blocks)
        spillover.wrap(wrapped, policy=policy)
        got = _noisy_grads(wrapped[0], x, seed=5, ctx=_ctx(tier, private_pool_bytes))
        assert_bitwise(ref, got)
    recs = wrapped._spillover_state.last_records()
    b_out = [o for o in recs[0].ops if o.name == "aten.addmm.default"][1]
    assert b_out.action == "recompute" and "in place" in b_out.reason


def test_retain_graph_and_double_backward(tiny_gpt_cl, private_pool_bytes):
    base, batch = tiny_gpt_cl
    idx, tgt = batch
    # torch's chunked loss runs one backward per forward (test_loss_region.py): the plain one
    base = copy.deepcopy(base)
    base.spillover_chunked_loss = False
    for policy in ("selective16", "callable", "auto"):
        ref_m = copy.deepcopy(base)
        loss = ref_m(idx, tgt)
        loss.backward(retain_graph=True)
        loss.backward()
        ref = grads(ref_m)
        model = _wrapped(base, policy, chunked_loss=False)
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with _ctx("host", private_pool_bytes):
                loss = model(idx, tgt)
            loss.backward(retain_graph=True)
            loss.backward()
            assert_bitwise(ref, grads(model))


@pytest.mark.parametrize("helper", ["torch's", "none"])
def test_modified_after_forward_raises(helper, monkeypatch):
    """The saved alias shares the output's version counter whether or not torch has
    checkpoint's _detach_helper (torch 2.13+; below it a plain detach() in the dispatch mode
    gave a fresh counter and the write went unseen on torch 2.8 and 2.11)."""
    if helper == "none":
        from spillover.recompute import ops

        monkeypatch.setattr(ops, "_DETACH_HELPER", None)
    lin = nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)

    def region(x):
        y = lin(x)
        return y, torch.sin(y)

    y, z = spillover.checkpoint(region, x, policy=_save_matmuls)
    with torch.no_grad():
        y.add_(1)  # y is the saved addmm output itself
    with pytest.raises(RuntimeError, match="modified in place"):
        z.sum().backward()


def test_checkpoint_function_api():
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(8, 32), nn.Linear(32, 8)
    x = torch.randn(16, 8, requires_grad=True)

    def region(x, scale=1.0):
        return lin2(torch.relu(lin1(x)) * scale)

    ref = region(x, scale=3.0).sum()
    ref_grads = torch.autograd.grad(ref, [x, lin1.weight, lin2.weight])
    for policy in ("full", "selective", "offload", _save_matmuls, "auto"):
        out = spillover.checkpoint(region, x, policy=policy, scale=3.0).sum()
        got = torch.autograd.grad(out, [x, lin1.weight, lin2.weight])
        assert torch.equal(out, ref)
        assert_bitwise(list(ref_grads), list(got))
    with torch.no_grad():  # nothing saved: runs plainly
        assert torch.equal(spillover.checkpoint(region, x, scale=3.0), region(x, scale=3.0))


def test_policy_errors():
    x = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(ValueError, match="policy='sometimes'"):
        spillover.checkpoint(torch.sin, x, policy="sometimes")
    with pytest.raises(TypeError):
        spillover.checkpoint(torch.sin, x, policy=3)
    with pytest.raises(ValueError, match="expected 'save' or 'recompute'"):
        spillover.checkpoint(lambda t: t @ t, x, policy=lambda op, i, o: "maybe")


def test_wrap_blocks_state_dict_and_unwrap(tiny_gpt_cl):
    base, batch = tiny_gpt_cl
    keys = list(base.state_dict())
    model = copy.deepcopy(base)
    assert spillover.wrap(model, policy="selective") is model
    assert list(model.state_dict()) == keys
    assert [name for name, _ in model._spillover_state.blocks] == ["blocks.0", "blocks.1"]
    assert all(isinstance(b, recompute._WrappedBlock) for b in model.blocks)
    assert type(model.blocks[0]).__name__ == "SpilloverBlock"
    with pytest.raises(ValueError, match="already wrapped"):
        spillover.wrap(model)
    model.load_state_dict(base.state_dict())
    spillover.unwrap(model)
    assert type(model.blocks[0]) is type(base.blocks[0])
    assert "_spillover_state" not in model.__dict__
    assert_bitwise(gpt_step(base, batch), gpt_step(model, batch))

    # check_fn: the outermost matching modules.
    m2 = spillover.wrap(copy.deepcopy(base), check_fn=lambda m: isinstance(m, nn.Linear))
    names = [n for n, _ in m2._spillover_state.blocks]
    assert names[:2] == ["blocks.0.attn.qkv", "blocks.0.attn.proj"] and "head" in names
    assert_bitwise(gpt_step(base, batch), gpt_step(m2, batch))
    with pytest.raises(ValueError, match="no blocks"):
        spillover.wrap(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="budget_bytes"):
        spillover.wrap(copy.deepcopy(base), policy="full", budget_bytes=1)


def test_explain_selective(tiny_gpt_cl):
    base, batch = tiny_gpt_cl
    model = _wrapped(base, "selective16")
    gpt_step(model, batch)
    ex = spillover.explain(model, machine=MACHINE)
    by_op = {(r["op"], r["output"]): r for r in ex.rows}
    d, s, b = base.cfg.d_model, base.cfg.seq, batch[0].shape[0]
    qkv = by_op[("aten.addmm.default", f"[{b * s}, {3 * d}] float32")]
    assert qkv["decision"] == "keep" and qkv["count"] == len(base.blocks)
    assert qkv["bytes"] == b * s * 3 * d * 4 and "FLOP/B >= 16" in qkv["why"]
    soft = by_op[("aten._softmax.default", f"[{b}, 4, {s}, {s}] float32")]
    assert soft["decision"] == "recompute" and soft["recompute_s"] > 0
    text = str(ex)
    assert "aten._softmax.default" in text
    # Ops only saved ops read are skipped where torch shows a region what autograd saves (2.8+)
    assert ("not rerun" in text) == (recompute.modes.top_hooks is not None)
    with pytest.raises(ValueError):
        spillover.explain(copy.deepcopy(base))


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
                                    for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_torch_compile_of_a_wrapped_block(private_pool_bytes):
    """A wrapped block compiles (torch's SAC with our decisions); its saved tensors reach the
    offload hooks. policy='auto' raises a clear error under compile, or (where Dynamo breaks the
    graph before the region) runs eagerly as without compile."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    base = _Tiny()
    ref = copy.deepcopy(base)
    for b in ref.blocks:
        b.compile(backend="aot_eager")
    ref(x).square().sum().backward()
    model = spillover.wrap(copy.deepcopy(base), policy=_save_matmuls)
    for b in model.blocks:
        b.compile(backend="aot_eager")
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.shape) or t,
                                                  lambda t: t):
        out = model(x).square().sum()
    out.backward()
    assert_bitwise(grads(ref), grads(model))
    assert torch.Size([8, 64]) in seen  # the first linear's output, saved by the policy

    # policy='auto' where Dynamo traces into the region (torch 2.15 here) raises its error.
    # Where Dynamo breaks the graph before the region (torch 2.5.1 and 2.11 on 2026-12-06), the
    # region runs eagerly: auto then learns and plans as it does without compile, with the same
    # gradients as the eager model; that is checked instead.
    auto = spillover.wrap(copy.deepcopy(base), policy="auto")
    for b in auto.blocks:
        b.compile(backend="aot_eager")
    plain = copy.deepcopy(base)
    try:
        for _ in range(3):
            auto.zero_grad(set_to_none=True)
            plain.zero_grad(set_to_none=True)
            auto(x).square().sum().backward()
            plain(x).square().sum().backward()
    except Exception as e:  # noqa: BLE001 -- which one is asserted just below
        assert "policy='auto' cannot run under torch.compile" in str(e), e
    else:
        assert_bitwise(grads(plain), grads(auto))
        planner = spillover.explain(auto).summary
        assert planner.get("phase", "").startswith(("settled", "tuning")), planner
    torch._dynamo.reset()


def test_llama_gradients_bitwise(private_pool_bytes):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    base = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 128, (2, 32))

    def step(m, ctx=None):
        m.zero_grad(set_to_none=True)
        with ctx or contextlib.nullcontext():
            loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return grads(m)

    ref = step(base)
    keys = list(base.state_dict())
    for policy in ("full", "selective", "offload", "auto", "callable"):
        for tier in (None, "host", "nvme"):
            model = copy.deepcopy(base)
            if policy == "auto":
                policy_obj = spillover.Planner(budget_bytes=1, machine=MACHINE)
            else:
                policy_obj = POLICIES[policy]
            with pytest.warns(UserWarning, match="use_cache=False"):
                spillover.wrap(model, policy=policy_obj, chunked_loss=False)
            assert model.config.use_cache is False
            assert [n for n, _ in model._spillover_state.blocks] == ["model.layers.0",
                                                                    "model.layers.1"]
            assert list(model.state_dict()) == keys
            for _ in range(3 if policy == "auto" else 1):
                assert_bitwise(ref, step(model, _ctx(tier, private_pool_bytes)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tier", [None, "host", "nvme"])
@pytest.mark.parametrize("policy", ["selective16", "callable", "auto"])
def test_gpt_gradients_bitwise_on_cuda(policy, tier):
    """On the device: saved outputs go D2H through the context and come back H2D in recompute."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, d_model=256, n_heads=8, n_layers=3, seq=256,
                    chunked_loss=True)  # the loss wrap gives it: the reference's math too
    base = GPT(cfg).cuda()
    batch = synthetic_batch(cfg, batch=4, device="cuda")
    ref = gpt_step(base, batch)
    model = _wrapped(base, policy)
    for _ in range(3):
        got = gpt_step(model, batch, _ctx(tier, 1 << 30))
        torch.cuda.synchronize()
        assert_bitwise(ref, got)



def _save_softmax(op, inputs, output):
    return "save" if op is torch.ops.aten._softmax.default else "recompute"


@needs_top_hooks
@pytest.mark.parametrize("tier", [None, "nvme"])
def test_ops_only_saved_outputs_read_are_not_rerun(tiny_gpt_cl, tier, tmp_path, monkeypatch):
    # Note [outputs only saved ops read]: with the softmax output saved, the scores matmul,
    # scaling and masking before it are not rerun; gradients stay bitwise.
    base, batch = tiny_gpt_cl
    ref = gpt_step(base, batch)
    model = spillover.wrap(copy.deepcopy(base), policy=_save_softmax)
    skipped = []
    make = recompute._Skip.make
    monkeypatch.setattr(recompute._Skip, "make", lambda self, *a: skipped.append(self.size) or
                        make(self, *a))
    for _ in range(2):
        ctx = (spillover.offload_context(tier, nvme_path=str(tmp_path), min_offload_bytes=0,
                                         host_pool_bytes=(2 << 20) + 77824)
               if tier else None)
        assert_bitwise(ref, gpt_step(model, batch, ctx))
    idx = batch[0]
    scores = torch.Size([idx.shape[0], 4, idx.shape[1], idx.shape[1]])  # [b, heads, s, s]
    n = len(base.blocks)
    # per block and step: scaled and masked scores, and the scores matmul (as [b*h, s, s])
    assert skipped.count(scores) == 2 * 2 * n, skipped
    assert len(skipped) >= 3 * 2 * n
    text = str(spillover.explain(model))
    assert "only saved outputs read it: never rerun" in text
