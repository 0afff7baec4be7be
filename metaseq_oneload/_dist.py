"""Collectives for loading: no-ops without a process group, and failures reach every rank.

Like torch.distributed.checkpoint's ``_DistWrapper``: every helper here works the same with
no process group (one process, nothing to talk to). Nothing is ever pickled between ranks:
small messages travel as UTF-8 JSON in uint8 tensors, weights as raw tensor bytes.

Failure protocol: each phase of a load runs inside ``try``; at its end all ranks call
:func:`settle`, which exchanges "did you fail, and why" over the data-parallel group and
then the model-parallel group (two hops cover the whole grid) and raises
:class:`~metaseq_oneload._errors.DistributedLoadError` on every rank if any rank failed.
Inside the broadcast loop the reader announces each bucket with a status word first, so a
reader that fails mid-stream releases the receivers instead of leaving them waiting.

Two failures no exchange can carry, because a rank is not there to take part:

* a rank that never reaches the load (its caller caught an error and went on): every load
  starts with :func:`arrive`, a check-in through the group's store with its own timeout
  (``arrival_timeout``, default :data:`DEFAULT_ARRIVAL_TIMEOUT` seconds, not the process
  group's 30 minutes), after which every rank that arrived raises, naming those that did not.
  A rank whose call to the load fails before it checks in (a bad argument, its own module)
  is not left to that timeout: :func:`tell_failed` settles the check-in as failed at once,
  with its reason, and every other rank raises it within ``_RETURN_GRACE`` seconds (unless
  the failed rank checks in again meanwhile: then that call was one it made alone, and the
  others' load goes on with it).
  Each check-in is decided once, by whichever rank claims it first, and every rank holds
  to these (each was a hang or a wrong verdict once, ``tests/unit/test_checkin_protocol.py``):
  "ok" means every member will take part, so only a rank that will counts or marks itself
  arrived before the verdict (a failing rank claims it first, then marks itself told); a
  rank's check-ins are those of the group counters it read once when its call began
  (:func:`metaseq_oneload._begun.begin`: where an entry point or an integration's discovery starts; else when it
  reached :func:`arrive` or :func:`tell_failed`), never one decided later for the others'
  next load: a check-in the others gave up on meanwhile was this call's, so its failure is
  not left for their next load and its arrival is told "too late" at once;
  a rank's next load withdraws a failure of its own earlier call in every group before it
  waits in any;
* a rank that dies mid-load: the backend's own error (gloo's "Connection closed by peer")
  becomes a :class:`DistributedLoadError` that names the step and, where this host can
  tell, the rank whose process is gone (:meth:`Group.guard`).

Messages carried between ranks are clipped (:data:`MESSAGE_CAP` characters a rank) and lists
in them capped, so a failure costs what a success costs, not seconds of megabyte messages.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import socket
import threading
import time
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from ._begun import began
from ._errors import DistributedLoadError, OneloadError, OptionError, cap_list
from ._settings import Settings, from_env, variable

__all__ = ["Group", "PeerFailure", "settle", "first_failure", "arrive", "tell_failed",
           "tell_left", "arrival_timeout", "clip",
           "ARRIVAL_TIMEOUT_ENV", "DEFAULT_ARRIVAL_TIMEOUT", "MESSAGE_CAP"]

logger = logging.getLogger("metaseq_oneload")

ARRIVAL_TIMEOUT_ENV = variable("arrival_timeout")
# (why 300 s: see Settings.arrival_timeout)
DEFAULT_ARRIVAL_TIMEOUT = Settings.arrival_timeout
# Characters of one rank's message that travel to the others (the local error keeps all of
# it as the cause).
MESSAGE_CAP = 2000
_KEY = "oneload/arrival"
_GRACE = 1.0  # seconds a lost peer on this host has to finish ending before it is looked for
_LOST_POLL = 0.2  # seconds between looks in the store for a peer that stopped
# Seconds a rank told that another rank's own call failed before the check-in (tell_failed)
# waits for that rank's next check-in before raising it: a call the failed rank made alone
# (a rank-specific code path that caught the error and went on) is withdrawn there, and its
# next call is the others' load. Nothing in the store tells that lone call from the
# others' load failing on that rank, in either order (it fails before they check in, or
# while they wait), so every rank waits this long at most, whichever came first; a failed
# rank that retries at once is met by the others' load. Short against arrival_timeout.
_RETURN_GRACE = 2.0
_FATE_POLL = 0.02


def clip(text: str, limit: int = MESSAGE_CAP) -> str:
    """``text``, cut to ``limit`` characters with a note of how many were left out."""
    return text if len(text) <= limit else f"{text[:limit]} ... ({len(text) - limit} more characters)"


def arrival_timeout(value: Optional[float] = None, settings: Optional[Settings] = None) -> float:
    """(local) Seconds the first collective of a load waits for every rank: ``value`` (the
    caller's ``arrival_timeout=``), else the settings' (``settings``, else the environment's
    now: ``$METASEQ_ONELOAD_ARRIVAL_TIMEOUT``, default :data:`DEFAULT_ARRIVAL_TIMEOUT`).

    Raises:
        OptionError: ``value`` is not a positive number, or the variable is malformed
            (naming it).
    """
    if value is None:
        return (settings or from_env(only=("arrival_timeout",))).arrival_timeout
    if not (isinstance(value, (int, float)) and value > 0):
        raise OptionError(f"arrival_timeout={value!r}: expected a positive number of seconds.")
    return float(value)


def _start_time(pid: int) -> Optional[str]:
    """The start time of process ``pid`` (Linux), so a reused pid is not taken for the rank."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields and fields[0] in ("Z", "X"):  # a zombie is gone, only not yet reaped
        return None
    return fields[19] if len(fields) > 19 else None


def _whoami() -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start": _start_time(pid)}


def _gone(info: dict) -> bool:
    """Whether the process a rank recorded at check-in has ended (this host only)."""
    if info.get("host") != socket.gethostname():
        return False
    pid = int(info.get("pid", -1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, ValueError):
        return False
    start = _start_time(pid)
    return start is None or (info.get("start") is not None and start != info["start"])


class Group:
    """(all ranks of ``group``) One process group, or none.

    ``device`` is where collective buffers must live: CUDA for NCCL groups, CPU otherwise.
    ``role`` names the group in messages ("data-parallel"); :meth:`at` says what the load is
    doing, for the message a lost rank produces.
    """

    def __init__(self, group: Optional["dist.ProcessGroup"], role: str = "process"):
        self.group = group
        self.role = role
        self.step = "loading"
        self._arrival: Optional[str] = None  # store key of this load's check-in
        self._given: Optional[tuple] = None  # (store, members) of a group over a store alone (over_store)
        self.active = group is not None and dist.is_available() and dist.is_initialized()
        if self.active:
            if dist.get_rank(group) < 0:
                raise ValueError(
                    f"rank {dist.get_rank()} is not a member of the process group it passed; pass the "
                    "groups this rank belongs to (every rank calls with its own data- and model-parallel group).")
            self.rank = dist.get_rank(group)
            self.size = dist.get_world_size(group)
            self.global_rank = dist.get_rank()
            backend = str(dist.get_backend(group)).lower()
            self.device = (torch.device("cuda", torch.cuda.current_device())
                           if "nccl" in backend and torch.cuda.is_available() else torch.device("cpu"))
        else:
            self.rank, self.size, self.global_rank = 0, 1, 0
            self.device = torch.device("cpu")

    @classmethod
    def over_store(cls, store, members: Sequence[int], rank: int, role: str = "process") -> "Group":
        """(local) Global rank ``rank`` of a group of ``members`` whose only channel is ``store``,
        with no process group: the check-in protocol (:func:`arrive`, :func:`tell_failed`)
        talks only through the store, so ranks can be threads around one store, each step of
        an interleaving forced (the protocol's tests). Collectives are not available on it."""
        g = cls(None, role)
        g.active, g.rank, g.size, g.global_rank = True, list(members).index(rank), len(members), rank
        g._given = (store, tuple(members))
        return g

    def members(self) -> tuple:
        """Global ranks of the group (this rank alone without one)."""
        if self._given is not None:
            return self._given[1]
        if not self.active:
            return (self.global_rank,)
        return tuple(dist.get_process_group_ranks(self.group))

    def at(self, step: str) -> None:
        """Record what the load is doing now (named if a rank is lost during it)."""
        self.step = step

    # -- communication, each call guarded: a lost peer becomes a DistributedLoadError

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """(local) Turn a backend error inside the block (a peer died, a connection was reset,
        the backend timed out) into a :class:`DistributedLoadError` naming the step and,
        where this host can tell, the lost rank; the backend's error is the cause."""
        try:
            yield
        except OneloadError:
            raise
        except RuntimeError as e:
            raise self._lost(e) from e

    def _lost(self, exc: BaseException) -> DistributedLoadError:
        members = self.members()
        gone = self._gone_ranks(members)
        cause = clip(f"{type(exc).__name__}: {exc}", 500)
        where = f"of the {self.role} group [{cap_list(members)}]"
        if gone:
            who = (f"rank {cap_list(sorted(gone))} {where} is gone (its process ended)" if len(gone) == 1 else
                   f"ranks {cap_list(sorted(gone))} {where} are gone (their processes ended)")
        else:
            who = (f"lost contact with a rank {where} (killed, crashed or unreachable; no rank on this host "
                   "is known to be gone)")
        failures = {r: f"lost during {self.step}" for r in sorted(gone)}
        self._tell_lost(cause)
        return DistributedLoadError(
            f"{self.step}: {who}. Rank {self.global_rank} stops here, as does every rank still running; a "
            "process group cannot be used again once a rank is lost: restart the job (torchrun restarts every "
            f"rank). Backend error: {cause}", failures)

    def _tell_lost(self, cause: str, raised: bool = False) -> None:
        """Leave word in the store that this rank stops: a peer waiting on a message from it
        (it lives on, so its sockets stay open) learns it at once, not at the backend's timeout.
        ``raised``: it stops because it raised, not because it lost a peer. The first word
        left stays (the first cause is the one to report)."""
        store = self._store()
        if store is None or self._arrival is None:
            return
        word = json.dumps({"rank": self.global_rank, "cause": cause, "raised": raised})
        with contextlib.suppress(Exception):  # the store's host may be the lost one
            store.compare_set(f"{self._arrival}/lost", "", word)

    def _left(self, info: dict) -> DistributedLoadError:
        """The error for a peer that raised out of the load (and may live on) while this rank
        waited for it in a collective."""
        rank, cause = int(info["rank"]), clip(str(info["cause"]), 500)
        return DistributedLoadError(
            f"{self.step}: rank {rank} of the {self.role} group [{cap_list(self.members())}] left the load: {cause}. "
            f"Rank {self.global_rank} stops here, as does every rank still running; the ranks may now be inside "
            "different collectives, so the process group cannot be used for another load: restart the job "
            "(torchrun restarts every rank).", {rank: cause})

    def wait_all(self, works: Sequence) -> None:
        """(local) Wait for this group's pending operations (``async_op`` collectives,
        ``isend``/``irecv``). A peer that stopped because it lost a rank raises here too,
        through the word it left in the store (:meth:`_tell_lost`): where ranks wait on one
        another point to point, a survivor may otherwise wait on a survivor that has left
        until the backend's timeout. gloo's point-to-point work says it is complete only
        once waited for, so the waiting happens on a thread while this one watches."""
        if not works:
            return
        store = self._store() if self._arrival is not None else None
        if store is None:
            with self.guard():
                for w in works:
                    w.wait()
            return
        done, failed = threading.Event(), []

        def wait():
            try:
                for w in works:
                    w.wait()
            except BaseException as e:  # noqa: BLE001  (raised below, on the calling thread)
                failed.append(e)
            finally:
                done.set()

        threading.Thread(target=wait, name="oneload-wait", daemon=True).start()
        with self.guard():
            while not done.wait(_LOST_POLL):
                if store.check([f"{self._arrival}/lost"]):
                    info = json.loads(store.get(f"{self._arrival}/lost"))
                    if info.get("raised"):
                        raise self._left(info)
                    e = RuntimeError(f"rank {info['rank']} of the group stopped: {info['cause']}")
                    raise self._lost(e) from e  # the waiting thread is left to the backend's timeout
            if failed:
                raise failed[0]

    def _gone_ranks(self, members: Sequence[int]) -> list:
        """Ranks whose process, recorded at this load's check-in on this host, has ended."""
        store = self._store()
        if store is None or self._arrival is None:
            return []
        gone = []
        try:
            old = store.timeout
            store.set_timeout(datetime.timedelta(seconds=5))  # the store's host may be the lost one
        except Exception:
            old = None
        try:
            here = socket.gethostname()
            infos = {}
            for r in members:
                key = f"{self._arrival}/r{r}"
                if r != self.global_rank and store.check([key]):
                    info = json.loads(store.get(key))
                    if info.get("host") == here:
                        infos[r] = info
            # The peer's sockets close before its process has ended: give it a moment.
            deadline = time.monotonic() + _GRACE
            while infos:
                gone = [r for r, info in infos.items() if _gone(info)]
                if gone or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
        except Exception as e:  # noqa: BLE001  (the store went with the lost rank)
            logger.debug("oneload: could not tell which rank was lost: %s", e)
        finally:
            if old is not None:
                with contextlib.suppress(Exception):
                    store.set_timeout(old)
        return gone

    def all_max(self, value: int) -> int:
        """(collective) The largest ``value`` over the group."""
        if not self.active or self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        with self.guard():
            self.wait_all([dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)])
        return int(t.item())

    def global_of(self, local_rank: int) -> int:
        return dist.get_global_rank(self.group, local_rank) if self.active else local_rank

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """(collective) In-place broadcast from local rank ``src``; staged through the
        group's device when the tensor lives elsewhere."""
        if not self.active or self.size == 1:
            return
        staged = tensor if tensor.device == self.device else tensor.to(self.device)
        with self.guard():
            self.wait_all([dist.broadcast(staged, src=self.global_of(src), group=self.group, async_op=True)])
        if staged is not tensor:
            tensor.copy_(staged)

    def broadcast_bytes(self, payload: Optional[bytes], src: int = 0) -> bytes:
        """(collective) ``payload`` from local rank ``src`` to everyone."""
        if not self.active or self.size == 1:
            return payload or b""
        # Each wait goes through wait_all: a peer that raised out of the load is noticed.
        n = torch.tensor([len(payload) if self.rank == src else 0], dtype=torch.int64, device=self.device)
        self.wait_all([dist.broadcast(n, src=self.global_of(src), group=self.group, async_op=True)])
        buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device) if self.rank == src
               else torch.empty(int(n.item()), dtype=torch.uint8, device=self.device))
        if int(n.item()):
            self.wait_all([dist.broadcast(buf, src=self.global_of(src), group=self.group, async_op=True)])
        return bytes(buf.cpu().numpy().tobytes()) if self.rank != src else payload

    def all_gather_bytes(self, payload: bytes) -> list:
        """(collective) Every rank's ``payload``, in local-rank order."""
        if not self.active or self.size == 1:
            return [payload]
        n = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self.size)]
        self.wait_all([dist.all_gather(sizes, n, group=self.group, async_op=True)])
        longest = max(int(s.item()) for s in sizes)
        buf = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        if payload:
            buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        out = [torch.empty_like(buf) for _ in range(self.size)]
        self.wait_all([dist.all_gather(out, buf, group=self.group, async_op=True)])
        return [bytes(o[: int(s.item())].cpu().numpy().tobytes()) for o, s in zip(out, sizes)]

    def exchange_bytes(self, payloads: Sequence[bytes]) -> list:
        """(collective) ``payloads[i]`` to local rank ``i``; returns what each local rank sent
        this one, in local-rank order. An all-to-all: each byte goes only to the rank that wants
        it, where :meth:`all_gather_bytes` sends every rank everything, padded to the longest."""
        if len(payloads) != self.size:
            raise ValueError(f"exchange_bytes: {len(payloads)} payloads for a group of {self.size}")
        if not self.active or self.size == 1:
            return list(payloads)
        sent = [len(p) for p in payloads]
        table = [torch.zeros(self.size, dtype=torch.int64, device=self.device) for _ in range(self.size)]
        mine = torch.tensor(sent, dtype=torch.int64, device=self.device)
        self.wait_all([dist.all_gather(table, mine, group=self.group, async_op=True)])
        got = [int(row[self.rank].item()) for row in table]
        blob = b"".join(payloads)
        inp = (torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device) if blob
               else torch.empty(0, dtype=torch.uint8, device=self.device))
        out = torch.empty(sum(got), dtype=torch.uint8, device=self.device)
        self.wait_all([dist.all_to_all_single(out, inp, got, sent, group=self.group, async_op=True)])
        data, parts, pos = out.cpu().numpy().tobytes(), [], 0
        for n in got:
            parts.append(data[pos: pos + n])
            pos += n
        return parts

    def all_gather_json(self, obj) -> list:
        return [json.loads(b) for b in self.all_gather_bytes(json.dumps(obj).encode())]

    # -- arrival

    def _store(self):
        """The store every member of the group reaches (the group's, else the default one)."""
        if self._given is not None:
            return self._given[0]
        if not self.active:
            return None
        for get in (lambda: self.group.get_group_store(), lambda: dist.distributed_c10d._get_default_store()):
            try:
                store = get()
            except Exception:  # noqa: BLE001  (older torch, a backend without one)
                continue
            if store is not None:
                return store
        return None

    def _base(self) -> str:
        """Store key prefix of this group's check-ins."""
        return f"{_KEY}/{self.role}/{hashlib.sha1(repr(self.members()).encode()).hexdigest()[:16]}"

    def begun_key(self) -> Optional[tuple]:
        """This group's entry in :data:`metaseq_oneload._begun.BEGUN` (the store too where it is all the group has:
        ranks as threads); None where its ranks cannot be listed (its check-in says so)."""
        try:
            return (self._given[0] if self._given is not None else None, self._base())
        except Exception:  # noqa: BLE001
            return None

    def generation(self) -> Optional[int]:
        """(local, one store look-up) The number of this group's next check-in, taken when a
        load begins (:func:`arrive`) and passed to :meth:`check_in` as ``since``; None
        without a store."""
        store = self._store() if self.active and self.size > 1 else None
        if store is None:
            return None
        try:
            return int(store.add(f"{self._base()}/gen", 0))
        except Exception:  # noqa: BLE001  (check_in meets the same store and reports it)
            return None

    def withdraw(self, gen: Optional[int]) -> None:
        """(this rank, through the store) Its load begins, ``gen`` its :meth:`generation`:
        withdraw a failure of its own earlier call that settled this group's check-in before
        (:meth:`_withdraw`). :func:`arrive` does so in every group before it waits in any: a
        rank waiting for that withdrawal in a later group must not wait out
        :data:`_RETURN_GRACE` while this rank waits in an earlier one."""
        store = self._store() if gen is not None and self.active and self.size > 1 else None
        if store is None:
            return
        try:
            self._withdraw(store, self._base(), gen)
        except Exception as e:  # noqa: BLE001  (check_in meets the same store and reports it)
            logger.debug("oneload: could not look for a failure of rank %s to withdraw: %s", self.global_rank, e)

    def check_in(self, timeout: float, prior: Optional[dict], own: bool = False,
                 since: Optional[int] = None) -> Optional[dict]:
        """(all ranks of the group, collective through the store) Wait at most ``timeout``
        seconds for every member to arrive. ``prior`` is this rank's failure (its own, before
        the load, or from an earlier group's check-in), passed on so that this group's
        members stop too: a rank with one settles the check-in as failed at once and does
        not wait. Returns the failure this rank must raise ({"message", "failures"}), or None.

        Check-ins are numbered by a counter in the store, bumped when one resolves (all
        arrived, one rank gave up waiting, or one failed): a rank that skipped a load meets
        the others at their next one, and one that comes after they gave up is told so,
        never left waiting inside a collective.

        ``since``: :meth:`generation` when this rank's load began (:func:`arrive`; None: now).
        A check-in of this group decided after that, without this rank, was this load's (the
        others gave up on it, or stopped with a failure, while it was still on its way, e.g.
        waiting in an earlier group's check-in): this rank is late for it and is told so, or
        stops with its own ``prior``, at once. It neither waits at, nor leaves a verdict in,
        the check-in after that one: that is the others' next load, which must not meet (and
        raise) a failure of this one.

        ``own``: ``prior`` is this rank's own call failing (:func:`tell_failed`). That may be a
        call this rank made alone (a rank-specific code path that caught the error and went
        on): the others, waiting or arriving, wait up to :data:`_RETURN_GRACE` seconds for
        its next check-in, which withdraws the failure (:meth:`_fate`), before raising it.
        """
        store = self._store() if self.size > 1 else None
        if store is None:
            return prior
        members = self.members()
        base = self._base()
        gen = store.add(f"{base}/gen", 0)
        self._withdraw(store, base, gen)
        missed = self._missed(store, base, gen, timeout, prior is not None, since)
        if missed is not None:
            return prior or missed
        key = f"{base}/{gen}"
        self._arrival = key
        me = str(self.global_rank)
        mark = f"{key}/r{me}"
        state = None
        if prior is not None:
            # This rank will not take part: the others stop now, not after arrival_timeout.
            # It is neither counted nor marked as arrived until the check-in is decided: a
            # partner whose count completed, or whose wait ended and who found every mark,
            # would settle it "ok" and wait in the load's first collective for a rank that
            # is gone (the hang of a 2x2 grid whose rank 3 failed before the load).
            verdict = {"failed": prior, "at": time.time()}
            if own:
                verdict["own"] = self.global_rank  # its own call: maybe one it made alone
            state = self._resolve(store, base, gen, json.dumps(verdict))
            store.set(mark, json.dumps(_whoami()))  # told (:meth:`_missed`)
        else:
            store.set(mark, json.dumps(_whoami()))
            if store.add(f"{key}/n", 1) >= self.size:
                state = self._resolve(store, base, gen, "ok")
            else:
                try:
                    store.wait([f"{key}/state"], datetime.timedelta(seconds=timeout))
                except Exception:  # noqa: BLE001  (the store's own timeout error)
                    # Only a rank that takes part marks itself before the verdict: a mark is an arrival.
                    missing = [r for r in members if not store.check([f"{key}/r{r}"])]
                    # Everyone may have come in the moment since the wait ended: then it is complete.
                    state = self._resolve(store, base, gen,
                                          json.dumps({"missing": missing, "timeout": timeout}) if missing else "ok")
        if state is None:
            state = store.get(f"{key}/state").decode()
        if state == "ok":
            return prior
        verdict = json.loads(state)
        if "failed" in verdict:
            if prior is None and "own" in verdict and self._fate(store, key, timeout) == "void":
                return self.check_in(timeout, prior, own)  # it came back: this is its next load
            return prior or verdict["failed"]
        missing = verdict["missing"]
        where = f"of the {self.role} group [{cap_list(members)}]"
        if self.global_rank in missing:
            return prior or self._too_late(verdict, timeout)
        else:
            previous = [r for r in self._previous_missing(store, base, gen) if r in missing]
            late = (f" Rank(s) {cap_list(previous)} also missed the previous load's check-in: are they one load "
                    "behind?" if previous else "")
            message = (f"rank{'s' if len(missing) > 1 else ''} {cap_list(missing)} {where} did not arrive within "
                       f"arrival_timeout={timeout:g}s (failed before the load and went on, or still busy); every "
                       "rank that arrived stops here. If ranks legitimately reach the load this far apart, raise "
                       f"arrival_timeout= (or {ARRIVAL_TIMEOUT_ENV}).{late}")
        return prior or {"message": message, "failures": {str(r): "never arrived" for r in missing}}

    def _too_late(self, verdict: dict, timeout: float) -> dict:
        """The failure of a rank that arrived after the others had stopped waiting for it
        (``verdict``: the check-in's, naming it missing)."""
        missing = verdict["missing"]
        where = f"of the {self.role} group [{cap_list(self.members())}]"
        message = (f"rank {self.global_rank} arrived after the other ranks {where} had stopped waiting for it "
                   f"(arrival_timeout={float(verdict.get('timeout', timeout)):g}s); every rank stopped this load. If "
                   f"ranks legitimately reach the load this far apart, raise arrival_timeout= (or "
                   f"{ARRIVAL_TIMEOUT_ENV}) on every rank.")
        return {"message": message, "failures": {str(r): "never arrived" for r in missing}}

    def _resolve(self, store, base: str, gen: int, value: str) -> str:
        """Decide check-in ``gen`` once: the first rank to claim it publishes ``value``, then
        bumps the counter (in that order: a rank that reads the new count finds the verdict
        of the one before, :meth:`_missed`); returns what was published (by whichever rank won)."""
        key = f"{base}/{gen}"
        me = str(self.global_rank)
        if store.compare_set(f"{key}/claim", "", me).decode() == me:
            store.set(f"{key}/state", value)
            store.add(f"{base}/gen", 1)
            if value == "ok" and gen > 0:
                self._forget(store, f"{base}/{gen - 1}")
            return value
        store.wait([f"{key}/state"], datetime.timedelta(seconds=60))
        return store.get(f"{key}/state").decode()

    def _forget(self, store, key: str) -> None:
        """Delete the keys of a check-in every member has left behind (all arrived at the next)."""
        try:
            for r in self.members():
                store.delete_key(f"{key}/r{r}")
            for k in ("n", "claim", "state", "why", "fate", "lost"):
                store.delete_key(f"{key}/{k}")
        except Exception:  # noqa: BLE001  (a store without delete: the keys stay, harmless)
            pass

    def _missed(self, store, base: str, gen: int, timeout: float, failing: bool = False,
                since: Optional[int] = None):
        """The failure of a check-in decided without this rank that was this rank's load's,
        or None. One store look-up on the success path.

        * Decided since this rank's load began (``since`` < ``gen``: check-in ``since``; the
          others stopped waiting for it, or one of them failed, while it was on its way):
          that check-in's failure, or, if they gave up waiting, that it came too late.
        * Else the previous check-in, if one rank settled it as failed (it failed before the
          load) less than ``timeout`` seconds ago and this rank had not arrived yet: this
          rank is late for that load, which the others left at once; it stops too rather
          than wait for them at the next check-in. (A check-in the others gave up waiting on
          before this load began is not this load's: this rank skipped it, and meets them
          at their next one.)

        Told once (this rank is marked arrived there): its next call is a new load.

        A rank's own failure (``own``) may be a call it made alone: not this rank's if that
        rank withdrew it (:meth:`_fate`): this rank's load is its next one. ``failing``:
        this rank fails too; it joins that failure without waiting."""
        late = since is not None and 0 <= since < gen
        at = since if late else gen - 1
        if at < 0:
            return None
        prev = f"{base}/{at}"
        mine = f"{prev}/r{self.global_rank}"
        if store.check([mine]) or not store.check([f"{prev}/state"]):
            return None
        state = store.get(f"{prev}/state").decode()
        verdict = json.loads(state) if state.startswith("{") else {}
        if "failed" in verdict:
            if not late and time.time() - float(verdict.get("at", 0)) > timeout:
                return None
            if "own" in verdict and not failing and self._fate(store, prev, timeout) == "void":
                # A call its rank made alone: that rank's next check-in is this load's; this
                # rank may be late for that one too.
                return self._missed(store, base, gen, timeout, failing, at + 1) if late else None
            store.set(mine, json.dumps(_whoami()))
            return verdict["failed"]
        if late and self.global_rank in verdict.get("missing", ()):
            store.set(mine, json.dumps(_whoami()))
            return self._too_late(verdict, timeout)
        return None

    def _fate(self, store, key: str, timeout: float) -> str:
        """(this rank, at check-in ``key``, which another rank's own call failing settled)
        Whether that failure is this rank's load's ("raise") or was a call the failed rank
        made alone, withdrawn at its next check-in ("void"). Waits at most
        :data:`_RETURN_GRACE` seconds for the failed rank to come back (never longer than
        ``timeout``); whichever decides first (that rank's withdrawal, or the first rank
        whose wait ends) decides for everyone."""
        deadline = time.monotonic() + min(_RETURN_GRACE, timeout)
        while not store.check([f"{key}/fate"]) and time.monotonic() < deadline:
            time.sleep(_FATE_POLL)
        return store.compare_set(f"{key}/fate", "", "raise").decode()

    def _withdraw(self, store, base: str, gen: int) -> None:
        """(the rank whose own call failing settled check-in ``gen - 1``) It is back, at its
        next load: withdraw that failure from ranks that have not taken it yet (:meth:`_fate`),
        so that a call it made alone does not fail the next load of the others. Ranks that
        took it already ("raise") keep it: that was their load."""
        if gen == 0:
            return
        prev = f"{base}/{gen - 1}"
        if not store.check([f"{prev}/state"]) or store.check([f"{prev}/fate"]):
            return
        state = store.get(f"{prev}/state").decode()
        verdict = json.loads(state) if state.startswith("{") else {}
        if verdict.get("own") == self.global_rank:
            store.compare_set(f"{prev}/fate", "", "void")

    @staticmethod
    def _previous_missing(store, base: str, gen: int) -> list:
        if gen == 0 or not store.check([f"{base}/{gen - 1}/state"]):
            return []
        state = store.get(f"{base}/{gen - 1}/state").decode()
        return [] if state == "ok" else json.loads(state).get("missing", [])


