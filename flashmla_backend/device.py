"""Which GPUs the kernels run on, and which kernel a device gets.

Kernels:
  "sm90"     wgmma + TMA, warp-specialized (Hopper: H100, H200, H20, H800), built for sm_90a;
  "portable" mma.sync + cp.async, needs ~150 KB of shared memory per block: A100/A800 (sm_80),
             Hopper, and newer GPUs with as much shared memory (through the compute_80 PTX).
FLASHMLA_BACKEND_KERNEL=portable|sm90 forces one (tests use it to cover both on Hopper).
"""
from __future__ import annotations

import dataclasses
import functools
import numbers
import os

import torch

from . import _ext

KERNEL_ENV = "FLASHMLA_BACKEND_KERNEL"
# The GPUs each kernel runs on, in words (which KV-cache formats each reads: flashmla_backend.kv_format).
KERNEL_GPUS = {
    "sm90": "Hopper GPUs (compute capability 9.0: H100, H200, H20, H800)",
    "portable": "GPUs of compute capability 8.0 and newer with enough shared memory per block (A100, A800, Hopper)",
}


class UnsupportedGPUError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class DeviceProps:
    index: int
    name: str
    major: int
    minor: int
    sm_count: int
    smem_per_block_optin: int

    @property
    def arch(self) -> str:
        return f"sm_{self.major}{self.minor}"


@functools.cache
def device_props(index: int) -> DeviceProps:
    info = _ext.ext().device_info(index)
    return DeviceProps(index=index, **info)


# SM count used for the scheduler on CPU tensors (the H100's, so CPU metadata matches an H100's).
CPU_SM_COUNT = 132


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (the scheduler's part count derives from it); CPU_SM_COUNT for CPU."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return device_props(index).sm_count
    return CPU_SM_COUNT


def _compiled_archs() -> set[str]:
    return set(_ext.ext().cuda_archs.split(";"))


@functools.cache
def _kernel_for(index: int, forced: str) -> str:
    props = device_props(index)
    C = _ext.ext()
    archs = _compiled_archs()
    sm90_ok = props.major == 9 and C.sm90_compiled()
    # sm_80 machine code serves 8.x; its compute_80 PTX (JIT-compiled by the driver) serves newer GPUs;
    # the 90a target has native code for Hopper.
    portable_ok = (
        props.major >= 8
        and props.smem_per_block_optin >= C.portable_decode_smem_bytes()
        and ("80" in archs or (props.major == 9 and "90a" in archs))
    )
    if forced not in ("", "auto", "portable", "sm90"):
        raise ValueError(f"flashmla_backend: {KERNEL_ENV}={forced!r}; expected 'auto', 'portable' or 'sm90'")
    if forced == "sm90" and not sm90_ok:
        raise UnsupportedGPUError(
            f"flashmla_backend: {KERNEL_ENV}=sm90 but GPU {index} '{props.name}' ({props.arch}) cannot run it "
            f"(needs a Hopper GPU, sm_90, and a build with the 90a target; this build has {sorted(archs)})"
        )
    if forced == "sm90" or (forced in ("", "auto") and sm90_ok):
        return "sm90"
    if portable_ok:
        return "portable"
    raise UnsupportedGPUError(
        f"flashmla_backend: GPU {index} '{props.name}' ({props.arch}, "
        f"{props.smem_per_block_optin // 1024} KB shared memory per block) is not supported. Supported: Hopper "
        f"(sm_90: H100, H200, H20, H800) and GPUs with sm_80-compatible code and at least "
        f"{C.portable_decode_smem_bytes() // 1024 + 1} KB of shared memory per block (A100/A800, sm_80). "
        f"This build targets {';'.join(sorted(archs))} (FLASHMLA_BACKEND_CUDA_ARCHS at build time). "
        "Ada and consumer Ampere GPUs (sm_86, sm_89: 99 KB) are not supported."
    )


def kernel_for(device: torch.device) -> str:
    """The decode kernel for a CUDA device; raises UnsupportedGPUError naming the GPU if none fits."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _kernel_for(index, os.environ.get(KERNEL_ENV, "").strip().lower())


def _device_arg(device) -> torch.device | None:
    """is_supported's argument as a torch.device (None stays None); TypeError / ValueError if it is none."""
    if device is None or isinstance(device, torch.device):
        return device
    expected = "None, a torch.device, a device string such as 'cuda', 'cuda:1' or 'cpu', or a CUDA device index"
    if isinstance(device, numbers.Integral) and not isinstance(device, bool):
        if device < 0:
            raise ValueError(f"flashmla_backend: device must be {expected} (>= 0), got {device!r}")
        return torch.device("cuda", int(device))
    if not isinstance(device, str):
        raise TypeError(f"flashmla_backend: device must be {expected}, got {type(device).__name__} {device!r}")
    try:
        return torch.device(device)
    except RuntimeError:
        raise ValueError(f"flashmla_backend: device must be {expected}, got {device!r}") from None


def is_supported(device: torch.device | int | str | None = None) -> tuple[bool, str]:
    """(True, kernel name) when the decode kernels run on ``device`` (default: current CUDA device),
    else (False, reason). Raises only for an argument that is not a device (TypeError / ValueError naming
    it): is_supported("nonsense") is a mistake, not an unsupported GPU."""
    dev = _device_arg(device)
    try:
        if not torch.cuda.is_available():
            return False, "no CUDA device (torch.cuda.is_available() is False)"
        if dev is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.type != "cuda":
            return False, f"{dev} is not a CUDA device"
        return True, kernel_for(dev)
    except (UnsupportedGPUError, _ext.ExtensionNotBuiltError, ValueError, RuntimeError) as e:
        return False, str(e)
