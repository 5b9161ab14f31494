"""llama.cpp against transformers on a usaf export: the same next-token log-probabilities? (issue 38)

A short `usaf train` run on the bundled demo model, exported as a merged checkpoint and as GGUF files by llama.cpp's
own converter and llama-quantize (`usaf export --gguf`, one per --outtype). For each of a few of the demo's held-out
prompts with their answers, every position's next-token log-probabilities over the whole vocabulary: transformers on
the merged export, llama.cpp (through llama-cpp-python's bindings) on each GGUF. Reported per GGUF: whether
llama.cpp tokenized the text as transformers did, the largest absolute difference of a log-probability, the mean
over positions of each position's largest difference, and how often the two agree on the most likely next token.

Run by bench/clients.sh, which builds llama.cpp first and sets LLAMA_CPP, LLAMA_QUANTIZE and LLAMA_CPP_LIB_PATH:

    bash bench/clients.sh                           # build (once, slow), train, export, compare
    .venv/bin/python bench/clients.py --work DIR    # the comparison alone, with llama.cpp already set up
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "src"))

from harness import RESULTS, machine, table  # noqa: E402

OUTTYPES = ("f16", "q8_0", "q4_k_m")


def train_and_export(work: Path, steps: int) -> tuple[Path, dict[str, Path]]:
    """The demo model trained `steps` steps on the shift task; its merged export and one GGUF an outtype."""
    from usaf.cli import main
    from usaf.demo.run import assets

    model, data = assets() / "model", assets() / "data"
    run = work / "run"
    sets = [f"schedule.max_steps={steps}", "data.max_seq_len=64", "log.report_to=none", "log.progress=false"]
    train = ["train", f"--model={model}", f"--data={data / 'train.jsonl'}", f"--out={run}"]
    assert main([*train, *(f"--set={s}" for s in sets)]) == 0
    merged = work / "merged"
    assert main(["export", str(run), f"--merged={merged}"]) == 0
    ggufs = {}
    for outtype in OUTTYPES:
        ggufs[outtype] = work / outtype / f"demo-{outtype}.gguf"
        assert main(["export", str(run), f"--gguf={ggufs[outtype]}", f"--outtype={outtype}"]) == 0
    return merged, ggufs


def texts(count: int) -> list[str]:
    from usaf.demo.run import assets
    from usaf.demo.task import read_jsonl

    return [r["prompt"] + r["completion"] for r in read_jsonl(assets() / "data" / "eval.jsonl")[:count]]


def transformers_logprobs(merged: Path, prompts: list[str]) -> list[tuple[list[int], object]]:
    import torch

    from usaf.model.hf import load_causal_lm, load_tokenizer

    tokenizer, model = load_tokenizer(str(merged)), load_causal_lm(str(merged), dtype=torch.float32).eval()
    found = []
    with torch.no_grad():
        for text in prompts:
            ids = tokenizer(text).input_ids
            logits = model(torch.tensor([ids])).logits[0].float()
            found.append((ids, torch.log_softmax(logits, -1).numpy()))
    return found


def llama_cpp_logprobs(gguf: Path, prompts: list[str]) -> list[tuple[list[int], object]]:
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=64, logits_all=True, n_threads=1, verbose=False)
    found = []
    for text in prompts:
        ids = llm.tokenize(text.encode(), add_bos=True, special=False)
        llm.reset()
        llm.eval(ids)
        logits = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
        shifted = logits - logits.max(-1, keepdims=True)
        found.append((ids, shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))))
    return found


def compare(reference, other) -> dict:
    import numpy as np

    same_tokens = all(list(a) == list(b) for (a, _), (b, _) in zip(reference, other, strict=True))
    worst, per_position, agree, positions = 0.0, [], 0, 0
    for (_, ours), (_, theirs) in zip(reference, other, strict=True):
        diff = np.abs(ours - theirs).max(-1)
        worst = max(worst, float(diff.max()))
        per_position += diff.tolist()
        agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        positions += len(diff)
    return {
        "same_tokens": same_tokens,
        "max_abs_logprob_diff": worst,
        "mean_position_max_abs_diff": float(np.mean(per_position)),
        "top1_agreement": agree / positions,
        "positions": positions,
    }


def report(results: dict, out: Path) -> None:
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    rows = [
        [
            outtype,
            f"{r['gguf_bytes']:,}",
            "yes" if r["same_tokens"] else "NO",
            f"{r['max_abs_logprob_diff']:.4f}",
            f"{r['mean_position_max_abs_diff']:.4f}",
            f"{100 * r['top1_agreement']:.1f} % of {r['positions']}",
        ]
        for outtype, r in results["gguf"].items()
    ]
    lines = [
        "# llama.cpp against transformers on a usaf export",
        "",
        f"Command: `{results['command']}`",
        "",
        f"Model: the bundled demo model ({results['model']}) after {results['steps']} steps of `usaf train` on the "
        f"shift task, exported merged and as GGUF by llama.cpp's convert_hf_to_gguf.py and llama-quantize (the "
        f"llama.cpp of {results['llama_cpp']}'s source package, built for this CPU). Next-token log-probabilities over the whole vocabulary at every position of "
        f"{results['texts']} held-out prompts with their answers: transformers {results['machine']['transformers']} "
        "(float32) on the merged export against llama.cpp (llama-cpp-python's bindings, CPU) on each GGUF.",
        "",
        *table(
            ["GGUF", "bytes", "same tokens", "max abs diff", "mean per-position max", "top-1 agreement"],
            rows,
            "lrlrrr",
        ),
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--work", type=Path, required=True, help="a scratch folder (the run and its exports)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--texts", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS / "clients", help="OUT.json and OUT.md")
    parser.add_argument(
        "--command", default="bash bench/clients.sh", help="the command recorded in the results"
    )
    args = parser.parse_args(argv)

    import llama_cpp
    import torch

    from usaf.demo.run import assets

    torch.set_num_threads(1)
    merged, ggufs = train_and_export(args.work, args.steps)
    prompts = texts(args.texts)
    reference = transformers_logprobs(merged, prompts)
    results = {
        "command": args.command,
        "machine": machine(),
        "model": json.loads((assets() / "model" / "config.json").read_text())["model_type"],
        "steps": args.steps,
        "texts": len(prompts),
        "llama_cpp": f"llama-cpp-python {llama_cpp.__version__}",
        "llama_cpp_lib": os.environ.get("LLAMA_CPP_LIB_PATH"),
        "gguf": {
            outtype: {
                "gguf_bytes": path.stat().st_size,
                **compare(reference, llama_cpp_logprobs(path, prompts)),
            }
            for outtype, path in ggufs.items()
        },
    }
    report(results, args.out)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
