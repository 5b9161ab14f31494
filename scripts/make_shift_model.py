"""Pretrain the byte-level Qwen3-MoE that bench/quality.py fine-tunes on a text domain shift, into a cache folder.

    .venv/bin/python scripts/make_shift_model.py            # builds bench/.cache/shift-model/<key>/ unless cached
    .venv/bin/python scripts/make_shift_model.py --force    # rebuild anyway

Domains (text every machine of this image has; nothing is downloaded):
  OLD (pretraining): English documentation and licence prose: the Python stdlib's `pydoc_data.topics` (the
      language reference's topics, ~465 KB) followed by the files of /usr/share/common-licenses (~260 KB, each
      text once: symlinked duplicates are skipped).
  NEW (the shift bench/quality.py fine-tunes on): roff man-page source, the gzipped English pages of
      /usr/share/man/man1..man8, in a fixed hash order of their names, capped at NEW_DOMAIN_BYTES. Its bytes
      differ clearly from the old domain's (`.TP`, `\\fB...\\fR`, `.SH`, escapes, option tables) while sharing
      some English, so learning it can interfere with what the model knows.
  English prose -> Python source is NOT used (reserved for an independent check).
Each domain is cut into BLOCK-byte blocks; every HOLDOUT_EVERY-th block is held out (no overlap with train).

Model: qwen3_moe, hidden 256, 4 layers, 16 experts top-2, expert width 256, 4 heads (2 KV heads) of 64, byte-level
vocabulary (256 bytes + <pad> <bos> <eos> = 259 ids: byte b has id b), untied embeddings: ~13.5 M parameters
(12.6 M in experts). A `PreTrainedTokenizerFast` with the same ids is saved next to it (AutoTokenizer loads it).

Pretraining: AdamW (lr PRETRAIN["lr"], betas 0.9/0.95, wd 0.01), warm-up then cosine to 10 %, clip 1.0, random
PRETRAIN["seq"]-byte windows of the old domain's train part, router balancing loss 0.01. Deterministic: seeded, and
torch.set_num_threads(1) (float reductions depend on the thread count; one thread also avoids the slow-downs of
oversubscribed cores on a shared 2-core machine; the same torch on the same kind of CPU gives
the same weights). About 4-5 minutes on this project's 2-core CPU. The result is cached under a key that hashes
this file's bytes, the torch/transformers versions and the old domain's bytes: any change rebuilds.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / "bench" / ".cache" / "shift-model"
THREADS = 1
SEED = 0
BLOCK, HOLDOUT_EVERY = 4096, 10
NEW_DOMAIN_BYTES = 3_000_000
LICENSES = Path("/usr/share/common-licenses")
MAN = Path("/usr/share/man")

PAD, BOS, EOS = 256, 257, 258
VOCAB = 259
SHAPE = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=512,  # unused: every layer is MoE
    moe_intermediate_size=256,
    num_experts=16,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    router_aux_loss_coef=0.01,
)
PRETRAIN = dict(steps=400, batch=16, seq=128, lr=3e-3, warmup=50)


class MissingDomain(RuntimeError):
    pass


# ---- the domains ----------------------------------------------------------------------------------------------


def old_domain_bytes() -> bytes:
    try:
        import pydoc_data.topics as topics
    except ImportError:
        raise MissingDomain(
            "old domain: Python's pydoc_data.topics is missing from this interpreter"
        ) from None
    if not LICENSES.is_dir():
        raise MissingDomain(f"old domain: {LICENSES} is missing (Debian's base-files provides it)")
    parts = [topics.topics[k] for k in sorted(topics.topics)]
    seen = set()
    for path in sorted(LICENSES.iterdir()):
        if path.is_symlink() or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if text not in seen:
            seen.add(text)
            parts.append(text)
    return "\n\n".join(parts).encode("utf-8")


def new_domain_bytes(limit: int = NEW_DOMAIN_BYTES) -> bytes:
    pages = [p for section in range(1, 9) for p in (MAN / f"man{section}").glob("*.gz") if not p.is_symlink()]
    if not pages:
        raise MissingDomain(
            f"new domain: no man pages under {MAN}/man1..man8 (the image must keep man pages)"
        )
    pages.sort(key=lambda p: hashlib.sha1(p.name.encode()).hexdigest())
    out, size = [], 0
    for page in pages:
        data = gzip.decompress(page.read_bytes())
        if data.startswith(b".so ") or len(data) < 512:  # redirects to another page, stubs
            continue
        out.append(data)
        size += len(data)
        if size >= limit:
            break
    return b"\n".join(out)[:limit]


def split(data: bytes) -> tuple[bytes, bytes]:
    """(train, held_out): every HOLDOUT_EVERY-th BLOCK-byte block is held out."""
    blocks = [data[i : i + BLOCK] for i in range(0, len(data), BLOCK)]
    held = [b for i, b in enumerate(blocks) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    train = [b for i, b in enumerate(blocks) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
    return b"".join(train), b"".join(held)


def domains() -> dict[str, dict[str, bytes]]:
    """{"old": {"train", "held_out"}, "new": {...}}; raises MissingDomain with a one-line reason."""
    out = {}
    for name, data in (("old", old_domain_bytes()), ("new", new_domain_bytes())):
        train, held = split(data)
        out[name] = {"train": train, "held_out": held}
    return out


def encode(data: bytes):
    """Bytes -> a 1-D int64 tensor of token ids (byte b -> id b: what the saved tokenizer gives, without <bos>)."""
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


# ---- the tokenizer --------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer():
    """A byte-level PreTrainedTokenizerFast: byte b -> id b, <pad> 256, <bos> 257, <eos> 258; encoding with
    special tokens prepends <bos>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {char: b for b, char in _bytes_to_unicode().items()}
    vocab.update({"<pad>": PAD, "<bos>": BOS, "<eos>": EOS})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<pad>", "<bos>", "<eos>"])
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )


