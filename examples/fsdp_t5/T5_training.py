"""The PyTorch FSDP T5 example (pytorch/examples, distributed/FSDP/T5_training.py), loading
the model once instead of once per rank.

The training loop, validation loop, optimizer, scheduler and FSDP wrapping (every T5Block,
then the root) are the example's. The one change that matters is in ``setup_model``:

    -  model = T5ForConditionalGeneration.from_pretrained(model_name)      # every rank: a full copy
    +  model = oneload.from_pretrained(T5ForConditionalGeneration, model_name,
    +                                  fsdp=oneload.hf.fully_shard_blocks(...))  # every rank: its shard

so each rank builds the model on the meta device, shards it with FSDP2 while it is still
empty, and receives only its shard: no rank ever holds the whole model in CPU memory.
(With ``--fsdp 1`` it follows the FSDP1 recipe instead: rank 0 reads once, torch broadcasts.)

Runs anywhere: without ``--model`` it builds a tiny T5 from a T5Config, saves it with
save_pretrained to ``--workdir`` and trains a few steps on synthetic token data (no
downloads), on CPU with gloo:

    torchrun --standalone --nproc_per_node 4 examples/fsdp_t5/T5_training.py

On GPUs with the real model (see README.md): ``--model google/flan-t5-xxl``.

``--save-model --checkpoint-type sharded`` saves every rank's shards with
torch.distributed.checkpoint, as the example's ``model_checkpointing`` does;
``--resume-from FOLDER`` starts a later run, on any number of ranks, from such a save (or any
checkpoint metaseq-oneload reads), each rank reading only its shard.
"""

import argparse
import functools
import os
import time
from datetime import datetime

import torch
import torch.distributed as dist
import torch.optim as optim
import tqdm
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import T5Config, T5ForConditionalGeneration
from transformers.models.t5.modeling_t5 import T5Block

import metaseq_oneload as oneload

from metaseq_oneload import from_pretrained
from metaseq_oneload.hf import empty_model, fsdp1_param_init_fn, fully_shard_blocks

g_gigabyte = 1024**3


def setup():
    # nccl on GPUs, gloo on CPU (the example assumes GPUs)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def cleanup():
    dist.destroy_process_group()


def get_date_of_run():
    date_of_run = datetime.now().strftime("%Y-%m-%d-%I:%M:%S_%p")
    print(f"--> current date and time of run = {date_of_run}")
    return date_of_run


def format_metrics_to_gb(item):
    return round(item / g_gigabyte, ndigits=4)


class SyntheticSummarization(Dataset):
    """Stands in for the example's wikihow dataset (same keys), without a download: random
    token ids, so the loss only shows that training runs."""

    def __init__(self, num_samples, input_length, output_length, vocab_size, seed):
        g = torch.Generator().manual_seed(seed)
        self.source = torch.randint(2, vocab_size, (num_samples, input_length), generator=g)
        self.target = torch.randint(2, vocab_size, (num_samples, output_length), generator=g)

    def __len__(self):
        return len(self.source)

    def __getitem__(self, i):
        return {"source_ids": self.source[i], "source_mask": torch.ones_like(self.source[i]),
                "target_ids": self.target[i], "target_mask": torch.ones_like(self.target[i])}


def train(args, model, rank, world_size, train_loader, optimizer, epoch, device, sampler=None):
    model.train()
    fsdp_loss = torch.zeros(2).to(device)
    if sampler:
        sampler.set_epoch(epoch)
    if rank == 0:
        inner_pbar = tqdm.tqdm(range(len(train_loader)), colour="blue", desc="r0 Training Epoch")
    for batch in train_loader:
        for key in batch.keys():
            batch[key] = batch[key].to(device)
        optimizer.zero_grad()
        output = model(input_ids=batch["source_ids"], attention_mask=batch["source_mask"], labels=batch["target_ids"])
        loss = output["loss"]
        loss.backward()
        optimizer.step()
        fsdp_loss[0] += loss.item()
        fsdp_loss[1] += 1
        if rank == 0:
            inner_pbar.update(1)

    dist.all_reduce(fsdp_loss, op=dist.ReduceOp.SUM)
    train_accuracy = fsdp_loss[0] / fsdp_loss[1]
    if rank == 0:
        inner_pbar.close()
        print(f"Train Epoch: \t{epoch}, Loss: \t{train_accuracy:.4f}")
    return train_accuracy