def arrive(groups: Sequence[Group], timeout: float, what: str) -> None:
    """(all ranks of every group, collective through the stores) Every rank of the grid
    has reached this load within ``timeout`` seconds, or every rank that did raises
    :class:`DistributedLoadError` naming the ranks that did not.

    The groups check in one after another, each passing on an earlier group's failure, so a
    rank missing from one data-parallel group stops the model-parallel neighbours too.
    Each group's count of check-ins is read first, when the call began (:func:`metaseq_oneload._begun.begin`) or
    else now: a check-in that the others settle (give up on, or fail) while this rank is
    on its way, or waits in an earlier group, is this load's, and this rank stops with it
    (:meth:`Group.check_in`'s ``since``) instead of leaving its verdict where their next
    load would meet it. A failure of this rank's own earlier call is withdrawn in every
    group first (:meth:`Group.withdraw`), before it waits in any.
    """
    active = [g for g in groups if g.active and g.size > 1]
    since = began(active)
    for g, start in zip(active, since):
        g.withdraw(start)
    failure = None
    for g, start in zip(active, since):
        g.at(f"{what}: checking in")
        failure = g.check_in(timeout, failure, since=start)
    if failure is not None:
        raise DistributedLoadError(f"{what}: {failure['message']}",
                                   {int(r): m for r, m in failure["failures"].items()})


