"""Build a tiny Llama-style model directory that SGLang can serve on CPU, with nothing from a hub.

The directory holds:
- config.json: a 2-layer Llama with grouped-query attention (4 query heads, 2 KV heads), float32;
- tokenizer.json / tokenizer_config.json: a byte-level BPE trained here with `tokenizers` on a
  generated corpus, with a chat template so /v1/chat/completions works;
- model.safetensors: random weights from a fixed seed.

Why our own weights and not `--load-format dummy`: SGLang's dummy loader seeds every parameter with the
same seed and draws from U(-1e-3, 1e-3), so all layers are identical and the logits are almost flat;
greedy outputs then barely depend on the prompt, which would make a token-identical comparison
meaningless. Our weights are scaled so that logits have wide margins: greedy decoding is varied across
prompts and robust to the float32 rounding differences between batch shapes (standalone vs PD, one
request vs sixteen).

The build is deterministic (numpy PCG64 with a fixed seed, a fixed corpus) and cheap (about a second),
so every server of a test session loads byte-identical files. Run as a script to build one by hand:
`python -m harness.tiny_model /tmp/tiny-llama`.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from pathlib import Path

import numpy as np

SEED = 20261122
HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 128
VOCAB = 512
MAX_POSITIONS = 4096
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

# A minimal template in the usual role-tag style; `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

_WORDS = (
    "the a one two three red blue green small large quick slow bright dark river mountain city "
    "forest engine memory cache prefill decode token batch server router request transfer page "
    "layer kernel tensor signal packet network queue thread worker lane buffer offset length "
    "time north south east west morning evening winter summer stone glass paper music light "
    "runs moves writes reads sends waits opens closes grows falls turns holds finds keeps "
    "under over across through between before after while because and or but with without"
).split()


def _corpus(rng: random.Random, lines: int = 4000) -> list[str]:
    """Generated text: sentences of random words with digits and punctuation, enough for BPE merges."""
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        sentence = " ".join(words)
        out.append(sentence[0].upper() + sentence[1:] + rng.choice([".", "!", "?", ",", ";"]))
    return out


def _build_tokenizer(out_dir: Path) -> int:
    """Train the byte-level BPE and write tokenizer files; returns the tokenizer's vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL_TOKENS,
        # Every byte is in the alphabet, so any UTF-8 input encodes (no unknown token needed).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(SEED)), trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "add_bos_token": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}, indent=2)
    )
    return tok.get_vocab_size()


def _config(token_ids: dict[str, int]) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": VOCAB,
        "bos_token_id": token_ids["<|bos|>"],
        "eos_token_id": token_ids["<|eos|>"],
        "pad_token_id": token_ids["<|pad|>"],
        # float32 so that batch-shape rounding differences stay far below the logit margins.
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def _weights() -> dict[str, np.ndarray]:
    """Random float32 weights; scales chosen so activations stay O(1) and logits spread widely."""
    rng = np.random.Generator(np.random.PCG64(SEED))

    def dense(out_features: int, in_features: int, gain: float = 1.0) -> np.ndarray:
        w = rng.standard_normal((out_features, in_features)) * (gain / np.sqrt(in_features))
        return w.astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(HIDDEN)
        # A larger query/key gain makes attention peaked, so outputs depend on earlier context too.
        w[p + "self_attn.q_proj.weight"] = dense(HEADS * HEAD_DIM, HIDDEN, 2.0)
        w[p + "self_attn.k_proj.weight"] = dense(KV_HEADS * HEAD_DIM, HIDDEN, 2.0)
        w[p + "self_attn.v_proj.weight"] = dense(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = dense(HIDDEN, HEADS * HEAD_DIM)
        w[p + "post_attention_layernorm.weight"] = norm(HIDDEN)
        w[p + "mlp.gate_proj.weight"] = dense(INTERMEDIATE, HIDDEN)
        w[p + "mlp.up_proj.weight"] = dense(INTERMEDIATE, HIDDEN)
        w[p + "mlp.down_proj.weight"] = dense(HIDDEN, INTERMEDIATE)
    w["model.norm.weight"] = norm(HIDDEN)
    # Logit standard deviation of about 8: the top-1 margin is typically far above float32 noise.
    w["lm_head.weight"] = dense(VOCAB, HIDDEN, 8.0)
    return w


def build_tiny_model(out_dir: str | os.PathLike) -> Path:
    """Write the model into out_dir (created if needed) and return its path.

    Rebuilding into the same directory yields byte-identical files, so concurrent callers are safe
    as long as each writes its own directory.
    """
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_vocab = _build_tokenizer(out)
    if tokenizer_vocab > VOCAB:
        raise RuntimeError(f"tokenizer has {tokenizer_vocab} tokens, model vocabulary is {VOCAB}")
    token_ids = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    special_ids = {t: token_ids[t] for t in SPECIAL_TOKENS if t in token_ids}
    if len(special_ids) != len(SPECIAL_TOKENS):
        # Special tokens live in added_tokens, not in the BPE vocab, in some tokenizers versions.
        added = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
        special_ids.update({a["content"]: a["id"] for a in added})
    (out / "config.json").write_text(json.dumps(_config(special_ids), indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": special_ids["<|bos|>"], "eos_token_id": special_ids["<|eos|>"]})
    )
    save_file(_weights(), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def kv_bytes_per_token() -> int:
    """KV cache bytes one token occupies (and a PD transfer moves): K and V of every layer, float32."""
    return LAYERS * 2 * KV_HEADS * HEAD_DIM * 4


def model_fingerprint(model_dir: str | os.PathLike) -> str:
    """sha256 over the files that define outputs; equal fingerprints mean identical servers' inputs."""
    digest = hashlib.sha256()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        digest.update(name.encode())
        digest.update((Path(model_dir) / name).read_bytes())
    return digest.hexdigest()


if __name__ == "__main__":
    target = build_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "/tmp/sglang-mori-tiny-llama")
    print(target, model_fingerprint(target))
