"""The GGUF -> Hugging Face checkpoint conversion of harness.real_model.

Cheap tests run the converter on a tiny GGUF written here with the `gguf` package (Q/K permuted the way
llama.cpp's converter does, one Q8_0 tensor); one test loads the real converted SmolLM2 with
transformers and asks it a question.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from harness import real_model as rm

# -- names and permutation --------------------------------------------------------------------------


@pytest.mark.parametrize("gguf_name, hf", [
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
    ("blk.7.attn_q.weight", "model.layers.7.self_attn.q_proj.weight"),
    ("blk.12.attn_k.weight", "model.layers.12.self_attn.k_proj.weight"),
    ("blk.29.attn_v.weight", "model.layers.29.self_attn.v_proj.weight"),
    ("blk.3.attn_output.weight", "model.layers.3.self_attn.o_proj.weight"),
    ("blk.3.ffn_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
    ("blk.3.ffn_gate.weight", "model.layers.3.mlp.gate_proj.weight"),
    ("blk.3.ffn_up.weight", "model.layers.3.mlp.up_proj.weight"),
    ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight"),
])
def test_hf_names(gguf_name, hf):
    assert rm.hf_name(gguf_name) == hf


@pytest.mark.parametrize("name", ["blk.0.attn_qkv.weight", "rope_freqs.weight", "blk.x.attn_q.weight", ""])
def test_unknown_names_are_refused(name):
    with pytest.raises(KeyError):
        rm.hf_name(name)


def test_permutation_of_one_head_interleaves_the_halves():
    w = np.arange(8, dtype=np.float32).reshape(8, 1)  # rows 0-3 first half, 4-7 second half
    assert rm.permute_rotary(w, 1)[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert rm.unpermute_rotary(rm.permute_rotary(w, 1), 1)[:, 0].tolist() == list(range(8))


@pytest.mark.parametrize("heads", [9, 3, 1])
def test_unpermute_inverts_permute(heads):
    w = np.random.default_rng(heads).standard_normal((heads * 64, 576)).astype(np.float32)
    assert np.array_equal(rm.unpermute_rotary(rm.permute_rotary(w, heads), heads), w)
    assert not np.array_equal(rm.permute_rotary(w, heads), w)


def _rope_hf(x, pos, theta=10000.0):
    """Hugging Face Llama: rotate-half, pair (i, i + d/2) turns by pos * theta^(-2i/d)."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(pos * inv), np.sin(pos * inv)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _rope_ggml(x, pos, theta=10000.0):
    """llama.cpp's normal rope: adjacent pairs (2i, 2i + 1) turn by the same angles."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(pos * inv), np.sin(pos * inv)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
    return out


def test_unpermuted_weights_give_the_same_attention_scores():
    """Why the permutation matters: q.k after rope is what attention sees. GGUF weights under llama.cpp's
    rope and the unpermuted weights under Hugging Face's rope must give the same scores per head."""
    rng = np.random.default_rng(0)
    heads, kv_heads, d, hidden = 3, 1, 8, 12
    wq_gguf = rng.standard_normal((heads * d, hidden))
    wk_gguf = rng.standard_normal((kv_heads * d, hidden))
    x_q, x_k = rng.standard_normal(hidden), rng.standard_normal(hidden)
    wq_hf, wk_hf = rm.unpermute_rotary(wq_gguf, heads), rm.unpermute_rotary(wk_gguf, kv_heads)
    for pos_q, pos_k in [(5, 2), (17, 0)]:
        k_g = _rope_ggml((wk_gguf @ x_k).reshape(kv_heads, d), pos_k)[0]
        k_h = _rope_hf((wk_hf @ x_k).reshape(kv_heads, d), pos_k)[0]
        s_g = _rope_ggml((wq_gguf @ x_q).reshape(heads, d), pos_q) @ k_g
        s_h = _rope_hf((wq_hf @ x_q).reshape(heads, d), pos_q) @ k_h
        np.testing.assert_allclose(s_h, s_g, rtol=1e-10, atol=1e-10)
    # The same rows without unpermuting do not (the check above is not vacuous).
    s_wrong = _rope_hf((wq_gguf @ x_q).reshape(heads, d), 5) @ _rope_hf((wk_gguf @ x_k).reshape(1, d), 2)[0]
    s_right = _rope_ggml((wq_gguf @ x_q).reshape(heads, d), 5) @ _rope_ggml((wk_gguf @ x_k).reshape(1, d), 2)[0]
    assert not np.allclose(s_wrong, s_right)


