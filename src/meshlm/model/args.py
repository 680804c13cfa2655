"""Model shapes. Presets carry real Llama-3 shapes so the planner and GPU benchmark see true sizes."""
from __future__ import annotations

from dataclasses import dataclass, asdict

ROPE_TYPES = ("default", "linear", "llama3")  # the values of ModelArgs.rope_type (model/llama.py rope_frequencies)


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
    # RoPE frequency scaling (config keys model.rope_scaling.*, transformers' rope_type names):
    # "default" none; "linear" every frequency / factor; "llama3" Llama 3.1's long-context scaling
    # (low frequencies / factor, high ones kept, a smooth ramp between; model/rope.py)
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192  # the context the model was pretrained at (llama3)
    # Attention variants of other families (model.hf_config maps their config.json onto these):
    qkv_bias: bool = False        # biases on wq, wk, wv (Qwen2), none on wo
    qk_norm: bool = False         # per-head RMSNorm of q and k before RoPE (Qwen3)
    explicit_head_dim: int = 0    # config key model.head_dim; 0: dim // n_heads (Qwen3 sets its own)
    # Mixture of experts (model/moe.py; config keys model.moe.*): 0 experts = a dense model.
    num_experts: int = 0
    top_k: int = 2
    moe_ffn_dim: int = 0          # hidden size of one routed expert (0: ffn_dim)
    shared_experts: int = 0       # always-on experts, run as one SwiGLU of shared_experts × moe_ffn_dim
    capacity_factor: float = 0.0  # <= 0: dropless; else each expert takes ceil(cf·T·k/E) per micro-batch
    moe_every: int = 1            # every k-th block (after the dense ones) is a MoE block
    moe_first_dense: int = 0      # leading blocks that keep the dense FFN (DeepSeek's first_k_dense)
    aux_loss_coef: float = 0.01   # weight of each MoE block's load-balancing loss
    attn_kernel: str = "sdpa"     # sdpa or flex (FlexAttention with a block mask); model.attn_impl resolved
    # the queries the model's mask covers: "own" (its tokens: no context parallelism); under CP, where
    # `docs` spans the whole sequence and the CP core masks causal attention itself, "local" (this
    # rank's queries, at `positions`: all-gather) or "all" (every query: Ulysses, after its all-to-all)
    mask_rows: str = "own"

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_dim(self) -> int:
        return self.moe_ffn_dim or self.ffn_dim

    def is_moe_block(self, i: int) -> bool:
        return self.moe and i >= self.moe_first_dense and (i - self.moe_first_dense) % self.moe_every == 0

    @property
    def n_moe_blocks(self) -> int:
        """How many i in range(n_layers) are `is_moe_block(i)`, counted without the loop (the planner
        asks this for every layout it prices)."""
        return max(0, -(-(self.n_layers - self.moe_first_dense) // self.moe_every)) if self.moe else 0

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.dim // self.n_heads

    @property
    def pretrain_seq_len(self) -> int:
        """The sequence length the model was trained at: what plan/explore assume when none is given
        (a Llama 3.1 preset reaches 131072 positions through RoPE scaling but was pretrained at 8192)."""
        return min(self.max_seq_len, self.rope_original_max_seq_len) if self.rope_type == "llama3" else self.max_seq_len

    def num_params(self) -> int:
        """Exact parameter count of `Llama(self)` without building it (the real vocabulary, no padding)."""
        hd = self.head_dim
        attn = self.dim * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        attn += (self.n_heads + 2 * self.n_kv_heads) * hd if self.qkv_bias else 0
        attn += 2 * hd if self.qk_norm else 0
        mlp = 3 * self.dim * self.ffn_dim
        block = attn + mlp + 2 * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        moe = self.n_moe_blocks * (self.moe_block_params(self.num_experts) - mlp)
        return self.vocab_size * self.dim + self.n_layers * block + moe + self.dim + head

    def moe_block_params(self, experts: int) -> int:
        """Feed-forward parameters of one MoE block counting `experts` routed experts: router, routed
        and shared experts (`experts = top_k` gives the parameters one token runs through)."""
        return self.dim * self.num_experts + 3 * self.dim * self.expert_dim * (experts + self.shared_experts)

    def active_params(self) -> int:
        """Parameters one token runs through: routed experts count top_k times, not num_experts."""
        if not self.moe:
            return self.num_params()
        return self.num_params() - self.n_moe_blocks * (self.moe_block_params(self.num_experts)
                                                          - self.moe_block_params(self.top_k))

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6·N (N without the embedding lookup) + 12·L·(heads·head_dim)·seq for
        attention (12·L·d·seq when heads·head_dim = d).
        MoE: N counts only the routed experts a token runs through (top_k), so MFU is the MFU of
        the active parameters (Megatron's and DeepSeek's convention); dropped tokens still count."""
        n = self.active_params() - (0 if self.tie_embeddings else self.vocab_size * self.dim)
        return 6.0 * n + 12.0 * self.n_layers * self.n_heads * self.head_dim * seq_len

    def to_dict(self) -> dict:
        return asdict(self)


def padded_vocab(vocab_size: int, multiple: int, tp: int = 1) -> int:
    """Rows the embedding and head really hold: the vocabulary rounded up to multiple·tp, so every tp
    rank's slice is a multiple of `multiple` (GEMM-friendly shapes; Megatron's
    make-vocab-size-divisible-by). Padded rows are zeros, never looked up and cut off before the loss."""
    step = multiple * tp
    return -(-vocab_size // step) * step


_LLAMA31 = dict(vocab_size=128256, max_seq_len=131072, rope_theta=500000.0, norm_eps=1e-5, rope_type="llama3",
                rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                rope_original_max_seq_len=8192)
_LLAMA32 = dict(_LLAMA31, rope_factor=32.0)

PRESETS: dict[str, ModelArgs] = {
    # tiny, for tests: every parallel degree up to 4 divides its heads and layers
    "debug": ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=128, vocab_size=256,
                       max_seq_len=128),
    # ~1.05M parameters: the `make train` / `meshlm train` default, which learns Python's shape in 1200
    # steps, 0.21 s each on one CPU core (README, quick start)
    "tiny": ModelArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=256,
                      max_seq_len=512),
    # ~6.0M parameters
    "small": ModelArgs(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, ffn_dim=1024, vocab_size=256,
                       max_seq_len=512),
    # The published Llama 3.2 (1B, 3B) and 3.1 (8B, 70B, 405B) shapes (Meta's config.json): vocabulary
    # 128,256, theta 5e5, 128K positions through llama3 RoPE scaling of an 8K pretraining context
    # (factor 32 for 3.2, 8 for 3.1); parameter counts 1.24B, 3.21B, 8.03B, 70.6B, 405.9B.
    "llama3-1b": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, tie_embeddings=True,
                           **_LLAMA32),
    "llama3-3b": ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192, tie_embeddings=True,
                           **_LLAMA32),
    "llama3-8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, **_LLAMA31),
    "llama3-70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, **_LLAMA31),
    "llama3-405b": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248, **_LLAMA31),
    # tiny MoE, for tests: 8 experts (ep up to 8), top-2, one shared expert, dropless; every block MoE
    "moe-debug": ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=128, vocab_size=256,
                           max_seq_len=128, num_experts=8, top_k=2, moe_ffn_dim=64, shared_experts=1),
    # Mixtral 8x7B (Jiang et al. 2024; HF config): 8 experts of 14336, top-2, every block, dropless
    "mixtral-8x7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                              vocab_size=32000, max_seq_len=32768, rope_theta=1e6, num_experts=8, top_k=2,
                              moe_ffn_dim=14336),
    # DeepSeekMoE 16B (Dai et al. 2024; HF deepseek-moe-16b-base): fine-grained, 64 routed experts of
    # 1408 (top-6) + 2 shared, the first block dense (10944), multi-head attention
    "deepseek-moe-16b": ModelArgs(dim=2048, n_layers=28, n_heads=16, n_kv_heads=16, ffn_dim=10944,
                                  vocab_size=102400, max_seq_len=4096, num_experts=64, top_k=6,
                                  moe_ffn_dim=1408, shared_experts=2, moe_first_dense=1),
}
