"""Train an MoE model's own experts under transformers.Trainer, then turn its checkpoint into a usaf delta.

    python examples/hf_trainer.py MODEL_DIR [OUT_DIR]
    accelerate launch --multi_gpu --num_processes 2 examples/hf_trainer.py MODEL_DIR [OUT_DIR]    (DDP)
    torchrun --nproc_per_node 2 examples/hf_trainer.py MODEL_DIR [OUT_DIR]    (DDP, no Accelerate launcher)

On CPUs, set ACCELERATE_USE_CPU=1 for either launcher (DDP on gloo); without it the Trainer does not use DDP.
One process and two train the same thing (up to float rounding): a step's batch is 8 sequences either way,
gradient accumulation making up what a second process would do. Then
`usaf apply MODEL_DIR OUT_DIR/delta.safetensors MERGED_DIR` writes a full checkpoint any tool can load.
"""

import os
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
processes = int(os.environ.get("WORLD_SIZE", "1"))  # set by accelerate launch and torchrun
# TrainingArguments first: under a launcher it starts the process group, and prepare_model then gives every
# process rank 0's selection
args = TrainingArguments(
    out,
    max_steps=10,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=max(1, 2 // processes),
    learning_rate=1e-3,
    report_to=[],
)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token  # some tokenizers (Mixtral's) have none
# 1 % of the experts, attention, embeddings and output layer (the default targets), and the routers whole
config = usaf.UsafConfig(density=0.01, targets=["experts", "attention", "embeddings", "lm_head", "routers"])
model = usaf.prepare_model(AutoModelForCausalLM.from_pretrained(model_dir), config)
# sequences of different lengths
words = ["fig", "apple", "melon", "kiwi", "banana", "plum", "cherry", "pear"]
train_data = [tokenizer(f"copy {word} -> {word}") for word in words * 4]
collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
trainer = Trainer(model=model, args=args, train_dataset=train_data, data_collator=collator)
trainer.train()
if trainer.is_world_process_zero():  # the checkpoint is rank 0's (every rank holds the same values)
    usaf.delta_from_trainer_checkpoint(f"{out}/checkpoint-10", model_dir, f"{out}/delta.safetensors")
