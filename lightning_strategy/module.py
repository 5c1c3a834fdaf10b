"""The LightningModule protocol that :class:`~lightning_strategy.OasesStrategy` trains.

Why a protocol and not "any LightningModule": an Oases step is not
``loss = module(batch); loss.backward(); opt.step()``.  The executor interleaves
forward, recompute and backward of two sub-batches over a TMP-sharded operator
sequence, and the engine then runs DeepSpeed's reduction and update -- one call,
``engine.train_batch``.  So the module describes *what* to train (a
:class:`~oases_ds.ModelConfig`) and the strategy builds *how* (this rank's shard,
on its TMP group, inside an ``OasesEngine``).  The module's ``training_step``
gets the full Lightning batch and hands it to :meth:`train_batch`.
"""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from oases_ds.hf import HFCheckpoint, is_hf_model
from oases_ds.models.config import ModelConfig
from oases_ds.models.operator_model import OperatorModel


class OasesLightningModule(pl.LightningModule):
    """A transformer described by a ``ModelConfig``, trained by ``OasesStrategy``.

    Args:
        model_config: the model: a ``ModelConfig``, or a Hugging Face start -- an
            :class:`~oases_ds.HFCheckpoint` (a local directory, config overrides) or a
            ``transformers`` model of a supported class -- whose config is used and whose
            weights the strategy loads into this rank's shard.  The strategy builds the shard
            (``self.model``, an :class:`~oases_ds.OperatorModel`) before
            ``configure_optimizers`` runs, so ``self.parameters()`` there are the
            shard's parameters.

    Batches are ``{"tokens": LongTensor(b, s), "labels": LongTensor(b, s)}``
    (labels ``-100`` ignored), ``b`` = the DataLoader's batch size = DeepSpeed's
    ``train_micro_batch_size_per_gpu``.

    Override ``training_step`` / ``validation_step`` freely (to log more), but
    run the step through :meth:`train_batch` / :meth:`eval_batch`: there is no
    loss with a graph to return, the engine has already run backward and the
    optimizer step when ``train_batch`` returns.
    """

    def __init__(self, model_config: ModelConfig | HFCheckpoint | Any) -> None:
        super().__init__()
        self.hf_checkpoint: HFCheckpoint | None = None
        if is_hf_model(model_config):
            try:
                model_config = HFCheckpoint(model_config)
            except ValueError as err:
                raise TypeError(f"OasesLightningModule: {err}") from None
        if isinstance(model_config, HFCheckpoint):
            self.hf_checkpoint, model_config = model_config, model_config.config()
        if not isinstance(model_config, ModelConfig):
            raise TypeError(f"OasesLightningModule needs an oases_ds ModelConfig, an HFCheckpoint or a supported "
                            f"transformers model, got {type(model_config).__name__}")
        self.model_config = model_config
        self.model: OperatorModel | None = None  # built by OasesStrategy on this rank's TMP group

    # -- what the strategy provides ---------------------------------------------------
    def train_batch(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Forward, backward and (on an accumulation boundary) the optimizer step of
        ``batch`` through the Oases engine.  Returns the step's loss (mean over its
        micro-batches and DP ranks), or ``None`` while ``Trainer(accumulate_grad_batches=k)``
        is still collecting the step's ``k`` micro-batches."""
        return self._oases_strategy().train_batch(batch)

    def eval_batch(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Loss of ``batch`` without dropout, averaged over DP ranks."""
        return self._oases_strategy().eval_batch(batch)

    def _oases_strategy(self) -> Any:
        from lightning_strategy.strategy import OasesStrategy  # local: strategy.py imports this module

        strategy = self.trainer.strategy
        if not isinstance(strategy, OasesStrategy):
            raise RuntimeError(f"{type(self).__name__} is trained by Trainer(strategy=\"oases\"), not {type(strategy).__name__}")
        return strategy

    # -- Lightning hooks with working defaults ------------------------------------------
    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Eager mean loss (synchronous collectives), e.g. for inference outside the engine."""
        return self.model(batch)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        loss = self.train_batch(batch)
        if loss is not None:
            self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.eval_batch(batch)
        self.log("val_loss", loss, prog_bar=True)  # already the DP mean: no sync_dist needed
        return loss

    def configure_optimizers(self) -> Any:
        """Default: none here, so the DeepSpeed config's ``"optimizer"`` section is used.
        Override to return a torch optimizer (and scheduler) over ``self.parameters()``."""
        return None
