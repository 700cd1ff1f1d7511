"""What one step recorded, per region and per op (bytes, FLOPs, what autograd saved), and the
signatures a plan's regions are matched by."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

try:  # torch >= 2.1
    from torch.utils.flop_counter import flop_registry as _FLOP_REGISTRY
except ImportError:  # pragma: no cover
    _FLOP_REGISTRY = {}



def output_tensors(out: Any) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (what keeping them pins; storages
    named as in Note [storage names], recompute/ops.py)."""
    seen = set()
    total = 0
    for t in tensors:
        if t.device.type == "meta":
            continue
        try:
            st = t.untyped_storage()
            key = (t.device, st._cdata)
        except (RuntimeError, NotImplementedError):  # fake (compile) or storage-less subclasses
            total += t.numel() * t.element_size()
            continue
        if key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


def _tensor_bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(y) for y in x)
    return 0


def _shape_sig(x: Any) -> Any:
    """What a flop formula reads of an argument: tensors by shape and dtype, the rest by value."""
    if isinstance(x, torch.Tensor):
        return (x.shape, x.dtype)
    if isinstance(x, (list, tuple)):
        return tuple(_shape_sig(y) for y in x)
    return x


#: op_flops of formula ops by (op, argument shapes): torch's formulas cost tens of
#: microseconds per call, and a region's forward asks once per op per step.
_FLOPS_MEMO: Dict[Any, int] = {}
_FLOPS_MEMO_MAX = 4096


def op_flops(func: Any, args: Sequence[Any], kwargs: Dict[str, Any], out: Any) -> int:
    """Recompute FLOPs of one op: torch's flop formulas for matmuls, convolutions and fused
    attention; one per output element for everything else (memory-bound ops)."""
    formula = _FLOP_REGISTRY.get(getattr(func, "overloadpacket", None))
    if formula is not None:
        try:
            key: Any = (func, _shape_sig(tuple(args)), _shape_sig(tuple(sorted(kwargs.items()))),
                        _shape_sig(out))
            hit = _FLOPS_MEMO.get(key)
        except TypeError:  # an unhashable argument: no memo
            key, hit = None, None
        if hit is not None:
            return hit
        try:
            flops = int(formula(*args, **kwargs, out_val=out))
        except Exception:  # an overload the formula does not know
            flops = None
        if flops is not None:
            if key is not None:
                if len(_FLOPS_MEMO) >= _FLOPS_MEMO_MAX:
                    _FLOPS_MEMO.clear()
                _FLOPS_MEMO[key] = flops
            return flops
    return sum(t.numel() for t in output_tensors(out))



def is_compute_bound(func: Any) -> bool:
    return getattr(func, "overloadpacket", None) in _FLOP_REGISTRY



@dataclasses.dataclass
class OpRecord:
    """One op call inside a region, as its forward ran."""

    index: int
    name: str
    shape: Tuple[int, ...]
    dtype: str
    bytes: int  # storage bytes its outputs pin if saved (0 for views)
    flops: int
    moved_bytes: int  # inputs + outputs, for the memory-bound part of its cost
    compute_bound: bool
    #: why the op is never saved ("view", "mutates an input", "random", "allocates only") or
    #: always saved ("effect"); None when the policy or planner decides.
    forced: Optional[str] = None
    needed: bool = False  # autograd saved (a view of) its output
    #: ... and can make it again at unpack from what the op saved (Note [made again at
    #: unpack] in activations/rederive.py): a region run plainly need not hold it
    rederived: bool = False
    #: never rerun: recomputation stops before it, or only saved ops read its output
    after_stop: bool = False
    #: ops of the region that read its output, views seen through (for Note [outputs only
    #: saved ops read] in recompute/modes.py)
    readers: Tuple[int, ...] = ()
    action: str = "recompute"  # keep | offload | recompute
    tier: str = ""  # host | nvme, for offloaded outputs (the planner's estimate)
    reason: str = ""

    @property
    def flops_per_byte(self) -> float:
        return self.flops / self.bytes if self.bytes else 0.0