def tell_failed(groups: Sequence[Group], error: BaseException, timeout: Optional[float] = None) -> None:
    """(this rank alone, through the stores) This rank's call to a load failed before its
    check-in (a bad argument, a group it is not in, its module): settle the check-in of
    each of its groups as failed, with ``error`` as the reason, so that every other rank
    raises it at once instead of waiting ``arrival_timeout`` for a rank that is not
    coming. ``timeout``: the caller's ``arrival_timeout`` (else the environment's, else the
    default; also where the caller's value is what failed). Waits for no one; never raises
    (the caller raises ``error`` itself)."""
    try:
        timeout = arrival_timeout(timeout)
    except Exception:  # noqa: BLE001  (the caller's arrival_timeout= may be what failed)
        timeout = DEFAULT_ARRIVAL_TIMEOUT
    active = [g for g in groups if g.active and g.size > 1]
    since = began(active)  # as arrive does: this call's check-ins, from where it began
    failure = None
    for g, start in zip(active, since):
        if failure is None:
            me = g.global_rank
            reason = clip(f"{type(error).__name__}: {error}")
            failure = {"message": f"rank {me} failed before the load began ({reason}); every rank stops this load. "
                                  f"Fix what rank {me} passed (or its code before the load), then load again on "
                                  "every rank.",
                       "failures": {str(me): reason}}
        try:
            g.check_in(timeout, failure, own=True, since=start)
        except Exception as e:  # noqa: BLE001  (the store is gone too: the others find out by their timeout)
            logger.debug("oneload: could not tell the %s group that rank %s failed: %s", g.role, g.global_rank, e)


