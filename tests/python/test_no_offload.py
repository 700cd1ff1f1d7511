"""spillover.no_offload(): torch.func losses (Liger's chunked losses, Unsloth's fused loss) under
an offload_context, with the model body still offloaded (issue 22, Note [no offload])."""

import contextlib
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spillover

_A = torch._C._autograd
HOOKS_ERROR = "don't yet support saved tensor hooks"


def ctx():
    return spillover.offload_context(tier="host", host_pool_bytes="64MiB")


def top():
    return _A._top_saved_tensors_default_hooks(True)


# ---- a loss in Liger's chunked-loss style ----------------------------------------------------


def _chunk_loss(h, w, y):
    return F.cross_entropy((h @ w.t()).float(), y, reduction="sum")


class ChunkedLinearCE(torch.autograd.Function):
    """Liger's pattern (liger_kernel/chunked_loss/fused_linear_*): forward computes the loss and
    its gradients chunk by chunk with torch.func.grad_and_value and saves the gradients;
    backward scales them by the incoming gradient."""

    @staticmethod
    def forward(fctx, hidden, weight, target, chunks):
        gv = torch.func.grad_and_value(_chunk_loss, argnums=(0, 1))
        n = target.numel()
        grad_h, grad_w, loss = [], torch.zeros_like(weight), hidden.new_zeros((), dtype=torch.float)
        for h, y in zip(hidden.chunk(chunks), target.chunk(chunks)):
            (gh, gw), v = gv(h, weight, y)
            grad_h.append(gh)
            grad_w += gw
            loss += v
        fctx.save_for_backward(torch.cat(grad_h) / n, grad_w / n)
        return loss / n

    @staticmethod
    def backward(fctx, grad_out):
        gh, gw = fctx.saved_tensors
        return gh * grad_out, gw * grad_out, None, None


