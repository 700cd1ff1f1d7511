"""The devices an estimate can be made for: this machine's CPU (measured), an H100 or an H200
(published figures), or figures given explicitly.

Note [device figures]
    ``"cpu"`` is this machine, as the planner sees it: the calibration's matmul FLOP/s and
    elementwise bandwidth (:mod:`spillover.calibrate`, cached on disk), its pool copy rate as
    the "link", its NVMe rates, and host costs measured here once per process: seconds per
    dispatched op (a chain of tiny ops, forward and backward), per op of a wrapped region on top
    of that, and per offloaded tensor (pack and unpack of a 4 KiB tensor, whose copy is
    nothing). Where the calibration already has ``host_seconds_per_op`` /
    ``host_seconds_per_offload`` they are used. Its memory is the RAM available now.

    ``"h100"`` and ``"h200"`` are SXM parts with the memory ``torch.cuda`` reports
    (``total_memory``: 81,559 MiB and 143,771 MiB), and *achievable* rates, not peak ones:
    bf16/fp16 matmuls at 650 TFLOP/s (66 % of the dense peak, what large training GEMMs reach),
    fp32 at 50 TFLOP/s (torch's default: no TF32), HBM at 80 % of its peak (3.35 and 4.8 TB/s),
    one data-centre NVMe drive (Gen4: 6.5 GB/s read, 3.5 GB/s write, 3.84 TB, rated 1 drive
    write per day), and 32 MiB of cuBLAS workspace (Hopper's). The link and the host's figures
    of the ``"h200"`` are those an H200 measured (2026-12-04, ``../shared/gpu-2026-12-04/``):
    54 GB/s each way from a pool block; 107 us of host time per offloaded tensor (pack 58.9 +
    unpack 47.9 us, ``link_cost.py --device cuda``); and the host's dispatch (Note [two clocks]
    in modes.py) as the probe's 1B Llama showed it: backward ran at its device time (autograd's
    engine is C++: 8 us per op), forward took 17 % more than its device time (the Python
    model's eager forward is host-bound: 30 us per op, 0.033 s for its 1,093 ops), and torch's
    full checkpointing 38 % more (a region's dispatch adds 12 us per op). Those three host
    figures are fitted to the probe's none and full forwards, so the estimate of those two
    modes agrees by construction; the host mode's time is a prediction from the link figures.
    The ``"h100"`` keeps the unmeasured figures: PCIe 5 x16 at 50 GB/s, 8 us per op both ways,
    4 us per region op and 25 us per offloaded tensor. Pass ``device=dict(...)``
    (:func:`device_spec`) with your own.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Dict, Mapping, Optional, Union

import psutil
import torch

from ..config import parse_size
from ..planner.machine import Machine

__all__ = ["Device", "device_spec", "DEVICES", "known_gpu"]

GiB = 1 << 30
MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Device:
    """What an estimate needs of a device (Note [device figures]). Rates in bytes or FLOPs per
    second; ``kind`` "cpu" (the device is the host: the pool counts as its memory) or "cuda"."""

    name: str
    kind: str
    memory_bytes: int
    matmul_flops: Mapping[str, float]
    memory_bytes_per_s: float  # memory-bound ops: bytes read + written per second
    link_bytes_per_s: float  # device <-> pinned host, each way (CPU: a copy into the pool)
    nvme_write_bytes_per_s: Optional[float]
    nvme_read_bytes_per_s: Optional[float]
    host_memory_bytes: int
    host_seconds_per_op: float  # dispatching one op of the forward (eager)
    host_seconds_per_region_op: float  # more per op inside a wrapped region (save / replay)
    host_seconds_per_offload: float  # pack + unpack of one offloaded tensor
    workspace_bytes: int = 0  # allocated once by the first matmul (cuBLAS)
    rounding: int = 1  # allocations rounded up to this (CUDA's caching allocator: 512)
    copy_inflight_bytes: int = 256 * MiB  # Note [the newest sources stay] in activations/link
    nvme_drive_bytes: Optional[int] = None
    nvme_drive_writes_per_day: float = 1.0
    #: dispatching one op of backward (autograd's engine); None: ``host_seconds_per_op``
    host_seconds_per_backward_op: Optional[float] = None

    def host_seconds(self, phase: str) -> float:
        """Host time to dispatch one op of ``phase`` (Note [two clocks] in modes.py)."""
        if phase in ("backward", "optimizer") and self.host_seconds_per_backward_op is not None:
            return self.host_seconds_per_backward_op
        if phase in ("region", "recompute"):
            return self.host_seconds_per_op + self.host_seconds_per_region_op
        return self.host_seconds_per_op

    def flops_per_s(self, dtype: str) -> float:
        f = self.matmul_flops
        return f.get(dtype) or f.get("float32") or max(f.values())

    def machine(self) -> Machine:
        """The planner's :class:`~spillover.planner.Machine` with these rates."""
        kw: Dict[str, Any] = dict(
            matmul_flops=dict(self.matmul_flops),
            elementwise_bytes_per_s=self.memory_bytes_per_s,
            d2h_bytes_per_s=self.link_bytes_per_s,
            h2d_bytes_per_s=self.link_bytes_per_s,
            nvme_write_bytes_per_s=self.nvme_write_bytes_per_s,
            nvme_read_bytes_per_s=self.nvme_read_bytes_per_s,
        )
        fields = {f.name for f in dataclasses.fields(Machine)}
        if "host_seconds_per_offload" in fields:  # the planner's host costs, where it has them
            kw["host_seconds_per_offload"] = self.host_seconds_per_offload
            kw["host_seconds_per_op"] = self.host_seconds_per_region_op
        if "host_seconds_per_forward_op" in fields and self.kind != "cpu":
            kw["host_seconds_per_forward_op"] = self.host_seconds_per_op  # two clocks
        return Machine(**kw)

    def replace(self, **kw: Any) -> Device:
        return dataclasses.replace(self, **kw)


