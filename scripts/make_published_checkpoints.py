"""Write tiny checkpoints in the layouts of published pre-quantized MoE models (deterministic, seconds, no downloads):

    .venv/bin/python scripts/make_published_checkpoints.py OUT_DIR

OUT_DIR/gpt-oss-mxfp4     gpt-oss with MXFP4 experts (`experts.*_blocks` / `_scales`), as openai/gpt-oss-20b
OUT_DIR/qwen3-moe-fp8     Qwen3-MoE with block-scaled FP8 linear layers (`weight` + `weight_scale_inv`, 8x8 blocks)
OUT_DIR/deepseek-v3-fp8   DeepSeek-V3 (MLA attention, a dense first layer) in the same FP8 layout

Each folder is a Hugging Face model directory (config.json with its quantization_config, model.safetensors, a
character tokenizer) that `usaf train --model` takes as it is; tests/quant/test_published.py builds the same ones.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from usaf.testing.published import make_fp8_moe, make_mxfp4_gpt_oss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write the checkpoints into (must not exist yet)")
    args = parser.parse_args()
    if args.out.exists():
        parser.error(f"{args.out} exists; choose a new folder")
    made = [
        make_mxfp4_gpt_oss(args.out / "gpt-oss-mxfp4"),
        make_fp8_moe(args.out / "qwen3-moe-fp8", "qwen3_moe", block=8),
        make_fp8_moe(args.out / "deepseek-v3-fp8", "deepseek_v3", block=8),
    ]
    for folder in made:
        print(folder)


if __name__ == "__main__":
    main()
