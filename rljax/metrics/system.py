"""Host/device memory and model-FLOPs-utilization helpers for `memory/*` and `perf/mfu` (GB = 1e9 bytes)."""

from __future__ import annotations

import pathlib
import re
import resource
import sys
from collections.abc import Sequence
from typing import Any

# Dense (no sparsity) bf16 peak FLOP/s per chip, from the vendors' datasheets (NVIDIA lists the sparse
# figure, twice these). Matched in order against the lowercased `jax.Device.device_kind`.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    (r"h[12]00 nvl", 835e12),  # H100 NVL / H200 NVL: 1671 TFLOP/s sparse
    (r"h100 pcie", 756e12),  # 1513 sparse
    (r"h100|h200|h800", 989e12),  # H100 SXM, H200 (and GH200): 1979 sparse
    (r"a100", 312e12),  # 624 sparse
    (r"l40s", 362e12),  # 733 sparse
    (r"\bl4\b", 121e12),  # 242 sparse
    (r"b200", 2250e12),  # HGX B200 per GPU: 4.5 PFLOP/s sparse
    (r"tpu v4", 275e12),
    (r"tpu v5 lite|tpu v5e", 197e12),
    (r"tpu v5p|tpu v5$", 459e12),
    (r"tpu v6 lite|tpu v6e", 918e12),
)
_GB = 1e9


def peak_flops(device_kind: str) -> float | None:
    """Dense bf16 peak FLOP/s of one chip of `device_kind` (e.g. "NVIDIA H100 80GB HBM3"), None if unknown."""
    kind = device_kind.lower().strip()
    for pattern, flops in PEAK_BF16_FLOPS:
        if re.search(pattern, kind):
            return flops
    return None


def training_flops_per_token(
    num_params: int, num_layers: int = 0, seq_len: int = 0, d_model: int = 0
) -> float:
    """FLOPs to train on one token (forward + backward): 6 N + 12 L T d (the second term is attention).

    Add 2 N per token for each extra forward pass (reference log-probs, old-policy recompute).
    References: Kaplan et al. 2020 (arXiv:2001.08361) sec. 2.1; Chowdhery et al. 2022 (PaLM) appendix B.
    """
    return 6.0 * num_params + 12.0 * num_layers * seq_len * d_model


def mfu(flops_per_token: float, tokens_per_s: float, device_kind: str, num_devices: int = 1) -> float | None:
    """Model FLOPs utilization: flops_per_token * tokens_per_s / (peak_flops(device_kind) * num_devices).

    `tokens_per_s` is the whole job's throughput over `num_devices` chips. Returns None when the device's
    peak is unknown (e.g. "cpu"). References: Chowdhery et al. 2022 (PaLM) appendix B.
    """
    peak = peak_flops(device_kind)
    if peak is None:
        return None
    return flops_per_token * tokens_per_s / (peak * num_devices)


def _proc_status_kb(field: str) -> int | None:
    try:
        text = pathlib.Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(rf"^{field}:\s+(\d+)\s+kB", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def host_memory_gb(peak: bool = False) -> float:
    """This process's resident set size in GB (`peak=True`: the high-water mark since start).

    Reads /proc/self/status (VmRSS / VmHWM); elsewhere falls back to getrusage's peak.
    """
    kb = _proc_status_kb("VmHWM" if peak else "VmRSS")
    if kb is not None:
        return kb * 1024 / _GB
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / _GB if sys.platform == "darwin" else maxrss * 1024 / _GB  # bytes on macOS, kB elsewhere


def device_memory_gb(devices: Sequence[Any] | None = None, peak: bool = True) -> float | None:
    """Largest device memory in use over `devices` (default: jax.local_devices()), in GB.

    Uses `memory_stats()["peak_bytes_in_use"]` (`peak=False` or no peak: "bytes_in_use"). Returns None when
    no device reports memory stats (the CPU backend does not).
    """
    if devices is None:
        import jax

        devices = jax.local_devices()
    used = []
    for device in devices:
        stats = device.memory_stats()
        if not stats:
            continue
        key = "peak_bytes_in_use" if peak and "peak_bytes_in_use" in stats else "bytes_in_use"
        if key in stats:
            used.append(stats[key])
    return max(used) / _GB if used else None
