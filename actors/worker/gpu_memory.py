"""vLLM's --gpu-memory-utilization on CUDA: the share of the GPU's total memory the engine may
take for weights, activations and the KV cache. The worker loads the weights, runs one forward
pass of the largest step the scheduler may send (its activations stay reserved by torch's
allocator), reads the device's memory, and gives the KV cache what is left of the share:

    KV cache bytes = utilization x total memory - memory in use

Memory is read through NVML (the ``nvidia-ml-py`` package, ``import pynvml``), which sees every
process on the device; without it, through ``torch.cuda.mem_get_info``. Neither is imported
unless a CUDA worker sizes its cache. On the CPU none of this applies: the KV cache takes
--kv-cache-gib (1 GiB by default), as vLLM's CPU build sizes it apart from this flag too."""
from __future__ import annotations

import logging

log = logging.getLogger("troupe.worker")

GIB = 1 << 30


class NotEnoughGpuMemory(ValueError):
    """The weights and activations already take the share --gpu-memory-utilization allows."""


def kv_cache_bytes_for_gpu(total_bytes: int, used_bytes: int, utilization: float) -> int:
    """The KV cache's bytes: ``utilization`` of ``total_bytes`` less ``used_bytes`` (the device's
    memory in use once the weights are loaded and a forward pass ran). Raises
    NotEnoughGpuMemory, saying what to change, when nothing is left."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(total_bytes * utilization)
    kv_bytes = budget - used_bytes
    if kv_bytes <= 0:
        raise NotEnoughGpuMemory(
            f"--gpu-memory-utilization {utilization:g} allows {budget / GIB:.2f} GiB of the GPU's "
            f"{total_bytes / GIB:.2f} GiB, but {used_bytes / GIB:.2f} GiB are already in use after "
            f"loading the model and a forward pass (this process's and any other's); raise "
            f"--gpu-memory-utilization or give the KV cache a size with --kv-cache-gib")
    return kv_bytes


def device_memory(device_index: int) -> tuple[int, int]:
    """(free, total) bytes of CUDA device ``device_index`` (torch's numbering): through NVML
    when it can be used, else torch.cuda.mem_get_info."""
    try:
        return _nvml_memory(device_index)
    except Exception as exc:          # no nvidia-ml-py, no driver library, a MIG slice ...
        log.debug("NVML cannot read the GPU's memory (%s); using torch.cuda.mem_get_info", exc)
    import torch
    free, total = torch.cuda.mem_get_info(device_index)
    return int(free), int(total)


def _nvml_memory(device_index: int) -> tuple[int, int]:
    """NVML numbers devices by PCI order, whatever CUDA_VISIBLE_DEVICES says: the device is
    found by its UUID, as torch reports it."""
    import pynvml
    import torch
    pynvml.nvmlInit()
    try:
        uuid = str(torch.cuda.get_device_properties(device_index).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return int(info.free), int(info.total)
    finally:
        pynvml.nvmlShutdown()