def tell_left(groups: Sequence[Group], error: BaseException) -> None:
    """(this rank alone, through the stores) This rank leaves a load it checked in to with
    ``error``, outside the steps that settle failures together: tell every group, so that a
    peer waiting for it in a collective raises at once, naming it and ``error``, instead of
    waiting for the process group's timeout (this process may live on, its sockets open).
    Never raises."""
    cause = clip(f"{type(error).__name__}: {error}", 500)
    for g in groups:
        if g.active and g.size > 1:
            g._tell_lost(cause, raised=True)


class PeerFailure(Exception):
    """This rank is fine, but another rank of its group failed (see :func:`first_failure`)."""


def first_failure(group: Group, error: Optional[BaseException]) -> Optional[BaseException]:
    """(collective over ``group``) This rank's error, or, if another rank of the group
    failed, an error saying so; None when all went well. Raises only if the group itself
    fails (a lost rank, :meth:`Group.guard`): a section that only one data-parallel group
    runs (its broadcast loop) uses it to stop in step, and carries the error to the next
    :func:`settle`, which every rank of the grid reaches."""
    if not group.active or group.size == 1:
        return error
    if group.all_max(0 if error is None else 1) and error is None:
        return PeerFailure("another rank of this group failed")
    return error


def settle(groups: Sequence[Group], error: Optional[BaseException], what: str) -> None:
    """(collective over every group given) Raise on every rank if any rank failed.

    ``error`` is this rank's failure in the phase just ended (None if it went well). With
    no active group the original error is re-raised unchanged. Each rank's message travels
    clipped to :data:`MESSAGE_CAP` characters; the raised message lists the first few ranks.
    """
    active = [g for g in groups if g.active and g.size > 1]
    if not active:
        if error is not None:
            raise error
        return
    for g in active:
        g.at(what)
    me = active[0].global_rank
    failures: dict = {}
    # A rank that only learned of another's failure (first_failure) adds nothing itself.
    if error is not None and not isinstance(error, PeerFailure):
        failures[str(me)] = clip(f"{type(error).__name__}: {error}")
    for g in active:
        for gathered in g.all_gather_json(failures):
            failures.update(gathered)
    if not failures:
        return
    ranks = sorted(int(r) for r in failures)
    shown = 8
    lines = "\n".join(f"  rank {r}: {failures[str(r)]}" for r in ranks[:shown])
    if len(ranks) > shown:
        lines += f"\n  ... and {len(ranks) - shown} more rank(s)"
    settled = DistributedLoadError(
        f"{what} failed on {len(ranks)} rank(s) ({cap_list(ranks)}); every rank stops here.\n{lines}",
        {r: failures[str(r)] for r in ranks},
    )
    settled.settled = True  # every rank raises it: none needs telling that this one left (_engine)
    raise settled from (None if isinstance(error, PeerFailure) else error)
