"""The foundation both buildings stand on (docs/architecture.md, "The two buildings"): config sections and
their checks, the `Layout` a config becomes on a world size, the enumerated choices, the card table, the
model's shape (model_args.py) and Hugging Face config mapping, pipeline schedules as data, and one facts
module per feature (facts/) holding what the runtime and the planner must agree on. Imports no torch."""
