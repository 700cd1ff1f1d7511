"""spillover.integrations.hf: a tiny Llama with a LoRA adapter under transformers.Trainer
(gradient checkpointing, gradient accumulation) gives LoRA parameters bitwise equal to HF's own
non-reentrant checkpointing, offloads on every optimizer step through one context; HF's
checkpointing and spillover's regions never both checkpoint a layer; the README's snippets
run."""

import contextlib
import functools
import pathlib
import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import spillover  # noqa: E402
from spillover import planner  # noqa: E402
from spillover.activations.context import OffloadContext  # noqa: E402
from spillover.integrations import StepContext, check_not_double_checkpointed, hf  # noqa: E402
from spillover.planner import Machine  # noqa: E402

# Fixed rates, so no test calibrates the machine ("selective" prices ops with them).
MACHINE = Machine({"float32": 1e11}, 5e9, 6e9, 6e9, 3e9, 2e9)
MIN_OFFLOAD = 4096  # the tiny model's activations are 8-32 KiB
POOL = "64MiB"  # small: the default pool (RAM/4) takes seconds to map and pre-fault
OPTS = {"tier": "host", "min_offload_bytes": MIN_OFFLOAD, "host_pool_bytes": POOL}
README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(autouse=True)
def _fixed_machine(monkeypatch):
    monkeypatch.setitem(planner._machines, "cpu", MACHINE)


def tiny_llama(lora=True, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        attention_dropout=0.0,
    )
    model = transformers.LlamaForCausalLM(cfg)
    if not lora:
        return model
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                          target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
    return peft.get_peft_model(model, cfg)


def dataset(n=12, seq=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (n, seq), generator=g)
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def training_args(out, **kw):
    return transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=3, learning_rate=1e-2, use_cpu=True, report_to=[], save_strategy="no",
        logging_strategy="no", seed=0, data_seed=0, dataloader_num_workers=0,
        disable_tqdm=True, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, **kw,
    )


def trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def train(out, callbacks=(), setup=None):
    model = tiny_llama()
    if setup is not None:
        setup(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing's new name
        trainer = transformers.Trainer(model=model, args=training_args(out),
                                       train_dataset=dataset(), callbacks=list(callbacks))
        trainer.train()
    return model, trainable(model)


def assert_bitwise(a, b):
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: max |d| = {(a[k] - b[k]).abs().max()}"


# ---- Trainer + PEFT ---------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_trainer_lora_bitwise_and_offloads_every_step(tmp_path, monkeypatch, policy):
    _, ref = train(tmp_path / "ref")

    entered = []
    enter = OffloadContext.__enter__
    monkeypatch.setattr(OffloadContext, "__enter__",
                        lambda self: (entered.append(self), enter(self))[1])
    ctx = spillover.offload_context(**OPTS)
    cb = hf.SpilloverCallback(ctx)
    model, got = train(tmp_path / "spill", [cb], lambda m: hf.enable(m, policy=policy,
                                                                 chunked_loss=False))

    assert_bitwise(got, ref)
    init = trainable(tiny_llama())
    assert any(not torch.equal(got[k], init[k]) for k in got), "training changed nothing"
    assert len(cb.step_stats) == 3  # one per optimizer step, 2 micro-batches each
    for s in cb.step_stats:
        assert s.bytes_offloaded > 0, s
        assert s.tensors_unpacked > 0, s  # backward ran inside the step
    assert cb.context is ctx and entered == [ctx] * 3 and ctx.steps == 3
    # every layer ran as a spillover region; HF's switch still holds spillover's function
    state = model.__dict__["_spillover_state"]
    assert {r.name for r in state.last_records()} == {"model.layers.0", "model.layers.1"}
    assert hf.is_enabled(model)
    for m in model.modules():
        if getattr(m, "gradient_checkpointing", False):
            assert getattr(m._gradient_checkpointing_func, "is_spillover", False)


def test_callback_without_enable_offloads_hf_checkpointing(tmp_path):
    """The callback alone: HF's own checkpointing, its region inputs and outside tensors go to
    the context."""
    _, ref = train(tmp_path / "ref")
    cb = hf.SpilloverCallback(**OPTS)
    _, got = train(tmp_path / "spill", [cb])
    assert_bitwise(got, ref)
    assert len(cb.step_stats) == 3 and all(s.bytes_offloaded > 0 for s in cb.step_stats)


def test_enable_requires_no_input_grads_with_frozen_embeddings():
    """LoRA freezes the embeddings: HF's reentrant checkpoint would need
    enable_input_require_grads; spillover's non-reentrant regions train either way."""
    model = tiny_llama()
    hf.enable(model, policy="full")
    model.base_model.model.disable_input_require_grads()
    ids = dataset(n=2)[0]["input_ids"][None]
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


def test_enable_then_disable_restores_hf_checkpointing():
    model = tiny_llama(lora=False)
    hf.enable(model, policy="full")
    assert hf.is_enabled(model)
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    hf.disable(model)
    assert not hf.is_enabled(model)
    funcs = {type(m._gradient_checkpointing_func) for m in model.modules()
             if getattr(m, "gradient_checkpointing", False)}
    assert funcs == {functools.partial}
    hf.enable(model, policy="selective")  # again, then a second time: replaces the policy
    hf.enable(model, policy="full")
    assert hf.is_enabled(model)


def test_use_cache_follows_hf():
    """HF's own rule: a checkpointed layer in training runs without the KV cache; generation
    (eval, no grad) keeps it."""
    model = tiny_llama(lora=False)
    hf.enable(model, policy="full")
    ids = dataset(n=2)[0]["input_ids"][None, :8]
    model.train()
    model(input_ids=ids, labels=ids, use_cache=True).loss.backward()
    state = model.__dict__["_spillover_state"]
    assert len(state.last_records()) == 2  # both layers ran as regions
    model.eval()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 11)


