"""Memory helpers and MFU: golden values, the peak table, and a real RSS increase."""

import numpy as np
import pytest

from rljax.metrics import device_memory_gb, host_memory_gb, mfu, peak_flops, training_flops_per_token


@pytest.mark.parametrize(
    "kind, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40S", 362e12),
        ("TPU v5 lite", 197e12),
        ("TPU v4", 275e12),
        ("cpu", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_flops_table(kind, peak):
    assert peak_flops(kind) == peak


def test_mfu_golden_values():
    # Qwen2.5-0.5B-like: N = 494e6, 24 layers, d = 896, T = 2048.
    fpt = training_flops_per_token(494_000_000, num_layers=24, seq_len=2048, d_model=896)
    assert fpt == 6 * 494e6 + 12 * 24 * 2048 * 896
    # 50k tokens/s on one H100 SXM: 3.492e9 * 5e4 / 9.89e14
    assert mfu(fpt, 50_000.0, "NVIDIA H100 80GB HBM3") == pytest.approx(fpt * 5e4 / 989e12, rel=1e-12)
    assert mfu(6e9, 1e4, "NVIDIA A100-SXM4-40GB", num_devices=8) == pytest.approx(6e13 / (8 * 312e12))
    assert mfu(6e9, 1e4, "cpu") is None


def test_host_memory_sees_a_large_allocation():
    before = host_memory_gb()
    block = np.ones(300_000_000 // 8)  # 0.3 GB, every page touched
    after = host_memory_gb()
    assert after - before > 0.25, (before, after)
    assert host_memory_gb(peak=True) >= after
    del block


class _FakeDevice:
    def __init__(self, stats):
        self._stats = stats

    def memory_stats(self):
        return self._stats


def test_device_memory_peak_over_devices():
    devices = [
        _FakeDevice({"bytes_in_use": 1e9, "peak_bytes_in_use": 3e9}),
        _FakeDevice({"bytes_in_use": 2e9, "peak_bytes_in_use": 2.5e9}),
        _FakeDevice(None),  # a device that reports nothing is left out
    ]
    assert device_memory_gb(devices) == 3.0
    assert device_memory_gb(devices, peak=False) == 2.0
    assert device_memory_gb([_FakeDevice({"bytes_in_use": 4e9})]) == 4.0  # no peak: current use
    assert device_memory_gb() is None  # the CPU backend reports no memory stats