@dataclasses.dataclass
class RegionRecord:
    """One region invocation of one step."""

    key: Any
    name: str
    signature: Any
    device: str
    mode: str  # checkpoint | plain | plain-keep | plain-offload
    input_bytes: int = 0
    #: the gradients its backward makes for its parameters (Note [gradients as backward goes]
    #: in search.py)
    grad_bytes: int = 0
    ops: List[OpRecord] = dataclasses.field(default_factory=list)
    needed_bytes: int = 0  # op outputs autograd saved: what running it plainly holds
    stop: int = 0  # ops at or after this index are never recomputed
    # autograd's saves were seen (torch 2.8+): only then are unread ops skipped at runtime
    saves_seen: bool = True
    offload: Optional[Dict[str, Any]] = None  # the offload context seen: tier, pool bytes
    #: Note [measured compute]: the forward's wall-clock seconds, where they are its compute's
    #: (a recording run on real CPU tensors); 0 where not measured
    forward_seconds: float = 0.0

    @property
    def rederived_bytes(self) -> int:
        """What of ``needed_bytes`` can be made again at unpack (Note [made again at
        unpack])."""
        return sum(o.bytes for o in self.ops if o.needed and o.rederived)

    @property
    def held_bytes(self) -> int:
        """Bytes this run holds after forward (saved outputs, kept or offloaded, + inputs)."""
        if self.mode != "checkpoint":
            return self.input_bytes + self.needed_bytes
        return self.input_bytes + sum(o.bytes for o in self.ops if o.action == "keep")



def _sim_link(ctx: Any) -> Optional[Tuple[float, float]]:
    """The simulated device's link of ``ctx`` (bytes/s, host seconds per device call), or None
    where its tensors are not on the simulated device (Note [the simulated device is a
    device])."""
    cfg = getattr(ctx, "config", None)
    bw = getattr(cfg, "sim_link_bandwidth", None)
    if not bw:
        return None
    return (float(bw), float(getattr(cfg, "sim_call_cost", 0.0) or 0.0))


def _ctx_signature(ctx: Any) -> Optional[Tuple[Any, ...]]:
    if ctx is None:
        return None
    cap = ctx.pool_limit  # not what is mapped now: a default pool grows (_growth.py)
    return (ctx.tier, cap, ctx.nvme, _sim_link(ctx))


def ctx_offload_info(ctx: Any) -> Optional[Dict[str, Any]]:
    if ctx is None:
        return None
    return {
        "tier": ctx.tier,
        "pool_bytes": ctx.pool_limit,
        "nvme": ctx.nvme,
        "sim": _sim_link(ctx),
        # Note [made again at unpack] in activations/rederive.py
        "rederive": bool(getattr(getattr(ctx, "config", ctx), "rederive", True)),
        # Note [regions shipped whole] in planner/search.py: the sources in flight it holds
        "inflight_bytes": _inflight_cap(ctx),
    }


def _inflight_cap(ctx: Any) -> int:
    """The bytes of copies in flight the context's device link holds before the device waits
    (Note [back-pressure] in rust/link/mod.rs)."""
    cap = getattr(ctx, "copy_inflight_bytes", None)  # the estimate's simulated context
    if cap is None:
        cap = getattr(getattr(ctx, "config", None), "copy_inflight_bytes", None)
    if cap is None:
        from ..activations.link.common import default_cap_bytes

        sim = _sim_link(ctx)
        cap = default_cap_bytes(sim[0] if sim else None)
    return int(cap)


