"""The dense peak FLOP/s of accelerators per dtype (the denominator of MFU)."""

from __future__ import annotations

# Dense (no structured sparsity) peak TFLOP/s per device, from vendor datasheets:
# - NVIDIA H100 SXM datasheet: BF16 Tensor Core 1,979 with sparsity -> 989 dense; FP32 67.
#   H100 PCIe: BF16 1,513 sparse -> 756 dense; FP32 51.
# - NVIDIA H200 datasheet (SXM): BF16 1,979 sparse -> 989 dense; FP32 67.
# - NVIDIA A100 datasheet: BF16 312 dense; FP32 19.5.
# - Google Cloud TPU system architecture pages: v4 275, v5e 197, v5p 459, v6e (Trillium) 918 BF16
#   per chip. Google lists no float32 peak (float32 matmuls run as several bf16 passes), so TPUs
#   have no float32 entry and log no MFU in float32 rather than a guessed one.
# float32 on GPUs uses the non-tensor-core FP32 peak; XLA may use TF32 for float32 matmuls,
# which makes MFU over 100% possible there: set metrics.peak_tflops to the TF32 peak then.
PEAK_TFLOPS = {
    ("h100 pcie", "bfloat16"): 756.0, ("h100 pcie", "float32"): 51.0,
    ("h100", "bfloat16"): 989.0, ("h100", "float32"): 67.0,
    ("h200", "bfloat16"): 989.0, ("h200", "float32"): 67.0,
    ("a100", "bfloat16"): 312.0, ("a100", "float32"): 19.5,
    ("tpu v4", "bfloat16"): 275.0,
    ("tpu v5 lite", "bfloat16"): 197.0, ("tpu v5e", "bfloat16"): 197.0,
    ("tpu v5p", "bfloat16"): 459.0, ("tpu v5", "bfloat16"): 459.0,
    ("tpu v6 lite", "bfloat16"): 918.0, ("tpu v6e", "bfloat16"): 918.0,
}


def peak_tflops(device_kind: str, dtype: str, override: float | None = None) -> float | None:
    """Returns the dense peak TFLOP/s of one device of `device_kind` in `dtype`; None when unknown (CPU).

    `override` (metrics.peak_tflops) wins. Longer names are matched first, so
    "NVIDIA H100 PCIe" is not taken for an SXM H100.
    """
    if override is not None:
        return override
    kind = device_kind.lower()
    for (name, peak_dtype), peak in sorted(PEAK_TFLOPS.items(), key=lambda item: -len(item[0][0])):
        if name in kind and peak_dtype == dtype:
            return peak
    return None
