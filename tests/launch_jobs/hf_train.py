"""A Hugging Face `Trainer` script: a tiny GPT-2 built from its config (no download),
trained on random tokens on CPU (gloo): run it with torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 hf_train.py --out DIR
"""

from __future__ import annotations

import torch
from straggler import Accelerator, parse, rank
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

VOCAB = 128
SEQ = 16


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.tokens = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class StepOfTheAccelerator(TrainerCallback):
    """Tells the emulated accelerator the step the Trainer is in."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator

    def on_step_begin(self, args, state, control, **kwargs):
        self.accelerator.step = state.global_step


def main() -> None:
    args = parse(__doc__.splitlines()[0])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    accelerator = Accelerator(args, rank())
    # The emulated device's time, in the model's own forward (after its last block).
    model.transformer.ln_f.register_forward_hook(lambda _, __, output: accelerator(output))
    training = TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch,
        learning_rate=1e-3, logging_strategy="no", save_strategy="no", report_to=[],
        use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(model=model, args=training, train_dataset=RandomTokens(4096),
                      callbacks=[StepOfTheAccelerator(accelerator)])  # fmt: skip
    trainer.train()


if __name__ == "__main__":
    main()