# -- a tiny GGUF end to end ------------------------------------------------------------------------

TINY = dict(layers=2, hidden=32, heads=2, kv_heads=1, head_dim=16, ffn=48)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _byte_alphabet():
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


def _hf_weights(vocab: int):
    rng = np.random.default_rng(7)
    h, q, kv, f = TINY["hidden"], TINY["heads"] * TINY["head_dim"], TINY["kv_heads"] * TINY["head_dim"], TINY["ffn"]
    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, h)), "model.norm.weight": rng.standard_normal(h)}
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": rng.standard_normal(h),
                  p + "post_attention_layernorm.weight": rng.standard_normal(h),
                  p + "self_attn.q_proj.weight": rng.standard_normal((q, h)),
                  p + "self_attn.k_proj.weight": rng.standard_normal((kv, h)),
                  p + "self_attn.v_proj.weight": rng.standard_normal((kv, h)),
                  p + "self_attn.o_proj.weight": rng.standard_normal((h, q)),
                  p + "mlp.gate_proj.weight": rng.standard_normal((f, h)),
                  p + "mlp.up_proj.weight": rng.standard_normal((f, h)),
                  p + "mlp.down_proj.weight": rng.standard_normal((h, f))})
    # Values bf16 represents exactly, so the round trip can be compared bit for bit.
    return {k: (np.round(v * 8) / 8).astype(np.float32) for k, v in w.items()}


def write_tiny_gguf(path):
    """A 2-layer llama GGUF the way llama.cpp's converter writes one: Q/K permuted, tied embeddings."""
    import gguf

    tokens = SPECIALS + _byte_alphabet() + ["Ġt", "he", "Ġthe"]
    merges = ["Ġ t", "h e", "Ġt he"]
    hf = _hf_weights(len(tokens))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(TINY["layers"])
    w.add_context_length(256)
    w.add_embedding_length(TINY["hidden"])
    w.add_feed_forward_length(TINY["ffn"])
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(TINY["head_dim"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    inverse = {v: k for k, v in rm._GLOBAL_NAMES.items()}
    for name, value in hf.items():
        if name in inverse:
            gname = inverse[name]
        else:
            layer, rest = name[len("model.layers."):].split(".", 1)
            gname = f"blk.{layer}." + {v: k for k, v in rm._BLOCK_NAMES.items()}[rest]
        if gname.endswith("attn_q.weight"):
            value = rm.permute_rotary(value, TINY["heads"])
        elif gname.endswith("attn_k.weight"):
            value = rm.permute_rotary(value, TINY["kv_heads"])
        if gname == "token_embd.weight":  # quantized, as in the real file
            q = gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf, tokens


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    hf, tokens = write_tiny_gguf(path)
    return path, hf, tokens


def _load(model_dir):
    import torch
    from safetensors.torch import load_file as load_torch

    return {k: v.to(torch.float32).numpy() for k, v in load_torch(str(model_dir / "model.safetensors")).items()}


def test_tiny_gguf_converts_to_the_original_weights(tiny_gguf, tmp_path):
    import gguf

    path, hf, tokens = tiny_gguf
    out = tmp_path / "ckpt"
    rm.write_checkpoint(path, out)
    got = _load(out)
    assert set(got) == set(hf), "tied embeddings: no lm_head.weight"
    for name, want in hf.items():
        if name == "model.embed_tokens.weight":  # went through Q8_0
            np.testing.assert_allclose(got[name], want, atol=np.abs(want).max() / 100)
        else:
            assert np.array_equal(got[name], want), name
    # Q/K really were permuted in the file: the raw GGUF rows differ from the HF rows.
    reader = gguf.GGUFReader(str(path))
    raw_q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    assert not np.array_equal(rm.dequantize(raw_q), hf["model.layers.0.self_attn.q_proj.weight"])

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"]) == (2, 32, 2, 1, 16, 48)
    assert cfg["tie_word_embeddings"] is True and cfg["vocab_size"] == len(tokens)
    assert (cfg["rope_theta"], cfg["rms_norm_eps"], cfg["eos_token_id"]) == (100000.0, 1e-05, 2)


def test_tiny_gguf_tokenizer(tiny_gguf, tmp_path):
    from transformers import AutoTokenizer

    path, _hf, tokens = tiny_gguf
    rm.write_checkpoint(path, tmp_path / "ckpt")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "ckpt"))
    assert (tok.bos_token, tok.eos_token, tok.eos_token_id) == ("<|im_start|>", "<|im_end|>", 2)
    ids = tok.encode(" the 42<|im_end|>", add_special_tokens=False)
    # Merges apply, digits split one by one (llama.cpp's `smollm` pre-tokenizer), control tokens stay whole.
    assert [tokens[i] for i in ids] == ["Ġthe", "Ġ", "4", "2", "<|im_end|>"]
    assert tok.decode(ids, skip_special_tokens=True) == " the 42"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"


