"""`tpassctl goodput --plot`: goodput or USD lost per month against job size.

matplotlib is an optional dependency (the ``plot`` extra); it is imported only
here, only when a plot is asked for.
"""

from __future__ import annotations

from pathlib import Path

from torchpass.errors import DependencyError
from torchpass.goodput import model
from torchpass.goodput.model import GoodputInputs

METRICS = ("goodput", "usd-lost-per-month")


def job_sizes(inp: GoodputInputs, smallest: int = 64, largest: int = 131_072) -> list[int]:
    """Powers of two from ``smallest`` to ``largest``, plus the job's own size."""
    sizes = []
    size = smallest
    while size <= largest:
        sizes.append(size)
        size *= 2
    return sorted(set(sizes) | {inp.gpus})


def sweep(inp: GoodputInputs, sizes: list[int]) -> dict[str, list[float]]:
    """Per strategy, (goodput, USD lost per month) at each size, closed form."""
    goodput: dict[str, list[float]] = {name: [] for name in model.STRATEGIES}
    usd: dict[str, list[float]] = {name: [] for name in model.STRATEGIES}
    for size in sizes:
        result = model.evaluate(model.with_job_size(inp, size))
        for name, strategy in result.strategies.items():
            goodput[name].append(strategy.goodput)
            usd[name].append(strategy.lost_usd_per_month)
    return {"goodput": goodput, "usd-lost-per-month": usd}  # type: ignore[dict-item]


def draw(inp: GoodputInputs, path: Path, metric: str = "goodput", title: str | None = None) -> Path:
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never open a window
        import matplotlib.pyplot as plt
    except ImportError:
        raise DependencyError("--plot needs matplotlib: pip install 'torchpass[plot]'") from None
    sizes = job_sizes(inp)
    series = sweep(inp, sizes)[metric]
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in model.STRATEGIES:
        values = series[name]
        if metric == "goodput":
            values = [100.0 * v for v in values]
        ax.plot(sizes, values, marker="o", markersize=3, label=model.STRATEGY_LABELS[name])
    ax.axvline(inp.gpus, color="grey", linestyle=":", linewidth=1, label=f"this job ({inp.gpus:,} GPUs)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs in the job (per-GPU failure rate fixed)")
    if metric == "goodput":
        ax.set_ylabel("goodput: useful / paid GPU-hours (%)")
    else:
        ax.set_yscale("log")
        ax.set_ylabel("USD lost per month")
    ax.set_title(title or f"torchpass goodput model, GPU MTBF {inp.gpu_mtbf_hours:,.0f} h")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