def validation(model, rank, world_size, val_loader, device):
    model.eval()
    fsdp_loss = torch.zeros(2).to(device)
    if rank == 0:
        inner_pbar = tqdm.tqdm(range(len(val_loader)), colour="green", desc="Validation Epoch")
    with torch.no_grad():
        for batch in val_loader:
            for key in batch.keys():
                batch[key] = batch[key].to(device)
            output = model(input_ids=batch["source_ids"], attention_mask=batch["source_mask"],
                           labels=batch["target_ids"])
            fsdp_loss[0] += output["loss"].item()
            fsdp_loss[1] += 1
            if rank == 0:
                inner_pbar.update(1)

    dist.all_reduce(fsdp_loss, op=dist.ReduceOp.SUM)
    val_loss = fsdp_loss[0] / fsdp_loss[1]
    if rank == 0:
        inner_pbar.close()
        print(f"Validation Loss: {val_loss:.4f}")
    return val_loss


def tiny_t5(folder):
    """A small flan-t5 shaped T5 (gated-gelu), written by save_pretrained as on the Hub."""
    config = T5Config(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                      num_heads=4, feed_forward_proj="gated-gelu", decoder_start_token_id=0)
    # Its own random stream: the first run (which builds the model on rank 0) and every later
    # run (which finds it saved) then train from the same RNG state, with the same dropout.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        T5ForConditionalGeneration(config).save_pretrained(folder)


def mixed_precision(args):
    if args.bf16 and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def setup_model(args, model_name, device):
    """The one change: our from_pretrained instead of every rank's own full copy (and, with
    ``--resume-from``, the weights of an earlier run instead of the pretrained ones)."""
    if args.resume_from:
        return resume_model(args, model_name, device)
    if args.every_rank_loads:  # the example as written, for comparison: N full copies
        model = T5ForConditionalGeneration.from_pretrained(model_name, dtype=torch.float32)
        if args.fsdp == 2:
            return fully_shard_blocks()(model)
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        return FSDP(model, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                              transformer_layer_cls={T5Block}), device_id=device)
    if args.fsdp == 2:
        return from_pretrained(T5ForConditionalGeneration, model_name, dtype=torch.float32,
                               fsdp=fully_shard_blocks(**fsdp2_kwargs(args)))
    # FSDP1 (the example's own wrapping): rank 0 reads once; torch broadcasts into the shards.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    model = empty_model(T5ForConditionalGeneration, model_name, dtype=torch.float32)
    full = {}
    if dist.get_rank() == 0:
        oneload.load_into(model, model_name, device=device, no_dist=True)  # rank 0 alone
        full = model.state_dict()
    dtype = mixed_precision(args)
    model = FSDP(model,
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={T5Block}),
                 mixed_precision=MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype) if dtype else None,
                 device_id=device, param_init_fn=fsdp1_param_init_fn(model, device))
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                               strict=False))
    return model


