"""Small on-disk fixtures: a tiny model directory with the char tokenizer, and a tiny task."""

import json
import random
from pathlib import Path

from usaf.tiny import tiny_model
from usaf.tokenizer import char_tokenizer


def make_model_dir(folder: Path, family: str = "qwen3_moe", seed: int = 0) -> Path:
    tokenizer = char_tokenizer()
    model = tiny_model(family, seed=seed, vocab_size=len(tokenizer))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_copy_task(path: Path, count: int, seed: int = 0) -> Path:
    """prompt/completion records: copy a short word (a pattern a tiny model picks up in a few steps)."""
    rnd = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            word = "".join(rnd.choice("abcdef") for _ in range(5))
            f.write(json.dumps({"prompt": f"copy {word} ->", "completion": f" {word}"}) + "\n")
    return path


# 0.1.0's default targets: what the tests of the experts engine, routers and selection are about
EXPERTS_AND_ROUTERS = ["experts", "routers"]


# settings of a short CPU run on the tiny model (fault and hardening tests)
FAST_RUN = [
    "data.max_seq_len=48",
    "data.batch_size=4",
    "select.density=0.1",
    "log.progress=false",
    "log.tensorboard=false",
    "schedule.warmup_steps=1",
]
