"""The planner building (docs/architecture.md, "The two buildings"): memory, communication and time of a
layout (cost/), the search over layouts (search/), calibration from a measured run (calibrate/) and mixed
clusters (mixed/); spec.py reads a config into what they price, hardware.py and cluster.py describe the
machines. Pure Python on purpose (no torch): `meshlm plan` answers in seconds for 16k GPUs, and it never
imports the runtime. Entry points: cost/estimate.py `estimate`, search/ranked.py `plan`, and the
`estimate` / `plan` subcommands in cli.py.
"""