def fsdp2_kwargs(args):
    """fully_shard's options: mixed precision, and CPU offload when asked for."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = mixed_precision(args)
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype) if dtype else MixedPrecisionPolicy()}
    if args.cpu_offload:  # shards stay in CPU memory (the load materialises them there)
        from torch.distributed.fsdp import CPUOffloadPolicy

        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    return kw


def resume_model(args, model_name, device):
    """``--resume-from``: the model built empty from ``model_name``'s config, sharded as for a
    fresh run, and filled from a checkpoint of an earlier run: a sharded save of this example
    (a torch.distributed.checkpoint folder written on any number of ranks) or any checkpoint
    metaseq-oneload reads. Every rank reads only what its shard needs, whatever the world size
    the checkpoint was saved on (the example's own load_model_sharded needs the same world)."""
    model = empty_model(T5ForConditionalGeneration, model_name, dtype=torch.float32)
    if args.fsdp == 2:
        model = fully_shard_blocks(**fsdp2_kwargs(args))(model) or model
        oneload.load_into(model, args.resume_from, device=None if args.cpu_offload else device)
        return model
    # FSDP1: rank 0 reads the checkpoint once, torch broadcasts into the shards (setup_model's recipe).
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    full = {}
    if dist.get_rank() == 0:
        oneload.load_into(model, args.resume_from, device=device, no_dist=True)
        full = model.state_dict()
    model = FSDP(model, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={T5Block}),
                 device_id=device, param_init_fn=fsdp1_param_init_fn(model, device))
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                               strict=False))
    return model


def save_model_sharded(args, model, save_dir):
    """The example's model_checkpointing.save_model_and_optimizer_sharded (model only): every
    rank writes its own shards with torch.distributed.checkpoint, under ``{"model": ...}``;
    FSDP1 through its SHARDED_STATE_DICT, FSDP2 as its state dict is (DTensor shards)."""
    import torch.distributed.checkpoint as dist_cp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    writer = dist_cp.FileSystemWriter(save_dir)
    if args.fsdp == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import StateDictType

        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            dist_cp.save({"model": model.state_dict()}, storage_writer=writer, planner=DefaultSavePlanner())
    else:
        dist_cp.save({"model": model.state_dict()}, storage_writer=writer, planner=DefaultSavePlanner())
    dist.barrier()


