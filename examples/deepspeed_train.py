"""Train with Oases from a DeepSpeed script: ``oases_ds.initialize`` instead of ``deepspeed.initialize``.

The same script runs a plain ``DeepSpeedEngine`` with ``"enabled": false`` in the ``oases``
section.  Every TMP rank of a group must get the same batch; DP ranks get different ones.

    torchrun --nproc_per_node 2 examples/deepspeed_train.py          # TMP 2 (CPU: gloo; GPU: NCCL)
    torchrun --nproc_per_node 4 examples/deepspeed_train.py          # TMP 2 x DP 2
"""
import torch

import oases_ds

ds_config = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    "oases": {"enabled": True, "tensor_parallel_size": 2, "schedule": "oases", "sub_batches": 2},
}
model = oases_ds.ModelConfig(family="gpt", vocab_size=256, hidden_size=128, num_heads=4, num_layers=4, seq_len=64)
engine, optimizer, _, _ = oases_ds.initialize(model=model, config=ds_config)
ctx = engine.parallel_context  # this rank's TMP / DP coordinates and groups

text = torch.tensor(list(open(torch.__file__, "rb").read()[:200_000]))  # bytes of a file every install has
gen = torch.Generator().manual_seed(ctx.dp_rank)  # the same samples on every TMP rank of this DP replica
for step in range(20):
    starts = torch.randint(0, len(text) - model.seq_len - 1, (8,), generator=gen)
    seq = torch.stack([text[s : s + model.seq_len + 1] for s in starts])
    loss = engine.train_batch({"tokens": seq[:, :-1], "labels": seq[:, 1:]})  # forward, backward, step
    if torch.distributed.get_rank() == 0 and step % 5 == 4:
        print(f"step {step + 1}: loss {float(loss):.3f}, exposed comm {engine.last_stats['exposed_comm_frac']:.1%}")
torch.distributed.destroy_process_group()
