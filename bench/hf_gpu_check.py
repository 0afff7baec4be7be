"""GPU check for from_pretrained: tiny T5 unwrapped, FSDP2, FSDP2 by broadcast and FSDP2 with
CPUOffloadPolicy on a CUDA mesh (NCCL), a tiny Llama under CPU offload (its rotary buffer must
end on the GPU, its parameter shards on CPU), plus the benchmark T5 with --big. Not part of
the suite.

torchrun --standalone --nproc_per_node 1 bench/hf_gpu_check.py OUTDIR [--big]

Run on an H200 (torch 2.11, transformers 5.17): all three loads exact on cuda:0, logits within
1.5e-6 of the CPU model; --big (the 1 GiB T5 of hf_t5_bench.py) loaded under FSDP2 in 0.35 s with
85 MiB of CPU peak above baseline. The two CPU-offload cases came later: checked on CPU (gloo,
world 1: exact), not yet on a GPU. There "fsdp2-offload" must show devices cpu (the shards)
and "llama-offload" shards ["cpu"], buffers ["cuda:0"].
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy

sys.path.insert(0, os.getcwd())
from transformers import T5Config, T5ForConditionalGeneration  # noqa: E402

from metaseq_oneload import from_pretrained  # noqa: E402
from metaseq_oneload.hf import fully_shard_blocks  # noqa: E402
from metaseq_oneload._into import is_dtensor as _is_dtensor  # noqa: E402


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024


out_dir = sys.argv[1]
cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(0)
res = {"torch": torch.__version__, "cuda": cuda, "device": torch.cuda.get_device_name(0) if cuda else "cpu"}

cfg = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
               feed_forward_proj="gated-gelu", decoder_start_token_id=0, dropout_rate=0.0)
torch.manual_seed(0)
ref = T5ForConditionalGeneration(cfg).eval()
folder = os.path.join(out_dir, "t5")
ref.save_pretrained(folder)
x = torch.tensor([[5, 17, 9, 3, 44, 101, 7], [8, 2, 99, 12, 6, 1, 0]])
y = torch.tensor([[4, 11, 30, 1, 0], [9, 9, 2, 77, 1]])
with torch.no_grad():
    ref_logits = ref(input_ids=x, labels=y).logits
saved = {k: v.clone() for k, v in ref.state_dict().items()}

offload = CPUOffloadPolicy(pin_memory=cuda)  # pinning needs a GPU
for name, kw in [("fsdp2", {"fsdp": fully_shard_blocks()}), ("unwrapped", {"device": dev}),
                 ("fsdp2-bcast", {"fsdp": fully_shard_blocks(), "strategy": "broadcast", "bucket_mb": 0.01}),
                 ("fsdp2-offload", {"fsdp": fully_shard_blocks(offload_policy=offload)})]:
    m, rep = from_pretrained(T5ForConditionalGeneration, folder, return_report=True, **kw)
    sd = m.state_dict()
    devices = sorted({str((t.to_local() if _is_dtensor(t) else t).device) for t in sd.values()})
    wdiff = max(float(((sd[k].full_tensor() if _is_dtensor(sd[k]) else sd[k]).cpu() - v).abs().max())
                for k, v in saved.items())
    with torch.no_grad():
        logits = m(input_ids=x.to(dev), labels=y.to(dev)).logits.cpu()
    m.train()
    loss = m(input_ids=x.to(dev), labels=y.to(dev)).loss
    loss.backward()
    res[name] = {"strategy": rep.strategy, "devices": devices, "weights_maxdiff": wdiff,
                 "logits_maxdiff": float((logits - ref_logits).abs().max()), "loss": float(loss),
                 "tied": m.shared.weight is m.encoder.embed_tokens.weight}
    del m

# CPU offload with a buffer: Llama's rotary inv_freq is computed, not loaded, and must be where
# the forward runs while the parameter shards stay on CPU.
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

torch.manual_seed(0)
lref = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2)).eval()
lfolder = os.path.join(out_dir, "llama")
lref.save_pretrained(lfolder)
tokens = torch.tensor([[3, 9, 27, 4, 60]])
with torch.no_grad():
    lref_logits = lref(tokens).logits
m = from_pretrained(LlamaForCausalLM, lfolder, fsdp=fully_shard_blocks(offload_policy=offload))
shards = sorted({str(p.to_local().device) for p in m.parameters() if _is_dtensor(p)})
buffers = sorted({str(b.device) for b in m.buffers()})
with torch.no_grad():
    llogits = m(tokens.to(dev)).logits.cpu()
m.train()
m(tokens.to(dev), labels=tokens.to(dev)).loss.backward()
res["llama-offload"] = {"shards": shards, "buffers": buffers,
                        "logits_maxdiff": float((llogits - lref_logits).abs().max())}
del m

if "--big" in sys.argv:
    big = os.path.join(out_dir, "t5big")
    bcfg = T5Config(vocab_size=32128, d_model=768, d_kv=64, d_ff=2816, num_layers=12, num_decoder_layers=12,
                    num_heads=12, feed_forward_proj="gated-gelu", decoder_start_token_id=0)
    t = time.perf_counter()
    T5ForConditionalGeneration(bcfg).save_pretrained(big)
    res["big_save_s"] = time.perf_counter() - t
    import gc
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status("VmHWM")
    torch.cuda.synchronize()
    t = time.perf_counter()
    m = from_pretrained(T5ForConditionalGeneration, big, fsdp=fully_shard_blocks())
    torch.cuda.synchronize()
    res["big"] = {"seconds": time.perf_counter() - t, "cpu_peak_above_base_MiB": (status("VmHWM") - base) / 2**20,
                  "gpu_allocated_MiB": torch.cuda.memory_allocated() / 2**20,
                  "params_MiB": sum(p.numel() * p.element_size() for p in m.parameters()) / 2**20}

print(json.dumps(res, indent=1))
with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
    json.dump(res, f, indent=1)
dist.destroy_process_group()
