"""Calibration from a measured run (`--calibrate RUN_DIR`): fit the device's rates from its metrics and
profile (fit.py), read traces (trace.py), GPU kernels (gpu.py) and a CPU's cores (cores.py)."""
