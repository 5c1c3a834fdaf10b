"""Rank functions for the Lightning tests (run under oases_ds.launcher, which sets
torchrun-style env vars: Lightning sees an already-launched job and starts no processes)."""
from __future__ import annotations

import os

import torch

from dist_workers import make_batch, tiny_config

os.environ.setdefault("DS_ACCELERATOR", "cpu")

SEED = 7
MICRO = 4
SAMPLES = 8  # two batches of MICRO per epoch
EPOCHS = 2


def dataset(step: int = 0, size: int = SAMPLES) -> list[dict[str, torch.Tensor]]:
    full = make_batch(tiny_config("gpt"), size, step)
    return [{k: v[i] for k, v in full.items()} for i in range(size)]


def full_params(model) -> dict[str, torch.Tensor]:
    """Parameters gathered over the TMP shards (``model`` is an OperatorModel)."""
    return {name: model.sharding.gather_full(name, p, p.float()) for name, p in model.named_parameters()}


def _module_class():
    from lightning_strategy import OasesLightningModule

    class TinyGPT(OasesLightningModule):
        def __init__(self) -> None:
            super().__init__(tiny_config("gpt"))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(dataset(), batch_size=self.batch_size)

        def val_dataloader(self):
            return torch.utils.data.DataLoader(dataset(step=99, size=MICRO), batch_size=MICRO)

    return TinyGPT


def _recorder():
    import lightning.pytorch as pl

    class Record(pl.Callback):
        """Losses and stats after every optimizer step; val loss after every validation."""

        def __init__(self, save_at_epoch_end: str | None = None) -> None:
            self.losses, self.val_losses, self.steps = [], [], []
            self.save_at_epoch_end = save_at_epoch_end
            self.start_params: dict[str, torch.Tensor] = {}

        def on_train_start(self, trainer, module):  # after a resume has loaded its checkpoint
            self.start_params = full_params(module.model)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step > (self.steps[-1] if self.steps else 0):
                self.steps.append(trainer.global_step)
                self.losses.append(float(trainer.callback_metrics["train_loss"]))

        def on_validation_epoch_end(self, trainer, module):
            if not trainer.sanity_checking:
                self.val_losses.append(float(trainer.callback_metrics["val_loss"]))

        def on_train_epoch_end(self, trainer, module):
            if self.save_at_epoch_end and trainer.current_epoch == 0:
                trainer.save_checkpoint(self.save_at_epoch_end)

    return Record


def _trainer(strategy, record, log_dir: str, epochs: int = EPOCHS, accumulate: int = 1):
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_epochs=epochs, gradient_clip_val=0.05,
        accumulate_grad_batches=accumulate, callbacks=[record], logger=CSVLogger(log_dir), enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, deterministic=False,
    )


