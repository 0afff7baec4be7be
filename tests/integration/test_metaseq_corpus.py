"""Every checkpoint of the metaseq conformance corpus (tests/fixtures/metaseq/corpus.json)
through real metaseq's eval-side loader, patched as ``+oneload=auto`` patches it
(``integrations.install()``), with no loading flags, on world sizes other than the saved
one: model parallel 1 on 1 rank, and model parallel 2 on 2 ranks (the tiny model has 2
heads, so 2 is the largest model-parallel size it takes). Each load must reproduce the
logits real metaseq produced from that set natively (its ``reference_logits.pt``).

One process group per world size loads every set (a spawn that imports metaseq costs
seconds). The corpus's FasterTransformer export (``refuse``) is no checkpoint and is
covered by the package's own corpus tests.

Bounds: fp32 compute within ``FP32`` (1e-5) of ``logits``. Low-precision sets:
``reshard_fp16``/``reshard_bf16`` keep the fp32 cfg of their source, so metaseq builds the
model in fp32 and upcasts the weights, as their ``logits`` were made: 1e-5 again. The
training sets ``train_mefp16``/``train_bf16_copy`` say fp16/bf16 in their cfg, and metaseq
builds and computes the model in that dtype, as it did for their ``logits_native``
(``logits`` is the same load with fp16/bf16 turned off, see the corpus README); a
low-precision model is compared with ``logits_native`` within ``LOW_PRECISION`` (a few
roundings of that dtype at these logits' magnitude; another model-parallel size adds the
partial sums in another order). The references themselves are 3e-3 (fp16) and 3.6e-2
(bf16) from fp32 compute.

Runs where metaseq is importable; skips otherwise (metaseq is not on PyPI).
"""

import pytest
import torch

from tests import corpus
from tests.distributed.harness import run_ranks
from tests.unit.test_metaseq_patch import _why_not, setup_metaseq

pytestmark = pytest.mark.skipif(bool(_why_not()), reason=_why_not() or "metaseq available")

FP32 = 1e-5
# A low-precision model against metaseq's own low-precision logits: this many units in the
# last place of that dtype at the logits' magnitude (measured: 2 at model parallel 2, where
# the row-parallel partial sums are rounded and added in another order; 0 at 1).
ULPS = 4

SETS = [e for e in corpus.entries("metaseq") if not e.refused]


def _forward(model, tokens, want, rank: int) -> tuple:
    with torch.no_grad():
        got = model(tokens)[0].float()
    if got.shape[-1] != want.shape[-1]:  # vocab-parallel output: this rank's slice
        n = got.shape[-1]
        want = want[..., rank * n:(rank + 1) * n]
    return got, want


def _compare(model, e: "corpus.Entry") -> dict:
    """(every rank) This rank's logits against the set's reference (its vocab slice where the
    output is vocab-parallel). A model metaseq built in fp16/bf16 is compared in that dtype
    with ``logits_native``, then upcast (``model.float()``: the very weights it loaded) and
    compared in fp32 with ``logits``."""
    from metaseq.distributed import utils as distributed_utils

    ref = torch.load(e.folder / "reference_logits.pt", weights_only=True)
    rank = distributed_utils.get_model_parallel_rank()
    dtype = next(model.parameters()).dtype
    model.eval()
    out = {"dtype": str(dtype).replace("torch.", "")}
    if dtype in (torch.float16, torch.bfloat16):
        got, want = _forward(model, ref["tokens"], ref["logits_native"], rank)
        ulp = torch.finfo(dtype).eps * 2.0 ** torch.floor(torch.log2(ref["logits_native"].abs().max()))
        out.update(native=float((got - want).abs().max()), native_bound=float(ULPS * ulp))
        model.float()
    got, want = _forward(model, ref["tokens"], ref["logits"], rank)
    out["fp32"] = float((got - want).abs().max())
    return out


def corpus_worker(rank: int, world: int, model_parallel: int, ids: list) -> dict:
    """(all ranks, collective) Every set of ``ids`` through the patched
    ``load_model_ensemble_and_task``, given only the set's path."""
    setup_metaseq(model_parallel)
    from metaseq import checkpoint_utils

    from metaseq_oneload import integrations

    integrations.install()
    # the patched loader, as +oneload=auto leaves it
    assert checkpoint_utils.load_model_ensemble_and_task.__module__ == "metaseq_oneload.integrations.metaseq"
    out = {}
    for ident in ids:
        e = corpus.by_id(ident)
        try:
            models, _, _ = checkpoint_utils.load_model_ensemble_and_task([str(e.path)])
            out[e.set] = _compare(models[0], e)
        except Exception as exc:  # reported per set: one failure must not hide the others
            out[e.set] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    return out


def _check(results: list, world: int, mp: int) -> None:
    rows, bad = [], []
    for rank, out in enumerate(results):
        for name, r in out.items():
            if "error" in r:
                bad.append(f"rank {rank} {name}: {r['error']}")
                continue
            row = f"MP{mp} on {world} rank {rank}: {name:26s} {r['dtype']:9s} fp32 {r['fp32']:.2e}"
            if "native" in r:
                row += f", in {r['dtype']} {r['native']:.2e} from logits_native (bound {r['native_bound']:.2e})"
                if not r["native"] <= r["native_bound"]:
                    bad.append(row)
            if not r["fp32"] <= FP32:
                bad.append(row)
            rows.append(row)
    print("\n" + "\n".join(rows))
    assert not bad, "\n".join(bad)


def test_every_set_on_one_rank(tmp_path):
    ids = [e.id for e in SETS]
    _check(run_ranks(1, corpus_worker, 1, ids, tmp_path=tmp_path, timeout=300), 1, 1)


def test_every_set_on_two_model_parallel_ranks(tmp_path):
    """Model parallel 2 on 2 ranks: a split of the MP1 sets, the MP4 set merged to 2, and the
    MP2 sets on 2 ranks where they were saved on 4 or 6 (for the others it is their own
    world size: the native layout through the same path)."""
    ids = [e.id for e in SETS]
    _check(run_ranks(2, corpus_worker, 2, ids, tmp_path=tmp_path, timeout=300), 2, 2)
