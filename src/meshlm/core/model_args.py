"""Model shapes. Presets carry real Llama-3 shapes so the planner and GPU benchmark see true sizes."""
from __future__ import annotations

from dataclasses import dataclass, asdict

# the values of ModelArgs.rope_type (model/layers.py rope_frequencies)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
MOE_SCORES = ("softmax", "sigmoid")  # the values of ModelArgs.moe_score (model/moe.py)


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
    # (low frequencies / factor, high ones kept, a smooth ramp between; model/layers.py rope_frequencies)
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192  # the context the model was pretrained at (llama3, yarn)
    # "yarn" (DeepSeek-V2/V3, transformers' _compute_yarn_parameters): frequencies blended between
    # interpolated and kept by a ramp over [beta_fast, beta_slow] rotations; mscale / mscale_all_dim
    # (0 = unset) scale cos/sin and the softmax (model/mla.py)
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0
    rope_mscale_all_dim: float = 0.0
    # Attention variants of other families (model.hf_config maps their config.json onto these):
    qkv_bias: bool = False        # biases on wq, wk, wv (Qwen2), none on wo
    qk_norm: bool = False         # per-head RMSNorm of q and k before RoPE (Qwen3)
    explicit_head_dim: int = 0    # config key model.head_dim; 0: dim // n_heads (Qwen3 sets its own)
    # Multi-head latent attention (DeepSeek-V2/V3, model/mla.py) when kv_lora_rank > 0: queries through a
    # q_lora_rank latent (0: one plain wq), keys and values from a kv_lora_rank latent, a decoupled RoPE
    # key of qk_rope_head_dim shared by all heads; q/k heads of qk_nope_head_dim + qk_rope_head_dim,
    # value heads of v_head_dim. n_kv_heads and head_dim are unused then.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    mtp_depth: int = 0            # DeepSeek-V3 multi-token-prediction modules after the last block (model/mtp.py)
    # Mixture of experts (model/moe.py; config keys model.moe.*): 0 experts = a dense model.
    num_experts: int = 0
    top_k: int = 2
    moe_ffn_dim: int = 0          # hidden size of one routed expert (0: ffn_dim)
    shared_experts: int = 0       # always-on experts, run as one SwiGLU of shared_experts × moe_ffn_dim
    capacity_factor: float = 0.0  # <= 0: dropless; else each expert takes ceil(cf·T·k/E) per micro-batch
    moe_every: int = 1            # every k-th block (after the dense ones) is a MoE block
    moe_first_dense: int = 0      # leading blocks that keep the dense FFN (DeepSeek's first_k_dense)
    aux_loss_coef: float = 0.01   # weight of each MoE block's load-balancing loss
    # DeepSeek-V3 routing (model/moe.py; config keys model.moe.*). The defaults are the plain path above.
    moe_score: str = "softmax"         # softmax or sigmoid affinities
    bias_update_rate: float = 0.0      # > 0: auxiliary-loss-free balancing (a per-expert selection bias)
    n_group: int = 1                   # experts in n_group groups; a token picks from its best topk_group
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' gate weights
    norm_topk_prob: bool = True        # gate weights renormalised to sum to one over the top-k
    seq_aux_loss_coef: float = 0.0     # weight of each MoE block's sequence-wise balance loss
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
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """Size of one query / key head: the whole head, or MLA's no-RoPE part plus its RoPE part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def rope_dim(self) -> int:
        """Dimensions RoPE rotates per head (MLA: only the decoupled part)."""
        return self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def expert_bias(self) -> bool:
        """Whether MoE blocks hold the selection bias: DeepSeek-V3's sigmoid routing always carries one
        (HF `e_score_correction_bias`), other routing only when balancing updates it."""
        return self.moe and (self.moe_score == "sigmoid" or self.bias_update_rate > 0)

    @property
    def plain_routing(self) -> bool:
        """Softmax top-k renormalised, no groups, bias or scaling: the Mixtral path of model/moe.py."""
        return (self.moe_score == "softmax" and not self.expert_bias and self.n_group == 1
                and self.routed_scaling_factor == 1.0 and self.norm_topk_prob)

    @property
    def pretrain_seq_len(self) -> int:
        """The sequence length the model was trained at: what plan/explore assume when none is given
        (a Llama 3.1 preset reaches 131072 positions through RoPE scaling but was pretrained at 8192)."""
        scaled = self.rope_type in ("llama3", "yarn")
        return min(self.max_seq_len, self.rope_original_max_seq_len) if scaled else self.max_seq_len

    def attention_params(self) -> int:
        """Parameters of one block's attention (norms inside it included, the block's two norms not)."""
        if self.mla:
            heads, qk, r = self.n_heads, self.qk_head_dim, self.kv_lora_rank
            q = self.dim * heads * qk if not self.q_lora_rank else \
                self.q_lora_rank * (self.dim + 1 + heads * qk)
            kv = self.dim * (r + self.qk_rope_head_dim) + r + r * heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + heads * self.v_head_dim * self.dim
        hd = self.head_dim
        attn = self.dim * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        attn += (self.n_heads + 2 * self.n_kv_heads) * hd if self.qkv_bias else 0
        return attn + (2 * hd if self.qk_norm else 0)

    def mtp_params(self, experts: int) -> int:
        """Parameters of the MTP modules (their embedding and head are the model's): two input norms, the
        projection, one block (MoE as block n_layers + k would be, with `experts` routed experts) and
        the head's norm each."""
        out = 0
        for k in range(self.mtp_depth):
            moe = self.is_moe_block(self.n_layers + k)
            ffn = self.moe_block_params(experts) if moe else 3 * self.dim * self.ffn_dim
            out += 2 * self.dim * self.dim + 5 * self.dim + self.attention_params() + ffn
        return out

    def num_params(self) -> int:
        """Exact parameter count of `Llama(self)` without building it (the real vocabulary, no padding;
        the MoE selection bias is a buffer, not counted)."""
        mlp = 3 * self.dim * self.ffn_dim
        block = self.attention_params() + mlp + 2 * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        moe = self.n_moe_blocks * (self.moe_block_params(self.num_experts) - mlp)
        return (self.vocab_size * self.dim + self.n_layers * block + moe + self.dim + head
                + self.mtp_params(self.num_experts))

    def moe_block_params(self, experts: int) -> int:
        """Feed-forward parameters of one MoE block counting `experts` routed experts: router, routed
        and shared experts (`experts = top_k` gives the parameters one token runs through)."""
        return self.dim * self.num_experts + 3 * self.dim * self.expert_dim * (experts + self.shared_experts)

    def active_params(self) -> int:
        """Parameters one token runs through: routed experts count top_k times, not num_experts."""
        if not self.moe:
            return self.num_params()
        idle = self.moe_block_params(self.num_experts) - self.moe_block_params(self.top_k)
        return (self.num_params() - self.n_moe_blocks * idle
                - (self.mtp_params(self.num_experts) - self.mtp_params(self.top_k)))

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6·N (N without the embedding lookup) + 6·L·heads·(qk + v head sizes)·seq
        for attention (12·L·d·seq when heads·head_dim = d); the MTP modules count as L more blocks and
        their head matmuls (the head is shared, so N holds it once).
        MoE: N counts only the routed experts a token runs through (top_k), so MFU is the MFU of
        the active parameters (Megatron's and DeepSeek's convention); dropped tokens still count."""
        n = self.active_params() - (0 if self.tie_embeddings else self.vocab_size * self.dim)
        v = self.v_head_dim if self.mla else self.head_dim
        attn = 6.0 * (self.n_layers + self.mtp_depth) * self.n_heads * (self.qk_head_dim + v) * seq_len
        return 6.0 * (n + self.mtp_depth * self.vocab_size * self.dim) + attn

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
# DeepSeek's MLA shape (V2-Lite, V3, Moonlight): 512-wide KV latent, 64-wide RoPE key, 128-wide heads
_MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
# YaRN from a 4K pretraining context to 160K (DeepSeek-V2-Lite / V3 config.json rope_scaling)
_YARN40 = dict(rope_type="yarn", rope_factor=40.0, rope_original_max_seq_len=4096, rope_beta_fast=32.0,
               rope_beta_slow=1.0, max_seq_len=163840, rope_theta=10000.0)

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
    # tiny DeepSeek-V3 shape, for tests: every degree up to 4 divides its heads, experts (8), groups (4)
    # and layers (4: the first dense); MLA with q LoRA, sigmoid group-limited routing with the balancing
    # bias, the sequence-wise loss, one MTP module
    "dsv3-debug": ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=128, vocab_size=256,
                            max_seq_len=128, norm_eps=1e-6, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
                            qk_nope_head_dim=16, v_head_dim=16, num_experts=8, top_k=2, moe_ffn_dim=32,
                            shared_experts=1, moe_first_dense=1, moe_score="sigmoid", n_group=4, topk_group=2,
                            routed_scaling_factor=2.5, aux_loss_coef=0.0, seq_aux_loss_coef=1e-4,
                            bias_update_rate=1e-3, mtp_depth=1),
    # DeepSeek-V3 671B (DeepSeek-AI 2024, arXiv 2412.19437; HF deepseek-ai/DeepSeek-V3 config.json): 61
    # blocks, the first 3 dense (18432), 256 routed experts of 2048 + 1 shared, top-8 from 4 of 8 groups,
    # sigmoid affinities scaled by 2.5, auxiliary-loss-free balancing (γ = 0.001) with α = 1e-4
    # sequence-wise loss, one MTP module; MLA with a 1536-wide q latent; YaRN ×40. 671B + the MTP block.
    "deepseek-v3": ModelArgs(dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, ffn_dim=18432, vocab_size=129280,
                             norm_eps=1e-6, q_lora_rank=1536, **_MLA, num_experts=256, top_k=8, moe_ffn_dim=2048,
                             shared_experts=1, moe_first_dense=3, moe_score="sigmoid", n_group=8, topk_group=4,
                             routed_scaling_factor=2.5, aux_loss_coef=0.0, seq_aux_loss_coef=1e-4,
                             bias_update_rate=1e-3, mtp_depth=1, rope_mscale=1.0, rope_mscale_all_dim=1.0,
                             **_YARN40),
    # DeepSeek-V2-Lite 15.7B (HF deepseek-ai/DeepSeek-V2-Lite config.json): 27 blocks, the first dense
    # (10944), 64 routed experts of 1408 + 2 shared, top-6 softmax without renormalisation, MLA without
    # q LoRA, sequence-wise balance loss 0.001, YaRN ×40 with mscale 0.707
    "deepseek-v2-lite": ModelArgs(dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, ffn_dim=10944,
                                  vocab_size=102400, norm_eps=1e-6, **_MLA, num_experts=64, top_k=6,
                                  moe_ffn_dim=1408, shared_experts=2, moe_first_dense=1, norm_topk_prob=False,
                                  aux_loss_coef=0.0, seq_aux_loss_coef=1e-3, rope_mscale=0.707,
                                  rope_mscale_all_dim=0.707, **_YARN40),
    # Moonlight-16B-A3B (Moonshot AI 2025, "Muon is Scalable for LLM Training"; HF
    # moonshotai/Moonlight-16B-A3B config.json, DeepseekV3ForCausalLM): DeepSeek-V3's shape at 16B: 27
    # blocks, the first dense (11264), 64 routed experts of 1408 + 2 shared, top-6 sigmoid (one group)
    # scaled by 2.446, MLA without q LoRA, theta 5e4, 8K context, no MTP module
    "moonlight-16b-a3b": ModelArgs(dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, ffn_dim=11264,
                                   vocab_size=163840, max_seq_len=8192, rope_theta=50000.0, norm_eps=1e-5, **_MLA,
                                   num_experts=64, top_k=6, moe_ffn_dim=1408, shared_experts=2, moe_first_dense=1,
                                   moe_score="sigmoid", routed_scaling_factor=2.446, aux_loss_coef=0.0,
                                   seq_aux_loss_coef=1e-3, bias_update_rate=1e-3),
}
