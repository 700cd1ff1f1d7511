"""torch.compile over a whole training run under offload_context (Note [one hook for the run] in
activations/registry.py): twelve steps compile into the graphs the same run compiles without
the context, with no recompile, no warning, and gradients bitwise equal to that run at every
step -- compiled as a module, through ``model.compile()`` and block by block after
``spillover.wrap``, with ``fullgraph=True`` and without, on the host and NVMe tiers, with one
context for the run and with a new context each step. aot_eager saves the tensors inductor
would and compiles in seconds on a CPU; one test runs inductor itself."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from conftest import assert_bitwise, grads
from torch._dynamo.utils import counters

import spillover
from spillover.models import GPT, GPTConfig, synthetic_batch

CFG = dict(vocab=128, d_model=64, n_heads=4, n_layers=2, seq=64)
STEPS = 12


def compiled(model, how, fullgraph, backend):
    """``model`` compiled the way a user does: as a module, by its method, or block by block
    (what spillover's guardrail recommends for wrapped models)."""
    if how == "module":
        return torch.compile(model, backend=backend, fullgraph=fullgraph)
    if how == "method":
        model.compile(backend=backend, fullgraph=fullgraph)
        return model
    for block in model.blocks:
        block.compile(backend=backend, fullgraph=fullgraph)
    return model


def run(model, how, fullgraph, contexts, backend="aot_eager"):
    """STEPS training steps (SGD, so the weights move); per step the gradients, and the graphs
    Dynamo compiled and the frames it recompiled over the run. ``contexts()`` gives the
    context of each step (None: no context)."""
    cfg = model.cfg
    idx, tgt = synthetic_batch(cfg, batch=2)
    torch._dynamo.reset()
    counters.clear()
    fn = compiled(model, how, fullgraph, backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.filterwarnings("ignore", "spillover: .*compiled", RuntimeWarning)
        for _ in range(STEPS):
            opt.zero_grad(set_to_none=True)
            ctx = contexts()
            if ctx is None:
                loss = fn(idx, tgt)
            else:
                with ctx:
                    loss = fn(idx, tgt)
            loss.backward()
            out.append(grads(model))
            opt.step()
    hooks = [str(w.message) for w in caught if "global hooks" in str(w.message)]
    return out, counters["stats"]["unique_graphs"], sum(counters["recompiles"].values()), hooks


def gpt(policy):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    return spillover.wrap(model, policy=policy) if policy else model


def cases():
    for how in ("module", "method", "blocks"):
        for fullgraph in (True, False):
            yield pytest.param(how, fullgraph, id=f"{how}-{'fullgraph' if fullgraph else 'breaks'}")


@pytest.mark.parametrize("tier", ["host", "nvme"])
@pytest.mark.parametrize("how,fullgraph", list(cases()))
def test_twelve_compiled_steps_one_graph_no_recompile(tmp_path, tier, how, fullgraph):
    policy = "selective" if how == "blocks" else None
    ref, ref_graphs, ref_re, _ = run(gpt(policy), how, fullgraph, lambda: None)
    kw = {"nvme_path": str(tmp_path)} if tier == "nvme" else {}
    ctx = spillover.offload_context(tier, host_pool_bytes="64MiB", min_offload_bytes=0, **kw)
    got, graphs, recompiles, hooks = run(gpt(policy), how, fullgraph, lambda: ctx)
    assert (graphs, recompiles) == (ref_graphs, ref_re) == (graphs, 0), (graphs, recompiles)
    assert not hooks, hooks[0]
    for step, (a, b) in enumerate(zip(got, ref)):
        assert_bitwise(a, b), step
    s = ctx.stats(total=True)
    assert s.steps == STEPS and s.bytes_offloaded_host + s.bytes_offloaded_nvme > 0, s


def test_a_new_context_each_step_compiles_once(tmp_path):
    """The README's loop makes its context inside the loop: each step's context is a new one."""
    ref, ref_graphs, _, _ = run(gpt(None), "module", True, lambda: None)
    made = []

    def fresh():
        made.append(spillover.offload_context("host", host_pool_bytes="16MiB",
                                              min_offload_bytes=0))
        return made[-1]

    got, graphs, recompiles, hooks = run(gpt(None), "module", True, fresh)
    assert (graphs, recompiles) == (ref_graphs, 0) and not hooks
    for a, b in zip(got, ref):
        assert_bitwise(a, b)
    assert all(c.stats().bytes_offloaded_host > 0 for c in made)


def test_steps_with_and_without_the_context_share_the_graph(tmp_path):
    """Entering and leaving: steps under the context, then without, then under a second one."""
    ctxs = [spillover.offload_context("host", host_pool_bytes="16MiB", min_offload_bytes=0)
            for _ in range(2)]
    order = iter([ctxs[0]] * 4 + [None] * 4 + [ctxs[1]] * 4)
    ref, ref_graphs, _, _ = run(gpt(None), "module", True, lambda: None)
    got, graphs, recompiles, _ = run(gpt(None), "module", True, lambda: next(order))
    assert (graphs, recompiles) == (ref_graphs, 0)
    for a, b in zip(got, ref):
        assert_bitwise(a, b)


@pytest.fixture
def deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def test_inductor_twelve_steps(tmp_path, deterministic):
    """Inductor's kernels: the same count of graphs and no recompile; gradients bitwise equal
    to inductor's run without the context. Deterministic algorithms: inductor's CPU kernel for
    the embedding's backward adds with atomics otherwise, and two runs without any context
    differ in the last bits at some steps (measured: steps 5 and 6 of 12)."""
    ref, ref_graphs, _, _ = run(gpt(None), "module", False, lambda: None, backend="inductor")
    ctx = spillover.offload_context("nvme", host_pool_bytes="16MiB", min_offload_bytes=0,
                                    nvme_path=str(tmp_path))
    got, graphs, recompiles, hooks = run(gpt(None), "module", False, lambda: ctx,
                                         backend="inductor")
    assert (graphs, recompiles) == (ref_graphs, 0) and not hooks
    for a, b in zip(got, ref):
        assert_bitwise(a, b)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copied_wrapped_model_compiles_block_by_block(how):
    """A wrapped model copied or loaded compiles its blocks under its own policy: the policy's
    context_fn is made with each policy, not read from the original (Note [context_fn under
    Dynamo] in recompute/policies.py), and the copy's steps equal the original's."""
    ref, ref_graphs, _, _ = run(gpt("selective"), "blocks", True, lambda: None)
    model = gpt("selective")
    if how == "deepcopy":
        twin = copy.deepcopy(model)
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    policy = twin._spillover_state.policy
    assert policy is not model._spillover_state.policy
    assert policy.torch_contexts.__closure__[0].cell_contents is policy
    got, graphs, recompiles, _ = run(twin, "blocks", True, lambda: None)
    assert (graphs, recompiles) == (ref_graphs, 0)
    for a, b in zip(got, ref):
        assert_bitwise(a, b)
