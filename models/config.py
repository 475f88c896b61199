"""ArchConfig: the hyper-parameters of a model's architecture, read from its checkpoint (config.json
or the GGUF header), that every architecture and the engine agree on."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from models.rope import DEFAULT as PLAIN_ROPE
from models.rope import RopeScaling

SLIDING, FULL = "sliding_attention", "full_attention"  # Hugging Face's layer_types values


class Routing(NamedTuple):
    """How a router's logits choose experts beyond plain softmax top-k (DeepSeek's): ``scoring``
    "softmax" or "sigmoid" (V3's); with ``n_group`` groups, only the experts of the ``topk_group``
    best groups compete, a group scored by its best expert ("max", V2's group_limited_greedy) or
    its best two summed ("top2", V3's); ``correction_bias``: a learned per-expert bias added to the
    scores to choose, not to weight (V3's e_score_correction_bias); the weights, renormalized or
    not, times ``scale`` (routed_scaling_factor)."""
    scoring: str = "softmax"
    n_group: int = 0
    topk_group: int = 0
    group_by: str = "max"
    correction_bias: bool = False
    scale: float = 1.0



@dataclass(frozen=True, slots=True)
class MLADims:
    """DeepSeek's multi-head latent attention (models/deepseek.py): q through a ``q_lora_rank``
    bottleneck (None: one projection), keys and values from one latent of ``kv_lora_rank`` per
    token plus a rotary key part of ``qk_rope_head_dim`` shared by the heads; each head's query and
    key ``qk_nope_head_dim + qk_rope_head_dim`` wide, its value ``v_head_dim``."""
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True, slots=True)
class MambaDims:
    """State-space mixers (models/mamba.py) in place of attention: each request carries a state
    through its tokens instead of a KV cache. ``version`` 1 (Mamba): a selective state of
    ``d_state`` per channel, the time step from a ``dt_rank`` projection; 2 (Mamba-2): ``num_heads``
    heads of ``head_dim`` channels, one decay per head, B and C shared by the heads of each of
    ``n_groups`` groups, a gated RMSNorm before the output; 3 (Gated DeltaNet): ``num_heads`` value
    heads of ``head_dim`` reading ``n_groups`` query/key heads of ``d_state`` through a (d_state,
    head_dim) state per head updated by the delta rule; 4 (LFM2's short convolution): the
    convolution alone, gated before and after. All convolve their inputs causally over ``d_conv``
    tokens."""
    version: int                               # 1 Mamba, 2 Mamba-2, 3 Gated DeltaNet (Qwen3-Next), 4 LFM2's short conv
    d_inner: int                               # channels of the mixer (intermediate_size; the values')
    d_state: int                               # N: the state's size per channel
    d_conv: int                                # the causal convolution's width
    dt_rank: int = 0                           # Mamba: the time step's projection rank
    num_heads: int = 0                         # Mamba-2
    head_dim: int = 0
    n_groups: int = 1
    conv_bias: bool = True
    proj_bias: bool = False                    # in_proj and out_proj have biases (use_bias)
    bcdt_rms_eps: float | None = None          # RMSNorms of B, C and dt (Falcon-Mamba's weightless ones)
    bcdt_norm_weights: bool = False            # and with weights (Jamba's dt_layernorm, b_layernorm, c_layernorm)
    norm_eps: float = 1e-5                     # Mamba-2's gated RMSNorm
    time_step_limit: tuple[float, float] = (0.0, float("inf"))   # Mamba-2's clamp of the time steps

    def __post_init__(self) -> None:
        if self.version not in (1, 2, 3, 4):
            raise ValueError(f"Mamba version {self.version} is not supported (1, 2, 3: Gated DeltaNet, 4: short conv)")
        if self.version in (2, 3) and (self.num_heads * self.head_dim != self.d_inner or self.num_heads % self.n_groups):
            raise ValueError(f"{self.num_heads} heads of {self.head_dim} must make the {self.d_inner} "
                             f"channels and split into {self.n_groups} groups")

    @property
    def conv_dim(self) -> int:
        """Channels the convolution turns: x (Mamba), x, B and C (Mamba-2), or q, k and v (Gated DeltaNet)."""
        return self.d_inner if self.version in (1, 4) else self.d_inner + 2 * self.n_groups * self.d_state

    @property
    def ssm_state_shape(self) -> tuple[int, ...]:
        if self.version == 3:
            return (self.num_heads, self.d_state, self.head_dim)
        if self.version == 4:
            return (0,)                        # the convolution's inputs are all it keeps
        return (self.d_inner, self.d_state) if self.version == 1 else (self.num_heads, self.head_dim, self.d_state)

    @property
    def conv_state_shape(self) -> tuple[int, ...]:
        """The last d_conv - 1 inputs of the convolution."""
        return (self.conv_dim, self.d_conv - 1)

    def state_bytes(self, dtype_bytes: int) -> int:
        """One request's state in one layer: the convolution's inputs in the model's dtype, the
        state-space state in float32."""
        conv = self.conv_dim * (self.d_conv - 1) * dtype_bytes
        ssm = 4
        for n in self.ssm_state_shape:
            ssm *= n
        return conv + ssm


@dataclass(frozen=True, slots=True)
class ArchConfig:
    architecture: str          # Hugging Face architecture name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    max_model_len: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # -- optional features; the defaults are plain Llama ------------------------------------
    qkv_bias: bool = False                     # bias on q/k/v projections (Qwen2, attention_bias)
    qk_norm: bool = False                      # per-head RMSNorms of q and k (GLM-4.5's use_qk_norm; Qwen3's always)
    o_bias: bool = False                       # bias on the output projection (attention_bias)
    hidden_act: str = "silu"                   # gated MLP activation: "silu" | "gelu_pytorch_tanh"
    sliding_window: int | None = None          # W: a sliding layer's query at p sees keys p-W < k <= p
    layer_types: tuple[str, ...] | None = None  # per layer SLIDING | FULL; None: every layer slides iff W
    rope_local_theta: float | None = None      # rotary base of sliding layers (Gemma 3); None: rope_theta
    rope_scaling: RopeScaling = PLAIN_ROPE     # the rope scaling of full layers (models/rope.py)
    rotary_dim: int | None = None              # a partial rotary: the leading dims of each head that turn
    rope_layers: tuple[bool, ...] | None = None  # per layer whether q and k turn (SmolLM3's NoPE); None: all
    # M-RoPE (Qwen2-VL's): the rotary frequencies split in sections, each turned by one of a
    # position's three rows (time, height, width); a text token's rows agree (plain rope). (): none
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False            # Qwen3-VL's: the rows' frequencies interleaved (t h w t h w ...)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5; None: head_size ** -0.5
    attn_logit_softcapping: float | None = None
    attention_sinks: bool = False              # a learned sink logit per head in every softmax (gpt-oss)
    attn_output_gate: bool = False             # attention's output times a sigmoid gate projected beside q (Qwen3-Next)
    alibi_bias_max: float | None = None        # ALiBi's distance biases in place of positions (BLOOM's 8, MPT's
                                               # attn_config); None: none
    embedding_multiplier: float = 1.0          # input embeddings scaled (Granite)
    residual_multiplier: float = 1.0           # each sublayer's output scaled before the residual add (Granite)
    parallel_residual: bool = False            # GPT-NeoX's use_parallel_residual: attention and MLP both read the stream
    shared_parallel_norm: bool = False         # and both read one norm of it (Falcon-7b's), not a norm each
    post_norm: bool = False                    # each norm after its sublayer's add, no final norm (OPT-350m)
    embedding_size: int = 0                    # token embeddings narrower than hidden, projected in and out (OPT's
                                               # word_embed_proj_dim); 0: hidden_size
    logits_scaling: float = 1.0                # logits divided (Granite)
    final_logit_softcapping: float | None = None
    # -- mixture of experts (Qwen3-MoE, Mixtral); 0 experts: every MLP is dense ---------------
    num_experts: int = 0                       # routed experts per MoE layer
    num_experts_per_tok: int = 0               # top-k experts each token is sent to
    moe_intermediate_size: int = 0             # one expert's intermediate size
    norm_topk_prob: bool = True                # the top-k routing weights renormalized to sum to 1
    moe_layers: tuple[int, ...] | None = None  # the layers whose MLP is the MoE block; None: all
    moe_bias: bool = False                     # the experts' projections and the router have biases (gpt-oss)
    shared_expert_intermediate_size: int = 0   # a shared expert beside the routed ones (Granite MoE Shared); 0: none
    moe_routing: Routing = Routing()           # DeepSeek's scoring, groups and scale; the default: softmax top-k
    mla: MLADims | None = None                 # DeepSeek's latent attention; head_size is then its cache row's width
    rotary_interleaved: bool = False           # the rotary turns interleaved pairs: q/k rows reordered at load (DeepSeek)
    swiglu_limit: float | None = None          # gpt-oss's clamped experts ("swigluoai"); None: SiLU-gated
    swiglu_alpha: float = 1.702                # its sigmoid's slope
    # -- state-space layers (Mamba, Mamba-2, and the hybrids that mix them with attention) -------
    mamba: MambaDims | None = None             # None: every layer attends
    mamba_layers: tuple[int, ...] | None = None  # the layers whose mixer is Mamba; None with ``mamba``: all
    mixerless_layers: tuple[int, ...] = ()     # layers without a token mixer (Nemotron-H's MLP blocks): no cache
    # -- encoder-only models (BERT, RoBERTa: models/bert.py) --------------------------------------
    encoder_only: bool = False                 # bidirectional attention over each prompt whole, no KV cache
    type_vocab_size: int = 0                   # token types (a text pair's segments); 0: none
    position_offset: int = 0                   # a prompt's first position in the position table (RoBERTa's 2)
    do_lower_case: bool = False                # sentence-transformers' config: pooling prompts lower-cased first
    max_position_embeddings: int = 0          # the position table's rows; 0: max_model_len + position_offset
    norm_bias: bool = True                     # their LayerNorms carry a bias (ModernBERT's do not)
    classifier_bias: bool = False              # a classifier head's dense layer has a bias (ModernBERT's)
    cls_token_id: int | None = None            # config.json's (SPLADE's pooling leaves those tokens out)
    sep_token_id: int | None = None
    # -- image input (a multimodal checkpoint served whole by the transformers backend) -----------
    image_token_id: int | None = None          # the token whose positions take an image's embeddings; None: text only
    mm_prefix_lm: bool = False                 # an image's positions attend to each other both ways (Gemma 3's)
    # M-RoPE: the vision patches merged into one image position, per side (spatial_merge_size)
    image_merge_size: int = 1
    # video input (Troupe's Qwen2-VL and Qwen2.5-VL classes): the token whose positions take a
    # video's embeddings (None: no videos), and M-RoPE's time positions per second of video
    # (Qwen2.5-VL's vision_config.tokens_per_second; a video's temporal patch spans its
    # second_per_grid_ts of them)
    video_token_id: int | None = None
    video_tokens_per_second: float = 1.0
    # audio input (Troupe's Qwen2-Audio class): the token whose positions take an audio clip's
    # embeddings; None: no audio
    audio_token_id: int | None = None
    # -- how the engine serves it (set by ``serving``, not read from the checkpoint) -------------
    serving_len: int = 0                       # the engine's --max-model-len; 0: default_max_model_len
    # a classifier's labels (--convert classify: a ``score`` head, hidden -> labels); 0: none
    num_labels: int = 0
    score_bias: bool = False                   # the score head has a bias (a token classifier's)
    # the score head made from the LM head's rows of these tokens (vLLM's classifier_from_token):
    # one label and two tokens, row[1] - row[0]; otherwise a row per label
    score_from_tokens: tuple[int, ...] = ()
    # a reward model's score head (vLLM's Qwen2ForRewardModel): hidden -> hidden, ReLU, -> labels
    score_mlp: bool = False

    def is_mamba_layer(self, layer: int) -> bool:
        """The layer mixes with a state-space state, not attention (no KV cache)."""
        return self.mamba is not None and (self.mamba_layers is None or layer in self.mamba_layers)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that attend, and hold KV cache."""
        return tuple(i for i in range(self.num_layers) if not self.is_mamba_layer(i) and i not in self.mixerless_layers)

    def mamba_state_bytes(self, dtype_bytes: int) -> int:
        """The recurrent state one request holds over all the state-space layers."""
        if self.mamba is None:
            return 0
        return sum(map(self.is_mamba_layer, range(self.num_layers))) * self.mamba.state_bytes(dtype_bytes)

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and (self.moe_layers is None or layer in self.moe_layers)

    def __post_init__(self) -> None:
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
            if not set(self.layer_types) <= {SLIDING, FULL}:
                raise ValueError(f"layer_types may hold {SLIDING!r} and {FULL!r}, got {sorted(set(self.layer_types))}")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_size and self.rotary_dim % 2 == 0):
            raise ValueError(f"a rotary over {self.rotary_dim} of {self.head_size} head dimensions is not supported "
                             "(an even number, at most the head's)")
        if self.mrope_section and 2 * sum(self.mrope_section) != (self.rotary_dim or self.head_size):
            raise ValueError(f"mrope_section {list(self.mrope_section)} covers {2 * sum(self.mrope_section)} rotary "
                             f"dimensions of {self.rotary_dim or self.head_size}")
        if self.rope_layers is not None and len(self.rope_layers) != self.num_layers:
            raise ValueError(f"rope_layers has {len(self.rope_layers)} entries for {self.num_layers} layers")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Bytes of K and V one token occupies across all the attention layers."""
        return 2 * len(self.attention_layers) * self.num_kv_heads * self.head_size * dtype_bytes

    def layer_uses_rope(self, layer: int) -> bool:
        return self.rope_layers is None or self.rope_layers[layer]

    def layer_sliding_window(self, layer: int) -> int | None:
        """The window of ``layer``'s attention, None for full attention."""
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def without_sliding_window(self) -> ArchConfig:
        """vLLM's --disable-sliding-window: every layer attends to the whole context, and the
        context is capped at the window, so within it the outputs are the windowed model's. The
        layers keep their types (Gemma 3's sliding layers keep their own rotary base)."""
        window = self.max_sliding_window
        if window is None:
            return self
        return dataclasses.replace(self, sliding_window=None, max_model_len=min(self.max_model_len, window))

    @property
    def default_max_model_len(self) -> int:
        """The context an engine serves when not told (vLLM's): all of ``max_model_len``, but the
        original context for longrope and dynamic NTK scaling (models/rope.py)."""
        return self.rope_scaling.default_len(self.max_model_len)

    def serving(self, max_model_len: int) -> ArchConfig:
        """This config for an engine serving contexts up to ``max_model_len`` (0: the default):
        the rotary tables cover them, and the rope scalings that depend on the context (longrope,
        dynamic) take theirs."""
        return dataclasses.replace(self, serving_len=max_model_len or self.default_max_model_len)

    @property
    def rope_positions(self) -> int:
        """The positions the rotary tables cover: the context the engine serves (less than the
        model's: a Llama 3.1's 131,072 positions of float32 cos and sin are 128 MB; more where
        VLLM_ALLOW_LONG_MAX_MODEL_LEN allowed it), else the model's."""
        return self.serving_len or self.max_model_len

    @property
    def max_sliding_window(self) -> int | None:
        """The largest window of any layer (what the attention backend must support)."""
        windows = [w for w in map(self.layer_sliding_window, range(self.num_layers)) if w is not None]
        return max(windows, default=None)

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_size) ** -0.5
