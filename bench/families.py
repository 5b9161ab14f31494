"""Every transformers model family whose experts use `@use_experts_implementation`: does usaf prepare it, and do
its logits and gradients match transformers' own? A survey beyond the nine families the tests pin down.

For each family with a causal-LM class, a tiny random configuration (usaf.testing.tiny's sizes over the family's
defaults) is built; then, in fp32: the prepared model's logits against the untouched model's, and the trained
values' gradients against the untouched model's dense expert gradients gathered at the same entries.

    .venv/bin/python bench/families.py      # writes bench/results/families-<date>.{json,md}
"""

from __future__ import annotations

import copy
import re
import sys
import traceback
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, table, write_results

import usaf
from usaf.errors import UsafError
from usaf.model.layout import find_moe_layers
from usaf.testing.tiny import FAMILIES, randomize_routers_and_biases, tiny_config

MAX_PARAMETERS = 20_000_000


def families_with_experts() -> list[str]:
    models = Path(transformers.__file__).parent / "models"
    found = set()
    for path in models.glob("*/modeling_*.py"):
        if "@use_experts_implementation" in path.read_text(errors="ignore"):
            found.add(path.parent.name)
    return sorted(found)


def model_types(module_name: str) -> list[str]:
    """The config `model_type`s a models/ folder defines (a folder may hold several, e.g. gemma4 → gemma4_text)."""
    types = []
    for path in (Path(transformers.__file__).parent / "models" / module_name).glob("configuration_*.py"):
        types += re.findall(r'model_type\s*=\s*"([^"]+)"', path.read_text(errors="ignore"))
    return types


def check(model_type: str) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return {"status": "no causal-LM class"}
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(1))
    full = {"layer_types": ["full_attention", "full_attention"]}
    attempts = (
        [{}] if model_type in FAMILIES else [{}, full, FAMILIES["deepseek_v3"], FAMILIES["gemma4_text"]]
    )
    failure = {}
    for extra in attempts:
        try:  # a tiny model of this family that transformers itself runs
            # the families of usaf.testing.tiny as tested; others at the common tiny sizes, ids inside the tiny vocabulary
            config = (
                tiny_config(model_type)
                if model_type in FAMILIES
                else tiny_config(model_type, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
            )
            with torch.device("meta"):  # sizes the family names differently keep their (huge) defaults
                size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
            if size > MAX_PARAMETERS:
                raise ValueError(f"the tiny config still has {size / 1e6:.0f} M parameters")
            torch.manual_seed(0)
            reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
            randomize_routers_and_biases(reference)
            with torch.no_grad():
                reference(input_ids=ids)
            break
        except Exception as err:  # this survey's tiny config does not fit the family: not a usaf result
            failure = failure or {
                "status": "tiny config does not run",
                "error": f"{type(err).__name__}: {err}"[:300],
            }
    else:
        return failure
    try:
        find_moe_layers(reference)
    except UsafError as err:
        return {"status": "no fused experts in the causal-LM model", "error": str(err)[:300]}
    try:
        model = usaf.prepare_model(copy.deepcopy(reference), usaf.UsafConfig(density=0.2, seed=0))
        reference.requires_grad_(False)
        for layer in find_moe_layers(reference):
            for t in layer.tensors:
                getattr(layer.experts, t.name).requires_grad_(True)
        ref_out = reference(input_ids=ids, labels=ids)
        out = model(input_ids=ids, labels=ids)
        logits_diff = float((out.logits - ref_out.logits).abs().max())
        ref_out.loss.backward()
        out.loss.backward()
        worst = 0.0
        dense = dict(reference.named_parameters())
        for name, delta in usaf.get_delta(model).items():
            if name not in dense or dense[name].grad is None:
                continue
            expected = dense[name].grad.reshape(-1)[delta.flat_indices]
            got = delta.values.grad
            worst = max(worst, float((got - expected).norm() / expected.norm().clamp_min(1e-12)))
        ok = logits_diff < 1e-5 and worst < 1e-4
        return {
            "status": "ok" if ok else "MISMATCH",
            "logits_max_abs_diff": logits_diff,
            "value_grad_rel_err": worst,
            "experts_layers": len(find_moe_layers(model)),
        }
    except Exception as err:
        return {
            "status": "usaf error",
            "error": f"{type(err).__name__}: {err}"[:300],
            "trace": traceback.format_exc(),
        }


def main() -> None:
    rows = {}
    for folder in families_with_experts():
        for model_type in model_types(folder) or [folder]:
            rows[model_type] = check(model_type)
            r = rows[model_type]
            print(f"{model_type:>28}  {r['status']}  {r.get('error', '')[:120]}", flush=True)
    facts = machine()
    counts = {}
    for r in rows.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    lines = [
        f"# usaf across transformers' MoE families ({facts['date']}, transformers {facts['transformers']})",
        "",
        "Every model type defined next to a `@use_experts_implementation` experts class, tiny random config, fp32: "
        "logits of the prepared model vs the untouched one (ok: < 1e-5), trained values' gradients vs the dense "
        "expert gradient at the same entries (ok: relative error < 1e-4). The nine families in the test suite "
        "use usaf.testing.tiny's hand-made configs; the others the common tiny sizes over the family's defaults (where "
        "those do not build, that is this survey's limit, not a usaf result).",
        "",
        "Summary: " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())),
        "",
    ]
    table_rows = []
    no_causal_lm = [name for name, r in rows.items() if r["status"] == "no causal-LM class"]
    for name, r in rows.items():
        if r["status"] == "no causal-LM class":
            continue
        diff = f"{r['logits_max_abs_diff']:.1e}" if "logits_max_abs_diff" in r else "–"
        grad = f"{r['value_grad_rel_err']:.1e}" if "value_grad_rel_err" in r else "–"
        detail = r.get("error", "").replace("|", "/").replace("\n", " ")[:160]
        table_rows.append([name, r["status"], diff, grad, detail])
    header = ["model type", "status", "logits max abs diff", "value grad rel err", "detail"]
    lines += table(header, table_rows, align="llrr")
    lines += [
        "",
        "Configurations without a causal-LM class (vision/audio towers, composite models): "
        + ", ".join(no_causal_lm)
        + ".",
        "",
    ]
    paths = write_results("families", {"machine": facts, "families": rows}, "\n".join(lines))
    print("\n".join(lines[:7]))
    print("wrote", *paths)


if __name__ == "__main__":
    main()
