"""One run of transformers.Trainer on a usaf-prepared model, for tests/test_trainer_accelerate.py: alone, or as
each process of `accelerate launch --multi_gpu --num_processes N` (DDP; gloo on the CPU with use_cpu=True).

    python tests/scripts/trainer_ddp.py BASE_DIR OUT_DIR PER_DEVICE_BATCH GRAD_ACCUM

Each process writes OUT_DIR/trained-rank<R>.safetensors (its trained values, their flat indices, its routers);
the main process also writes the losses and turns the last Trainer checkpoint into OUT_DIR/delta.safetensors.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import usaf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/helpers.py
from helpers import copy_sequences

STEPS = 4


def main(base: str, out: str, batch: int, accumulation: int) -> None:
    torch.set_num_threads(1)
    config = usaf.UsafConfig(
        density=0.1, selection="magnitude", targets=[*usaf.config.DEFAULT_TARGETS, "routers"]
    )
    model = usaf.prepare_model(AutoModelForCausalLM.from_pretrained(base), config)
    args = TrainingArguments(
        output_dir=out,
        max_steps=STEPS,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        learning_rate=0.05,
        warmup_steps=0,
        logging_steps=1,
        save_steps=STEPS,
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=copy_sequences(64))
    trainer.train()
    tensors = {f"{name}:values": change.values for name, change in usaf.get_delta(model).items()}
    tensors |= {f"{name}:flat_indices": change.flat_indices for name, change in usaf.get_delta(model).items()}
    tensors |= {n: p.detach() for n, p in model.named_parameters() if p.requires_grad and ".usaf." not in n}
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, f"{out}/trained-rank{args.process_index}.safetensors"
    )
    if trainer.is_world_process_zero():
        losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
        with open(f"{out}/losses.json", "w") as f:
            json.dump({"losses": losses, "world_size": args.world_size}, f)
        usaf.delta_from_trainer_checkpoint(f"{out}/checkpoint-{STEPS}", base, f"{out}/delta.safetensors")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
