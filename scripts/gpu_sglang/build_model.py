"""Write a random-weight Llama-shaped GQA model directory (config.json + model.safetensors) for the
GPU runs of real SGLang: no tokenizer (servers run with --skip-tokenizer-init and take input_ids).

Why not `--load-format dummy`: its U(-1e-3, 1e-3) weights, the same seed for every parameter, give
near-flat logits, so greedy tokens would flip on rounding noise between batch shapes (the CPU harness's
test/harness/tiny_model.py explains the same choice). Weights here are scaled for O(1) activations and
wide logit margins. Deterministic: numpy PCG64 from a fixed seed, so every server loads equal bytes.

Usage: build_model.py OUT_DIR [--arch llama|mla] [--layers N] [--hidden H] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

SEED = 20261127


def build(out: Path, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int,
          vocab: int, dtype: str) -> Path:
    from safetensors.numpy import save_file

    head_dim = hidden // heads
    rng = np.random.Generator(np.random.PCG64(SEED))

    def dense(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * (gain / np.sqrt(cols))).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, hidden), dtype=np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(hidden)
        # Peaked attention, so outputs depend on the whole context (and so on the transferred KV).
        w[p + "self_attn.q_proj.weight"] = dense(heads * head_dim, hidden, 2.0)
        w[p + "self_attn.k_proj.weight"] = dense(kv_heads * head_dim, hidden, 2.0)
        w[p + "self_attn.v_proj.weight"] = dense(kv_heads * head_dim, hidden)
        w[p + "self_attn.o_proj.weight"] = dense(hidden, heads * head_dim)
        w[p + "post_attention_layernorm.weight"] = norm(hidden)
        w[p + "mlp.gate_proj.weight"] = dense(intermediate, hidden)
        w[p + "mlp.up_proj.weight"] = dense(intermediate, hidden)
        w[p + "mlp.down_proj.weight"] = dense(hidden, intermediate)
    w["model.norm.weight"] = norm(hidden)
    w["lm_head.weight"] = dense(vocab, hidden, 8.0)  # logit std about 8: wide top-1 margins
    out.mkdir(parents=True, exist_ok=True)
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "hidden_act": "silu", "max_position_embeddings": 16384, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "vocab_size": vocab,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": dtype, "dtype": dtype,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def build_mla(out: Path, layers: int, hidden: int, heads: int, intermediate: int, vocab: int,
              dtype: str, kv_lora: int = 512, nope: int = 128, rope: int = 64, v_dim: int = 128) -> Path:
    """DeepSeek-V2-shaped (MLA: one compressed latent + one rope key per token; DeepSeek-V2-Lite's
    attention dims, which SGLang's Triton MLA decode kernel expects: with a 256-wide latent it failed
    to compile, 256 vs 512 in its P.V dot), dense MLP in every
    layer (first_k_dense_replace = layers), no q LoRA."""
    from safetensors.numpy import save_file

    rng = np.random.Generator(np.random.PCG64(SEED))

    def dense(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * (gain / np.sqrt(cols))).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, hidden), dtype=np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(hidden)
        w[p + "self_attn.q_proj.weight"] = dense(heads * (nope + rope), hidden, 2.0)
        w[p + "self_attn.kv_a_proj_with_mqa.weight"] = dense(kv_lora + rope, hidden, 2.0)
        w[p + "self_attn.kv_a_layernorm.weight"] = norm(kv_lora)
        w[p + "self_attn.kv_b_proj.weight"] = dense(heads * (nope + v_dim), kv_lora)
        w[p + "self_attn.o_proj.weight"] = dense(hidden, heads * v_dim)
        w[p + "post_attention_layernorm.weight"] = norm(hidden)
        w[p + "mlp.gate_proj.weight"] = dense(intermediate, hidden)
        w[p + "mlp.up_proj.weight"] = dense(intermediate, hidden)
        w[p + "mlp.down_proj.weight"] = dense(hidden, intermediate)
    w["model.norm.weight"] = norm(hidden)
    w["lm_head.weight"] = dense(vocab, hidden, 8.0)
    out.mkdir(parents=True, exist_ok=True)
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "q_lora_rank": None,
        "kv_lora_rank": kv_lora, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope,
        "v_head_dim": v_dim, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "moe_intermediate_size": 256, "first_k_dense_replace": layers, "moe_layer_freq": 1,
        "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
        "scoring_func": "softmax", "routed_scaling_factor": 1.0, "hidden_act": "silu",
        "max_position_embeddings": 16384, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": False,
        "vocab_size": vocab, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": dtype, "dtype": dtype,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dtype", default="bfloat16")  # what SGLang's --dtype auto serves
    ap.add_argument("--arch", choices=("llama", "mla"), default="llama")
    a = ap.parse_args()
    if a.arch == "mla":
        print(build_mla(Path(a.out), a.layers, a.hidden, a.heads, a.intermediate, a.vocab, a.dtype))
        return
    print(build(Path(a.out), a.layers, a.hidden, a.heads, a.kv_heads, a.intermediate, a.vocab, a.dtype))


if __name__ == "__main__":
    main()
