"""The estimate's picture: predicted device memory over the step, one panel per mode."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from .result import Estimate

__all__ = ["plot_modes", "timeline_panels"]

MiB = float(1 << 20)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover (matplotlib is a test dependency)
        raise RuntimeError("drawing needs matplotlib: pip install matplotlib") from e
    return plt


def timeline_panels(path: str, title: str,
                    panels: Sequence[Tuple[str, Dict[str, List[Tuple[float, int]]],
                                           Dict[str, float]]],
                    ylabel: str = "device memory (MiB)") -> str:
    """One panel per mode, stacked and sharing the time axis: each panel's curves (``{label:
    [(seconds, bytes)]}``, e.g. "predicted" and "measured"), the end of forward and of backward
    as dashed lines (``{"forward": s, "backward": s}``, from the first curve's clock), and the
    peak of each curve annotated."""
    plt = _pyplot()
    n = max(1, len(panels))
    fig, axes = plt.subplots(n, 1, figsize=(9, 1.9 * n + 0.9), dpi=110, sharex=False,
                             squeeze=False)
    colors = {"predicted": "tab:blue", "measured": "tab:orange"}
    for ax, (mode, curves, marks) in zip(axes[:, 0], panels):
        top = 0.0
        for label, pts in curves.items():
            if not pts:
                continue
            color = next((c for k, c in colors.items() if label.startswith(k)), None)
            ts = [t for t, _ in pts]
            ms = [m / MiB for _, m in pts]
            ax.plot(ts, ms, label=label, linewidth=1.3, color=color)
            i = max(range(len(ms)), key=ms.__getitem__)
            top = max(top, ms[i])
            ax.annotate(f"peak {ms[i]:.0f} MiB", (ts[i], ms[i]), xytext=(4, -12),
                        textcoords="offset points", fontsize=8, color=color)
            ax.plot([ts[i]], [ms[i]], marker="o", markersize=3, color=color)
        for name, style in (("forward", "--"), ("backward", ":")):
            if name in marks:
                ax.axvline(marks[name], color="grey", linestyle=style, linewidth=0.9)
        if "forward" in marks:
            ax.text(marks["forward"], top * 1.02 if top else 1, " backward →", fontsize=7,
                    color="grey", va="bottom")
        ax.set_ylim(0, top * 1.18 if top else 1)
        ax.set_ylabel(f"{mode}\n{ylabel}", fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
        if len(curves) > 1:
            ax.legend(fontsize=7, loc="best")
    axes[-1, 0].set_xlabel("seconds into the step (dashed: forward ends; dotted: backward "
                           "ends, the optimizer step after it)", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_modes(est: Estimate, path: str,
               measured: Optional[Dict[str, List[Tuple[float, int]]]] = None) -> str:
    panels = []
    for m in est:
        curves = {"predicted": m.timeline}
        if measured and measured.get(m.mode):
            curves["measured"] = measured[m.mode]
        panels.append((m.mode, curves, m.marks))
    return timeline_panels(path, f"spillover.estimate: {est.what} on {est.device.name}",
                           panels)
