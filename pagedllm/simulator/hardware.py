"""Hardware profiles: effective rates of one device and its links.

Built-in GPU profiles come from published peak figures times an efficiency factor (the table in
docs/simulator.md states both); `pagedllm simulate calibrate` measures this machine with the real
engine and writes a profile JSON with the fitted rates.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

GiB = 1 << 30


class ProfileError(ValueError):
    """A hardware profile that cannot be read; the message names the value."""


@dataclass(frozen=True)
class HardwareProfile:
    """Effective (achieved, not peak) rates of one device; None means "not a cost here"."""

    name: str
    gemm_flops: float
    """FLOP/s of the linear layers (GEMMs)."""
    attn_flops: float | None
    """FLOP/s of prefill attention (QK^T and PV over the chunk's context)."""
    kv_read_bw: float | None
    """Bytes/s at which decode attention reads K/V."""
    weight_read_bw: float | None
    """Bytes/s at which a step streams the weights (roofline floor of the GEMMs); None: folded
    into step_overhead_s (calibrated profiles of one model)."""
    step_overhead_s: float
    """Fixed cost of one step (scheduling, launch, Python)."""
    per_seq_s: float = 0.0
    """Cost per scheduled request in a step (input preparation, bookkeeping)."""
    per_sample_s: float = 0.0
    """Cost per sampled row beyond its lm_head GEMM (sampler, output processing)."""
    prompt_step_s: float = 0.0
    """Extra fixed cost of a step that computes any prompt token (prompt chunk or recomputation).
    On a CPU such a step runs the model layer by layer through torch, where a decode-only step is
    one native call (worker/native_decode.py); the built-in GPU profiles price both alike (0).
    Where small_step_tokens > 0, this is the cost of larger steps only."""
    small_step_tokens: int = 0
    """Steps of at most this many tokens are priced at the small-step rates below (0: every step at
    the rates above). On a CPU that is the small-M kernel's row limit for the dtype
    (layers/native_linear.py): up to it, a prompt step's GEMMs stream the weights once through that
    kernel; above it they run oneDNN's blocked GEMM, at another cost per token and per step."""
    small_step_gemm_flops: float | None = None
    """FLOP/s of the GEMMs in steps of at most small_step_tokens tokens; None: gemm_flops."""
    small_prompt_step_s: float = 0.0
    """prompt_step_s of a step of at most small_step_tokens tokens (used where small_step_tokens > 0)."""
    swap_bw: float = 16e9
    """Bytes/s of KV blocks between device and host (swap-out and swap-in)."""
    copy_bw: float = 100e9
    """Bytes/s of device-to-device block copies (copy-on-write)."""
    link_bw: float = 0.0
    """Bytes/s per direction of the link between devices (TP all-reduce, PP send)."""
    link_latency_s: float = 0.0
    """Latency of one collective or send."""
    memory_bytes: int = 0
    """Device memory; with memory_utilization it sizes the KV cache unless the flags do."""
    memory_utilization: float = 0.9
    """Fraction of device memory for weights, activations and KV."""
    source: dict[str, Any] = field(default_factory=dict)
    """How the figures were obtained (peaks and efficiency factors, or the calibration runs)."""

    def __post_init__(self) -> None:
        if not self.gemm_flops > 0:
            raise ProfileError(f"profile {self.name!r}: gemm_flops must be positive, got {self.gemm_flops}")
        for name in ("attn_flops", "kv_read_bw", "weight_read_bw", "small_step_gemm_flops"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ProfileError(f"profile {self.name!r}: {name} must be positive or null, got {v}")
        if not isinstance(self.small_step_tokens, int) or self.small_step_tokens < 0:
            raise ProfileError(f"profile {self.name!r}: small_step_tokens must be a non-negative integer, "
                               f"got {self.small_step_tokens!r}")
        for name in ("step_overhead_s", "per_seq_s", "per_sample_s", "prompt_step_s", "small_prompt_step_s",
                     "link_latency_s"):
            if getattr(self, name) < 0:
                raise ProfileError(f"profile {self.name!r}: {name} must be non-negative, got {getattr(self, name)}")
        for name in ("swap_bw", "copy_bw"):
            if not getattr(self, name) > 0:
                raise ProfileError(f"profile {self.name!r}: {name} must be positive, got {getattr(self, name)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], origin: str = "profile") -> HardwareProfile:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ProfileError(f"{origin}: unknown fields {unknown}")
        try:
            return cls(**data)
        except TypeError as e:
            raise ProfileError(f"{origin}: {e}") from None

    def save(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class GPUSpec:
    """Published peak figures of one GPU (dense BF16, HBM, links)."""

    name: str
    bf16_flops: float
    hbm_bw: float
    memory_bytes: int
    link_bw: float  # NVLink, per direction
    host_bw: float  # PCIe, per direction
    reference: str


# Published datasheet peaks (dense, no sparsity).
GPU_SPECS = {
    "a100": GPUSpec("A100-SXM4-80GB", 312e12, 2.039e12, 80 * GiB, 300e9, 32e9,
                    "NVIDIA A100 datasheet: 312 TFLOPS BF16 dense, 2,039 GB/s HBM2e, NVLink 600 GB/s, PCIe Gen4"),
    "h100": GPUSpec("H100-SXM5-80GB", 989e12, 3.35e12, 80 * GiB, 450e9, 64e9,
                    "NVIDIA H100 datasheet: 989 TFLOPS BF16 dense, 3.35 TB/s HBM3, NVLink 900 GB/s, PCIe Gen5"),
    "h200": GPUSpec("H200-SXM-141GB", 989e12, 4.8e12, 141 * 10**9, 450e9, 64e9,
                    "NVIDIA H200 datasheet: 989 TFLOPS BF16 dense, 4.8 TB/s HBM3e, NVLink 900 GB/s, PCIe Gen5"),
}

# Efficiency factors applied to every GPU profile (achieved / peak), with why.
GPU_EFFICIENCY = {
    "gemm": (0.65, "large BF16 GEMMs reach 60-70% of dense peak"),
    "attention": (0.40, "FlashAttention-2 forward reaches 35-50% of peak on Hopper"),
    "hbm": (0.80, "streaming reads reach ~80% of HBM peak"),
    "link": (0.70, "ring all-reduce bus bandwidth ~70% of NVLink peak"),
    "host": (0.75, "pinned-memory PCIe copies ~75% of peak"),
}
GPU_OVERHEADS = {
    "step_overhead_s": (0.004, "scheduler, input preparation and launch per step (vLLM V1-like engine)"),
    "per_seq_s": (10e-6, "per scheduled request: block table row, metadata"),
    "per_sample_s": (5e-6, "per sampled row: sampler and output processing"),
    "link_latency_s": (8e-6, "one NVLink collective"),
}


def gpu_profile(key: str) -> HardwareProfile:
    spec = GPU_SPECS[key]
    e = {k: v for k, (v, _) in GPU_EFFICIENCY.items()}
    o = {k: v for k, (v, _) in GPU_OVERHEADS.items()}
    return HardwareProfile(
        name=spec.name,
        gemm_flops=spec.bf16_flops * e["gemm"],
        attn_flops=spec.bf16_flops * e["attention"],
        kv_read_bw=spec.hbm_bw * e["hbm"],
        weight_read_bw=spec.hbm_bw * e["hbm"],
        step_overhead_s=o["step_overhead_s"],
        per_seq_s=o["per_seq_s"],
        per_sample_s=o["per_sample_s"],
        swap_bw=spec.host_bw * e["host"],
        copy_bw=spec.hbm_bw * e["hbm"] / 2,  # a copy reads and writes
        link_bw=spec.link_bw * e["link"],
        link_latency_s=o["link_latency_s"],
        memory_bytes=spec.memory_bytes,
        memory_utilization=0.9,
        source={"peaks": spec.reference,
                "efficiency": {k: {"factor": v, "why": w} for k, (v, w) in GPU_EFFICIENCY.items()},
                "overheads": {k: {"value": v, "why": w} for k, (v, w) in GPU_OVERHEADS.items()}},
    )


def load_profile(spec: str) -> HardwareProfile:
    """A built-in GPU profile name (a100, h100, h200) or a profile JSON (from calibrate)."""
    if spec.lower() in GPU_SPECS:
        return gpu_profile(spec.lower())
    from pagedllm.simulator.model import read_json_object

    data = read_json_object(spec, "--profile", sorted(GPU_SPECS), ProfileError)
    return HardwareProfile.from_dict(data, spec)
