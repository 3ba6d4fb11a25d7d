"""Hardware presets: GPU peak throughput and memory, link bandwidths.

All figures are the vendors' published dense (no sparsity) peaks and nominal one-direction link
rates. Real runs reach a fraction of them; the planner applies the utilisation you give (MFU,
default 40%) to compute, and uses link rates as they are, so its communication times are lower
bounds: NCCL typically reaches 70-90% of a link's nominal rate ("bus bandwidth").

The consumer and workstation cards, with "16-bit" meaning bf16 tensor cores with fp32
accumulation (what a PyTorch bf16 matmul uses), dense:
- RTX 3090: 71 TFLOP/s bf16, 35.6 fp32, 24 GB; RTX A6000: 154.8 bf16, 38.7 fp32, 48 GB
  (NVIDIA Ampere GA102 GPU Architecture whitepaper v2.0, Appendix A and C,
  https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf);
- RTX 4090: 165.2 bf16, 82.6 fp32, 24 GB (NVIDIA Ada GPU Architecture whitepaper, Appendix A,
  https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf).
All three reach the host over PCIe 4.0 x16: 16 GT/s per lane with 128b/130b encoding, 31.5 GB/s
each way (the "pcie4" preset rounds it to 32). A board that splits two cards to x8/x8, as many
desktop boards do, halves it: give the planner's host_link. Between the cards the default is the
same PCIe link (the 3090 and the A6000 take an NVLink bridge; the 4090 has none).

`host_link` is each GPU's link to host memory, which offload crosses (planner/offload.py):
PCIe 5.0 x16 for the H100, H200, B200 and MI300X, PCIe 4.0 x16 for A100, L40S, A10 and L4,
PCIe 3.0 x16 for V100.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.precisions import PrecisionSpec

__all__ = ["GpuSpec", "GPUS", "LINKS", "gpu_spec"]


@dataclass(frozen=True)
class GpuSpec:
    """Dense peak TFLOP/s by compute precision, and memory in bytes (decimal GB as sold)."""

    name: str
    tflops_16bit: float  # bf16/fp16 tensor cores, dense
    tflops_fp32: float   # fp32 without TF32 (PyTorch's default for matmuls since 1.12)
    memory_bytes: int
    link: str = "pcie4"  # the usual intra-node link of the part (a LINKS preset)
    has_bf16: bool = True
    host_link: str = "pcie4"  # the link to host memory (a LINKS preset)

    def peak_tflops(self, precision: PrecisionSpec) -> float:
        """The dense peak at the precision's compute dtype (None: the parameters' own, fp32)."""
        return self.tflops_fp32 if precision.compute_dtype is None else self.tflops_16bit


_G = 10**9
GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("H100 SXM", 989.4, 66.9, 80 * _G, "nvlink4", host_link="pcie5"),
    "h100-pcie": GpuSpec("H100 PCIe", 756.0, 51.2, 80 * _G, "pcie5", host_link="pcie5"),
    "h200": GpuSpec("H200 SXM", 989.4, 66.9, 141 * _G, "nvlink4", host_link="pcie5"),
    "b200": GpuSpec("B200", 2250.0, 80.0, 180 * _G, "nvlink5", host_link="pcie5"),
    "a100": GpuSpec("A100 80GB SXM", 312.0, 19.5, 80 * _G, "nvlink3"),
    "a100-40gb": GpuSpec("A100 40GB SXM", 312.0, 19.5, 40 * _G, "nvlink3"),
    "l40s": GpuSpec("L40S", 362.1, 91.6, 48 * _G, "pcie4"),
    "a10": GpuSpec("A10", 125.0, 31.2, 24 * _G, "pcie4"),
    "l4": GpuSpec("L4", 121.0, 30.3, 24 * _G, "pcie4"),
    "v100": GpuSpec("V100 SXM2 32GB", 125.0, 15.7, 32 * _G, "nvlink2", has_bf16=False,
                    host_link="pcie3"),
    "rtx3090": GpuSpec("RTX 3090", 71.0, 35.6, 24 * _G, "pcie4"),
    "rtx4090": GpuSpec("RTX 4090", 165.2, 82.6, 24 * _G, "pcie4"),
    "a6000": GpuSpec("RTX A6000", 154.8, 38.7, 48 * _G, "pcie4"),
    "mi300x": GpuSpec("MI300X", 1307.4, 163.4, 192 * _G, "xgmi", host_link="pcie5"),
}

# One-direction GB/s per GPU. Intra-node: NVLink totals halved (900 GB/s bidirectional on H100 is
# 450 GB/s each way); PCIe x16. Inter-node: one NIC per GPU at its line rate.
LINKS: dict[str, float] = {
    "nvlink5": 900.0, "nvlink4": 450.0, "nvlink3": 300.0, "nvlink2": 150.0,
    "xgmi": 448.0,  # MI300X: 7 Infinity Fabric links of 64 GB/s each way
    "pcie5": 64.0, "pcie4": 32.0, "pcie3": 16.0,
    "ib-800g": 100.0, "ib-400g": 50.0, "ib-200g": 25.0, "ib-100g": 12.5,
    "eth-400g": 50.0, "eth-200g": 25.0, "eth-100g": 12.5, "eth-25g": 3.125, "eth-10g": 1.25,
}


def gpu_spec(name: str) -> GpuSpec:
    key = str(name).strip().lower()
    if key not in GPUS:
        raise ValueError(f"unknown GPU preset {name!r}: choose one of {', '.join(GPUS)} "
                         f"(or give --peak-tflops and --gpu-memory)")
    return GPUS[key]
