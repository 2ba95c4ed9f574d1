"""Tiny real checkpoints, written by transformers' own ``save_pretrained`` (random weights).

Every test that needs a checkpoint builds it from one of these configs; nothing is downloaded.
``CONFIGS`` covers the traps of DESIGN.md: GQA and MHA, tied and untied, biases (qwen2), MoE
(mixtral), fused parts (phi3), Conv1D ``[in, out]`` (gpt2), head_dim != hidden/heads (gemma).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Small enough to build in well under a second; odd enough to catch dim mix-ups
# (hidden != intermediate != vocab, kv heads != heads). Kept compact on purpose.
# fmt: off
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, vocab_size=256,
        tie_word_embeddings=False, max_position_embeddings=128,
    ),
    "llama-tied-mha": dict(
        model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=200,
        tie_word_embeddings=True, max_position_embeddings=128,
    ),
    "llama-bias-headdim": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=128,
        attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
        max_position_embeddings=128,
    ),
    "mistral": dict(
        model_type="mistral", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, vocab_size=256,
        tie_word_embeddings=False, max_position_embeddings=128, sliding_window=None,
    ),
    "qwen2": dict(
        model_type="qwen2", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, vocab_size=256,
        tie_word_embeddings=False, max_position_embeddings=128,
    ),
    "qwen2-tied": dict(
        model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, vocab_size=192,
        tie_word_embeddings=True, max_position_embeddings=128,
    ),
    "mixtral": dict(
        model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, vocab_size=256, num_local_experts=4,
        num_experts_per_tok=2, tie_word_embeddings=False, max_position_embeddings=128,
    ),
    "gpt2": dict(
        model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=250, n_positions=64,
        bos_token_id=0, eos_token_id=0,
    ),
    "phi3": dict(
        model_type="phi3", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, vocab_size=256,
        tie_word_embeddings=False, max_position_embeddings=128, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    ),
    "phi3-mha": dict(
        model_type="phi3", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=128,
        tie_word_embeddings=False, max_position_embeddings=128, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    ),
    "gemma": dict(
        model_type="gemma", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, vocab_size=256,
        max_position_embeddings=128,
    ),
    # Added with the inventory tests: more of the variants the inventory must get right.
    "mistral-headdim": dict(
        model_type="mistral", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, vocab_size=160,
        tie_word_embeddings=False, max_position_embeddings=128, sliding_window=None,
    ),
    "mixtral-mha-tied": dict(
        model_type="mixtral", hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=144, num_local_experts=3,
        num_experts_per_tok=1, tie_word_embeddings=True, max_position_embeddings=128,
    ),
    "gpt2-untied-inner": dict(
        model_type="gpt2", n_embd=48, n_layer=3, n_head=4, n_inner=80, vocab_size=130,
        n_positions=40, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
    ),
    "phi3-tied": dict(
        model_type="phi3", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=136,
        tie_word_embeddings=True, max_position_embeddings=128, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    ),
    "gemma-untied-mha": dict(
        model_type="gemma", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, vocab_size=144,
        tie_word_embeddings=False, max_position_embeddings=128,
    ),
    "gemma2": dict(
        model_type="gemma2", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256,
        max_position_embeddings=128,
    ),
    "qwen3": dict(
        model_type="qwen3", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, vocab_size=256,
        tie_word_embeddings=False, max_position_embeddings=128,
    ),
    # Granite 3.x: Llama tensors, tied, with the multipliers far from 1 so a dropped one shows.
    "granite": dict(
        model_type="granite", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, vocab_size=256,
        tie_word_embeddings=True, max_position_embeddings=128, embedding_multiplier=12.0,
        logits_scaling=8.0, residual_multiplier=0.22, attention_multiplier=0.0625,
    ),
    # fam-dense: OLMo-2, StarCoder2, Cohere, StableLM, GLM-4, Gemma-3 (text).
    "olmo2": dict(  # q/k norm over the whole projection; GQA so tp 4 > kv 2 replicates
        model_type="olmo2", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, vocab_size=256,
        tie_word_embeddings=False, max_position_embeddings=128,
    ),
    "starcoder2": dict(  # biases everywhere, LayerNorm with bias, c_fc/c_proj GeLU MLP
        model_type="starcoder2", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, vocab_size=256,
        tie_word_embeddings=True, max_position_embeddings=128, bos_token_id=0, eos_token_id=0,
    ),
    "cohere": dict(  # parallel attn+MLP, per-head [heads, head_dim] q/k LayerNorm, logit_scale
        model_type="cohere", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, vocab_size=256, use_qk_norm=True,
        logit_scale=0.5, tie_word_embeddings=True, max_position_embeddings=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    ),
    "stablelm": dict(  # partial rotary, qkv bias, per-head q/k LayerNorms, parallel residual
        model_type="stablelm", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, vocab_size=256, use_qkv_bias=True,
        qk_layernorm=True, use_parallel_residual=True, tie_word_embeddings=False,
        max_position_embeddings=128, bos_token_id=0, eos_token_id=0,
    ),
    "stablelm-sequential": dict(  # StableLM-2-1.6B style: post_attention_layernorm, no qk norm
        model_type="stablelm", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=128, use_qkv_bias=True,
        tie_word_embeddings=False, max_position_embeddings=128, bos_token_id=0, eos_token_id=0,
    ),
    "glm4": dict(  # fused gate_up, qkv bias, 4 norms per layer, partial rotary
        model_type="glm4", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=8, vocab_size=256,
        attention_bias=True, tie_word_embeddings=False, max_position_embeddings=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    ),
    "gemma3_text": dict(  # q/k norms, 4 norms, sliding 5:1 (window 4 < the test's 16 tokens)
        model_type="gemma3_text", hidden_size=64, intermediate_size=160, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256,
        sliding_window=4, max_position_embeddings=128,
    ),
    # fam-fused: GPT-NeoX (per-head interleaved query_key_value), Phi-1/2, Falcon (3 layouts)
    "gpt_neox": dict(
        model_type="gpt_neox", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, vocab_size=256, max_position_embeddings=128,
        tie_word_embeddings=False,
    ),
    "gpt_neox-sequential-nobias": dict(
        model_type="gpt_neox", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, vocab_size=200, max_position_embeddings=128,
        use_parallel_residual=False, attention_bias=False, tie_word_embeddings=True,
    ),
    "phi": dict(
        model_type="phi", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, vocab_size=256,
        max_position_embeddings=128,
    ),
    "phi-qk-layernorm": dict(
        model_type="phi", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, vocab_size=250, max_position_embeddings=128, qk_layernorm=True,
    ),
    "falcon": dict(  # new decoder architecture (Falcon-40B style): 2 kv groups of 4 q heads
        model_type="falcon", hidden_size=64, ffn_hidden_size=160, num_hidden_layers=2,
        num_attention_heads=8, num_kv_heads=2, new_decoder_architecture=True, vocab_size=256,
    ),
    "falcon-mqa": dict(  # Falcon-7B style: multi_query, parallel_attn, one input_layernorm
        model_type="falcon", hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
        multi_query=True, vocab_size=250, tie_word_embeddings=False,
    ),
    "falcon-mha-sequential-bias": dict(  # classic MHA, per-head [q; k; v], 2 norms, biases
        model_type="falcon", hidden_size=64, ffn_hidden_size=96, num_hidden_layers=2,
        num_attention_heads=4, multi_query=False, parallel_attn=False, bias=True,
        vocab_size=256,
    ),
    # fam-moe: the MoE families (a dense layer in each, so mixed layers are exercised).
    "qwen2_moe": dict(
        model_type="qwen2_moe", hidden_size=64, intermediate_size=160, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, vocab_size=256, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=80,
        decoder_sparse_step=1, mlp_only_layers=[2], tie_word_embeddings=False,
        max_position_embeddings=128,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe", hidden_size=64, intermediate_size=160, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, vocab_size=256,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=1,
        mlp_only_layers=[0], norm_topk_prob=True, tie_word_embeddings=False,
        max_position_embeddings=128,
    ),
    "llama4_text": dict(
        model_type="llama4_text", hidden_size=64, intermediate_size=48,
        intermediate_size_mlp=96, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, vocab_size=256, num_local_experts=4,
        num_experts_per_tok=1, interleave_moe_layer_step=2, tie_word_embeddings=False,
        max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=None,
    ),
    "gpt_oss": dict(
        model_type="gpt_oss", hidden_size=64, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, vocab_size=256,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        tie_word_embeddings=False, max_position_embeddings=128,
    ),
    # fam-mla: DeepSeek MLA + MoE. Layer 0 dense (first_k_dense_replace), 1..3 MoE with 8
    # routed + 2 shared experts; v_head_dim != qk_nope_head_dim != kv_lora_rank, so a mix-up
    # of the MLA dims cannot hide. V2 here is V2-Lite-like (no q_lora_rank: plain q_proj).
    "deepseek_v2": dict(
        model_type="deepseek_v2", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=256, q_lora_rank=None,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
        first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=2, topk_group=1,
        routed_scaling_factor=2.0, tie_word_embeddings=False, max_position_embeddings=128,
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=256, q_lora_rank=24,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=128,
    ),
    # GLM-4.5: GQA with q/k/v biases, per-head q/k norms and partial rotary; DeepSeek-V3's MoE
    # (one dense layer, shared experts, sigmoid router with correction bias, groups)
    "glm4_moe": dict(
        model_type="glm4_moe", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5,
        tie_word_embeddings=False, max_position_embeddings=128,
    ),
    # MiniMax-M2: whole-projection q/k norms (split with the heads), partial rotary, Mixtral's
    # expert names with a sigmoid router and correction bias
    "minimax_m2": dict(
        model_type="minimax_m2", hidden_size=64, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
        num_local_experts=8, num_experts_per_tok=2, rotary_dim=8, tie_word_embeddings=False,
        max_position_embeddings=128,
    ),
    # Qwen2.5-VL: qwen2's text model at the top level (kv 2, qkv biases, multimodal rotary)
    # beside a windowed ViT (4 heads, fused qkv, gated MLP with biases) and a 2x2 merger
    "qwen2_5_vl": dict(
        model_type="qwen2_5_vl", tie_word_embeddings=False,
        text_config=dict(
            hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64,
            fullatt_block_indexes=[1], window_size=112,
        ),
    ),
    # Qwen2-VL: qwen2's text model (kv 2, qkv biases, multimodal rotary) beside a ViT with
    # LayerNorms and a fc1/fc2 MLP (4 heads, fused qkv split as one slice) and a 2x2 merger
    "qwen2_vl": dict(
        model_type="qwen2_vl", tie_word_embeddings=False,
        text_config=dict(
            hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2),
    ),
    # Qwen3-VL: qwen3's text model (kv 2, q/k norms, interleaved multimodal rotary) under
    # model.language_model.* beside a ViT with position table, 4 heads and two DeepStack mergers
    "qwen3_vl": dict(
        model_type="qwen3_vl", tie_word_embeddings=False,
        text_config=dict(
            hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=128,
            rope_parameters={
                "rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
        ),
        vision_config=dict(
            depth=3, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64,
            deepstack_visual_indexes=[0, 2], num_position_embeddings=64,
        ),
    ),
    # quant branch: dims where real quantization blocks fit (head_dim 128 = one FP8 block and
    # one GPTQ/AWQ group of 128; tp=2 splits every block/group, tp=4 cuts in-features 256).
    "llama-quant": dict(
        model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=128, vocab_size=128,
        tie_word_embeddings=False, max_position_embeddings=128,
    ),
    "llama-quant4": dict(
        model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=128,
        tie_word_embeddings=False, max_position_embeddings=128,
    ),
    "mixtral-quant": dict(
        model_type="mixtral", hidden_size=256, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=128, vocab_size=128,
        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
        max_position_embeddings=128,
    ),
    # flagships: the multimodal Llama-4 (Llama4ForConditionalGeneration): llama4_text's model
    # under language_model.* beside a vision tower and projector (make_checkpoint: a config
    # with a vision_config is written by transformers' image-text-to-text class)
    "llama4": dict(
        model_type="llama4", tie_word_embeddings=False,
        text_config=dict(
            hidden_size=64, intermediate_size=48, intermediate_size_mlp=96, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, head_dim=16, vocab_size=256,
            num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
            max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=None,
        ),
        vision_config=dict(
            hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            image_size=56, patch_size=14, projector_input_dim=48, projector_output_dim=40,
            vision_output_dim=24, pixel_shuffle_ratio=0.5,
        ),
    ),
    # flagships: the multimodal Gemma-3 (Gemma3ForConditionalGeneration): gemma3_text's model
    # under language_model.* beside a SigLIP tower and the pooling projector (4 x 4 patches
    # pooled to 4 tokens per image)
    "gemma3": dict(
        model_type="gemma3", mm_tokens_per_image=4, image_token_index=255,
        boi_token_index=253, eoi_token_index=254,
        text_config=dict(
            hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, sliding_window=8,
            max_position_embeddings=128, query_pre_attn_scalar=16,
        ),
        vision_config=dict(
            hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            image_size=56, patch_size=14, vision_use_head=False,
        ),
    ),
    # flagships: the multimodal Mistral-3 (Mistral3ForConditionalGeneration): mistral's model
    # under language_model.* (its own lm_head, as published) beside a Pixtral tower and the
    # 2 x 2 patch-merging projector
    "mistral3": dict(
        model_type="mistral3", tie_word_embeddings=False, image_token_index=10,
        spatial_merge_size=2,
        text_config=dict(
            model_type="mistral", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
            max_position_embeddings=128, sliding_window=None,
        ),
        vision_config=dict(
            model_type="pixtral", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, head_dim=8, image_size=56, patch_size=14,
        ),
    ),
    # LLaVA-NeXT as granite-vision builds it: granite (multipliers, tied at the top level)
    # beside a SigLIP tower (pooling head saved), features of two layers, strategy "full"
    "llava_next": dict(
        model_type="llava_next", tie_word_embeddings=True, image_token_index=255,
        vision_feature_layer=[-2, -1], vision_feature_select_strategy="full",
        image_grid_pinpoints=[[28, 56], [56, 28], [56, 56]],
        text_config=dict(
            model_type="granite", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            max_position_embeddings=128, embedding_multiplier=12.0, logits_scaling=8.0,
            residual_multiplier=0.22, attention_multiplier=0.015625,
        ),
        vision_config=dict(
            model_type="siglip_vision_model", hidden_size=32, intermediate_size=48,
            num_hidden_layers=2, num_attention_heads=4, image_size=28, patch_size=14,
        ),
    ),
    # LLaVA-1.5: llama beside a CLIP tower (class token, pre_layrnorm)
    "llava": dict(
        model_type="llava", tie_word_embeddings=False, image_token_index=255,
        vision_feature_layer=-2, vision_feature_select_strategy="default",
        text_config=dict(
            model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            max_position_embeddings=128,
        ),
        vision_config=dict(
            model_type="clip_vision_model", hidden_size=32, intermediate_size=48,
            num_hidden_layers=2, num_attention_heads=4, image_size=28, patch_size=14,
            projection_dim=32,
        ),
    ),
}
# fmt: on

# Qwen3-VL-MoE: Qwen3-VL's config with qwen3_moe's text model (4 experts of 48, top 2, layer 1
# dense) under model.language_model.*, its experts packed as the releases store them ([E, H, 2I],
# [E, I, H]: make_checkpoint transposes what transformers 5 saves), beside the same ViT
CONFIGS["qwen3_vl_moe"] = {
    **CONFIGS["qwen3_vl"],
    "model_type": "qwen3_vl_moe",
    "text_config": {
        **CONFIGS["qwen3_vl"]["text_config"],
        "moe_intermediate_size": 48,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
    },
}


# Real sizes where the logic depends on size, widths shrunk so they build in seconds:
# Llama-3's 128,256-entry vocabulary with its 32 / 8 heads (``make_checkpoint("llama", out,
# **LLAMA3_VOCAB)``), and a Qwen3-MoE of 10,000+ tensors in 20+ files of at most 200 KB
# (``make_checkpoint("qwen3_moe", out, **MANY_QWEN3_MOE)``).
LLAMA3_VOCAB: dict[str, Any] = dict(
    vocab_size=128_256,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_hidden_layers=2,
)
MANY_QWEN3_MOE: dict[str, Any] = dict(
    max_shard_size="200KB",
    num_hidden_layers=14,
    num_experts=256,
    moe_intermediate_size=16,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
)


def make_config(name: str, **overrides: Any) -> Any:
    """A transformers ``PretrainedConfig`` for ``CONFIGS[name]`` (with overrides)."""
    from transformers import AutoConfig

    fields = dict(CONFIGS[name])
    fields.update(overrides)
    model_type = fields.pop("model_type")
    return AutoConfig.for_model(model_type, **fields)


def make_checkpoint(
    name: str,
    out: Path,
    *,
    dtype: str = "bfloat16",
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a random-weight checkpoint of ``CONFIGS[name]`` to ``out`` with ``save_pretrained``.

    ``max_shard_size`` (e.g. ``"20KB"``) makes transformers write several files and an index.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    cfg = make_config(name, **overrides)
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if "vision_config" in CONFIGS[name] else AutoModelForCausalLM
    model = auto.from_config(cfg, dtype=getattr(torch, dtype))
    # Random non-trivial norms and biases too, so a swapped or dropped tensor cannot hide; but
    # matrices scaled by 1/sqrt(fan-in) so activations stay O(1) and the dtype's own noise is
    # small: a loose reference would let a wrong-but-plausible layout pass verify's forward.
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn_like(p, dtype=torch.float32)
            if p.ndim >= 2:
                value = noise * min(p.shape[-2:]) ** -0.5
            elif "norm" in name or ".ln_" in name or name.endswith("ln_f.weight"):
                value = 1.0 + 0.2 * noise
            else:
                value = 0.2 * noise
            p.copy_(value.to(p.dtype))
        # a router's correction bias is a saved buffer that transformers initializes to zeros:
        # random too, so a bias loaded into the wrong layer (or not at all) changes the routing
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_((0.2 * torch.randn_like(b, dtype=torch.float32)).to(b.dtype))
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)
    published_expert_layout(out)
    return out


def published_expert_layout(out: Path) -> None:
    """Rewrite ``out``'s packed experts as its family's published files hold them: dims 1 and 2
    swapped of every tensor the family stores ``[E, in, out]`` where transformers 5 holds and
    ``save_pretrained`` writes ``[E, out, in]`` (``ExpertSpec.transposed``: Qwen3-VL-MoE's
    gate_up_proj / down_proj; transformers' conversion_mapping.py transposes them on load). A
    no-op for every other family."""
    import json

    from safetensors.torch import load_file, save_file

    from shardctl.archs import find

    family = find(json.loads((out / "config.json").read_text())["model_type"])
    experts = family.forward.experts if family is not None and family.forward else None
    if experts is None or not experts.transposed:
        return
    ends = tuple("." + name for name in experts.transposed)
    for f in sorted(out.glob("*.safetensors")):
        state = load_file(str(f))
        state = {
            k: (v.transpose(1, 2).contiguous() if k.endswith(ends) else v) for k, v in state.items()
        }
        save_file(state, str(f), metadata={"format": "pt"})
