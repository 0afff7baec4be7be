"""The errors this package raises on purpose.

Every message says what was found, what was expected and what to do, and names the
file(s) involved. Tests pin the wording with ``pytest.raises(..., match=...)``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import struct
import zipfile
from typing import Iterator


class OneloadError(RuntimeError):
    """Base class of every error metaseq-oneload raises on purpose."""


class CheckpointLayoutError(OneloadError):
    """The files do not form one complete, consistent checkpoint (missing shard, mixed
    runs, truncated or non-checkpoint file, ambiguous folder, symlink loop...)."""


class MalformedCheckpointError(CheckpointLayoutError):
    """A file's contents made reading it fail in a way no specific check names (a header
    field of the wrong type, a structure that does not hold together): the file is not
    what a checkpoint of its kind holds. The reader's own error is the ``__cause__``."""


class CheckpointNotFoundError(CheckpointLayoutError, FileNotFoundError):
    """Nothing at the path: no file, folder or suffixed set. With ``strategy="auto"`` a
    rank that cannot see the files receives them by broadcast instead."""


class UnsafeCheckpointError(OneloadError):
    """A checkpoint's pickle needs a class outside the allowlist; nothing was executed."""


class StateDictMismatchError(OneloadError):
    """The target (module or requested layout) does not match the checkpoint: missing,
    unexpected or wrongly shaped tensors. Raised before any weight is written."""


class ConversionError(OneloadError):
    """A conversion cannot proceed as asked (bad target, unsafe destination, incomplete write)."""


class OutputExistsError(ConversionError, FileExistsError):
    """A destination file exists and ``overwrite`` was not given, or it is a source file."""


class UnsupportedArchitectureError(ConversionError):
    """The checkpoint's architecture has settings Hugging Face OPT cannot express. Raised
    before anything is written; ``settings`` names each one."""

    def __init__(self, message: str, settings=()):
        super().__init__(message)
        self.settings = tuple(settings)