def test_enable_needs_a_transformers_model():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        hf.enable(torch.nn.Sequential(torch.nn.Linear(2, 2)))


# ---- never two checkpoints around one layer ---------------------------------------------------


@contextlib.contextmanager
def checkpoint_nesting(monkeypatch):
    """Counts the deepest nesting of torch checkpoint calls (spillover's regions and HF's own
    function) while the block runs; patched before HF binds its function."""
    depth, peak = [0], [0]

    def counted(orig):
        def call(*a, **k):
            depth[0] += 1
            peak[0] = max(peak[0], depth[0])
            try:
                return orig(*a, **k)
            finally:
                depth[0] -= 1

        return call

    import torch.utils.checkpoint as tc
    import transformers.modeling_utils as mu

    monkeypatch.setattr(tc, "checkpoint", counted(tc.checkpoint))
    monkeypatch.setattr(mu, "checkpoint", counted(mu.checkpoint))
    yield peak


def _hf_gc_on(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _step(model):
    ids = dataset(n=2)[0]["input_ids"][None]
    model.train()
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_enable_takes_over_hf_checkpointing(monkeypatch):
    ref_model = tiny_llama(lora=False)
    _hf_gc_on(ref_model)
    ref = _step(ref_model)
    with checkpoint_nesting(monkeypatch) as peak:
        model = tiny_llama(lora=False)
        _hf_gc_on(model)
        hf.enable(model, policy="selective", chunked_loss=False)  # HF's loss: bitwise
        _hf_gc_on(model)  # HF's switch again (as Trainer(gradient_checkpointing=True) does)
        got = _step(model)
    assert peak[0] == 1
    assert_bitwise(got, ref)
    check_not_double_checkpointed(model)  # spillover's own function: fine


def test_wrap_on_hf_checkpointed_model_never_nests(monkeypatch):
    """HF checkpointing on, then spillover.wrap: the check says so, and wrap() refuses.

    Without the check in wrap() both checkpoint a layer: the subclass wrap() makes of a
    ``GradientCheckpointingLayer`` gets HF's checkpointing forward again (``__init_subclass__``),
    outside spillover's region."""
    with checkpoint_nesting(monkeypatch) as peak:
        model = tiny_llama(lora=False)
        _hf_gc_on(model)
        with pytest.raises(ValueError, match="gradient_checkpointing_disable"):
            check_not_double_checkpointed(model)
        with pytest.raises(ValueError, match="second time"):
            spillover.wrap(model, policy=spillover.SelectivePolicy(machine=MACHINE))
        assert "_spillover_state" not in model.__dict__
        model.gradient_checkpointing_disable()  # as the error says: then wrap() alone
        spillover.wrap(model, policy=spillover.SelectivePolicy(machine=MACHINE))
        _step(model)
    assert peak[0] == 1


def test_callback_refuses_wrapped_blocks_under_hf_checkpointing(tmp_path):
    """wrap() first, then Trainer(gradient_checkpointing=True) turns HF's on over the wrapped
    blocks: the callback stops the run before a step checkpoints a layer twice."""
    cb = hf.SpilloverCallback(**OPTS)
    with pytest.raises(ValueError, match="twice"):
        train(tmp_path, [cb], lambda m: spillover.wrap(m, policy="full"))
    assert not cb.steps.active


def test_wrap_and_enable_refuse_each_other():
    model = tiny_llama()
    spillover.wrap(model, policy="full")
    with pytest.raises(ValueError, match="unwrap"):
        hf.enable(model)
    spillover.unwrap(model)
    hf.enable(model, policy="full")
    with pytest.raises(ValueError, match="already wrapped"):
        spillover.wrap(model)
    with pytest.raises(ValueError, match="already wrapped"):
        spillover.wrap(model.base_model.model)
    assert spillover.explain(model) is not None  # explain reads enable()'s state


def test_unwrap_turns_spillover_off_hf_checkpointing_stays(monkeypatch):
    model = tiny_llama(lora=False)
    hf.enable(model, policy="full")
    spillover.unwrap(model)
    assert not hf.is_enabled(model)
    ref_model = tiny_llama(lora=False)
    _hf_gc_on(ref_model)
    assert_bitwise(_step(model), _step(ref_model))


# ---- StepContext in a hand-written loop -------------------------------------------------------


def test_step_context_backward_outside():
    model = tiny_llama(lora=False)
    hf.enable(model, policy="full")
    steps = StepContext(**OPTS)
    ids = dataset(n=2)[0]["input_ids"][None]
    model.train()
    for _ in range(2):
        steps.begin()
        loss = model(input_ids=ids, labels=ids).loss
        steps.end()
        loss.backward()
    assert steps.steps == 2 and all(s.bytes_offloaded > 0 for s in steps.step_stats)


# ---- the README's snippets --------------------------------------------------------------------


def readme_snippet(title):
    """The python block under ``### {title}`` in the README's "With your training stack"."""
    text = README.read_text()
    section = text.split("## With your training stack", 1)[1].split("\n## ", 1)[0]
    part = section.split(f"### {title}", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", part, flags=re.S)
    assert len(blocks) == 1, f"README: one python block under ### {title}"
    return blocks[0]


def run_snippet(title, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPILLOVER_HOST_POOL_BYTES", POOL)
    ns = {"__name__": "__readme__"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        exec(compile(readme_snippet(title), f"README.md ({title})", "exec"), ns)
    return ns


def test_readme_hf_trainer_peft(tmp_path, monkeypatch):
    ns = run_snippet("HF Trainer + PEFT", tmp_path, monkeypatch)
    assert len(ns["callback"].step_stats) == 3
    assert hf.is_enabled(ns["model"])


def test_readme_plain_loop(tmp_path, monkeypatch):
    ns = run_snippet("Plain loop", tmp_path, monkeypatch)
    assert ns["ctx"].stats().tensors_packed > 0
