"""Named scenarios for `tpassctl goodput --preset NAME`.

A preset is a set of overrides on the GoodputInputs defaults. Only the
failure rate is published data; the recovery times are assumptions stated in
docs/goodput.md, meant to be overridden with a site's own numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchpass.errors import ConfigError

# Llama 3 (Dubey et al., "The Llama 3 Herd of Models", 2024, section 3.3.4):
# 419 unexpected interruptions in a 54-day snapshot of pre-training on 16,384
# H100 GPUs (8 per server). Per GPU: 16,384 GPUs * 54 days * 24 h / 419.
LLAMA3_GPUS = 16_384
LLAMA3_DAYS = 54
LLAMA3_INTERRUPTIONS = 419
LLAMA3_GPU_MTBF_HOURS = LLAMA3_GPUS * LLAMA3_DAYS * 24 / LLAMA3_INTERRUPTIONS  # 50,676.9


@dataclass(frozen=True)
class Preset:
    name: str
    summary: str
    values: dict[str, Any] = field(default_factory=dict)
    sources: tuple[str, ...] = ()
    # The model trained, where the scenario names one: --measured applies the figures that grow
    # with the model (pause, save, relaunch, GPU-killed recovery) only inside their measured sizes.
    model_size: str | None = None


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="llama3-16k",
            summary="16,384-GPU H100 pretraining at Llama 3's published interruption rate (54 days of work)",
            values={
                "gpus": LLAMA3_GPUS,
                "gpus_per_node": 8,
                "gpu_mtbf_hours": LLAMA3_GPU_MTBF_HOURS,
                "work_hours": LLAMA3_DAYS * 24.0,
                # ~7.8 failures a day, each node out ~24 h: ~7.8 failures in repair
                # on average; 16 spare nodes (0.8% of the job) run out on <1%.
                "spare_nodes": 16,
            },
            # Llama 3 405B was pre-trained on up to 16K H100 GPUs (Dubey et al. 2024, sec. 3.3).
            model_size="405B",
            sources=(
                "Dubey et al. 2024, The Llama 3 Herd of Models, sec. 3.3.4: 419 unexpected "
                "interruptions in 54 days on 16,384 H100 GPUs",
            ),
        ),
        Preset(
            name="pretrain-1k",
            summary="1,024-GPU H100 pretraining at the same per-GPU failure rate (30 days of work)",
            values={
                "gpus": 1024,
                "gpus_per_node": 8,
                "gpu_mtbf_hours": LLAMA3_GPU_MTBF_HOURS,
                "work_hours": 30 * 24.0,
                "spare_nodes": 4,
            },
            sources=("per-GPU rate from Dubey et al. 2024 (as llama3-16k), scaled to 1,024 GPUs",),
        ),
        Preset(
            name="pretrain-100k",
            summary="100,000-GPU run at Epoch AI's round figure of one failure per 50,000 GPU-hours",
            values={
                "gpus": 100_000,
                "gpus_per_node": 8,
                "gpu_mtbf_hours": 50_000.0,
                "work_hours": 90 * 24.0,
                # 2 failures/h * 24 h repair = 48 in repair on average; 80 spare nodes.
                "spare_nodes": 80,
            },
            sources=(
                "Epoch AI 2024, Hardware failures won't limit AI scaling: an H100 failing once every "
                "50,000 hours gives a 100,000-GPU cluster a failure every 30 minutes",
            ),
        ),
    )
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(sorted(PRESETS))}") from None
