"""What a run reports and how it is watched: metrics.jsonl and the console line (metrics), slow ranks
(straggler), the hardware's energy counters (energy), what autograd keeps (saved), the PNG report
(report) and Weights & Biases (wandb_sink)."""
