"""The planner's search on synthetic steps (no torch run): which outputs a budget keeps,
recomputes or offloads, where near ties go, and the peak it plans. Shared by
test_planner.py and test_planner_budget.py: the synthetic blocks (``_step``) and the machines."""

import pytest

from spillover.planner import Machine, OpRecord, RegionRecord, explain_records, make_plan

MiB = 1 << 20
# CPU-like and GPU-like rates: 100 GFLOP/s matmul, 5 GB/s elementwise, 10 GB/s link, 2 GB/s NVMe.
CPU = Machine({"float32": 1e11}, 5e9, 1e10, 1e10, 2e9, 2e9)
GPU = Machine({"float32": 5e12}, 5e11, 2e10, 2e10, 5e9, 5e9)


def _op(i, name, mib, flops_per_byte=0.25, needed=False, after_stop=False, forced=None):
    nbytes = int(mib * MiB)
    return OpRecord(
        index=i, name=name, shape=(int(mib * MiB) // 4,), dtype="float32", bytes=nbytes,
        flops=int(flops_per_byte * nbytes), moved_bytes=2 * nbytes,
        compute_bound=flops_per_byte > 1, forced=forced, needed=needed, after_stop=after_stop,
    )


def _block(ri, device="cpu", offload=None):
    """A transformer-ish block: a big cheap attention-score chain, matmuls, elementwise ops."""
    ops = [
        _op(0, "layer_norm", 8, needed=True),
        _op(1, "qkv", 24, flops_per_byte=256),
        _op(2, "view", 0, forced="view"),
        _op(3, "scores", 128, flops_per_byte=32),
        _op(4, "softmax", 128, needed=True),
        _op(5, "attn_v", 8, flops_per_byte=512, needed=True),
        _op(6, "up", 32, flops_per_byte=256, needed=True),
        _op(7, "gelu", 32, needed=True),
        _op(8, "down", 8, flops_per_byte=1024, after_stop=True),
    ]
    needed = sum(o.bytes for o in ops if o.needed)
    return RegionRecord(key=ri, name=f"blocks.{ri}", signature=ri, device=device,
                        mode="checkpoint", input_bytes=8 * MiB, ops=ops, needed_bytes=needed,
                        stop=8, offload=offload)


def _step(n=4, device="cpu", offload=None):
    return [_block(i, device, offload) for i in range(n)]


def _actions(rec):
    return {o.name: o.action for o in rec.ops}


def test_everything_fits_keeps_everything():
    recs = _step()
    plan = make_plan(recs, CPU, budget=10 << 30, outside_bytes=16 * MiB)
    assert plan.fits and plan.recompute_seconds == 0
    assert all(r.mode == "plain-keep" for r in plan.regions)
    assert plan.planned_bytes == plan.plain_bytes == 16 * MiB + 4 * (8 + 208) * MiB
    plan = make_plan(_step(), CPU, budget=None)
    assert all(r.mode == "plain-keep" for r in plan.regions)


def test_frees_the_cheapest_bytes_first_and_keeps_the_last_region():
    recs = _step()
    full = 16 * MiB + 4 * 8 * MiB
    budget = full + 4 * 72 * MiB  # room for about the matmul outputs of every block
    plan = make_plan(recs, CPU, budget=budget, outside_bytes=16 * MiB)
    assert plan.fits and plan.planned_bytes <= budget
    first = _actions(recs[0])
    # Memory-bound and score outputs are recomputed; the dear matmul outputs are kept.
    assert first["scores"] == first["softmax"] == first["gelu"] == "recompute"
    assert first["attn_v"] == "keep"
    assert first["down"] == "recompute" and recs[0].ops[-1].after_stop
    assert all(r.mode == "checkpoint" for r in recs[:-1])
    # Cost grows with what is recomputed: a tighter budget costs more.
    tight = make_plan(_step(), CPU, budget=full + 4 * 16 * MiB, outside_bytes=16 * MiB)
    assert tight.recompute_seconds > plan.recompute_seconds
    assert tight.planned_bytes <= full + 4 * 16 * MiB


def test_slack_goes_to_the_last_regions_first():
    # on a device (on a CPU host a near tie goes to the lower peak: the test after this one)
    recs = _step(device="cuda:0")
    plain_one = 8 * MiB + recs[0].needed_bytes
    # Room for three blocks' inputs and matmul outputs, and one block run plainly.
    budget = 16 * MiB + 3 * (8 + 64) * MiB + plain_one
    plan = make_plan(recs, CPU, budget=budget, outside_bytes=16 * MiB)
    assert [r.mode for r in recs] == ["checkpoint"] * 3 + ["plain-keep"]
    assert plan.planned_bytes <= budget
    assert [_actions(r)["qkv"] for r in recs[:3]] == ["keep"] * 3


def test_a_near_tie_goes_to_the_lower_peak_on_a_cpu_host():
    """Note [near ties go to memory]: the same budget on a CPU host; running the last block
    plainly saves under TIME_SLACK of the step's modeled compute, so the plan that holds less
    wins; a saving over it still buys memory."""
    from spillover.planner.search import TIME_SLACK

    plain_one = 8 * MiB + _step()[0].needed_bytes
    budget = 16 * MiB + 3 * (8 + 64) * MiB + plain_one
    gpu = make_plan(_step(device="cuda:0"), CPU, budget=budget, outside_bytes=16 * MiB)
    recs = _step()
    cpu = make_plan(recs, CPU, budget=budget, outside_bytes=16 * MiB)
    step_s = 3 * sum(CPU.op_seconds(o) for r in recs for o in r.ops)
    gap = (cpu.recompute_seconds + cpu.transfer_seconds) - (gpu.recompute_seconds
                                                             + gpu.transfer_seconds)
    assert 0 < gap <= TIME_SLACK * step_s
    assert cpu.planned_bytes < gpu.planned_bytes and cpu.fits
    assert "plain-keep" not in [r.mode for r in recs]
    # a budget with no room to keep anything more: the same plan either way
    tight = make_plan(_step(), CPU, budget=16 * MiB + 4 * 8 * MiB + 1, outside_bytes=16 * MiB)
    assert tight.fits and tight.recompute_seconds > 0


def test_plain_tails_of_plain_offload_are_not_near_ties():
    """Note [plain tails are not near ties]: on a CPU host under an NVMe context, running the
    last blocks plainly beside plain-offload saves under TIME_SLACK of the step (a near tie
    the lower peak would win) but is the same step with fewer copies: the fastest that fits
    wins, and a budget with room for no tail keeps plain-offload."""
    from spillover.planner.search import TIME_SLACK

    nvme = {"tier": "nvme", "pool_bytes": 32 * MiB, "nvme": True}

    def plan(budget, kinds=None):
        recs = _step(6, offload=nvme)
        kw = {"kinds": kinds} if kinds else {}
        return make_plan(recs, CPU, budget=budget, outside_bytes=16 * MiB, peak_offset=0, **kw)

    lowest = plan(300 * MiB)
    assert lowest.variant == "plain-offload" and lowest.fits
    one = plan(500 * MiB)
    assert one.variant == "plain-offload, last 1 plain" and one.fits
    assert lowest.model_peak < one.model_peak <= 500 * MiB
    step_s = 3 * sum(CPU.op_seconds(o) for r in _step(6, offload=nvme) for o in r.ops)
    gap = (lowest.recompute_seconds + lowest.transfer_seconds) - (one.recompute_seconds
                                                                  + one.transfer_seconds)
    assert 0 < gap <= TIME_SLACK * step_s  # a near tie by the rule it is an exception to
    two = plan(700 * MiB)
    assert two.variant == "plain-offload, last 2 plain" and two.model_peak <= 700 * MiB
    # the checkpoint variants keep the near-tie rule: given only those, the lower peak still
    # wins on this host (test_a_near_tie_goes_to_the_lower_peak_on_a_cpu_host)
    assert not plan(700 * MiB, ("checkpoint", "checkpoint+offload")).variant.startswith(
        "plain-offload")


def test_budget_below_the_minimum_is_reported():
    recs = _step()
    plan = make_plan(recs, CPU, budget=1 * MiB, outside_bytes=16 * MiB)
    assert not plan.fits and "below the least" in plan.note
    assert plan.planned_bytes == plan.full_bytes
    assert all(o.action == "recompute" for r in recs for o in r.ops)


def test_gpu_offloads_what_the_link_hides():
    offload = {"tier": "host", "pool_bytes": 64 << 30, "nvme": False}
    recs = _step(8, device="cuda:0", offload=offload)
    plan = make_plan(recs, GPU, budget=256 * MiB, outside_bytes=16 * MiB)
    assert plan.fits
    acts = [_actions(r) for r in recs]
    # The dearest-to-recompute outputs of the early blocks move to host memory for free ...
    assert acts[0]["attn_v"] == "offload" and acts[0]["up"] == "offload"
    assert all(o.tier == "host" for o in recs[0].ops if o.action == "offload")
    # ... the last block's are never counted as hidden (backward needs them first).
    last_offloaded = [o for o in recs[-1].ops if o.action == "offload"]
    assert all("cheaper to move" in o.reason for o in last_offloaded)
    assert plan.transfer_seconds >= 0


def test_nvme_only_beyond_the_host_pool():
    offload = {"tier": "nvme", "pool_bytes": 256 * MiB, "nvme": True}
    recs = _step(8, device="cuda:0", offload=offload)
    make_plan(recs, GPU, budget=200 * MiB, outside_bytes=16 * MiB)
    tiers = [(ri, o.tier) for ri, r in enumerate(recs) for o in r.ops if o.action == "offload"]
    assert {"host", "nvme"} <= {t for _, t in tiers}
    # Packed last = stays in the pool; earlier ones go to disk.
    first_host = min(ri for ri, t in tiers if t == "host")
    assert all(t == "host" for ri, t in tiers if ri > first_host)
    assert all(t == "nvme" for ri, t in tiers if ri < first_host)


def test_cpu_host_tier_frees_nothing_but_nvme_does():
    host = {"tier": "host", "pool_bytes": 1 << 30, "nvme": False}
    recs = _step(device="cpu", offload=host)
    make_plan(recs, CPU, budget=200 * MiB, outside_bytes=16 * MiB)
    assert not any(o.action == "offload" for r in recs for o in r.ops)
    nvme = {"tier": "nvme", "pool_bytes": 64 * MiB, "nvme": True}
    recs = _step(device="cpu", offload=nvme)
    plan = make_plan(recs, CPU, budget=200 * MiB, outside_bytes=16 * MiB)
    moved = [o for r in recs for o in r.ops if o.action == "offload"]
    # the 128 MiB scores go in pieces (Note [gathered storages] in rust/tier/gather.rs)
    assert moved and any(o.bytes > 64 * MiB for o in moved)
    for r in recs:  # a recomputed region's whole-block offloads fit in the pool together
        if r.mode != "checkpoint":
            continue  # a region run plainly reloads what it saved one tensor at a time
        whole = [o.bytes for o in r.ops if o.action == "offload" and o.bytes <= 32 * MiB]
        assert r.input_bytes + sum(whole) <= 32 * MiB
    assert plan.planned_bytes >= 64 * MiB  # the pool is this host's memory: it counts


def _chain(ri, offload=None, saves_seen=True):
    """A region whose softmax output, when saved, spares the scaling and masking before it."""
    ops = [
        _op(0, "scale", 128),
        _op(1, "mask", 128),
        _op(2, "softmax", 128, needed=True),
        _op(3, "attn_v", 8, flops_per_byte=512, needed=True),
        _op(4, "out", 8, flops_per_byte=1024, after_stop=True),
    ]
    for o, readers in zip(ops, [(1,), (2,), (3,), (4,), ()]):
        o.readers = readers
    return RegionRecord(key=ri, name=f"b{ri}", signature=ri, device="cpu", mode="checkpoint",
                        input_bytes=8 * MiB, ops=ops, needed_bytes=136 * MiB, stop=4,
                        offload=offload, saves_seen=saves_seen)


def test_offloads_a_chain_end_when_that_spares_the_ops_before_it():
    # Note [outputs only saved ops read]: saving the softmax output spares rerunning the
    # scaling and masking before it; rerunning all three costs more than moving 128 MiB.
    nvme = {"tier": "nvme", "pool_bytes": 64 * MiB, "nvme": True}
    recs = [_chain(i, offload=nvme) for i in range(4)]
    plan = make_plan(recs, CPU, budget=100 * MiB, outside_bytes=0,
                     kinds=("checkpoint", "checkpoint+offload"))
    # The last region's transfers cannot hide behind compute, so the greedy pass recomputes its
    # chain; then offloading the softmax output pays for itself (161 ms of ops spared).
    last = _actions(recs[-1])
    assert last["softmax"] == "offload" and last["scale"] == last["mask"] == "recompute"
    why = next(o.reason for o in recs[-1].ops if o.name == "softmax")
    assert "spares rerunning 2 ops" in why, why
    assert plan.fits and plan.recompute_seconds == 0  # the skipped ops cost nothing
    # explain says what the runtime will do with them: not rerun, at no recompute cost.
    rows = {(r["op"], r["decision"]): r for r in explain_records(recs, "auto", CPU, plan).rows}
    assert ("scale", "recompute") not in rows and ("mask", "recompute") not in rows
    assert rows[("scale", "not rerun")]["why"] == "only saved outputs read it: never rerun"
    assert rows[("scale", "not rerun")]["recompute_s"] is None


def test_without_autograds_saves_seen_nothing_is_planned_as_skipped():
    """RegionRecord.saves_seen (torch < 2.8 cannot show a region what autograd saves): the
    runtime then reruns every op it does not keep, so the plan must not count the ops a kept
    chain end would spare; the same region with its saves seen counts them (the test above)."""
    from spillover.planner.variants import Greedy

    recompute = {}
    for seen in (True, False):
        recs = [_chain(i, saves_seen=seen) for i in range(2)]
        g = Greedy(recs, CPU, 0, 0, None, True, False)
        for ri in range(2):  # the softmax and attn_v kept, the rest recomputed
            g.ops[(ri, 2)] = g.ops[(ri, 3)] = ("keep", "", "")
            g.ops[(ri, 0)] = g.ops[(ri, 1)] = ("recompute", "", "")
        g._total_recompute()
        recompute[seen] = g.recompute
    assert recompute[True] == 0  # the scale and mask only feed the kept softmax: skipped
    # the runtime reruns them all the same
    spared = 2 * sum(CPU.rerun_seconds(_op(i, "x", 128)) for i in range(2))
    assert recompute[False] == pytest.approx(spared)


def test_peak_budget_counts_the_region_rebuilt_in_backward():
    # One block saves 208 MiB for backward: a checkpointed region brings all of it back at once,
    # and on the way rebuilds its 128 MiB of scores that autograd does not keep (Note
    # [recompute transients]).
    budget = 528 * MiB
    recs = _step()
    held_plan = make_plan(recs, CPU, budget=budget, outside_bytes=16 * MiB)
    recs = _step()
    peak_plan = make_plan(recs, CPU, budget=budget, outside_bytes=16 * MiB, peak_offset=0)
    # The same budget as a peak costs more recomputation than as bytes held after forward.
    assert peak_plan.fits and peak_plan.model_peak <= budget
    assert peak_plan.recompute_seconds > held_plan.recompute_seconds
    assert peak_plan.model_peak >= (208 + 128 + 16) * MiB
    # A measured offset (what the model misses: gradients, copies in flight) tightens it more.
    recs = _step()
    tighter = make_plan(recs, CPU, budget=budget, outside_bytes=16 * MiB,
                        peak_offset=64 * MiB)
    assert tighter.fits and tighter.model_peak + 64 * MiB <= budget
    assert tighter.recompute_seconds > peak_plan.recompute_seconds


def test_plain_offload_regions_reload_one_by_one():
    host = {"tier": "host", "pool_bytes": 4 << 30, "nvme": False}
    budget = 300 * MiB
    recs = _step(device="cuda:0", offload=host)
    plan = make_plan(recs, GPU, budget=budget, outside_bytes=16 * MiB, peak_offset=0,
                     kinds=("plain-offload",))
    assert plan.fits and plan.model_peak <= budget and plan.variant.startswith("plain-offload")
    # On a GPU what the context takes leaves the device; run plainly, a region reloads its
    # tensors one by one (its model: the largest twice) and recomputes nothing.
    assert plan.recompute_seconds == 0
    text = str(explain_records(recs, "auto", GPU, plan))
    assert "offload-host" in text and "runs plainly" in text
    # Given every variant, the planner takes one at least as cheap as each alone.
    costs = []
    for kinds in (("checkpoint",), ("checkpoint+offload",), ("plain-offload",), None):
        recs = _step(device="cuda:0", offload=host)
        kw = {"kinds": kinds} if kinds else {}
        p = make_plan(recs, GPU, budget=budget, outside_bytes=16 * MiB, peak_offset=0, **kw)
        costs.append(p.recompute_seconds + p.transfer_seconds if p.fits else float("inf"))
    assert costs[-1] <= min(costs[:-1])


def test_a_tensor_whose_host_cost_exceeds_its_saving_is_not_offloaded():
    """Note [host cost in the plan]: the same GPU step, priced once with free host time and
    once with 5 ms per offloaded tensor (a host far slower than the device, every op's rerun
    cheaper than that): the plan offloads nothing it can recompute instead, and still fits."""
    import dataclasses

    offload = {"tier": "host", "pool_bytes": 64 << 30, "nvme": False}
    free = _step(8, device="cuda:0", offload=offload)
    make_plan(free, GPU, budget=256 * MiB, outside_bytes=16 * MiB)
    dear_machine = dataclasses.replace(GPU, host_seconds_per_offload=5e-3)
    dear = _step(8, device="cuda:0", offload=offload)
    plan = make_plan(dear, dear_machine, budget=256 * MiB, outside_bytes=16 * MiB)
    assert plan.fits
    assert sum(o.action == "offload" for r in free for o in r.ops) > 0
    assert sum(o.action == "offload" for r in dear for o in r.ops) == 0


def test_a_rerun_op_pays_its_dispatch():
    """Note [host cost in the plan]: a recomputed op costs its device time and the replay's
    host dispatch."""
    import dataclasses

    op = _op(0, "gelu", 1)
    slow_host = dataclasses.replace(GPU, host_seconds_per_op=40e-6)
    assert slow_host.rerun_seconds(op) == GPU.op_seconds(op) + 40e-6


def test_two_clocks_in_the_plan():
    """Note [two clocks in the plan]: with the forward's dispatch per op set, a recomputed op
    costs the longer of its kernel and its replay's dispatch, a checkpointed region pays its
    hooks' dispatch where the device does not hide it, and a host-bound forward hides copies
    for as long as it runs; without it (0) nothing changes."""
    import dataclasses

    from spillover.planner.variants import Greedy

    op = _op(0, "gelu", 1)
    two = dataclasses.replace(GPU, host_seconds_per_op=12e-6, host_seconds_per_forward_op=30e-6)
    assert two.rerun_seconds(op) == max(GPU.op_seconds(op), 30e-6 + 12e-6)
    one = dataclasses.replace(GPU, host_seconds_per_op=12e-6)
    assert one.rerun_seconds(op) == GPU.op_seconds(op) + 12e-6
    assert one.wrapped_seconds(_block(0).ops) == 0.0
    ops = _block(0).ops
    dev = sum(GPU.op_seconds(o) for o in ops)
    assert two.forward_seconds(ops) == max(dev, 30e-6 * len(ops))
    assert two.wrapped_seconds(ops) == max(dev, (30e-6 + 12e-6) * len(ops)) - max(
        dev, 30e-6 * len(ops))
    # a region run checkpointed costs its hooks even when it keeps everything (a host-bound
    # forward: 3 ms per op, 1 ms more wrapped, against the block's 0.7 ms of kernels)
    slow = dataclasses.replace(GPU, host_seconds_per_op=1e-3, host_seconds_per_forward_op=3e-3)
    hooks = slow.wrapped_seconds(ops)
    assert abs(hooks - 1e-3 * len(ops)) < 1e-12
    recs = _step(2, device="cuda:0")
    g = Greedy(recs, slow, 1 << 40, 0, None, False, False).run()
    assert not any(a == "recompute" and not recs[ri].ops[i].forced
                   and not recs[ri].ops[i].after_stop and recs[ri].ops[i].bytes
                   for (ri, i), (a, _, _) in g.ops.items())
    assert g.recompute >= 2 * hooks


def test_a_host_bound_replay_costs_its_dispatch_whatever_it_keeps():
    """Note [a replay's host time is the region's] (planner/machine.py): with two clocks a
    region's replay dispatches every op before its stop, kept or rerun. Where that dispatch is
    longer than the rerun kernels, keeping ops saves nothing; where the kernels are longer,
    keeping one saves its kernel. With one clock each rerun op costs its kernel and dispatch,
    as before."""
    import dataclasses

    from spillover.planner.variants import Greedy

    ops = _block(0).ops
    before_stop = sum(1 for o in ops if not o.after_stop)
    rerun = [o for o in ops if not o.after_stop and not o.forced]
    dev = sum(GPU.op_seconds(o) for o in rerun)
    host_bound = dataclasses.replace(GPU, host_seconds_per_op=12e-3,
                                     host_seconds_per_forward_op=30e-3)
    assert host_bound.replay_seconds(ops, rerun) == pytest.approx(42e-3 * before_stop)
    assert host_bound.replay_seconds(ops, rerun[:1]) == pytest.approx(
        42e-3 * before_stop)  # the rest kept: no gain
    dev_bound = dataclasses.replace(GPU, host_seconds_per_op=12e-9,
                                    host_seconds_per_forward_op=30e-9)
    assert dev_bound.replay_seconds(ops, rerun) == pytest.approx(dev)
    assert dev_bound.replay_seconds(ops, rerun[1:]) == pytest.approx(
        dev - GPU.op_seconds(rerun[0]))
    one = dataclasses.replace(GPU, host_seconds_per_op=12e-6)
    assert one.replay_seconds(ops, rerun) == pytest.approx(
        sum(one.rerun_seconds(o) for o in rerun))
    # A plan that keeps everything it can and one that keeps nothing cost the same host-bound
    # replay: the plan's recompute is the regions' hooks and dispatch, not less.
    recs = _step(2, device="cuda:0")
    keep_all = Greedy(recs, host_bound, 1 << 40, 0, None, False, False).run()
    recs = _step(2, device="cuda:0")
    keep_none = Greedy(recs, host_bound, 0, 0, None, False, False).run()
    assert keep_all.kept > keep_none.kept
    assert keep_all.recompute == pytest.approx(keep_none.recompute)
    assert keep_none.recompute == pytest.approx(
        2 * (host_bound.wrapped_seconds(ops) + 42e-3 * before_stop))


def test_the_tail_stays_on_the_device_when_the_budget_holds_it():
    """Note [the tail stays]: on a GPU under a context, what the model saves after its last
    region (here 64 MiB: a loss's log-probabilities) round-trips over the link with nothing to
    hide behind. With room for it the plan keeps it (and charges the shipped variants that
    round trip); with no room it still goes, and the plan fits as before."""
    host = {"tier": "host", "pool_bytes": 4 << 30, "nvme": False}
    tail = 64 * MiB
    recs = _step(device="cuda:0", offload=host)
    roomy = make_plan(recs, GPU, budget=600 * MiB, outside_bytes=80 * MiB, peak_offset=0,
                      tail_bytes=tail)
    assert roomy.fits and roomy.keep_tail and roomy.variant.endswith("tail kept")
    assert roomy.model_peak <= 600 * MiB
    recs = _step(device="cuda:0", offload=host)
    shipped = make_plan(recs, GPU, budget=600 * MiB, outside_bytes=80 * MiB, peak_offset=0)
    # without the tail's bytes the planner has nothing to weigh: the same plan, nothing kept
    assert not shipped.keep_tail
    # Backward frees the tail before it rebuilds a region, so a tail smaller than the largest
    # region rebuilt costs no peak. A larger one (512 MiB) does: under a budget with room for
    # the least peak but not for the tail on top, it goes, charged its round trip.
    big = 512 * MiB
    recs = _step(device="cuda:0", offload=host)
    least = make_plan(recs, GPU, budget=0, outside_bytes=big + 16 * MiB, peak_offset=0,
                      tail_bytes=big)
    assert not least.keep_tail and least.model_peak < big
    recs = _step(device="cuda:0", offload=host)
    budget = (least.model_peak + big) // 2
    tight = make_plan(recs, GPU, budget=budget, outside_bytes=big + 16 * MiB, peak_offset=0,
                      tail_bytes=big)
    assert tight.fits and not tight.keep_tail and tight.model_peak <= budget
    assert tight.transfer_seconds >= 2 * big / GPU.link_bytes_per_s
    recs = _step(device="cuda:0", offload=host)
    kept = make_plan(recs, GPU, budget=big + least.model_peak, outside_bytes=big + 16 * MiB,
                     peak_offset=0, tail_bytes=big)
    assert kept.fits and kept.keep_tail
    assert kept.transfer_seconds < tight.transfer_seconds
    # a CPU host's context keeps its pool in this memory: nothing to weigh there
    recs = _step(device="cpu", offload=host)
    assert not make_plan(recs, CPU, budget=600 * MiB, outside_bytes=80 * MiB, peak_offset=0,
                         tail_bytes=tail).keep_tail