def test_manifest_check_and_rebuild(tiny_gguf, tmp_path):
    path, _hf, _tokens = tiny_gguf
    cache = tmp_path / "cache"
    built = rm.ensure_real_model(cache, gguf_path=path)
    source = rm.sha256_file(path)
    assert rm.check_checkpoint(built, source) == []
    stamp = (built / "model.safetensors").stat().st_mtime_ns
    assert rm.ensure_real_model(cache, gguf_path=path) == built  # cached: not rebuilt
    assert (built / "model.safetensors").stat().st_mtime_ns == stamp

    (built / "tokenizer.json").write_text("{}")
    assert rm.check_checkpoint(built, source) == ["tokenizer.json does not match its hash"]
    (built / "config.json").unlink()
    assert "config.json missing" in rm.check_checkpoint(built, source)
    assert rm.check_checkpoint(built, "0" * 64)[0] == "built from another GGUF"
    logs = []
    rm.ensure_real_model(cache, gguf_path=path, log=logs.append)
    assert rm.check_checkpoint(built, source) == []
    assert logs and logs[0].startswith("rebuilding") and "config.json missing" in logs[0]

    manifest = json.loads((built / "manifest.json").read_text())
    manifest["converter_version"] = rm.CONVERTER_VERSION - 1
    (built / "manifest.json").write_text(json.dumps(manifest))
    assert rm.check_checkpoint(built, source) == [
        f"converter version {rm.CONVERTER_VERSION - 1}, now {rm.CONVERTER_VERSION}"]
    (built / "manifest.json").unlink()
    assert rm.check_checkpoint(built) == ["no manifest.json"]
    assert rm.check_checkpoint(tmp_path / "nowhere") == ["no manifest.json"]
    assert not [p for p in cache.glob(".smollm2-*") if p.is_dir()], "no temporary build directory left behind"


def test_non_llama_gguf_is_refused(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(rm.RealModelError, match="only llama"):
        rm.write_checkpoint(tmp_path / "x.gguf", tmp_path / "out")


# -- the real model ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    """The checkpoint `make install` converted; built here from the GGUF in site-packages if missing."""
    try:
        return rm.ensure_real_model()
    except rm.RealModelError as exc:
        pytest.fail(f"{exc}", pytrace=False)


def test_real_checkpoint_shape(smollm2):
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 9, 3, 64, 576, 49152)
    assert cfg["tie_word_embeddings"] is True
    assert rm.check_checkpoint(smollm2, rm.sha256_file(rm.find_gguf())) == []
    assert rm.kv_bytes_per_token(smollm2) == 30 * 2 * 3 * 64 * 4


def test_converted_model_answers(smollm2):
    """Greedy, with the chat template: the answer the original model gives."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32)
    inputs = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert tok.decode(answer, skip_special_tokens=True) == "The capital of France is Paris."
    assert answer[-1] == tok.eos_token_id  # stops by itself
