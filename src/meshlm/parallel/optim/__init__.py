"""Optimizers over whatever the dimensions left on this rank: the interface the trainer drives and AdamW's
kernels (adamw), Muon (muon), and their ZeRO forms over shards (zero_adamw, zero_muon; nvme: AdamW with
its state in per-rank files)."""
