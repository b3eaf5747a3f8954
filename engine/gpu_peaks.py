"""GPUs' dense peak FLOP/s from their datasheets, for MFU (engine/device.py's peak_flops, which
loads this on CUDA only). (bf16/fp16, tf32, fp32) by a substring of the device's name; the first
match wins, so a more specific name comes before a shorter one.
"""
PEAK_FLOPS = [
    ("H200", (989e12, 494e12, 67e12)),
    ("H100 PCIe", (756e12, 378e12, 51e12)),
    ("H100", (989e12, 494e12, 67e12)),
    ("A100", (312e12, 156e12, 19.5e12)),
    ("A10G", (125e12, 62.5e12, 31.2e12)),
    ("L40S", (362e12, 183e12, 91.6e12)),
    ("L4", (121e12, 60e12, 30e12)),
    ("RTX 4090", (165e12, 82.6e12, 82.6e12)),
    ("RTX 3090", (71e12, 35.6e12, 35.6e12)),
    ("V100", (125e12, 15.7e12, 15.7e12)),
    ("T4", (65e12, 8.1e12, 8.1e12)),
]
