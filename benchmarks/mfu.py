"""MFU against the chip's datasheet peak, with the bf16 GEMM rate measured on the machine as a second reference.

    ref = mfu_reference()                      # once per run, on the benchmark's device
    ref.mfu(flop_per_s)                        # model FLOP/s over the datasheet's dense bf16 peak
    ref.of_gemm(flop_per_s)                    # the same FLOP/s over the GEMM rate measured here
    ref.to_json()                              # what a result file records of both

The datasheet peak is the denominator MFU is quoted against across the field (dense bf16, no sparsity): 989
TFLOP/s for the H100 and H200 SXM parts (the same Hopper die). A chip not in the table has no datasheet MFU (None),
only the measured column. The measured rate is the median of timed 8192^3 bf16 matmuls on random data (what a
large GEMM reaches on this card at its clocks, ~790 TFLOP/s on an H200), so `of_gemm` says how far the model's
work is from what this card's cuBLAS does at best.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

#: dense bf16 TFLOP/s by the vendor's datasheet, keyed by a substring of torch.cuda.get_device_name()
DATASHEET_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0}


@dataclass(frozen=True)
class MFUReference:
    chip: str
    datasheet_tflops: float | None
    """Dense bf16 peak of the chip's datasheet; None for a chip not in DATASHEET_BF16_TFLOPS (or the CPU)."""
    measured_gemm_tflops: float | None
    """bf16 8192^3 matmul rate measured on this device (median); None on the CPU."""

    def mfu(self, flop_per_s: float) -> float | None:
        return flop_per_s / (self.datasheet_tflops * 1e12) if self.datasheet_tflops else None

    def of_gemm(self, flop_per_s: float) -> float | None:
        return flop_per_s / (self.measured_gemm_tflops * 1e12) if self.measured_gemm_tflops else None

    def to_json(self) -> dict:
        return asdict(self)


def datasheet_tflops(name: str) -> float | None:
    return next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in name), None)


def measure_gemm_tflops(device: torch.device, n: int = 8192, repeats: int = 20) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * n**3 / times[len(times) // 2] / 1e12


def mfu_reference(device: torch.device | None = None) -> MFUReference:
    """The references on `device` (default: the current CUDA device, or the CPU without one)."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type != "cuda":
        return MFUReference("cpu", None, None)
    name = torch.cuda.get_device_name(device)
    return MFUReference(name, datasheet_tflops(name), measure_gemm_tflops(device))


def mfu_reference_in_child() -> MFUReference:
    """`mfu_reference()` measured in a child process, so the caller (a driver whose workers own the GPU) holds no
    CUDA context or memory of its own on the device."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, __file__], capture_output=True, text=True, check=True).stdout
    return MFUReference(**json.loads(out.strip().splitlines()[-1]))


if __name__ == "__main__":
    import json

    print(json.dumps(mfu_reference().to_json()))
