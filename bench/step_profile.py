"""Where a usaf training step spends its time beyond the forward: bench/compare.py's random Qwen3-MoE model
("full": 200 M parameters, batch 2 x 128, fp32, one thread), usaf element 0.5 % + routers (magnitude selection,
CompactAdamW, as compare.py trains it), against stock transformers' no-grad forward (compare.py's "inference"
row, the 2.3x target's denominator). torch.profiler over a few steps; ops by self time, and the step's time by the
same kinds as bench/scale.py.

    .venv/bin/python bench/step_profile.py [--shape quick] [--steps 3]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="full")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=18)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import compare
    import scale
    from transformers import AutoConfig, AutoModelForCausalLM

    import usaf
    from usaf.train.optim import CompactAdamW

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "qwen3_moe", **compare.RANDOM_SHAPES[args.shape], max_position_embeddings=256
    )
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model = usaf.prepare_model(
        copy.deepcopy(reference), compare.experts_config(compare.BY_KEY["usaf-element"])
    )
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    values = {id(p) for n, p in model.named_parameters() if n.endswith(".values")}
    optimizer = CompactAdamW(
        [
            {"params": [p for p in trainable if id(p) in values], "compact": True},
            {"params": [p for p in trainable if id(p) not in values], "compact": False},
        ],
        lr=1e-4,
        weight_decay=0.0,
    )
    ids = torch.randint(0, config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(1))

    def step():
        loss = usaf.causal_lm_loss(model, ids, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def forward(m):
        with torch.no_grad():
            usaf.causal_lm_loss(m, ids, ids)

    fns = {
        "step": step,
        "usaf forward": lambda: forward(model),
        "inference forward": lambda: forward(reference),
    }
    times = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(args.steps):
        for k, fn in fns.items():
            began = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - began)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in med.items())
        + f"; step / inference forward {med['step'] / med['inference forward']:.2f}x, step / usaf forward "
        f"{med['step'] / med['usaf forward']:.2f}x"
    )
    for name, fn in (("step", step), ("inference forward", lambda: forward(reference))):
        with scale.labels(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            began = time.perf_counter()
            fn()
            wall = time.perf_counter() - began
        split = scale.split(prof.events(), wall)
        print(
            f"\n{name}: profiled {wall * 1e3:.0f} ms: "
            + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in split.items())
        )
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