def full_cpu_state_dict(args, model):
    """The whole model's weights on rank 0's CPU, as the example saves them."""
    if args.fsdp == 1:  # the example's own FSDP1 calls
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def fsdp_main(args):
    setup()  # before loading: the load is collective
    local_rank = int(os.environ["LOCAL_RANK"])
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    model_name = args.model
    if model_name is None:
        model_name = os.path.join(args.workdir, "t5-tiny")
        if rank == 0 and not os.path.exists(os.path.join(model_name, "config.json")):
            tiny_t5(model_name)
        dist.barrier()

    t0 = time.perf_counter()
    model = setup_model(args, model_name, device)
    if rank == 0:
        print(f"--> loaded {model_name} onto {world_size} ranks (FSDP{args.fsdp}) in {time.perf_counter() - t0:.1f}s")
    vocab = model.config.vocab_size

    train_dataset = SyntheticSummarization(args.train_samples, args.input_length, args.output_length, vocab, 1)
    val_dataset = SyntheticSummarization(args.val_samples, args.input_length, args.output_length, vocab, 2)
    sampler1 = DistributedSampler(train_dataset, rank=rank, num_replicas=world_size, shuffle=True)
    sampler2 = DistributedSampler(val_dataset, rank=rank, num_replicas=world_size)
    train_kwargs = {"batch_size": args.batch_size, "sampler": sampler1}
    test_kwargs = {"batch_size": args.test_batch_size, "sampler": sampler2}
    if torch.cuda.is_available():
        cuda_kwargs = {"num_workers": 2, "pin_memory": True, "shuffle": False}
        train_kwargs.update(cuda_kwargs)
        test_kwargs.update(cuda_kwargs)
    train_loader = torch.utils.data.DataLoader(train_dataset, **train_kwargs)
    val_loader = torch.utils.data.DataLoader(val_dataset, **test_kwargs)

    optimizer = optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    best_val_loss = float("inf")
    curr_val_loss = float("inf")
    if rank == 0:
        time_of_run = get_date_of_run()
        dur = []
        train_acc_tracking = []
        val_acc_tracking = []
        mem_alloc_tracker = []

    for epoch in range(1, args.epochs + 1):
        t0 = time.time()
        train_accuracy = train(args, model, rank, world_size, train_loader, optimizer, epoch, device, sampler=sampler1)
        if args.run_validation:
            curr_val_loss = validation(model, rank, world_size, val_loader, device)
        scheduler.step()
        if rank == 0:
            print(f"--> epoch {epoch} completed...entering save and stats zone")
            dur.append(time.time() - t0)
            train_acc_tracking.append(train_accuracy.item())
            if args.run_validation:
                val_acc_tracking.append(curr_val_loss.item())
            if args.track_memory and torch.cuda.is_available():
                mem_alloc_tracker.append(format_metrics_to_gb(torch.cuda.memory_allocated()))
            print("completed save and stats zone...")

        if args.save_model and curr_val_loss < best_val_loss and args.checkpoint_type == "sharded":
            save_dir = os.path.join(args.workdir, "T5-sharded")
            if rank == 0:
                print(f"--> saving sharded checkpoint to {save_dir}")
            save_model_sharded(args, model, save_dir)
        elif args.save_model and curr_val_loss < best_val_loss:
            cpu_state = full_cpu_state_dict(args, model)
            if rank == 0:
                save_name = os.path.join(args.workdir, f"T5-model-{time_of_run}-{epoch}-{curr_val_loss.item():.4f}.pt")
                print(f"--> saving as model name {save_name}")
                torch.save(cpu_state, save_name)
        if curr_val_loss < best_val_loss:
            best_val_loss = curr_val_loss
            if rank == 0:
                print(f"-->>>> New Val Loss Record: {best_val_loss}")

    dist.barrier()
    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="PyTorch T5 FSDP Example, loaded once with metaseq-oneload")
    parser.add_argument("--model", default=None,
                        help="a save_pretrained folder or Hub id (e.g. google/flan-t5-xxl); default: a tiny T5 "
                             "built and saved under --workdir")
    parser.add_argument("--workdir", default=os.environ.get("TMPDIR", "/tmp") + "/oneload-fsdp-t5")
    parser.add_argument("--fsdp", type=int, choices=(1, 2), default=2, help="FSDP2 fully_shard (default) or FSDP1")
    parser.add_argument("--every-rank-loads", action="store_true",
                        help="load as the original example does (every rank reads a full copy), for comparison")
    parser.add_argument("--batch-size", type=int, default=4, metavar="N")
    parser.add_argument("--test-batch-size", type=int, default=4, metavar="N")
    parser.add_argument("--epochs", type=int, default=2, metavar="N")
    parser.add_argument("--lr", type=float, default=0.002, metavar="LR")
    parser.add_argument("--gamma", type=float, default=0.7, metavar="M")
    parser.add_argument("--seed", type=int, default=1, metavar="S")
    parser.add_argument("--train-samples", type=int, default=32, help="synthetic training samples (example: 1500)")
    parser.add_argument("--val-samples", type=int, default=16, help="synthetic validation samples (example: 300)")
    parser.add_argument("--input-length", type=int, default=64, help="example: 512")
    parser.add_argument("--output-length", type=int, default=16, help="example: 150")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision on GPUs that support it")
    parser.add_argument("--cpu-offload", action="store_true",
                        help="FSDP2 CPUOffloadPolicy: parameter shards, gradients and optimizer state in CPU memory")
    parser.add_argument("--track_memory", action="store_false", default=True)
    parser.add_argument("--run_validation", action="store_false", default=True)
    parser.add_argument("--save-model", action="store_true", default=False)
    parser.add_argument("--checkpoint-type", choices=("full", "sharded"), default="full",
                        help="what --save-model writes: the full state dict from rank 0 (torch.save), or every "
                             "rank's shards as a torch.distributed.checkpoint folder (<workdir>/T5-sharded)")
    parser.add_argument("--resume-from", default=None, metavar="PATH",
                        help="start from the weights of an earlier run: a sharded save (any world size) or any "
                             "checkpoint metaseq-oneload reads; --model (or the tiny T5) still gives the config")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    os.makedirs(args.workdir, exist_ok=True)
    fsdp_main(args)