def _gpu(name: str, memory_mib: int, hbm_tb_s: float, **kw: Any) -> Device:
    from ..activations.link.common import default_cap_bytes

    figures: Dict[str, Any] = dict(
        name=name, kind="cuda", memory_bytes=memory_mib * MiB,
        matmul_flops={"bfloat16": 650e12, "float16": 650e12, "float32": 50e12},
        memory_bytes_per_s=0.8 * hbm_tb_s * 1e12, link_bytes_per_s=50e9,
        nvme_write_bytes_per_s=3.5e9, nvme_read_bytes_per_s=6.5e9,
        host_memory_bytes=2048 * GiB // 8,  # a quarter TiB per GPU of an 8-GPU node
        host_seconds_per_op=8e-6, host_seconds_per_region_op=4e-6,
        host_seconds_per_offload=25e-6, workspace_bytes=32 * MiB, rounding=512,
        nvme_drive_bytes=3840 * 10**9,
    )
    figures.update(kw)
    # the link's cap on copies whose source is held (Note [back-pressure] in rust/link): the
    # default, which on CUDA is made without the link's rate (link_for in activations/hooks.py)
    figures.setdefault("copy_inflight_bytes", default_cap_bytes(None))
    return Device(**figures)


#: Note [device figures]
DEVICES: Dict[str, Device] = {
    "h100": _gpu("h100", 81559, 3.35),
    # measured on an H200 (2026-12-04): the link, the host per offload, the host's dispatch
    "h200": _gpu("h200", 143771, 4.8, link_bytes_per_s=54e9, host_seconds_per_offload=107e-6,
                 host_seconds_per_op=30e-6, host_seconds_per_backward_op=20e-6,
                 host_seconds_per_region_op=12e-6),
}


def known_gpu(name: str) -> Optional[str]:
    """The :data:`DEVICES` key a GPU's name (``torch.cuda.get_device_name()``) names, if any."""
    low = name.lower()
    return next((k for k in DEVICES if k in low), None)


_cpu_lock = threading.Lock()
_cpu: Optional[Device] = None


