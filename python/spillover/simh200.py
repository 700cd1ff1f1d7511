"""A simulated H200 on the CPU: the simulated device's link set so that a CPU model meets it as
the probe's 1B Llama met the H200's (../shared/gpu-2026-12-04, Note [the simulated H200]).

Note [the simulated H200]
    What made offloading hard on the H200 is two ratios, not its speed:
    - the link is slower than forward makes activations: none's forward saved 8.68 GB in
      0.033 s (263 GB/s) against a link of 54 GB/s each way, **4.9x**; so a forward hides
      about a fifth of what it saves, and offloading everything is link-bound;
    - the host's time per offloaded tensor (58.9 us per pack + 47.9 us per unpack, the link's
      host cost on CUDA) against the device's compute per offloaded tensor (a 0.086 s step over
      277 offloaded tensors: 310 us), **0.34**.
    On the CPU a step is ~100x slower and the host is the device, so both ratios are far off.
    :func:`settings` takes what a CPU step measured -- its forward's seconds, what a host
    context offloads from it (bytes and tensors), the step's seconds, and the host's own cost
    per offload and device calls per offload on a free simulated link -- and returns the
    ``offload_context`` keywords that restore them: ``sim_link_bandwidth`` = saved bytes /
    forward seconds / 4.9, and ``sim_call_cost`` = what each device call must cost the host for
    pack + unpack to reach 0.34 of the compute per offloaded tensor (0 when the CPU's own cost
    is already there). ``sim_compute_lag``: a tenth of the forward, as a GPU's compute stream
    runs behind the host. ``copy_inflight_bytes``: the link's cap (the sources it may hold, in
    flight or landed: Note [the newest sources stay] in activations/link/device.py) at the
    H200's share of a forward's saved bytes -- its default cap, 20 ms of its link (1.08 GB), is
    12 % of the 8.68 GB; the default's 64 MiB floor would hold a third of a CPU step's
    activations on the simulated device, and offloading would free little there.
    ``benches/python/sim_h200.py`` measures, prints the ratios it ran at, and runs the modes
    there; ``tests/python/test_sim_h200.py`` and ``test_sim_device_plans.py`` are its CI-sized
    forms.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict

__all__ = ["H200", "SimH200", "settings"]

#: What the H200 measured (../shared/gpu-2026-12-04/RESULTS.md, probe `step` and `link`).
H200 = {
    "link_bytes_per_s": 54e9,
    "forward_saved_bytes": 8.68e9,
    "forward_seconds": 0.033,
    "step_seconds": 0.086,
    "offloaded_tensors": 277,
    "host_seconds_per_offload": 58.9e-6 + 47.9e-6,
}
#: The link's default cap on the H200 (activations/link/common.py: 20 ms of the link).
H200_CAP_BYTES = int(H200["link_bytes_per_s"] * 0.020)
#: Note [the simulated H200]: forward's production of saved bytes over the link's bandwidth ...
PRODUCTION_OVER_LINK = (H200["forward_saved_bytes"] / H200["forward_seconds"]
                        / H200["link_bytes_per_s"])
#: ... and the host's time per offload over the device's compute per offloaded tensor.
HOST_OVER_COMPUTE = (H200["host_seconds_per_offload"]
                     / (H200["step_seconds"] / H200["offloaded_tensors"]))


@dataclasses.dataclass(frozen=True)
class SimH200:
    """The simulated device's settings (Note [the simulated H200]) and the ratios they give."""

    sim_link_bandwidth: float
    sim_call_cost: float
    sim_compute_lag: float
    copy_inflight_bytes: int
    production_over_link: float
    host_over_compute: float
    cpu_host_over_compute: float  # what the CPU's own cost per offload gave, before call costs

    def context_kwargs(self) -> Dict[str, Any]:
        return {"sim_link_bandwidth": self.sim_link_bandwidth,
                "sim_call_cost": self.sim_call_cost, "sim_compute_lag": self.sim_compute_lag,
                "copy_inflight_bytes": self.copy_inflight_bytes}

    def describe(self) -> str:
        return (f"simulated H200: link {self.sim_link_bandwidth / 1e9:.3g} GB/s (forward makes "
                f"saved bytes {self.production_over_link:.2f}x faster; H200 "
                f"{PRODUCTION_OVER_LINK:.2f}x), {self.sim_call_cost * 1e6:.1f} us per device "
                f"call (host per offload {self.host_over_compute:.2f} of the compute per "
                f"offloaded tensor; H200 {HOST_OVER_COMPUTE:.2f}; the CPU's own "
                f"{self.cpu_host_over_compute:.2f}), compute lag "
                f"{self.sim_compute_lag * 1e3:.1f} ms, link cap "
                f"{self.copy_inflight_bytes / 2**20:.1f} MiB")


def settings(forward_seconds: float, step_seconds: float, saved_bytes: int, offloads: int,
             host_seconds_per_offload: float, calls_per_offload: float) -> SimH200:
    """The simulated H200 for a CPU step that measured these (Note [the simulated H200]):
    ``forward_seconds`` and ``step_seconds`` without offload, ``saved_bytes`` and ``offloads``
    what a host context offloads from one forward, ``host_seconds_per_offload`` and
    ``calls_per_offload`` what pack + unpack cost the host and the device on a free simulated
    link."""
    for name, v in (("forward_seconds", forward_seconds), ("step_seconds", step_seconds),
                    ("saved_bytes", saved_bytes), ("offloads", offloads)):
        if not v > 0:
            raise ValueError(f"simh200.settings: {name} must be > 0, got {v!r}")
    bandwidth = saved_bytes / forward_seconds / PRODUCTION_OVER_LINK
    compute = step_seconds / offloads
    own = max(0.0, host_seconds_per_offload) / compute
    missing = max(0.0, HOST_OVER_COMPUTE * compute - max(0.0, host_seconds_per_offload))
    call_cost = missing / calls_per_offload if calls_per_offload > 0 else 0.0
    host = (max(0.0, host_seconds_per_offload) + call_cost * calls_per_offload) / compute
    return SimH200(sim_link_bandwidth=bandwidth, sim_call_cost=call_cost,
                   sim_compute_lag=forward_seconds / 10,
                   copy_inflight_bytes=max(1, int(saved_bytes * H200_CAP_BYTES
                                                  / H200["forward_saved_bytes"])),
                   production_over_link=saved_bytes / forward_seconds / bandwidth,
                   host_over_compute=host, cpu_host_over_compute=own)
