"""Model shapes. Presets carry real Llama-3 shapes so the planner and GPU benchmark see true sizes."""
from __future__ import annotations

from dataclasses import dataclass, asdict


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    vocab_multiple: int = 128  # rows of the embedding and head are padded to this × tp (padded_vocab)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Exact parameter count of `Llama(self)` without building it (the real vocabulary, no padding)."""
        hd = self.head_dim
        attn = self.dim * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.dim * self.ffn_dim
        block = attn + mlp + 2 * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.n_layers * block + self.dim + head

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6·N (N without the embedding lookup) + 12·L·d·seq for attention."""
        n = self.num_params() - (0 if self.tie_embeddings else self.vocab_size * self.dim)
        return 6.0 * n + 12.0 * self.n_layers * self.dim * seq_len

    def to_dict(self) -> dict:
        return asdict(self)


def padded_vocab(vocab_size: int, multiple: int, tp: int = 1) -> int:
    """Rows the embedding and head really hold: the vocabulary rounded up to multiple·tp, so every tp
    rank's slice is a multiple of `multiple` (GEMM-friendly shapes; Megatron's
    make-vocab-size-divisible-by). Padded rows are zeros, never looked up and cut off before the loss."""
    step = multiple * tp
    return -(-vocab_size // step) * step


PRESETS: dict[str, ModelArgs] = {
    # tiny, for tests: every parallel degree up to 4 divides its heads and layers
    "debug": ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=128, vocab_size=256,
                       max_seq_len=128),
    # ~6.0M parameters: the `make train` default, a couple of minutes on two CPU cores
    "small": ModelArgs(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, ffn_dim=1024, vocab_size=256,
                       max_seq_len=512),
    "llama3-1b": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                           vocab_size=128256, max_seq_len=8192, rope_theta=500000.0, tie_embeddings=True),
    "llama3-3b": ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192,
                           vocab_size=128256, max_seq_len=8192, rope_theta=500000.0, tie_embeddings=True),
    "llama3-8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                           vocab_size=128256, max_seq_len=8192, rope_theta=500000.0),
    "llama3-70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                            vocab_size=128256, max_seq_len=8192, rope_theta=500000.0),
    "llama3-405b": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248,
                             vocab_size=128256, max_seq_len=8192, rope_theta=500000.0),
}