class Tiny(nn.Module):
    def __init__(self, vocab=512, d=128, layers=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def body(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + F.gelu(b(h))  # (4096, 128) fp32: 2 MiB per saved activation
        return h


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 512, (4096,), generator=g)
    y = torch.randint(0, 512, (4096,), generator=g)
    return x, y


def _step(model, x, y, context=None, wrap_loss=True):
    model.zero_grad(set_to_none=True)
    if context is None:
        h = model.body(x)
        loss = ChunkedLinearCE.apply(h, model.head.weight, y, 4)
    else:
        with context:
            h = model.body(x)
            if wrap_loss:
                with spillover.no_offload():
                    loss = ChunkedLinearCE.apply(h, model.head.weight, y, 4)
            else:
                loss = ChunkedLinearCE.apply(h, model.head.weight, y, 4)
    loss.backward()
    return loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_torch_func_loss_fails_under_the_context_without_no_offload():
    torch.manual_seed(0)
    model = Tiny()
    x, y = _data()
    with pytest.raises(RuntimeError, match=HOOKS_ERROR):
        _step(model, x, y, ctx(), wrap_loss=False)
    assert top() is None  # the context's hooks left with it


def test_torch_func_loss_bitwise_with_no_offload_and_body_offloaded():
    torch.manual_seed(0)
    model = Tiny()
    x, y = _data()
    ref_loss, ref_grads = _step(model, x, y)
    c = ctx()
    for _ in range(2):  # one context, two steps
        loss, grads = _step(model, x, y, c)
        assert torch.equal(loss, ref_loss)
        assert grads.keys() == ref_grads.keys()
        for n, g in grads.items():
            assert torch.equal(g, ref_grads[n]), n
        s = c.stats()
        assert s.bytes_offloaded > 0 and s.tensors_offloaded >= 3  # the body left the device
        assert s.tensors_unpacked >= s.tensors_offloaded
    assert top() is None


def test_liger_chunked_loss_under_no_offload():
    pytest.importorskip("liger_kernel", reason="liger-kernel is not installed here (it pulls "
                        "triton kernels); ChunkedLinearCE above is its pattern")
    from liger_kernel.chunked_loss import LigerFusedLinearORPOLoss  # torch.func.grad_and_value

    torch.manual_seed(0)
    model = Tiny()
    x = torch.randint(0, 512, (2, 2, 1024))  # (chosen, rejected) x 2 x seq
    y = torch.randint(0, 512, (4, 1024))
    loss_fn = LigerFusedLinearORPOLoss(compiled=False)

    def run(context):
        model.zero_grad(set_to_none=True)
        with context if context is not None else contextlib.nullcontext():
            h = model.body(x.reshape(-1)).reshape(4, 1024, -1)
            with spillover.no_offload():
                out = loss_fn(model.head.weight, h, y)
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_loss, ref_grads = run(None)
    c = ctx()
    loss, grads = run(c)
    assert c.stats().bytes_offloaded > 0
    assert torch.equal(loss, ref_loss)
    for n, g in grads.items():
        assert torch.equal(g, ref_grads[n]), n


# ---- the hook stack -----------------------------------------------------------------------


def test_outside_any_context_is_a_noop():
    assert top() is None
    with spillover.no_offload():
        assert top() is None
        w = torch.randn(8)
        assert torch.equal(torch.func.grad(lambda t: (t * t).sum())(w), 2 * w)
    assert top() is None
    p, u = (lambda t: t), (lambda t: t)
    with torch.autograd.graph.saved_tensors_hooks(p, u):  # not spillover's, no context: kept
        with spillover.no_offload():
            assert top()[0] is p
        assert top()[0] is p


def _saves(n=1 << 19):
    return torch.exp(torch.randn(n, requires_grad=True))  # exp saves its 2 MiB result


def test_nesting_restores_the_hooks_and_offload_resumes():
    c = spillover.offload_context(tier="host", host_pool_bytes="64MiB", min_offload_bytes=0)
    outs = []
    with c:
        ours = top()
        assert ours is not None
        outs.append(_saves())
        after_first = c.stats().tensors_offloaded
        assert after_first >= 1
        with spillover.no_offload():
            assert top() is None
            outs.append(_saves())
            with spillover.no_offload():  # nested: nothing more to take
                assert top() is None
                outs.append(_saves())
            assert top() is None
        assert top()[0] is ours[0] and top()[1] is ours[1]
        assert c.stats().tensors_offloaded == after_first  # the region's saves were not seen
        outs.append(_saves())
        assert c.stats().tensors_offloaded == after_first + 1  # offloaded again after it
    assert top() is None
    for o in outs:
        o.sum().backward()


def test_exception_inside_restores_the_hooks():
    with ctx():
        ours = top()
        with pytest.raises(ValueError, match="boom"), spillover.no_offload():
            raise ValueError("boom")
        assert top()[0] is ours[0]
    assert top() is None


def test_decorator_form():
    @spillover.no_offload()
    def loss_fn(h):
        assert top() is None
        return h.sum()

    with ctx():
        ours = top()
        loss_fn(torch.ones(3))
        assert top()[0] is ours[0]


def test_foreign_hooks_above_ours_raise_and_change_nothing():
    p, u = (lambda t: t), (lambda t: t)
    with ctx():
        ours = top()
        with torch.autograd.graph.saved_tensors_hooks(p, u):
            with pytest.raises(RuntimeError, match="not spillover's.*outside those hooks"), \
                    spillover.no_offload():
                pass
            assert top()[0] is p
        assert top()[0] is ours[0]
    # ours under a user's pair: ours are taken, the user's stay (and torch.func sees them)
    with torch.autograd.graph.saved_tensors_hooks(p, u):
        with ctx(), spillover.no_offload():
            assert top()[0] is p
        assert top()[0] is p
    assert top() is None


def test_two_contexts_nested_both_suspended():
    with ctx() as a:
        with ctx(), spillover.no_offload():
            assert top() is None
        assert top()[0].__self__ is a
    assert top() is None


def test_context_exited_inside_the_region_is_not_pushed_back():
    c = ctx()
    c.__enter__()
    with spillover.no_offload():
        c.__exit__(None, None, None)  # by hand, not nested: must not pop another pair
        assert top() is None
    assert top() is None


def test_per_thread():
    seen = {}
    ready, go = threading.Event(), threading.Event()

    def other():
        with ctx():
            seen["other_before"] = top() is not None
            ready.set()
            go.wait(10)
            seen["other_during"] = top() is not None  # main's region left this thread alone
        seen["other_after"] = top() is None

    t = threading.Thread(target=other)
    with ctx():
        t.start()
        ready.wait(10)
        with spillover.no_offload():
            assert top() is None
            go.set()
            t.join(10)
        assert top() is not None
    assert seen == {"other_before": True, "other_during": True, "other_after": True}


class WithLoss(Tiny):
    """The loss inside forward, as transformers models (and Liger's patches of them) do."""

    def forward(self, x, y):
        h = self.body(x)
        self.tops.append(top()[0].__self__)
        with spillover.no_offload():
            return ChunkedLinearCE.apply(h, self.head.weight, y, 4)


def test_wrap_auto_learning_step_counting_hooks_are_taken_too():
    from spillover.recompute.blocks import _CountingHooks

    torch.manual_seed(0)
    model = WithLoss()
    x, y = _data()
    ref_loss, ref_grads = _step(model, x, y)
    spillover.wrap(model, policy="auto")
    c = ctx()
    model.tops = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with c:
            loss = model(x, y)
            assert top()[0].__self__ is c
        loss.backward()
        assert torch.equal(loss.detach(), ref_loss)
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert grads.keys() == ref_grads.keys()
        for n, g in grads.items():
            assert torch.equal(g, ref_grads[n]), n
    # the first step learns: the planner's counting pair sat over the context's
    assert isinstance(model.tops[0], _CountingHooks)
    assert top() is None


# ---- the callbacks' no_offload= ------------------------------------------------------------


class LossModule(nn.Module):
    def forward(self, h, w, y):
        return ChunkedLinearCE.apply(h, w, y, 4)


class WithLossModule(Tiny):
    def __init__(self):
        super().__init__()
        self.loss = LossModule()

    def forward(self, input_ids, labels):
        h = self.body(input_ids.reshape(-1))
        return {"loss": self.loss(h, self.head.weight, labels.reshape(-1))}


def _rows(n=8, seq=1024):
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 512, (seq,), generator=g),
             "labels": torch.randint(0, 512, (seq,), generator=g)} for _ in range(n)]


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_bitwise(a, b):
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_no_offload_forward_hook():
    from spillover.suspend import no_offload_forward

    m = LossModule()
    seen = []
    m.register_forward_pre_hook(lambda mod, args: seen.append(top()))  # ours run first
    handle = no_offload_forward(m)
    h = torch.randn(64, 8, requires_grad=True)
    w = torch.randn(16, 8, requires_grad=True)
    y = torch.randint(0, 16, (64,))
    with ctx():
        ours = top()
        m(h, w, y).backward()
        assert seen == [None] and top()[0] is ours[0]
        with pytest.raises(RuntimeError, match="shape"):
            m(h, w[:, :4], y)  # forward raises: the hooks are back all the same
        assert top()[0] is ours[0]
        handle.remove()
        with pytest.raises(RuntimeError, match=HOOKS_ERROR):
            m(h, w, y)
    with pytest.raises(TypeError, match="no_offload\\(\\)\\(loss_fn\\)"):
        no_offload_forward(_chunk_loss)