def lightning_runs(work_dir: str) -> dict:
    """Everything the Lightning tests check, in one pair of processes:

    * "trainer": Trainer(strategy="oases", devices=2) (the seed from the config
      file named by PL_DEEPSPEED_CONFIG_PATH, the TMP degree by default from the
      devices), 2 epochs x 2 steps, with validation, saving a checkpoint at the
      end of epoch 0;
    * "resumed": a fresh Trainer resumed from that checkpoint for epoch 1;
    * "accumulate": accumulate_grad_batches=2 over half-size batches, 1 epoch;
    * "accumulate_overlapped": the same with overlap_micro_batches=True;
    * "sequence_parallel": as "resumed" but from the start, with the sequence split between blocks;
    * "direct": the same steps (same samples in the order Lightning's sampler
      gives) through oases_ds.initialize + engine.train_batch;
    * "nan": the error a Trainer stops with when the second step's loss is NaN.
    """
    import oases_ds
    from lightning_strategy import OasesStrategy  # importing the package registers "oases"

    TinyGPT, Record = _module_class(), _recorder()
    ckpt = os.path.join(work_dir, "epoch0.ckpt")
    out: dict = {}

    def run(name, strategy, record, batch_size=MICRO, accumulate=1, ckpt_path=None):
        module = TinyGPT()
        module.batch_size = batch_size
        trainer = _trainer(strategy, record, os.path.join(work_dir, name), accumulate=accumulate,
                           epochs=1 if accumulate > 1 else EPOCHS)
        trainer.fit(module, ckpt_path=ckpt_path)
        engine = trainer.strategy.deepspeed_engine
        out[name] = {
            "params": full_params(module.model), "start_params": record.start_params,
            "losses": record.losses, "steps": record.steps, "val_losses": record.val_losses,
            "global_step": trainer.global_step, "engine_steps": engine.global_steps,
            "gas": engine.gradient_accumulation_steps(), "micro": engine.train_micro_batch_size_per_gpu(),
            "prog_bar": sorted(trainer.progress_bar_metrics), "logged": {k: float(v) for k, v in trainer.logged_metrics.items()},
            "sampler": dict(trainer.strategy.distributed_sampler_kwargs),
            "stored_blocks": tuple(engine.schedule.stored_blocks),
            "sequence_parallel": engine.module.sequence_parallel,
            "pipeline_order": getattr(getattr(engine.executor, "pipe", None), "name", None),
        }

    assert os.environ.get("PL_DEEPSPEED_CONFIG_PATH"), "the test names the config with the seed"
    run("trainer", "oases", Record(save_at_epoch_end=ckpt))
    out["listing"] = sorted(os.listdir(ckpt))
    del os.environ["PL_DEEPSPEED_CONFIG_PATH"]  # from here on, the constructor arguments
    run("resumed", OasesStrategy(tensor_parallel_size=2, seed=SEED), Record(), ckpt_path=ckpt)
    # the same checkpoint under another layout, TMP 1 x DP 2 (half the batch per rank: the same
    # global batch), through its portable state
    run("resumed_tmp1", OasesStrategy(tensor_parallel_size=1, seed=SEED), Record(), batch_size=MICRO // 2, ckpt_path=ckpt)
    run("accumulate", OasesStrategy(tensor_parallel_size=2, seed=SEED), Record(), batch_size=MICRO // 2, accumulate=2)
    run("accumulate_overlapped", OasesStrategy(tensor_parallel_size=2, seed=SEED, overlap_micro_batches=True), Record(),
        batch_size=MICRO // 2, accumulate=2)
    # a plan with recomputation policies (every block at degree 2; attn0 and mlp1 stored, as
    # oases-plan planner.recompute=auto writes them): the same trajectory as "trainer"
    from oases_ds.planner.plan import Plan

    plan = os.path.join(work_dir, "policies.json")
    if int(os.environ.get("RANK", "0")) == 0:
        Plan((2, 2), (2, 2), devices=2, attn_policies=("store", "oases"), mlp_policies=("oases", "store")).to_json(plan)
    torch.distributed.barrier() if torch.distributed.is_initialized() else None
    run("planned", OasesStrategy(tensor_parallel_size=2, seed=SEED, plan=plan), Record())
    run("sequence_parallel", OasesStrategy(tensor_parallel_size=2, seed=SEED, sequence_parallel=True), Record())

    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 0.05,
           "zero_optimization": {"stage": 0}, "steps_per_print": 10**9, "zero_allow_untested_optimizer": True,
           "oases": {"enabled": True, "tensor_parallel_size": 2, "seed": SEED}}
    engine, *_ = oases_ds.initialize(
        model=tiny_config("gpt"), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), config=cfg)
    full = make_batch(tiny_config("gpt"), SAMPLES, 0)
    ctx = engine.parallel_context
    # Lightning's own training sampler: shuffled, seed 0, reseeded per epoch, split by DP rank.
    sampler = torch.utils.data.DistributedSampler(range(SAMPLES), num_replicas=ctx.dp_size, rank=ctx.dp_rank,
                                                  shuffle=True, seed=0)
    params, losses, val = [], [], []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler))
        for b in range(SAMPLES // MICRO):
            idx = order[b * MICRO : (b + 1) * MICRO]
            losses.append(float(engine.train_batch({k: v[idx] for k, v in full.items()})))
            params.append(full_params(engine.module))
        val.append(float(engine.eval_batch(make_batch(tiny_config("gpt"), MICRO, 99))))
    out["direct"] = {"params": params, "losses": losses, "val_losses": val}
    out["nan"] = _nan_run(TinyGPT, os.path.join(work_dir, "nan"))
    return out


def _nan_run(module_class, log_dir: str) -> str:
    """A Trainer whose weights turn NaN before its second step: the error it stops with."""
    import lightning.pytorch as pl

    from lightning_strategy import OasesStrategy

    class PoisonSecondStep(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == 1:
                with torch.no_grad():
                    module.model.head.norm.weight.fill_(float("nan"))

    module = module_class()
    module.batch_size = MICRO
    trainer = _trainer(OasesStrategy(tensor_parallel_size=2, seed=SEED), PoisonSecondStep(), log_dir, epochs=1)
    try:
        trainer.fit(module)
    except Exception as err:  # noqa: BLE001 -- the error is what the test checks
        return f"{type(err).__name__}: {err}"
    return "no error"


def protocol_error_run() -> str:
    """A plain LightningModule under strategy="oases": the error, as a string."""
    import lightning.pytorch as pl
    import lightning_strategy  # noqa: F401  (registers "oases")

    class Plain(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

        def training_step(self, batch, batch_idx):
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(strategy="oases", accelerator="cpu", devices=2, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False)
    try:
        trainer.fit(Plain(), torch.utils.data.DataLoader(torch.randn(4, 2), batch_size=2))
    except Exception as err:  # noqa: BLE001 -- the message is what the test checks
        return f"{type(err).__name__}: {err}"
    return "no error"


def hf_validate_run(kind: str) -> dict:
    """``OasesLightningModule(<transformers model>)`` under ``Trainer(strategy="oases")``, TMP 2:
    the validation loss against ``transformers``' own on the same batch."""
    import lightning.pytorch as pl
    import torch.nn.functional as F

    import hf_workers
    from lightning_strategy import OasesLightningModule
    from oases_ds.models.operator_model import IGNORE_INDEX

    hf_model = hf_workers.tiny_hf_model(kind)  # same seed on every rank: the same weights
    module = OasesLightningModule(hf_model)
    batch = hf_workers.batch_of(module.model_config, MICRO)
    with torch.no_grad():
        logits = hf_workers.hf_logits(hf_model.eval(), batch)
    ref = float(F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX))
    samples = [{k: v[i] for k, v in batch.items()} for i in range(MICRO)]
    trainer = pl.Trainer(strategy="oases", accelerator="cpu", devices=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    result = trainer.validate(module, torch.utils.data.DataLoader(samples, batch_size=MICRO), verbose=False)
    return {"val_loss": float(result[0]["val_loss"]), "ref": ref}
