"""fairseq_logits.py JOBS.json OUT.pt : in fairseq's Python, load checkpoints with fairseq's own
loaders, each job with or without ``metaseq_oneload.install()``, and save each model's logits
on its set's reference tokens (or the error the call raised) for the tests in
tests/integration/test_fairseq_load.py to compare.

A job is a dict with ``id``, ``patched`` (bool), ``set`` (a folder of the fairseq fixtures) and
``call``, one of:

- ``ensemble``: ``checkpoint_utils.load_model_ensemble_and_task([set/file], arg_overrides)``
  with the job's ``file`` and extra keyword arguments ``kwargs``;
- ``from_pretrained``: ``TransformerLanguageModel.from_pretrained(set, file, ...)``;
- ``unsharded``: stock fairseq's loader on the set's unsharded equivalent: the file itself
  for a singleton set, else one file whose ``model`` is fairscale's own
  ``FullyShardedDataParallel.consolidate_shard_weights`` of the shards' flat parameters
  (with their ``fsdp_metadata``), as fairseq's ``--use-sharded-state`` loading would have it.
"""

import os
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fairseq_cpu_shim  # noqa: F401,E402  (CPU FSDP, Megatron imports, weights_only allowlist)

import json  # noqa: E402

import torch  # noqa: E402

import metaseq_oneload  # noqa: E402


def logits(model, tokens):
    model.eval()
    with torch.no_grad():
        return model(tokens)[0]


def unsharded(folder: Path, scratch: Path) -> Path:
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    shards = sorted(folder.glob("checkpoint_last*.pt"))
    if len(shards) == 1:
        return shards[0]
    states = [torch.load(f, map_location="cpu", weights_only=False) for f in shards]
    state = dict(states[0])
    state["model"] = FSDP.consolidate_shard_weights([s["model"] for s in states],
                                                    [s["fsdp_metadata"] for s in states])
    del state["fsdp_metadata"]
    state.pop("last_optimizer_state", None)  # flat per shard; the model loaders do not read it
    out = scratch / folder.name / "checkpoint_last.pt"
    if out.exists():
        return out
    out.parent.mkdir()
    torch.save(state, out)
    return out


def run(job, fixtures: Path, scratch: Path):
    from fairseq import checkpoint_utils
    from fairseq.models.transformer_lm import TransformerLanguageModel

    if not job["patched"]:
        metaseq_oneload.uninstall()
    elif not metaseq_oneload.installed():
        metaseq_oneload.install()
    folder = fixtures / job["set"]
    tokens = torch.load(folder / "reference_logits.pt", weights_only=True)["tokens"]
    overrides = {"data": str(fixtures)}
    if job["call"] == "from_pretrained":
        hub = TransformerLanguageModel.from_pretrained(str(folder), job["file"], data_name_or_path=str(fixtures))
        return logits(hub.models[0], tokens)
    path = unsharded(folder, scratch) if job["call"] == "unsharded" else folder / job["file"]
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task([str(path)], arg_overrides=overrides,
                                                                 **job.get("kwargs", {}))
    return logits(models[0], tokens)


def main(jobs_file, out_file):
    jobs = json.loads(Path(jobs_file).read_text())
    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "fairseq"
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for job in jobs:
            try:
                results[job["id"]] = {"logits": run(job, fixtures, Path(scratch))}
            except Exception as e:  # noqa: BLE001  (the tests assert on it)
                results[job["id"]] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    metaseq_oneload.uninstall()
    torch.save(results, out_file)


if __name__ == "__main__":
    main(*sys.argv[1:])