def test_hf_trainer_callback_no_offload(tmp_path):
    transformers = pytest.importorskip("transformers")
    from spillover.integrations.hf import SpilloverCallback

    def train(make_callback=None):
        torch.manual_seed(0)
        model = WithLossModule()
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=4,
            max_steps=2, learning_rate=1e-2, use_cpu=True, report_to=[], save_strategy="no",
            logging_strategy="no", seed=0, data_seed=0, dataloader_num_workers=0,
            disable_tqdm=True)
        cbs = [make_callback(model)] if make_callback is not None else []
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_rows(),
                                       callbacks=cbs)
        trainer.train()
        return _params(model), cbs

    ref, _ = train()
    failing = []
    with pytest.raises(RuntimeError, match=HOOKS_ERROR):
        train(lambda m: failing.append(SpilloverCallback(tier="host", host_pool_bytes="64MiB"))
              or failing[0])
    failing[0].steps.end()  # HF calls no callback on an exception: the step is left open
    assert top() is None
    got, (cb,) = train(lambda m: SpilloverCallback(tier="host", host_pool_bytes="64MiB",
                                                   no_offload=m.loss))
    _assert_bitwise(got, ref)
    assert len(cb.step_stats) == 2 and all(s.bytes_offloaded > 0 for s in cb.step_stats)
    assert top() is None


def test_lightning_callback_no_offload():
    L = pytest.importorskip("lightning")
    from spillover.integrations.lightning import SpilloverCallback

    class Lit(L.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(**batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    def fit(make_callback=None):
        L.seed_everything(0, verbose=False)
        model = WithLossModule()
        cbs = [make_callback(model)] if make_callback is not None else []
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=cbs)
        loader = torch.utils.data.DataLoader(_rows(), batch_size=4, shuffle=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's advice on num_workers and the like
            trainer.fit(Lit(model), train_dataloaders=loader)
        return _params(model), cbs

    ref, _ = fit()
    with pytest.raises(RuntimeError, match=HOOKS_ERROR):
        fit(lambda m: SpilloverCallback(tier="host", host_pool_bytes="64MiB"))
    got, (cb,) = fit(lambda m: SpilloverCallback(tier="host", host_pool_bytes="64MiB",
                                                 no_offload=[m.loss]))
    _assert_bitwise(got, ref)
    assert len(cb.step_stats) == 2 and all(s.bytes_offloaded > 0 for s in cb.step_stats)
    assert top() is None


def test_readme_snippet():
    import contextlib as cl
    import io
    import pathlib

    readme = pathlib.Path(__file__).resolve().parents[2] / "README.md"
    section = readme.read_text().split("### torch.func losses", 1)[1].split("\n### ", 1)[0]
    blocks = section.split("```python\n")[1:]
    assert len(blocks) == 1, "README: one python block under ### torch.func losses"
    ns = {}
    out = io.StringIO()
    with cl.redirect_stdout(out):
        exec(compile(blocks[0].split("```", 1)[0], "README.md", "exec"), ns)
    assert ns["ctx"].stats().bytes_offloaded > 0
    assert ns["head"].weight.grad is not None and ns["body"][0].weight.grad is not None
    assert "offloaded" in out.getvalue()
    assert top() is None
