"""``OasesStrategy``: Lightning's ``DeepSpeedStrategy`` with an ``OasesEngine`` inside.

Why a DeepSpeedStrategy subclass: DeepSpeed already owns the optimizer, the
data-parallel reduction, gradient accumulation boundaries, clipping and
directory checkpoints, and Lightning's DeepSpeedStrategy already maps all of
that onto the Trainer (config formatting, ``accumulate_grad_batches`` ->
``gradient_accumulation_steps``, checkpoint save/load through the engine with
Lightning's loop state as DeepSpeed client state).  What differs is only *who
runs the step*: ``engine.train_batch`` does forward, backward and the optimizer
step of a whole step at once, so Lightning must neither call backward nor step.

How a step flows (automatic optimization is kept, so Lightning's global step,
LR schedulers, callbacks and ``accumulate_grad_batches`` all work)::

    Lightning loop -> LightningModule.optimizer_step -> OasesStrategy.optimizer_step
        -> closure() -> OasesLightningModule.training_step(batch)
             -> self.train_batch(batch) -> OasesStrategy.train_batch
                  -> engine.train_batch(k micro-batches)   # fwd + bwd + DeepSpeed step
             -> returns the (detached) loss
        -> OasesStrategy.backward(loss): nothing to do, the engine did it
    (no second engine.step(): the step happened inside train_batch)

Hooks overridden (tested with lightning==2.6.6, deepspeed==0.19.8):

* public Strategy hooks: ``setup_environment`` (DeepSpeedStrategy refuses CPU;
  we check that DeepSpeed's accelerator matches Lightning's instead),
  ``setup_distributed`` (also builds the :class:`ParallelContext`), ``connect``
  (rejects modules that do not follow the protocol), ``on_train_batch_start``,
  ``training_step`` (NaN for batches that only join an accumulation step),
  ``backward``, ``optimizer_step``, ``distributed_sampler_kwargs`` (DP rank/size,
  not world), ``register_strategies``.
* DeepSpeedStrategy methods: ``init_deepspeed`` (builds the engine through
  ``oases_ds.initialize`` instead of ``deepspeed.initialize``) and the
  ``deepspeed_engine`` property (the engine lives beside the LightningModule,
  not around it, because its module is the ``OperatorModel``).
* private Lightning internals relied on: ``_configure_launcher`` (the Trainer
  constructor calls it once devices are known: the TMP degree defaults to the
  devices per node and is checked there, before processes are launched), DeepSpeedStrategy's ``_init_optimizers`` (runs
  ``configure_optimizers``), ``_init_deepspeed_distributed`` (on CPU, where
  ``setup_distributed``'s CUDA index check cannot pass), ``_load_config`` / ``_init_config_if_needed``
  (config file, ``PL_DEEPSPEED_CONFIG_PATH``, batch size and accumulation from
  the Trainer); and its ``save_checkpoint`` / ``load_checkpoint``
  as they are.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import logging
from typing import Any, Callable, Optional

import torch
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.types import LRSchedulerConfig

import oases_ds
from lightning_strategy.module import OasesLightningModule
from oases_ds import build_model
from oases_ds._deepspeed_compat import choose_deepspeed_defaults
from oases_ds.config import parse_oases_section
from oases_ds.models.operator_model import OperatorModel
from oases_ds.parallel.context import ParallelContext
from oases_ds.parallel.topology import Topology

TESTED_LIGHTNING = "==2.6.6"
# Metrics from engine.last_stats logged after every optimizer step (prog_bar: shown in the bar).
LOGGED_STATS = {"tokens_per_s": True, "tmp_bytes": True, "exposed_comm_frac": False}


class OasesStrategy(DeepSpeedStrategy):
    """Tensor-model-parallel training with overlapped communication, as a Lightning strategy.

    Args:
        tensor_parallel_size: TMP degree; must divide the number of processes.  Default:
            the config's, else the Trainer's ``devices`` (devices per node), so that
            ``Trainer(strategy="oases", devices=2)`` shards the model over both devices
            as a user asking a TMP strategy for 2 devices expects (TMP 1 would be
            plain data parallelism); with several nodes, DP runs across them.
        schedule: Oases schedule (``oases``, ``megatron``, ...); default: the config's, else ``oases``.
        sub_batches: sub-batches per micro-batch; default: the config's, else 2.
        seed: initial weights and dropout keys; default: the config's, else oases_ds' default.
        plan: a plan JSON (per-block TMP degrees, from the planner); default: every block at
            ``tensor_parallel_size``.
        pipeline_stages: pipeline stages (each a contiguous range of layers; the world is
            stages x DP x TMP); default: the config's, else 1.  With stages and no
            ``tensor_parallel_size``, the TMP degree defaults to ``devices / pipeline_stages``.
        pipeline_schedule: ``1f1b`` or ``gpipe``: the order of the ``accumulate_grad_batches``
            micro-batches over the stages; default: the config's, else ``1f1b``.
        sequence_parallel: split the sequence over the TMP ranks between blocks (the
            ``oases.sequence_parallel`` of a DeepSpeed config); default: the config's, else off.
        overlap_micro_batches: run the ``accumulate_grad_batches`` micro-batches of a step as one
            schedule, each forward under the previous micro-batch's backward (one stage, schedule
            ``oases``); default: the config's, else off.
        config: a full DeepSpeed config (dict or JSON path), optionally with an
            ``"oases"`` section; the arguments above override that section.  Do not
            set ``gradient_accumulation_steps`` (it comes from
            ``Trainer(accumulate_grad_batches)``).  Default: ZeRO stage 0.
        zero_stage: ZeRO stage when ``config`` has no ``zero_optimization`` (0 or 1).
        accelerator, parallel_devices, cluster_environment, precision_plugin,
        process_group_backend, logging_level: as for ``DeepSpeedStrategy``.
    """

    strategy_name = "oases"

    def __init__(
        self,
        tensor_parallel_size: Optional[int] = None,
        schedule: Optional[str] = None,
        sub_batches: Optional[int] = None,
        seed: Optional[int] = None,
        plan: Optional[str] = None,
        pipeline_stages: Optional[int] = None,
        pipeline_schedule: Optional[str] = None,
        sequence_parallel: Optional[bool] = None,
        overlap_micro_batches: Optional[bool] = None,
        config: Optional[Any] = None,
        zero_stage: int = 0,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
        process_group_backend: Optional[str] = None,
        logging_level: int = logging.WARN,
    ) -> None:
        loaded = copy.deepcopy(self._load_config(config)) or {}  # never mutate the caller's dict
        loaded.setdefault("zero_optimization", {"stage": zero_stage})
        loaded.setdefault("zero_allow_untested_optimizer", True)
        loaded.setdefault("steps_per_print", 10**9)
        section = dict(loaded.get("oases") or {})
        section["enabled"] = True
        for key, value in (("tensor_parallel_size", tensor_parallel_size), ("schedule", schedule),
                           ("sub_batches", sub_batches), ("seed", seed), ("plan", plan),
                           ("pipeline_stages", pipeline_stages), ("pipeline_schedule", pipeline_schedule),
                           ("sequence_parallel", sequence_parallel), ("overlap_micro_batches", overlap_micro_batches)):
            if value is not None:
                section[key] = value
        self.oases = parse_oases_section(section)  # one-line error on a bad field, before any process starts
        self._tp_from_devices = "tensor_parallel_size" not in section  # set in _configure_launcher
        loaded["oases"] = section
        super().__init__(
            accelerator=accelerator, config=loaded, logging_level=logging_level, parallel_devices=parallel_devices,
            cluster_environment=cluster_environment, precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=datetime.timedelta(seconds=self.oases.process_group_timeout_s),
        )
        self.parallel_context: Optional[ParallelContext] = None
        self._engine: Any = None
        self._pending: list[dict[str, torch.Tensor]] = []  # micro-batches of the step being collected
        self._stepped_this_batch = False

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Oases: overlapped tensor-model-parallel DeepSpeed",
                                   override=True)

    # -- start-up ------------------------------------------------------------------------
    def connect(self, model: Any) -> None:
        if not isinstance(model, OasesLightningModule):
            raise MisconfigurationException(
                f"strategy=\"oases\" trains an OasesLightningModule (a LightningModule built from an oases_ds "
                f"ModelConfig, see lightning_strategy/README.md); got {type(model).__name__}"
            )
        if self._tp_from_devices:
            try:
                model.model_config.check_tp(self.oases.tensor_parallel_size)
            except ValueError as err:
                raise MisconfigurationException(
                    f"{err} (strategy=\"oases\" takes its TMP degree from devices={self.oases.tensor_parallel_size}; "
                    f"pass strategy=OasesStrategy(tensor_parallel_size=...) to choose another)"
                ) from None
        super().connect(model)

    def _configure_launcher(self) -> None:
        # Called by the Trainer's constructor once devices and nodes are known: the
        # earliest point to take the default TMP degree from the devices, and to refuse
        # one that does not divide the world, before any process is launched.
        if self._tp_from_devices:
            tp = max(1, self.num_processes // self.oases.pipeline_stages)
            self.oases = self.oases.model_copy(update={"tensor_parallel_size": tp})
            self.config["oases"]["tensor_parallel_size"] = tp  # what oases_ds.initialize reads
        try:
            Topology(world_size=self.num_nodes * self.num_processes, tp_size=self.oases.tensor_parallel_size,
                     pp_size=self.oases.pipeline_stages)
        except ValueError as err:
            raise MisconfigurationException(str(err)) from None
        super()._configure_launcher()

    def setup_environment(self) -> None:
        # DeepSpeedStrategy.setup_environment raises on anything but CUDA; Oases runs on
        # CPU (gloo) as well, so go straight to DDPStrategy's after checking DeepSpeed's
        # accelerator agrees with Lightning's.  DeepSpeed is imported here, not at the top:
        # importing it fixes its accelerator, which the user may still set after importing us.
        from deepspeed.accelerator import get_accelerator

        ds_device = get_accelerator().device_name()
        if ds_device != self.root_device.type:
            raise MisconfigurationException(
                f"Lightning runs on {self.root_device.type} but DeepSpeed's accelerator is {ds_device}; "
                f"set DS_ACCELERATOR={self.root_device.type} before importing deepspeed"
            )
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        choose_deepspeed_defaults(self.config)  # before DeepSpeed's comm starts (it would JIT-build an op on CPU)
        if self.root_device.type == "cpu":
            # DeepSpeedStrategy.setup_distributed, less its check that CUDA device
            # indices equal local ranks (CPU devices have no index).
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()
        else:
            super().setup_distributed()
        self.parallel_context = ParallelContext.build(
            self.oases.tensor_parallel_size, self.oases.process_group_timeout_s, device=self.root_device,
            pipeline_stages=self.oases.pipeline_stages,
        )

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Split data by DP rank only: the TMP ranks of one group, and the stages of one
        pipeline, must see the same samples."""
        topo = Topology(world_size=self.world_size, tp_size=self.oases.tensor_parallel_size,
                        pp_size=self.oases.pipeline_stages)
        return {"num_replicas": topo.dp_size, "rank": topo.coord(self.global_rank).dp}

    def init_deepspeed(self) -> None:
        """Build this rank's TMP shard on the strategy's group, run the module's
        ``configure_optimizers`` on it, and wrap both in an ``OasesEngine``."""
        module = self.lightning_module
        trainer = module.trainer
        if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise MisconfigurationException("DeepSpeed does not support clipping gradients by value; use gradient_clip_val alone")
        ctx = self.parallel_context
        module.model = self._shard_for(module, ctx)
        fitting = trainer.state.fn == TrainerFn.FITTING
        optimizer, scheduler_config = None, None
        if fitting and "optimizer" not in self.config:
            if not is_overridden("configure_optimizers", module, OasesLightningModule):
                raise MisconfigurationException(
                    "no optimizer: override configure_optimizers or put an \"optimizer\" section in the DeepSpeed config"
                )
            optimizer, scheduler_config = self._init_optimizers()
        index = self.root_device.index
        engine, ds_optimizer, _, ds_scheduler = oases_ds.initialize(
            args=argparse.Namespace(device_rank=index if index is not None else self.local_rank),
            model=module.model, optimizer=optimizer,
            lr_scheduler=scheduler_config.scheduler if scheduler_config else None,
            config=self.config, parallel_context=ctx, dist_init_required=False,
        )
        if ds_scheduler is not None:
            # Lightning steps the scheduler (at its interval, after optimizer steps) and saves it.
            engine.lr_scheduler = None
            if scheduler_config is None:
                scheduler_config = LRSchedulerConfig(ds_scheduler, interval="step")
            else:
                scheduler_config.scheduler = ds_scheduler
        self.optimizers = [ds_optimizer] if fitting else []
        self.lr_scheduler_configs = [scheduler_config] if scheduler_config else []
        self._engine = engine
        self._pending = []

    def _shard_for(self, module: OasesLightningModule, ctx: ParallelContext) -> OperatorModel:
        old = module.model
        if old is not None and old.group is ctx.tp_group:
            return old
        shard = build_model(module.model_config, ctx, self.oases)
        if module.hf_checkpoint is not None and old is None:  # first build: the checkpoint's weights
            module.hf_checkpoint.load_into(shard)
        shard = self.precision_plugin.convert_module(shard)
        if old is not None:  # a second fit of the same module: keep its trained weights
            shard.load_state_dict(old.state_dict())
        return shard

    @property
    def deepspeed_engine(self) -> Any:
        return self._engine

    # -- the step --------------------------------------------------------------------------
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._stepped_this_batch = False
        if batch_idx % self.lightning_module.trainer.accumulate_grad_batches == 0 and self._pending:
            rank_zero_warn(f"oases: dropping {len(self._pending)} micro-batch(es) of an incomplete accumulation step")
            self._pending = []

    def train_batch(self, batch: dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
        """See :meth:`OasesLightningModule.train_batch`."""
        engine = self._engine
        self._stepped_this_batch = True
        self._pending.append(batch)
        if len(self._pending) < engine.gradient_accumulation_steps():
            return None
        step = {k: torch.cat([mb[k] for mb in self._pending]) for k in batch}
        self._pending = []
        loss = engine.train_batch(step)
        module = self.lightning_module
        for name, prog_bar in LOGGED_STATS.items():
            module.log(name, float(engine.last_stats[name]), prog_bar=prog_bar, on_step=True, on_epoch=False)
        return loss

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``training_step``; a batch that only joined a step still being
        collected (``accumulate_grad_batches > 1``) has no loss yet: Lightning, which
        refuses ``None`` in distributed runs, gets NaN for it instead."""
        output = super().training_step(*args, **kwargs)
        if output is None and self._pending:
            return torch.tensor(float("nan"), device=self.root_device)
        return output

    @torch.no_grad()
    def eval_batch(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._engine.eval_batch(batch)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Nothing to do: ``engine.train_batch`` already ran the backward (and the
        ``on_before_backward`` / ``on_after_backward`` hooks are therefore not called)."""
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Run the closure (``training_step`` -> ``engine.train_batch``, which steps the
        optimizer) and nothing else.  ``on_before_optimizer_step`` is not called: the
        step happens inside ``train_batch``."""
        result = closure()
        if not self._stepped_this_batch:
            raise MisconfigurationException(
                f"{type(self.lightning_module).__name__}.training_step must call self.train_batch(batch): "
                "the Oases engine runs forward, backward and the optimizer step"
            )
        return result