# ---- the model ------------------------------------------------------------------------------------------------


def model_config(**overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=VOCAB,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        **{**SHAPE, **overrides},
    )


def windows(ids, count: int, seq: int, generator):
    """`count` random windows of `seq` ids from a 1-D tensor, as a (count, seq) batch."""
    import torch

    starts = torch.randint(0, ids.numel() - seq, (count,), generator=generator)
    return torch.stack([ids[s : s + seq] for s in starts.tolist()])


def held_out_batches(ids, seq: int, count: int, batch: int):
    """Fixed non-overlapping windows of a held-out stream, `count` of them at most, in batches."""
    n = min(count, ids.numel() // seq)
    rows = ids[: n * seq].view(n, seq)
    return [rows[i : i + batch] for i in range(0, n, batch)]


def mean_loss(model, batches) -> float:
    import torch

    import usaf

    was = model.training
    model.eval()
    with torch.no_grad():
        total = sum(float(usaf.causal_lm_loss(model, b, b)) * b.shape[0] for b in batches)
    model.train(was)
    return total / sum(b.shape[0] for b in batches)


def pretrain(model, train_ids, eval_sets: dict, settings: dict, log=print) -> dict:
    import torch

    steps, warmup = settings["steps"], settings["warmup"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings["lr"], betas=(0.9, 0.95), weight_decay=0.01)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    generator = torch.Generator().manual_seed(SEED)
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        ids = windows(train_ids, settings["batch"], settings["seq"], generator)
        out = model(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            log(
                f"step {step:4d}  loss {out.loss.item():.3f}  lr {schedule.get_last_lr()[0]:.1e}  "
                f"{time.perf_counter() - start:5.0f} s"
            )
    model.eval()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, **{f"{k}_loss": mean_loss(model, v) for k, v in eval_sets.items()}}


def cache_key(old: bytes) -> str:
    import torch
    import transformers

    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(f"{torch.__version__}/{transformers.__version__}".encode())
    h.update(hashlib.sha256(old).digest())
    return h.hexdigest()[:16]


def build(force: bool = False, log=print) -> Path:
    """The pretrained model's folder (built unless cached); raises MissingDomain when a domain's files are absent."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    data = domains()
    out = CACHE / cache_key(data["old"]["train"] + data["old"]["held_out"])
    if (out / "pretrain.json").exists() and not force:
        return out
    torch.set_num_threads(THREADS)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(model_config(), dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    log(f"qwen3_moe: {params:,} parameters; old domain {len(data['old']['train']):,} train bytes")
    seq = PRETRAIN["seq"]
    eval_sets = {
        name: held_out_batches(encode(data[name]["held_out"]), seq, 64, 16) for name in ("old", "new")
    }
    result = pretrain(model, encode(data["old"]["train"]), eval_sets, PRETRAIN, log)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    model.save_pretrained(tmp)
    tokenizer = byte_tokenizer()
    tokenizer.save_pretrained(tmp)
    summary = {
        "parameters": params,
        "shape": SHAPE,
        "pretrain": PRETRAIN,
        "threads": THREADS,
        "uniform_loss": math.log(256),
        **result,
    }
    (tmp / "pretrain.json").write_text(json.dumps(summary, indent=2))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    log(
        f"pretrained in {result['seconds']:.0f} s: held-out loss old {result['old_loss']:.3f}, "
        f"new {result['new_loss']:.3f} nats/byte (uniform {math.log(256):.2f}) -> {out}"
    )
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--force", action="store_true", help="rebuild even when cached")
    args = parser.parse_args(argv)
    try:
        path = build(force=args.force)
    except MissingDomain as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
