"""Write checkpoints in the layouts of published pre-quantized MoE models (deterministic, no downloads):

    .venv/bin/python scripts/make_published_checkpoints.py OUT_DIR
    .venv/bin/python scripts/make_published_checkpoints.py OUT_DIR --full gpt-oss-20b    # 13.8 GB, MXFP4
    .venv/bin/python scripts/make_published_checkpoints.py OUT_DIR --full qwen3-30b-a3b  # 31.2 GB, block FP8

Tiny (seconds):
OUT_DIR/gpt-oss-mxfp4     gpt-oss with MXFP4 experts (`experts.*_blocks` / `_scales`), as openai/gpt-oss-20b
OUT_DIR/qwen3-moe-fp8     Qwen3-MoE with block-scaled FP8 linear layers (`weight` + `weight_scale_inv`, 8x8 blocks)
OUT_DIR/deepseek-v3-fp8   DeepSeek-V3 (MLA attention, a dense first layer) in the same FP8 layout

Each folder is a Hugging Face model directory (config.json with its quantization_config, model.safetensors, a
character tokenizer) that `usaf train --model` takes as it is; tests/quant/test_published.py builds the same ones.

--full PRESET writes OUT_DIR/PRESET at the preset's full shapes (gpt-oss-20b: MXFP4 experts; qwen3-30b-a3b: FP8 in
128x128 blocks, as Qwen/Qwen3-30B-A3B-FP8) with random weights, streamed shard by shard (memory: one 64 MB chunk),
sharded with model.safetensors.index.json as the published repositories are; the tokenizer is the tiny character one,
the config's vocab_size stays the model's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from usaf.testing.published import make_fp8_moe, make_mxfp4_gpt_oss, write_full_published

PRESETS = Path(__file__).resolve().parents[1] / "src" / "usaf" / "presets"
FULL = ("gpt-oss-20b", "qwen3-30b-a3b")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write the checkpoints into (must not exist yet)")
    parser.add_argument(
        "--full", choices=FULL, help="write this preset at full size instead of the tiny ones"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (--full)")
    args = parser.parse_args()
    if args.out.exists() and not args.full:
        parser.error(f"{args.out} exists; choose a new folder")
    if args.full:
        folder = args.out / args.full
        if folder.exists():
            parser.error(f"{folder} exists; choose a new folder")
        config = json.loads((PRESETS / f"{args.full}.json").read_text())

        def progress(done: int, total: int) -> None:
            print(f"\r{done / 1e9:6.2f} / {total / 1e9:.2f} GB", end="", file=sys.stderr, flush=True)

        print(write_full_published(folder, config, seed=args.seed, progress=progress))
        return
    made = [
        make_mxfp4_gpt_oss(args.out / "gpt-oss-mxfp4"),
        make_fp8_moe(args.out / "qwen3-moe-fp8", "qwen3_moe", block=8),
        make_fp8_moe(args.out / "deepseek-v3-fp8", "deepseek_v3", block=8),
    ]
    for folder in made:
        print(folder)


if __name__ == "__main__":
    main()
