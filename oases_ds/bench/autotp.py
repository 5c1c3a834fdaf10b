"""The end-to-end table's baseline: DeepSpeed AutoTP with Hugging Face activation checkpointing.

Why here and not in the executor: the comparison is against what a user runs today
without Oases -- ``transformers``' ``LlamaForCausalLM`` at the same dims, sharded by
``deepspeed.initialize`` with ``"tensor_parallel": {"autotp_size": 2}`` and full
recomputation through ``gradient_checkpointing_enable()`` -- so none of our code may
stand in for it.  Only the model config comes from us (:func:`oases_ds.hf.hf_config`,
the same dims as the Oases model).  A step is what :func:`oases_ds.bench.measure.measure_rank`
times: forward + backward of one micro-batch, no optimizer step.

``transformers`` and ``deepspeed`` are imported inside :func:`autotp_rank`: the
benchmark must run (without this column) where ``transformers`` is absent.
"""
from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

from oases_ds.models.config import ModelConfig


def autotp_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of the AutoTP pair (torchrun-style env set); returns ``{"variants": {label: {"step_s": [...]}}}``.

    ``spec``: ``model`` (ModelConfig fields), ``micro_batch``, ``warmup``, ``repeats``, ``seed``, ``timeout_s``;
    optionally ``label`` (default ``autotp``), ``checkpointing`` (Hugging Face's recomputation of every
    decoder layer, default on), ``tp_overlap_comm`` (DeepSpeed's overlap of AutoTP's collectives, default
    off) and ``micro_steps`` (forward and backward of that many micro-batches per timed step, accumulated
    as DeepSpeed accumulates them; default 1).
    """
    import deepspeed
    import transformers

    from oases_ds.hf import hf_config

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=spec["timeout_s"]))
    cfg = ModelConfig(**spec["model"])
    torch.manual_seed(spec["seed"])
    model = transformers.LlamaForCausalLM(hf_config(cfg))
    model.config.use_cache = False
    if spec.get("checkpointing", True):
        # transformers 5 renamed it; same recomputation of every decoder layer in backward
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.train()
    micro_steps = int(spec.get("micro_steps", 1))
    ds_config = {"train_micro_batch_size_per_gpu": spec["micro_batch"], "gradient_accumulation_steps": micro_steps,
                 "tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": bool(spec.get("tp_overlap_comm", False))},
                 "zero_optimization": {"stage": 0}, "steps_per_print": 10 ** 9}
    # DeepSpeed refuses backward() without an optimizer; an SGD that never steps costs nothing in the step
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    gen = torch.Generator().manual_seed(spec["seed"])
    tokens = torch.randint(0, cfg.vocab_size, (spec["micro_batch"], cfg.seq_len), generator=gen)
    steps = []
    for rep in range(spec["warmup"] + spec["repeats"]):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(micro_steps):
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
        dt = time.perf_counter() - t0
        engine.module.zero_grad(set_to_none=True)
        if rep >= spec["warmup"]:
            steps.append(dt)
    # which layers AutoTP sharded: evidence in the record that the TMP collectives run on the
    # process group (gloo, over the link) and e.g. the head is not reduced through shared memory
    sharded = sorted({type(m).__name__ for m in engine.module.modules() if type(m).__module__.startswith("deepspeed.")})
    return {"rank": dist.get_rank(), "variants": {spec.get("label", "autotp"): {"step_s": steps}},
            "sharded_module_types": sharded}


def autotp_rank_reporting(spec: dict[str, Any]) -> dict[str, Any]:
    """:func:`autotp_rank`, but an exception becomes ``{"error": "<Type>: <message>"}``.

    Why catch at all: an AutoTP that does not work on the installed
    DeepSpeed/``transformers`` must be *reported with its exact error* and its column left out,
    while the Oases columns are still measured.  The error text travels in the result
    (a namespace rank's stderr is not the benchmark's); the other rank fails on its
    own process-group timeout or the broken pipe and reports likewise."""
    try:
        return autotp_rank(spec)
    except Exception as err:  # noqa: BLE001 -- recorded verbatim, never silenced
        return {"error": f"{type(err).__name__}: {err}".splitlines()[0][:500]}
