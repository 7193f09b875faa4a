"""The GPU description XLA's CUDA compiler needs to compile without a GPU.

jax's CUDA plugin makes compile-only devices from a topology shape and a
`GpuTargetConfigProto` (text format): what the compiler would otherwise ask
the driver. The figures are NVIDIA's published ones for the part (H100 SXM5:
132 SMs, 1.98 GHz boost, 50 MB L2, 228 KB shared memory per SM, compute
capability 9.0; https://www.nvidia.com/en-us/data-center/h100/ and the CUDA
programming guide's per-capability limits, read 2026-12).
"""

from __future__ import annotations

from legorl_jax.train.chips import Chip

# Per GPU model: SMs, boost clock (GHz), L2 bytes, shared memory per SM and per
# block (opt-in) in bytes, compute capability.
_PARTS = {
    "h100": (132, 1.98, 50 * 2**20, 228 * 2**10, 227 * 2**10, (9, 0)),
}


def target_config(chip: Chip) -> str:
    """`chip` as a GpuTargetConfigProto in text format."""
    if chip.generation not in _PARTS:
        raise ValueError(f"no GPU target description for {chip.generation!r}; known: {sorted(_PARTS)}")
    sms, ghz, l2, smem_core, smem_block, (major, minor) = _PARTS[chip.generation]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {smem_core}
  threads_per_core_limit: 2048
  core_count: {sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(chip.hbm_bandwidth)}
  l2_cache_size: {l2}
  clock_rate_ghz: {ghz}
  device_memory_size: {chip.hbm_bytes}
  shared_memory_per_block_optin: {smem_block}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
device_description_str: "NVIDIA {chip.generation.upper()}"
"""
