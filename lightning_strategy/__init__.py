"""PyTorch Lightning integration: ``Trainer(strategy="oases")``.

Importing this package registers :class:`OasesStrategy` under the name
``"oases"`` in Lightning's strategy registry (Lightning has no entry points for
strategies), so ``import lightning_strategy`` before building the Trainer.
See ``lightning_strategy/README.md`` for the module protocol and an example.
"""
from lightning.pytorch.strategies import StrategyRegistry

from lightning_strategy.module import OasesLightningModule
from lightning_strategy.strategy import OasesStrategy

__all__ = ["OasesLightningModule", "OasesStrategy"]

OasesStrategy.register_strategies(StrategyRegistry)
