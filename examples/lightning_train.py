"""Train with Oases from Lightning: ``Trainer(strategy="oases")``.

The strategy builds this rank's TMP shard of the model before ``configure_optimizers``;
``training_step`` hands each batch to ``self.train_batch`` (the whole Oases step).

    python examples/lightning_train.py                 # 2 CPU processes, TMP 2
    python examples/lightning_train.py --accelerator gpu --devices 2
"""
import argparse

import lightning.pytorch as pl
import torch

import lightning_strategy  # noqa: F401  registers strategy="oases"
from lightning_strategy import OasesLightningModule
from oases_ds import ModelConfig


class TinyGPT(OasesLightningModule):
    def __init__(self) -> None:
        super().__init__(ModelConfig(family="gpt", vocab_size=256, hidden_size=64, num_heads=4, num_layers=2, seq_len=32))

    def configure_optimizers(self):  # self.parameters(): this rank's shard
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self):  # {"tokens", "labels"}; the strategy shards by DP rank only
        text = torch.tensor(list(open(torch.__file__, "rb").read()[:100_000]))
        seq = text[: (len(text) // 33) * 33].view(-1, 33)[:256]
        return torch.utils.data.DataLoader([{"tokens": s[:-1], "labels": s[1:]} for s in seq], batch_size=8)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--accelerator", default="cpu")
    ap.add_argument("--devices", type=int, default=2)
    args = ap.parse_args()
    trainer = pl.Trainer(strategy="oases", accelerator=args.accelerator, devices=args.devices, max_steps=20,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(TinyGPT())
    if trainer.is_global_zero:
        print(f"trained {trainer.global_step} steps, loss {float(trainer.callback_metrics['train_loss']):.3f}")
