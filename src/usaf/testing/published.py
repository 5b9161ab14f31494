"""Tiny checkpoints in the layouts of published pre-quantized MoE models, built deterministically from tiny random
models (no downloads): a gpt-oss with MXFP4 experts as openai/gpt-oss-* stores them, and a Qwen3-MoE with
block-scaled FP8 linear layers as Qwen/Qwen3-*-FP8 and DeepSeek-V3 store them.

The quantizers here only make fixtures: usaf never quantizes into a published format.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from usaf.io import shards
from usaf.testing.tiny import tiny_model
from usaf.train.tokenizer import char_tokenizer

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_MAX = 448.0


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] -> (blocks uint8 [..., out, in/32, 16], scales uint8 [..., out, in/32]): 32 values share the
    exponent scale 2**(scale - 127); two e2m1 codes a byte, the even value in the low nibble."""
    w = weight.float()
    groups = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = groups.abs().amax(dim=-1).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    lut = torch.tensor(FP4_VALUES[:8])
    code = (scaled.abs().unsqueeze(-1) - lut).abs().argmin(dim=-1).to(torch.uint8)
    code |= (scaled < 0).to(torch.uint8) << 3
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, cols] -> (float8_e4m3fn [rows, cols], weight_scale_inv float32 [rows/b0, cols/b1]): w ≈ q * scale_inv
    per block."""
    rows, cols = weight.shape
    b0, b1 = block
    tiles = weight.float().reshape(rows // b0, b0, cols // b1, b1)
    scale_inv = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(rows, cols).contiguous(), scale_inv.float().contiguous()


def _save_plain(folder: Path, model, tokenizer) -> dict[str, torch.Tensor]:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
        path.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    return tensors


def _finish(folder: Path, tensors: dict, quantization_config: dict) -> Path:
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = quantization_config
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return folder


def _tokenizer():
    return char_tokenizer()


def make_mxfp4_gpt_oss(folder: str | Path, seed: int = 0, tokenizer=True, **overrides) -> Path:
    """A tiny gpt-oss whose experts are stored as openai/gpt-oss-20b stores them: `experts.gate_up_proj_blocks`
    [E, 2I, H/32, 16] and `_scales` [E, 2I, H/32] (uint8), the same for down_proj; everything else bf16.
    `overrides`: config fields (e.g. num_experts)."""
    folder = Path(folder)
    tok = _tokenizer() if tokenizer else None
    sizes = {"intermediate_size": 64, "vocab_size": len(tok) if tok else 97, **overrides}
    model = tiny_model("gpt_oss", seed=seed, dtype=torch.bfloat16, **sizes)
    tensors = _save_plain(folder, model, tok)
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # the parameter is [E, in, out]; the published blocks run along `in` for each output row
        blocks, scales = quantize_mxfp4(tensors.pop(key).transpose(1, 2))
        tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
    qc = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    return _finish(folder, tensors, qc)


def make_fp8_moe(
    folder: str | Path, family: str = "qwen3_moe", block: int = 8, seed: int = 0, tokenizer=True
) -> Path:
    """A tiny MoE whose decoder linear layers (attention, experts, dense MLPs; not the routers) are block-scaled FP8 (`weight` float8_e4m3fn plus
    `weight_scale_inv` float32 per block x block tile), per-expert tensors as Qwen3-*-FP8 and DeepSeek-V3 ship them;
    embeddings, norms, routers and the head stay bf16."""
    folder = Path(folder)
    tok = _tokenizer() if tokenizer else None
    model = tiny_model(family, seed=seed, dtype=torch.bfloat16, vocab_size=len(tok) if tok else 97)
    tensors = _save_plain(folder, model, tok)
    for key in list(tensors):
        value = tensors[key]
        # every linear layer of the decoder but the routers, as the published FP8 checkpoints do
        router = key.endswith(("mlp.gate.weight", "router.weight"))
        quantized = key.startswith("model.layers.") and key.endswith(".weight") and not router
        if quantized and value.ndim == 2 and value.shape[0] % block == 0 and value.shape[1] % block == 0:
            tensors[key], tensors[key + "_scale_inv"] = quantize_fp8(value, (block, block))
    qc = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [block, block],
    }
    return _finish(folder, tensors, qc)


# ---- full-size checkpoints, written shard by shard ----------------------------------------------------------------
# The published shapes (a preset's config.json) with random weights, streamed: one tensor (one expert) in memory at a
# time, never a shard or the model. Random MXFP4 codes are drawn as bytes with scales near 2**-7 (values of RMS
# about 0.02, as an initialized model's); random FP8 values are bytes too (RMS 0.6, scales near 0.03; drawing normals
# and converting them took 9x longer: 20 CPU minutes for Qwen3-30B-A3B).

_ROW_CHUNK_BYTES = 64 << 20


def _tensor_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFF_FFFF


def _random_rows(kind: str, shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    if kind == "ones":
        return torch.ones(shape, dtype=dtype)
    if kind == "zeros":
        return torch.zeros(shape, dtype=dtype)
    if kind == "codes":  # MXFP4 codes: any byte is two valid e2m1 values
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    if kind == "exponents":  # MXFP4 scales 2**(s - 127), s in 119..121
        return torch.randint(119, 122, shape, generator=gen, dtype=torch.uint8)
    # FP8: random e4m3 bytes with the exponent's top bit cleared: |v| <= 1.875, never NaN, RMS 0.6
    if kind == "fp8":
        count = math.prod(shape)
        words = torch.empty(-(-count // 8), dtype=torch.int64).random_(generator=gen)
        return words.view(torch.uint8)[:count].bitwise_and_(0xBF).view(torch.float8_e4m3fn).reshape(shape)
    if kind == "scale_inv":
        return (0.02 + 0.02 * torch.rand(shape, generator=gen)).float()
    return (torch.randn(shape, generator=gen) * 0.02).to(dtype)  # "normal"


@dataclass(frozen=True)
class _Spec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str


def _attention_projections(config: dict) -> tuple[tuple[str, int, int], ...]:
    """(name, out features, in features) of a decoder layer's q, k, v and o projections."""
    h, heads, kv, hd = (
        config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    )
    return (("q", heads * hd, h), ("k", kv * hd, h), ("v", kv * hd, h), ("o", h, heads * hd))


