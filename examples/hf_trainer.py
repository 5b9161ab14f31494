"""Train an MoE model's own experts under transformers.Trainer, then turn its checkpoint into a usaf delta.

    python examples/hf_trainer.py MODEL_DIR [OUT_DIR]
    accelerate launch --multi_gpu --num_processes 2 examples/hf_trainer.py MODEL_DIR [OUT_DIR]   # DDP, 2 GPUs

Then `usaf apply MODEL_DIR OUT_DIR/delta.safetensors MERGED_DIR` writes a full checkpoint any tool can load.
Under DDP every process prepares the same selection (it is seeded), the trained values' and routers' gradients are
averaged as any parameter's, and only the main process writes the delta.
"""

import sys

from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainingArguments,
)

import usaf

model_dir, out = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "hf_trainer_out"
tokenizer = AutoTokenizer.from_pretrained(model_dir)
tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token  # some tokenizers (Mixtral's) have none
model = usaf.prepare_model(AutoModelForCausalLM.from_pretrained(model_dir), usaf.UsafConfig(density=0.01))
train_data = [tokenizer(f"copy {word} -> {word}") for word in ("apple", "grape", "melon", "lemon") * 8]
args = TrainingArguments(out, max_steps=10, per_device_train_batch_size=8, learning_rate=1e-3, report_to=[])
collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
trainer = Trainer(model=model, args=args, train_dataset=train_data, data_collator=collator)
trainer.train()
if trainer.is_world_process_zero():
    usaf.delta_from_trainer_checkpoint(f"{out}/checkpoint-10", model_dir, f"{out}/delta.safetensors")
