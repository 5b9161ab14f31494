"""Tiny checkpoints in the layouts of published pre-quantized MoE models, built deterministically from tiny random
models (no downloads): a gpt-oss with MXFP4 experts as openai/gpt-oss-* stores them, and a Qwen3-MoE with
block-scaled FP8 linear layers as Qwen/Qwen3-*-FP8 and DeepSeek-V3 store them.

The quantizers here only make fixtures: usaf never quantizes into a published format.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

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