def _gpt_oss_specs(config: dict) -> list[list[_Spec]]:
    """Tensors of openai/gpt-oss-* in their published names, layouts and dtypes, grouped: the embedding, each
    layer, the final norm and head."""
    bf16, u8 = torch.bfloat16, torch.uint8
    h, inter, e = config["hidden_size"], config["intermediate_size"], config["num_local_experts"]
    heads = config["num_attention_heads"]
    vocab = config["vocab_size"]
    groups = [[_Spec("model.embed_tokens.weight", (vocab, h), bf16, "normal")]]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layer = [
            _Spec(p + "input_layernorm.weight", (h,), bf16, "ones"),
            _Spec(p + "post_attention_layernorm.weight", (h,), bf16, "ones"),
            _Spec(p + "self_attn.sinks", (heads,), bf16, "zeros"),
        ]
        for proj, out, inp in _attention_projections(config):
            layer += [
                _Spec(p + f"self_attn.{proj}_proj.weight", (out, inp), bf16, "normal"),
                _Spec(p + f"self_attn.{proj}_proj.bias", (out,), bf16, "zeros"),
            ]
        layer += [
            _Spec(p + "mlp.router.weight", (e, h), bf16, "normal"),
            _Spec(p + "mlp.router.bias", (e,), bf16, "zeros"),
        ]
        for proj, out, inp in (("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)):
            q = p + f"mlp.experts.{proj}"
            layer += [
                _Spec(q + "_blocks", (e, out, inp // 32, 16), u8, "codes"),
                _Spec(q + "_scales", (e, out, inp // 32), u8, "exponents"),
                _Spec(q + "_bias", (e, out), bf16, "zeros"),
            ]
        groups.append(layer)
    groups.append(
        [_Spec("model.norm.weight", (h,), bf16, "ones"), _Spec("lm_head.weight", (vocab, h), bf16, "normal")]
    )
    return groups


def _qwen3_moe_fp8_specs(config: dict, block: int) -> list[list[_Spec]]:
    """Tensors of Qwen/Qwen3-*-FP8: every decoder linear layer but the router block-scaled FP8, per expert."""
    bf16 = torch.bfloat16
    h, inter = config["hidden_size"], config["moe_intermediate_size"]
    e = config.get("num_experts") or config.get("num_local_experts") or config["n_routed_experts"]
    hd = config["head_dim"]
    vocab = config["vocab_size"]

    def fp8(name: str, out: int, inp: int) -> list[_Spec]:
        scales = (-(-out // block), -(-inp // block))
        return [
            _Spec(name + ".weight", (out, inp), torch.float8_e4m3fn, "fp8"),
            _Spec(name + ".weight_scale_inv", scales, torch.float32, "scale_inv"),
        ]

    groups = [[_Spec("model.embed_tokens.weight", (vocab, h), bf16, "normal")]]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layer = [
            _Spec(p + "input_layernorm.weight", (h,), bf16, "ones"),
            _Spec(p + "post_attention_layernorm.weight", (h,), bf16, "ones"),
            _Spec(p + "self_attn.q_norm.weight", (hd,), bf16, "ones"),
            _Spec(p + "self_attn.k_norm.weight", (hd,), bf16, "ones"),
        ]
        for proj, out, inp in _attention_projections(config):
            layer += fp8(p + f"self_attn.{proj}_proj", out, inp)
        layer.append(_Spec(p + "mlp.gate.weight", (e, h), bf16, "normal"))
        for x in range(e):
            q = p + f"mlp.experts.{x}."
            layer += (
                fp8(q + "gate_proj", inter, h) + fp8(q + "up_proj", inter, h) + fp8(q + "down_proj", h, inter)
            )
        groups.append(layer)
    groups.append(
        [_Spec("model.norm.weight", (h,), bf16, "ones"), _Spec("lm_head.weight", (vocab, h), bf16, "normal")]
    )
    return groups


def _spec_bytes(spec: _Spec) -> int:
    return math.prod(spec.shape) * spec.dtype.itemsize


def _shard_names(count: int, zero_based: bool) -> list[str]:
    if zero_based:  # openai/gpt-oss-20b: model-00000-of-00002 ... model-00002-of-00002
        return [f"model-{i:05d}-of-{count - 1:05d}.safetensors" for i in range(count)]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _write_spec(writer: shards.StreamingWriter, spec: _Spec, seed: int) -> None:
    gen = torch.Generator().manual_seed(_tensor_seed(seed, spec.name))
    row_bytes = _spec_bytes(spec) // spec.shape[0]
    step = max(1, _ROW_CHUNK_BYTES // max(row_bytes, 1))
    for first in range(0, spec.shape[0], step):
        rows = (min(step, spec.shape[0] - first), *spec.shape[1:])
        writer.write(spec.name, _random_rows(spec.kind, rows, gen, spec.dtype), byte_offset=first * row_bytes)


def write_full_published(
    folder: str | Path,
    config: dict,
    *,
    seed: int = 0,
    shard_bytes: int = 5 << 30,
    block: int = 128,
    progress=None,
) -> Path:
    """A checkpoint at `config`'s shapes (a preset's config.json: gpt_oss in MXFP4, qwen3_moe in block FP8) with
    random weights, in the published layout: shards of about `shard_bytes` split at layer boundaries,
    model.safetensors.index.json, config.json with its quantization_config, the tiny test tokenizer (the config's
    vocab_size stays the model's). Memory stays at one tensor chunk (64 MB); `progress(done_bytes, total_bytes)`."""
    folder = Path(folder)
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    family = config["model_type"]
    if family == "gpt_oss":
        groups = _gpt_oss_specs(config)
        config.setdefault(
            "quantization_config",
            {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]},
        )
        zero_based = True
    elif family == "qwen3_moe":
        groups = _qwen3_moe_fp8_specs(config, block)
        config["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [block, block],
        }
        zero_based = False
    else:
        raise ValueError(f"no published full-size layout for model_type '{family}' (gpt_oss, qwen3_moe)")
    config.setdefault("torch_dtype", "bfloat16")
    shards_of: list[list[_Spec]] = [[]]
    for group in groups:
        size = sum(_spec_bytes(s) for s in shards_of[-1])
        if shards_of[-1] and size + sum(_spec_bytes(s) for s in group) > shard_bytes:
            shards_of.append([])
        shards_of[-1].extend(group)
    names = _shard_names(len(shards_of), zero_based)
    folder.mkdir(parents=True, exist_ok=True)
    total = sum(_spec_bytes(s) for shard in shards_of for s in shard)
    done, weight_map = 0, {}
    for file, specs in zip(names, shards_of, strict=True):
        planned = [shards.PlannedTensor(s.name, s.dtype, s.shape) for s in specs]
        writer = shards.StreamingWriter(folder / file, planned, metadata={"format": "pt"})
        for spec in specs:
            _write_spec(writer, spec, seed)
            weight_map[spec.name] = file
            done += _spec_bytes(spec)
            if progress is not None:
                progress(done, total)
        writer.close()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _tokenizer().save_pretrained(folder)
    return folder
