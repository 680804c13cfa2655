"""Pipeline parallelism, the torch side: build.py cuts the model into this rank's stages and attaches
runtime.py, which executes the per-rank `Action` lists of meshlm/core/schedule/ (backward.py: the
zero-bubble I/W split; trace.py: measured timelines).
"""
