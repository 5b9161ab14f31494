"""Pretrain the small MoE that `usaf demo` fine-tunes, and write it with its tokenizer and data.

    .venv/bin/python scripts/make_demo_model.py            # rewrites src/usaf/demo_assets/{model,data}
    .venv/bin/python scripts/make_demo_model.py --out DIR  # somewhere else (DIR/model, DIR/data)

A fresh Mixtral model (3 layers, hidden 64, 8 experts, top-2; ~0.5 M parameters, fp32, ~2 MB) is fully
trained with plain transformers/torch on the demo's pretraining skills, `copy: kqzm -> kqzm` and
`upper: kqzm -> KQZM` (usaf.demo.task), loss on the completion only. Its attention thereby learns to fetch
the aligned source character and its FFNs to map it; the demo's new skill, `shift: kqzm -> lran`, reuses the
attention pattern and needs a new per-character mapping, which training only expert weights (+ routers) can
provide.

The tokenizer is usaf's character tokenizer spelled as a Llama vocabulary (`char_tokenizer(llama_vocab=True)`: the
same ids), and the family is Mixtral, so that llama.cpp's convert_hf_to_gguf.py converts the model (for a
qwen3_moe it takes only the published tokenizers it recognises by hash) and the demo reaches a GGUF.

Deterministic: everything is seeded, the data is generated from fixed seeds, and the run uses one CPU thread
(float reductions depend on the thread count; one thread also avoids the large slow-downs of oversubscribed
cores); the same torch version on the same kind of CPU reproduces the same weights bit for bit. 1000 steps
take about 2-3 minutes on an idle CPU core, more on a busy machine. The script ends by printing the accuracy
of the result on fresh examples of each skill: copy and upper ~100 %, shift ~0 %.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from usaf.demo.task import (
    KINDS,
    PRETRAIN_KINDS,
    encode_records,
    make_examples,
    task_accuracy,
    write_demo_data,
)
from usaf.train.tokenizer import char_tokenizer

# The demo model's shape; the bundled config.json is what this made (bench/compare.py's smoke run reads it).
DEMO_MODEL_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,  # each expert's width
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    router_aux_loss_coef=0.01,  # keeps all 8 experts in use, so the demo has experts worth choosing among
)
# Mixtral, because llama.cpp's converter reads a Llama-family model's character vocabulary as it is
# (char_tokenizer(llama_vocab=True)); for a qwen3_moe it accepts only the published tokenizers it knows by hash.
FAMILY = "mixtral"


def demo_model_config(tokenizer):
    """The demo model's transformers config, for a tokenizer like `usaf.train.tokenizer.char_tokenizer()`."""
    return AutoConfig.for_model(
        FAMILY,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **DEMO_MODEL_SHAPE,
    )


DEFAULT_OUT = Path(__file__).resolve().parents[1] / "src" / "usaf" / "demo_assets"
SEED = 0
FRESH_SEED = 10**9  # for examples no pretraining step has seen (step seeds are 0..steps-1)


def build_model(tokenizer) -> torch.nn.Module:
    torch.manual_seed(SEED)
    return AutoModelForCausalLM.from_config(demo_model_config(tokenizer), dtype=torch.float32)


def pretrain(model, tokenizer, steps: int, batch_size: int, lr: float, log_every: int) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)

    def lr_factor(step: int) -> float:  # linear warm-up, then cosine to 10 %
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    mixer = random.Random(SEED)
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        # Each step's examples come from their own seed, so the stream does not depend on the batch history.
        records = [
            r for kind in PRETRAIN_KINDS for r in make_examples(kind, batch_size // len(PRETRAIN_KINDS), step)
        ]
        mixer.shuffle(records)
        input_ids, labels = encode_records(tokenizer, records)
        out = model(input_ids=input_ids, labels=labels, output_router_logits=True, use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % log_every == 0 or step == steps - 1:
            elapsed = time.perf_counter() - start
            print(
                f"step {step:5d}  loss {out.loss.item():.4f}  aux {out.aux_loss.item():.3f}  "
                f"lr {schedule.get_last_lr()[0]:.2e}  {elapsed:6.1f}s",
                flush=True,
            )
    model.eval()


def save(model, tokenizer, model_dir: Path) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False
    model.config.use_cache = True
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=16,
    )
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="writes OUT/model and OUT/data")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=100)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    tokenizer = char_tokenizer(llama_vocab=True)
    model = build_model(tokenizer)
    print(f"{FAMILY}: {sum(p.numel() for p in model.parameters()):,} parameters, vocab {len(tokenizer)}")
    pretrain(model, tokenizer, args.steps, args.batch_size, args.lr, args.log_every)

    save(model, tokenizer, args.out / "model")
    paths = write_demo_data(args.out / "data")
    # Fresh examples (a seed no training step uses) show what the model can and cannot do.
    accuracy = {kind: task_accuracy(model, tokenizer, make_examples(kind, 200, FRESH_SEED)) for kind in KINDS}
    print(
        json.dumps(
            {"accuracy": accuracy, "model": str(args.out / "model"), **{k: str(v) for k, v in paths.items()}}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