def _measure_host_costs() -> Dict[str, float]:
    """Host seconds per dispatched op, per op of a wrapped region on top of it, and per
    offloaded tensor (Note [device figures]): medians of interleaved rounds, measured as the
    calibration measures them (``calibrate.host_cost_times``)."""
    from .. import calibrate

    n = 100
    t = calibrate.on_own_thread(lambda: calibrate.host_cost_times(torch.device("cpu"), n, 5))
    base = t["plain"]
    # forward n sins + backward n (sin's backward: cos and mul) + the sum: ~3n + 2 ops
    return {
        "host_seconds_per_op": base / (3 * n + 2),
        "host_seconds_per_offload": max(0.0, (t["offloaded"] - base) / n),
        "host_seconds_per_region_op": max(0.0, (t["wrapped"] - 2 * base) / (2 * n)),
    }


def cpu_device() -> Device:
    """This machine's CPU (Note [device figures]): measured once per process."""
    global _cpu
    with _cpu_lock:
        if _cpu is not None:
            return _cpu
        from .. import calibrate

        with torch.random.fork_rng(devices=[]):
            cal = calibrate.calibrate(device="cpu")
            d = cal["devices"]["cpu"]
            host = _measure_host_costs()
        if d.get("host_seconds_per_offload") is not None:
            host["host_seconds_per_offload"] = float(d["host_seconds_per_offload"])
        if d.get("host_seconds_per_op") is not None:
            host["host_seconds_per_region_op"] = float(d["host_seconds_per_op"])
        avail = psutil.virtual_memory().available
        _cpu = Device(
            name="cpu", kind="cpu", memory_bytes=avail,
            matmul_flops=dict(d["matmul_flops"]),
            memory_bytes_per_s=float(d["elementwise_bytes_per_s"]),
            link_bytes_per_s=min(float(d["d2h_bytes_per_s"]), float(d["h2d_bytes_per_s"])),
            nvme_write_bytes_per_s=cal.get("nvme_write_bytes_per_s"),
            nvme_read_bytes_per_s=cal.get("nvme_read_bytes_per_s"),
            host_memory_bytes=avail, **host,
        )
        return _cpu


_FIELDS = {f.name for f in dataclasses.fields(Device)}


def device_spec(device: Union[str, Device, Mapping[str, Any]] = "cpu") -> Device:
    """The :class:`Device` for ``device``: ``"cpu"`` (this machine, measured), ``"h100"``,
    ``"h200"``, a :class:`Device`, or a dict of figures: ``{"base": "h100", "memory_bytes":
    "94GiB", "link_bytes_per_s": 25e9, ...}`` (fields of :class:`Device`; sizes accept units;
    ``base`` defaults to ``"h100"``). ValueError naming the choices otherwise."""
    if isinstance(device, Device):
        return device
    if isinstance(device, str):
        name = device.strip().lower()
        if name == "cpu":
            return cpu_device()
        if name in DEVICES:
            return DEVICES[name]
        raise ValueError(
            f"spillover.estimate: device={device!r}: expected 'cpu' (this machine), "
            f"{', '.join(repr(k) for k in DEVICES)}, or a dict of figures such as "
            "{'base': 'h100', 'memory_bytes': '94GiB'} (see spillover.estimate.Device)")
    if isinstance(device, Mapping):
        figures = dict(device)
        base = device_spec(figures.pop("base", "h100"))
        bad = [k for k in figures if k not in _FIELDS]
        if bad:
            raise ValueError(
                f"spillover.estimate: unknown device figure(s) {', '.join(map(repr, bad))}; "
                f"known: {', '.join(sorted(_FIELDS))}")
        for k in ("memory_bytes", "host_memory_bytes", "workspace_bytes",
                  "copy_inflight_bytes", "nvme_drive_bytes"):
            if isinstance(figures.get(k), str):
                figures[k] = parse_size(figures[k])
        return base.replace(**figures)
    raise TypeError(f"spillover.estimate: device={device!r}: expected a name, a dict of "
                    "figures or a spillover.estimate.Device")
