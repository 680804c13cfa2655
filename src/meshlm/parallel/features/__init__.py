"""Per-block features that are not a dimension: float8 linears (float8), activation checkpointing
(activation_checkpoint), the chunked output head and loss (chunked_loss) and the multi-token-prediction
term of the loss (mtp)."""
