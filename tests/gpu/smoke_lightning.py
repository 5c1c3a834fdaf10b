"""Lightning on one GPU (a step of ``tests/gpu/smoke.sh``): ``Trainer(accelerator="gpu",
devices=1, strategy="oases", precision="bf16-mixed")``, five steps of the tiny GPT on
synthetic tokens; prints one JSON line with the losses.  ``--accelerator cpu`` runs the same
on CPU (``bf16-mixed`` is DeepSpeed's bf16 there too), which is how this script is tested."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import lightning.pytorch as pl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning_strategy  # noqa: E402,F401  registers "oases"
from lightning_strategy import OasesLightningModule  # noqa: E402
from oases_ds import ModelConfig  # noqa: E402


class TinyGPT(OasesLightningModule):
    def __init__(self) -> None:
        super().__init__(ModelConfig(family="gpt", vocab_size=64, hidden_size=64, num_heads=4, num_layers=2, seq_len=32))
        self.losses: list[float] = []
        self.step_devices: set[str] = set()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def training_step(self, batch, batch_idx):
        loss = self.train_batch(batch)
        if loss is not None:
            self.losses.append(float(loss))
        # read here: after fit, Lightning's teardown moves the module back to the CPU
        self.step_devices.add(str(next(self.model.parameters()).device))
        return loss

    def train_dataloader(self):
        seq = torch.randint(0, 64, (40, 33), generator=torch.Generator().manual_seed(0))
        data = [{"tokens": s[:-1], "labels": s[1:]} for s in seq]
        return torch.utils.data.DataLoader(data, batch_size=8)


def main(accelerator: str) -> dict:
    module = TinyGPT()
    trainer = pl.Trainer(accelerator=accelerator, devices=1, strategy="oases", precision="bf16-mixed", max_steps=5,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(module)
    devices = sorted(module.step_devices)
    want = "cuda" if accelerator == "gpu" else accelerator
    return {"losses": module.losses, "step_devices": devices, "global_step": trainer.global_step,
            "ok": len(module.losses) == 5 and all(math.isfinite(x) for x in module.losses)
            and len(devices) == 1 and devices[0].startswith(want)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--accelerator", default="gpu")
    result = main(ap.parse_args().accelerator)
    print(json.dumps(result))
    sys.exit(0 if result["ok"] else 1)
