"""The whole conformance corpus onto worlds 1..4 and model-parallel sizes 1 and 2, on real
gloo ranks, one process group per world loading every set: each rank's part equals
Megatron's split of an independent reading of the files (tests/corpus.py), exactly, with
verify=True; metaseq sets also as FSDP flat shards (fairscale's own sharding)."""

from __future__ import annotations

import pytest

from tests.corpus import entries
from tests.distributed.harness import run_ranks
from tests.distributed.workers import load_corpus

ALL = [e for e in entries() if not e.refused]
# Model parallel 2 where the model has a Megatron form: metaseq's model, and fairseq's
# Megatron sets (fairseq's plain transformer_lm has no model-parallel twin to load into).
MP2 = [e.id for e in ALL if e.family == "metaseq" or e.mp > 1]
FLAT = {e.id for e in ALL if e.family == "metaseq"}


# Worlds of 3 and 4 ranks play one node per rank and ask for ``parallel`` (ranks that want the
# same bytes read each once between them and exchange); worlds of 2 are one node (its ranks
# read through its page cache).
@pytest.mark.parametrize("world,mp_size", [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (4, 2)])
def test_corpus_onto_any_world(tmp_path, world, mp_size):
    ids = [e.id for e in ALL] if mp_size == 1 else MP2
    nodes = world > 2
    results = run_ranks(world, load_corpus, mp_size, ids, FLAT, nodes, tmp_path=tmp_path, timeout=400)
    rows = results[0]
    assert {r[0] for r in rows} == set(ids)
    assert all(r[4] for r in rows)  # verify=True passed everywhere
    assert all(len(r) == len(rows) for r in results)
    w = world // mp_size
    for i, row in enumerate(rows):
        if not row[1]:
            # Every rank holds its whole part (flat=False; the dtype of storage and output agree).
            read = sum(r[i][3] for r in results)
            held = sum(r[i][5] for r in results) / w
            if nodes:
                # Across nodes, the part's bytes are read once between the ranks that share it.
                assert read <= 1.05 * held, (row[0], world, mp_size, read, held)
                if w > 1:
                    assert {r[i][2] for r in results} == {"parallel"}, row
            else:
                # On one node each rank reads its own part, the page cache serving the repeats.
                assert all(r[i][3] <= 1.05 * r[i][5] for r in results), (row[0], world, mp_size)
                if w > 1:
                    assert all("page cache" in r[i][6] and r[i][2] != "parallel" for r in results), row