class DistributedLoadError(OneloadError):
    """Raised on every rank when any rank of a collective load failed.

    ``failures`` maps the global rank of each failing rank to its message.
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None):
        super().__init__(message)
        self.failures = dict(failures or {})


class OutOfResourcesError(OneloadError, MemoryError):
    """The machine ran out of memory or threads while reading (a ``MemoryError``, a thread
    that could not start, an allocator that refused): neither the file's fault nor a bug.
    Still a ``MemoryError``, for callers that catch one. The original is the ``__cause__``."""


class OptionError(OneloadError, ValueError):
    """An option's value cannot be used (a chunk of 0 MiB, a negative tolerance, no jobs).
    Raised before anything is read or written; a ValueError too, as a bad argument is."""


class DigestError(OneloadError):
    """A content digest could not be computed or did not match: a tensor's leaves were
    missing or given twice (a digest is never guessed), or bytes disagree with a recorded
    or given digest. The message names the tensor, and the file where one is known."""


class MissingRemoteExtraError(OneloadError, ImportError):
    """A URL was given, and fsspec or its protocol's package is not installed: a refusal
    (the command line's exit 2), an ImportError too for callers that catch that."""


class RemoteStoreError(OneloadError):
    """An object store (or a proxy, cache or CDN in front of it) answered a ranged read
    with something else than the bytes asked for: the whole object, another range, a body
    of the wrong length, a redirect. Nothing it sent was used."""


class RemoteObjectChangedError(RemoteStoreError):
    """An object was replaced in the store while it was being read: its ETag (or version)
    is no longer the one its header was read from. Nothing of the new version was used."""


def os_error_message(e: OSError, path: "str | os.PathLike | None" = None, doing: str = "read") -> str:
    """What went wrong with a file, for a message: the file (the error's own, else
    ``path``), what the system said, and what to do about it."""
    where = e.filename if e.filename is not None else path
    where = os.fsdecode(where) if where is not None else "a file"
    done = {"read": "read", "write": "written", "access": "accessed"}.get(doing, doing)
    code = e.errno
    if code in (errno.EACCES, errno.EPERM):
        who = ""
        with contextlib.suppress(Exception):
            import getpass

            who = f" ({getpass.getuser()})"
        return (f"{where}: permission denied: this user{who} cannot {doing} it. Check its permissions and those "
                f"of the folders above it (ls -l on the file, ls -ld on each folder), or run as a user who can.")
    if code == errno.EISDIR:
        return f"{where}: is a folder where a file was expected; pass a file, or the folder itself as the checkpoint."
    if code == errno.ENOTDIR:
        return f"{where}: a part of this path is a file, not a folder; check the path."
    if code == errno.ENOENT:
        return f"{where}: no such file (removed or renamed while it was being {done}?); check the path."
    if code == errno.EIO:
        return (f"{where}: input/output error while trying to {doing} it: the disk or network file system failed. "
                "Check the storage (dmesg, the mount) and try again.")
    if code == errno.ENOMEM:
        return (f"{where}: this machine ran out of memory or threads while trying to {doing} it ({e.strerror}); "
                "the file is not at fault. Free memory or run fewer processes at once, or raise this process's "
                "limits (ulimit -v, the container's or job's memory limit), and try again.")
    reason = e.strerror or str(e) or type(e).__name__
    return f"{where}: cannot {doing} the file ({reason}). Check that it can be {done} (ls -l, cat) and try again."


def unreadable(path: "str | os.PathLike", e: OSError) -> CheckpointLayoutError:
    """The error for a checkpoint file the system would not let us read (raise it ``from e``).
    A missing file stays a not-found error: a rank that cannot see the files is told apart
    by it (and callers catching FileNotFoundError keep working)."""
    if isinstance(e, FileNotFoundError):
        return CheckpointNotFoundError(os_error_message(e, path))
    return CheckpointLayoutError(os_error_message(e, path))


# What a reader raises when the bytes or the objects it reads are not what it expects:
# errors of the data, not of the caller. Not RuntimeError (torch's loader's are turned into
# ours where it is called, in _reading; any other is ours to fix: a bug, CLI exit 3), not
# MemoryError (the machine's, see resource_problem). TypeError and AttributeError stay: a
# header field of the wrong type raises them in the code that reads it.
_MALFORMED = (ValueError, TypeError, AttributeError, LookupError, RecursionError, EOFError, ArithmeticError,
              struct.error, zipfile.BadZipFile, pickle.UnpicklingError)


def resource_problem(e: BaseException) -> "str | None":
    """What ran out, where ``e`` is the machine running short (memory, threads) rather than
    a file's fault or a bug; else None. An error raised while a shortage was being handled
    (an ImportError, a SystemError or a KeyError met on the way out of a MemoryError: its
    ``__context__``, unless raised ``from None``) is the shortage's too, so the chain of
    causes is searched. Texts are matched only where the allocator or the interpreter
    begins its message: an allowlisted call quotes what a file hands it (``torch.device('not
    enough memory')``), and a file must not pass for a full machine."""
    seen: set = set()
    while e is not None and id(e) not in seen and len(seen) < 64:
        seen.add(id(e))
        what = _ran_short(e)
        if what is not None:
            return what
        e = e.__cause__ if e.__cause__ is not None else (None if e.__suppress_context__ else e.__context__)
    return None


# How the allocators and the interpreter begin their messages (torch's DefaultCPUAllocator:
# "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory
# ..."; CPython's: "can't start new thread"; a C++ std::bad_alloc translated as it is).
_SHORT_TEXTS = (("threads", "can't start new thread"), ("threads", "can't create new thread"),
                ("memory", "[enforce fail at alloc_cpu"), ("memory", "std::bad_alloc"))


def _ran_short(e: BaseException) -> "str | None":
    if isinstance(e, OneloadError):
        return None  # already said (a shortage), or a refusal of ours
    try:
        text = str(e)
    except Exception:  # noqa: BLE001  (a message that cannot be formed tells nothing)
        text = ""
    if isinstance(e, MemoryError):
        return f"memory (MemoryError{': ' + text[:300] if text else ''})"
    if isinstance(e, OSError) and e.errno == errno.ENOMEM:
        # an mmap, a read or a fork refused for memory (not EAGAIN: a pipe's BlockingIOError has it too)
        return f"memory for a mapping ({type(e).__name__}: {text[:300]})"
    if isinstance(e, RuntimeError):
        if type(e).__name__ == "OutOfMemoryError":  # torch's, by its type
            return f"memory ({type(e).__name__}: {text[:300]})"
        if text.startswith("unable to mmap") and "Cannot allocate memory" in text:  # torch.load(mmap=True)'s
            return f"memory for a mapping ({type(e).__name__}: {text[:300]})"
        for what, start in _SHORT_TEXTS:
            if text.startswith(start):
                return f"{what} ({type(e).__name__}: {text[:300]})"
    return None


def out_of_resources(what: str, path: "str | os.PathLike | None" = None, *,
                     unpickling: bool = False, trusted: bool = False) -> OutOfResourcesError:
    """The error for a machine that ran short (``what``: from :func:`resource_problem`).
    ``unpickling``: it happened while a file's pickle ran, where the file chooses what is
    allocated (an allowlisted ``bytearray(1 << 50)``, a legacy storage's size), so a memory
    shortage may be the machine's or the file's, and the error says both (not for a mapping
    refused, whose size is the file's on disk). ``trusted``: the pickle ran with
    ``trust_pickle``, its code and all."""
    where = f"{os.fsdecode(path)}: " if path is not None else ""
    if unpickling and what.startswith("memory ("):
        ran = ("the file's code ran (trust_pickle)" if trusted else
               "nothing from it was executed beyond the allowlisted calls")
        return OutOfResourcesError(
            f"{where}ran out of memory while unpickling the file (out of {what}). This is either a shortage of "
            "this machine's memory (free memory or run fewer processes at once, or raise this process's memory "
            "limit: ulimit -v, the container's or job's limit), or the file's pickle asking for more than its "
            f"checkpoint needs, as a damaged or crafted file does (copy it again from its source; {ran}). "
            "Which of the two cannot be told from here.")
    return OutOfResourcesError(
        f"{where}this machine ran out of memory or threads while reading (out of {what}); the file is not at "
        "fault, and this is not a refusal of it. Free memory or run fewer processes at once, or raise this "
        "process's limits (ulimit -v for memory, ulimit -u for threads, the container's or job's memory "
        "limit), and run the command again.")


@contextlib.contextmanager
def reading(path: "str | os.PathLike") -> Iterator[None]:
    """(local) The boundary where a checkpoint's files are read and interpreted: an error
    that is not ours (an OSError; a TypeError from a header field of the wrong type, a
    RecursionError, ...) becomes a :class:`CheckpointLayoutError` naming the file, with the
    original as ``__cause__`` (tracebacks and ``--debug`` keep it). Wrap only reading, not
    the caller's arguments: a bad argument stays the caller's ValueError."""
    try:
        yield
    except OneloadError:
        raise
    except Exception as e:  # noqa: BLE001  (sorted below: the machine's, the file's, or ours)
        what = resource_problem(e)
        if what is not None:  # first: an AttributeError met while a MemoryError unwound is no bad file
            raise out_of_resources(what, path) from e
        if isinstance(e, OSError):
            raise unreadable(path, e) from e
        if not isinstance(e, _MALFORMED):
            raise  # a bug: its traceback, CLI exit 3
        text = str(e).rstrip(". ") or "no details"
        text = text if len(text) <= 300 else text[:300] + " ..."
        raise MalformedCheckpointError(
            f"{os.fsdecode(path)}: could not be read as a checkpoint: {type(e).__name__}: {text}. Its contents are "
            "not what torch.save writes for a metaseq, fairseq or PyTorch model (a header field of the wrong type, "
            "a structure that does not hold together); nothing from it was used. Re-create or re-copy the file. If "
            "torch.load(path, weights_only=True) reads it as the checkpoint you expect, this is a bug in "
            "metaseq-oneload: please report it with the traceback (CLI: --debug).") from e


def cap_list(items, n: int = 5, fmt=str, sep: str = ", ") -> str:
    """``items`` joined for a message, the first ``n`` (each through ``fmt``) then a count:
    a folder or cfg that claims a million shards must not make a 100 MB error message, nor
    take seconds to format one."""
    items = items if isinstance(items, (list, tuple, range)) else list(items)
    head = sep.join(fmt(x) for x in items[:n])
    return head + (f" ... and {len(items) - n} more" if len(items) > n else "")