#: Note [the simulated device is a device]
#:     A context with ``sim_link_bandwidth`` puts CPU tensors on the simulated device: its
#:     copies cross a link of that bandwidth into the host pool, and the tensor's storage is
#:     freed as on a GPU. The planner once saw those regions as a CPU host's (the pool charged
#:     as device memory, offloading "freeing nothing", the CPU's memcpy as the link, RSS as the
#:     peak), so on the simulated H200 auto planned for a machine that was not there and missed
#:     both budgets (0.81x none's live-storage peak against 0.58x and 0.7x). Such regions are
#:     planned as a device's: :func:`host_is_device` is False for them, the machine's link is
#:     the simulated one (:meth:`~spillover.planner.machine.Machine.simulated`), and the peak
#:     meter counts live tensor storages (``spillover._peak.StorageMeter``), the device's
#:     memory there.
def sim_of(rec: RegionRecord) -> Optional[Tuple[float, float]]:
    """The simulated link the region ran over (bytes/s, host seconds per device call), or None
    (Note [the simulated device is a device])."""
    return rec.offload.get("sim") if rec.offload else None


def host_is_device(rec: RegionRecord) -> bool:
    """True where the region's "device" is this host's memory, the offload pool's too: a CPU
    region not on the simulated device (Note [the simulated device is a device])."""
    return rec.device == "cpu" and not sim_of(rec)


#: Note [a CPU host ships nothing]
#:     On a CPU host (the simulated device aside) the context's host pool is the same RAM the
#:     budget counts. A pool of the user's size is RAM taken already: what fills it frees the
#:     tensors' own. A default pool grows by what it takes, and stays with the process at the
#:     most it held (Note [the pool lives for the process] in _pools.py). So under a default
#:     pool that keeps in RAM what it takes (the host tier; tier auto while its pool grows:
#:     Note [RAM before the drive] in _growth.py), what the context would take is kept in
#:     place instead, from a region's start to backward (``OffloadContext.keep_rest``), in
#:     every step auto runs, the learning step included: the same live bytes, no copy, no pool
#:     grown for them. Before, the Quick start's loop with ``policy="auto"`` and no budget (GPT
#:     4x256, seq 512, vocab 8192) learned with every saved tensor shipped, kept a 512 MiB pool
#:     for a plan that ships 2 MiB, and peaked at 750 MiB with the pool counted, 1.93x no
#:     checkpointing's 389 MiB. A tier that writes to the drive, or a pool of the user's size,
#:     goes on as before. Such a context frees nothing, and its pool stays the one mapped: the
#:     records say so (``region_offload_info``: no NVMe, the pool mapped now), and the budget
#:     charges that pool, not the cap a default pool may grow to (6 GiB on this 24 GiB host),
#:     which had put every plan over any budget below it. Before, with budget 150 MiB (GPT
#:     4x256 as above) auto ran plain-offload at 568 MiB with its pool; now full recomputation,
#:     144 MiB.
def keeps_on_host(ctx: Any, device: str) -> bool:
    """Note [a CPU host ships nothing]: whether what ``ctx`` would take from a region on
    ``device`` is kept in place."""
    return (ctx is not None and device == "cpu" and _sim_link(ctx) is None
            and bool(ctx.grows_in_ram))


def region_offload_info(ctx: Any, kept_here: bool) -> Optional[Dict[str, Any]]:
    """What a region's record says of its context (``ctx_offload_info``). Where it keeps in
    place what it would take (``kept_here``: :func:`keeps_on_host`) the context frees nothing
    (no NVMe) and its pool stays the one mapped now, which is what the budget charges (not the
    cap a default pool could grow to: a CPU host's default cap of several GiB put every plan
    over any smaller budget)."""
    info = ctx_offload_info(ctx)
    if info is not None and kept_here:
        info.update(pool_bytes=int(ctx.pool_mapped), nvme=False)
    return info


def input_signature(args: Sequence[Any], kwargs: Dict[str, Any]) -> Tuple[Any, ...]:
    sig: List[Any] = []
    for a in list(args) + [kwargs[k] for k in sorted(kwargs)]:
        if isinstance(a, torch.Tensor):
            sig.append((tuple(a.shape), str(a.dtype), str(a.device), a.requires_grad))
        elif isinstance(a, (list, tuple)):
            sig.append(input_signature(a, {}))
    return tuple(sig)

