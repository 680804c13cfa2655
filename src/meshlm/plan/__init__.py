"""Analytical planner: memory, communication and time of a layout, and a search over layouts.

Pure Python on purpose (no torch, no torch.distributed): `meshlm plan` answers in seconds for 16k GPUs.
Entry points: estimate.estimate(), search.plan(), and the `estimate` / `plan` subcommands in cli_cmds.
"""
