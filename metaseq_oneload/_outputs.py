"""Where output files go: temporary names, exclusive creation, all-or-nothing commits.

Every output goes to a temporary name in its destination folder, created exclusively
(``.NAME.oneload-tmp+HOST+PID+RANDOM``: no checkpoint grammar matches it, nobody can plant a
file or a link there first) and :class:`OutputSet` renames them only when all are complete,
so an interruption, ``kill -9`` included, leaves no file at any final name. The host and pid
in the name let a later run remove what a dead process of the same host left, and nothing
that another host (shared storage) is still writing.

Two conversions to the same names never both succeed: an :class:`OutputSet` holds a lock on
``.PREFIX.oneload-lock`` (``flock``: released by the kernel when its holder dies) from the
existence check to the last rename, and without ``overwrite`` each final name is taken by a
hard link, which fails if the name exists, so not even a writer outside this package is
replaced. Errors of the destination (permissions, a read-only or full file system) are
:class:`ConversionError` saying what to do.

Nothing planted at a name we write reaches a user's file. Every file is created with
``O_CREAT | O_EXCL | O_NOFOLLOW`` (folders with ``mkdir``); the only existing files a writer
opens are the empty ones :func:`make_temp` created in this process (same inode, one name),
and the lock a dead conversion left (a regular file of one name, locked, then removed and
created afresh). A link, a hard link, a FIFO or a device at such a name is refused untouched
(opened with ``O_NONBLOCK`` and checked with ``fstat``, so a FIFO cannot block us). Small
files (the index beside a set, the commit journal) are written by :func:`replace_file`: a
temporary name, then a rename; a failure, a full disk included, leaves no side file.

A commit renames its files one at a time; its journal (``.PREFIX.oneload-commit``) is on
disk from before the first rename to after the last, so a kill in between leaves a set that
discovery refuses with what happened and how to recover (:func:`interrupted_commit`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import shlex
import shutil
import socket
import stat
import threading
import time
from typing import Iterable, Mapping, Optional, Sequence

from ._errors import ConversionError, OptionError, OutputExistsError, cap_list
from ._storage import is_url
from ._threads import check_signals

__all__ = [
    "OutputSet",
    "open_for_writing",
    "pwrite_all",
    "write_new",
    "replace_file",
    "make_temp",
    "stale_temps",
    "remove_stale_temps",
    "source_clash",
    "destination_error",
    "journal_path",
    "interrupted_commit",
]


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    check_signals()  # a chunk at a time: an interrupt another thread took stops the writer here
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


# (st_dev, st_ino) -> path of every empty file make_temp created in this process: the only
# existing files a writer here may open (and empty) for writing.
_CREATED: dict = {}
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def _kind_of(mode: int) -> str:
    for test, what in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device")):
        if test(mode):
            return what
    return "a file"


def _not_ours(path: str, found: str, role: str) -> "OutputExistsError":
    return OutputExistsError(
        f"{path}: found {found} at the name of {role}, where only a file this package creates itself belongs; "
        f"nothing was written to it or through it. It is not ours to remove: check what it is, remove it "
        f"(rm {shlex.quote(path)}) and run again.")


def open_for_writing(path: str) -> int:
    """A descriptor for writing ``path`` from its start: a new file, created exclusively, or
    the empty file :func:`make_temp` created in this process. Never through a link, never a
    FIFO or device (opened without blocking, then checked), never a file with another name
    (a planted hard link would carry our bytes into a user's file), never truncating
    anything this process did not create."""
    flags = os.O_RDWR | _NOFOLLOW | _CLOEXEC | _NONBLOCK
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666)
        st = os.fstat(fd)
        _CREATED[(st.st_dev, st.st_ino)] = os.path.abspath(path)  # ours: a writer may start it over
        return fd
    except FileExistsError:
        pass
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _not_ours(path, "a symbolic link", "an output's temporary file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_ours(path, _kind_of(st.st_mode), "an output's temporary file")
        if st.st_nlink != 1 or _CREATED.get((st.st_dev, st.st_ino)) != os.path.abspath(path):
            raise _not_ours(path, f"a file this process did not create ({st.st_nlink} name(s), {st.st_size} bytes)",
                            "an output's temporary file")
        os.ftruncate(fd, 0)  # ours (make_temp's): empty it for a writer that starts over
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_new(path: str, data: bytes) -> None:
    """(local) ``data`` into a new file at ``path`` (:func:`open_for_writing`), fsync'd."""
    fd = open_for_writing(path)
    try:
        pwrite_all(fd, memoryview(data), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(final: str, data: bytes, *, what: str = "file") -> None:
    """(local) Put ``data`` at ``final`` all at once: written under an exclusively created
    temporary name (:func:`make_temp`), fsync'd, then renamed over ``final`` (a rename
    replaces a link or a hard link planted there; it never writes into what it pointed at).
    On any failure, a full disk included, the temporary file is removed and nothing at
    ``final`` changed.

    Raises:
        ConversionError: the folder refused (what failed and what to do).
    """
    remove_stale_temps(final)
    try:
        tmp = make_temp(final)
    except OSError as e:
        raise destination_error(final, e, f"cannot create the temporary file of the {what}") from e
    try:
        write_new(tmp, data)
        check_signals(commit=True)  # interrupted: never commit
        os.replace(tmp, final)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError) and not isinstance(e, ConversionError):
            raise destination_error(final, e, f"cannot write the {what}") from e
        raise
    finally:
        _forget(tmp)


def _forget(path: str) -> None:
    """``path`` (a temporary file of ours) is renamed or removed: an inode number the file
    system may give to someone else's file later is no longer one we may open."""
    for ident, p in list(_CREATED.items()):
        if p == path:
            _CREATED.pop(ident, None)

# --------------------------------------------------------------------------- temporary names


_TAG = ".oneload-"


def _host() -> str:
    """This machine's name as it appears in temporary names: letters, digits, ``.-_`` only,
    so the ``+`` between host, pid and tail is unambiguous (host names end in -12 often)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname() or "localhost")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def make_temp(final: str, *, folder: bool = False, kind: str = "tmp") -> str:
    """(local) Create, exclusively, an empty temporary file (or folder) in ``final``'s
    folder, named ``.NAME.oneload-tmp+HOST+PID+RANDOM``: never a name that exists, never
    through a link (``O_EXCL | O_NOFOLLOW``; ``mkdir`` for a folder), permissions as for any
    new file (the umask decides). Returns its path; rename it to ``final`` when complete.
    ``kind`` replaces "tmp" (e.g. "old" for a folder moved aside)."""
    directory, base = os.path.split(os.path.abspath(os.fspath(final)))
    prefix = f".{base}{_TAG}{kind}+{_host()}+{os.getpid()}+"
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(100):
        path = os.path.join(directory, prefix + secrets.token_hex(4))
        try:
            if folder:
                os.mkdir(path, 0o777)
            else:
                fd = os.open(path, flags | _CLOEXEC, 0o666)
                try:
                    st = os.fstat(fd)
                    _CREATED[(st.st_dev, st.st_ino)] = path
                finally:
                    os.close(fd)
            return path
        except FileExistsError:
            continue
    raise ConversionError(f"{directory}: could not create a temporary name for {base}.")


def _temp_pid(rest: str, host: str) -> Optional[int]:
    """The pid in what follows ``.NAME.oneload-KIND`` when this host wrote the name:
    ``+HOST+PID+TAIL`` (:func:`make_temp`) or ``-HOST-PID`` (export-hf's earlier names)."""
    if rest.startswith("+"):
        fields = rest[1:].split("+")
        if len(fields) in (2, 3) and fields[0] == host and fields[1].isdigit():
            return int(fields[1])
        return None
    head = f"-{host}-"
    if rest.startswith(head) and rest[len(head):].isdigit():
        return int(rest[len(head):])
    return None


def stale_temps(final: str, *, kinds: Sequence[str] = ("tmp",)) -> list:
    """(local) Temporary files and folders of ``final`` (see :func:`make_temp`) that a dead
    process of this host left: the pid in the name is gone. Names of other hosts are never
    returned (on shared storage their writers may be alive), nor names this host cannot
    attribute (older ``.NAME.tmp-PID`` names carry no host)."""
    directory, base = os.path.split(os.path.abspath(os.fspath(final)))
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    host = _host()
    out = []
    for n in names:
        for kind in kinds:
            stem = f".{base}{_TAG}{kind}"
            pid = _temp_pid(n[len(stem):], host) if n.startswith(stem) else None
            if pid is not None and pid != os.getpid() and not _pid_alive(pid):
                out.append(os.path.join(directory, n))
    return sorted(out)


def remove_stale_temps(final: str, *, kinds: Sequence[str] = ("tmp",)) -> list:
    """(local) Remove :func:`stale_temps` (files, and folders with their contents); returns
    what was removed."""
    removed = []
    for p in stale_temps(final, kinds=kinds):
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.unlink(p)
            removed.append(p)
        except FileNotFoundError:
            pass
    return removed


def source_clash(path: str, sources: Iterable[str]) -> Optional[str]:
    """(local) The source file that writing, replacing or removing ``path`` would destroy,
    or None: ``path`` is a source (the same name, a link to it, a hard link: the same
    inode), or ``path`` is a folder holding one."""
    path = os.path.abspath(os.fspath(path))
    real = os.path.realpath(path)
    try:
        st = os.stat(path)
        ident = (st.st_dev, st.st_ino)
    except OSError:
        ident = None
    folder = os.path.isdir(path) and not os.path.islink(path)
    for src in sources:
        src = os.fspath(src)
        src_real = os.path.realpath(src)
        if src_real == real or os.path.abspath(src) == path:
            return src
        try:
            sst = os.stat(src)
            if ident is not None and (sst.st_dev, sst.st_ino) == ident:
                return src
        except OSError:
            pass
        if folder and (src_real.startswith(real + os.sep) or os.path.abspath(src).startswith(path + os.sep)):
            return src
    return None


# --------------------------------------------------------------------------- output set


def destination_error(path: str, e: OSError, doing: str = "cannot write") -> "ConversionError":
    """The :class:`ConversionError` for an ``OSError`` of the destination: what failed, why,
    and what to do (``raise destination_error(...) from e``)."""
    if isinstance(e, ConversionError):
        return e
    if e.errno in (errno.EACCES, errno.EPERM):
        hint = "permission denied: choose a folder you can write to, or make this one writable for you"
    elif e.errno == errno.EROFS:
        hint = "the file system is read-only: choose a destination on a writable one"
    elif e.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = "the disk (or your quota) is full: free space or choose another folder"
    elif e.errno == errno.ENOTDIR:
        hint = "a part of the path is a file, not a folder: choose another destination"
    else:
        hint = "check the destination folder's permissions and free space"
    return ConversionError(f"{path}: {doing} ({e.strerror or e}); {hint}. Nothing was written under a final name.")


_JOURNAL_FORMAT = "metaseq-oneload commit"
_JOURNAL_MAX = 1 << 20


def journal_path(directory: str, prefix: str) -> str:
    """Where :meth:`OutputSet.commit` of the set ``prefix`` keeps its journal."""
    return os.path.join(directory, f".{prefix}{_TAG}commit")


def interrupted_commit(directory: str, prefix: str) -> Optional[str]:
    """(local) Why the set ``prefix`` in ``directory`` must not be loaded because a commit
    of it was cut short (its journal is there and not every name holds the file it put
    there), or None. Reads the journal and stats the names; opens nothing else."""
    path = journal_path(directory, prefix)
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | _NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        return (f"{path}: a conversion's commit journal is here but cannot be read ({e.strerror or e}); a "
                "conversion to these names may have been interrupted while it renamed its files. Run it again "
                f"with overwrite=True (CLI: --overwrite), or remove {os.path.basename(path)} if you know the set "
                "is whole.")
    try:
        st = os.fstat(fd)
        raw = os.read(fd, _JOURNAL_MAX + 1) if stat.S_ISREG(st.st_mode) else b""
    finally:
        os.close(fd)
    try:
        body = json.loads(raw) if len(raw) <= _JOURNAL_MAX else None
        if not isinstance(body, dict) or body.get("format") != _JOURNAL_FORMAT:
            raise ValueError("not a commit journal")
        files = [(str(n), int(dev), int(ino)) for n, dev, ino in body["files"]]
        replaces = [str(n) for n in body.get("replaces", ())]
        pid, host = int(body.get("pid", 0)), str(body.get("host", "?"))
    except (ValueError, TypeError, KeyError) as e:
        return (f"{path}: a conversion's commit journal is here but is not one this package wrote ({e}); a "
                "conversion to these names may have been interrupted while it renamed its files. Run it again "
                f"with overwrite=True (CLI: --overwrite), or remove {os.path.basename(path)} if you know the set "
                "is whole.")
    new, old = [], []
    for name, dev, ino in files:
        try:
            s = os.stat(os.path.join(directory, name), follow_symlinks=False)
            (new if (s.st_dev, s.st_ino) == (dev, ino) else old).append(name)
        except OSError:
            old.append(name)
    left = [n for n in replaces if os.path.lexists(os.path.join(directory, n))]
    if not new or (not old and not left):  # no name changed yet, or every one did: not a mix
        return None
    who = f"pid {pid} on {host}"
    if host == _host() and pid and pid != os.getpid() and _pid_alive(pid):
        return (f"{directory}: a conversion ({who}) is renaming the files of {prefix} into place right now; "
                "wait for it to finish, then load again.")
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(body.get("started", 0) or 0)))
    return (f"{directory}: a conversion to {prefix} ({who}, started {started}) was interrupted while it "
            f"renamed its finished files into place: {len(new)} name(s) hold the new files "
            f"({cap_list(new, 4) if new else 'none'}), {len(old)} still hold the older set's or are missing "
            f"({cap_list(old, 4) if old else 'none'})"
            + (f", and {len(left)} file(s) of the older set it replaces are still there ({cap_list(left, 4)})"
               if left else "")
            + ". Loading these files together would mix two sets. Run the same conversion again with "
            "overwrite=True (CLI: --overwrite) to complete it, or remove the files of "
            f"{prefix} and {os.path.basename(path)}.")


# Errors of link() that mean "this file system has no hard links", not "the name exists".
_NO_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS, errno.EXDEV}


def check_space(folder: str, finals: Sequence[str], need: int) -> None:
    """(local) Refuse an output of about ``need`` bytes into ``folder`` before anything is
    written, counting as free the files it replaces (``finals`` that exist).

    Raises:
        ConversionError: the disk does not have the room.
    """
    reclaimed = sum(os.path.getsize(f) for f in finals if os.path.isfile(f))
    free = shutil.disk_usage(folder).free
    if need - reclaimed > free:
        raise ConversionError(
            f"{folder}: the output needs about {need / (1 << 30):.2f} GiB and the disk has {free / (1 << 30):.2f} "
            "GiB free; nothing was written. Free space or choose another folder.")


def local_destination(dst: "str | os.PathLike") -> str:
    """(local) ``dst`` as given, once it is sure to name a local (or mounted) path.

    Raises:
        OptionError: ``dst`` is an object-store URL. Made absolute, ``s3://b/x`` would become
            a local folder named ``s3:`` beside the caller.
    """
    dst = os.fspath(dst)
    if is_url(dst):
        raise OptionError(f"{dst}: outputs are written to a local (or mounted) folder, not to an object store; "
                          "write them there, then copy the files to the store.")
    return dst


class OutputSet:
    """(local, one process) The files of one conversion, all or nothing.

    Each final name gets a temporary file in the same folder (same file system, so the
    final ``os.replace`` is atomic), created exclusively by :meth:`temp` (:func:`make_temp`).
    :meth:`commit` renames them back to back only after every file is complete and
    fsync'd; :meth:`abort` removes them. A process killed before :meth:`commit` leaves only
    hidden temporary files, which the next conversion to the same names on the same host
    removes (:meth:`clean_stale`: their pid is gone).
    """

    def __init__(self, finals: Sequence[str], *, overwrite: bool, protected: Iterable[str] = (),
                 replaces: Sequence[str] = (), lock: Optional[str] = None):
        for f in finals:
            local_destination(f)
        self.finals = [os.path.abspath(f) for f in finals]
        self.overwrite = overwrite
        self.replaces = [os.path.abspath(f) for f in replaces if os.path.abspath(f) not in self.finals]
        self.protected = [os.fspath(p) for p in protected]
        self.temps: dict = {}  # final -> its temporary file, once created
        self._lock = threading.Lock()
        # One lock per destination prefix (default: the first file's name), beside the files.
        self.lock_path = os.path.abspath(lock or self.finals[0])
        directory, base = os.path.split(self.lock_path)
        self.lock_path = os.path.join(directory, f".{base}{_TAG}lock")
        self.journal_path = journal_path(directory, base)
        self._lock_fd: Optional[int] = None
        self.removed: list = []
        self.notes: list = []
        self.committed = False

    def check(self) -> None:
        """Refuse to write over a source file, ever, and over any existing file without
        ``overwrite``; make the folders; take the destination's lock (held until
        :meth:`release` or :meth:`abort`), so that no other conversion writes these names
        meanwhile."""
        for f in self.finals + self.replaces:
            if os.path.lexists(f) and source_clash(f, self.protected) is not None:
                raise OutputExistsError(
                    f"{f}: is (or links to) a file of the source checkpoint; a conversion never writes "
                    "over its source. Choose another destination prefix or folder."
                )
        for d in sorted({os.path.dirname(f) for f in self.finals}):
            try:
                os.makedirs(d, exist_ok=True)
            except OSError as e:
                raise destination_error(d, e, "cannot create the destination folder") from e
        self._acquire()
        try:
            existing = [f for f in self.finals + self.replaces if os.path.lexists(f)]
            if existing and not self.overwrite:
                names = cap_list(existing, 4, fmt=os.path.basename)
                cut = os.path.lexists(self.journal_path)
                raise OutputExistsError(
                    f"{os.path.dirname(existing[0])}: {len(existing)} destination file(s) exist ({names}); "
                    "nothing was written. Pass overwrite=True (CLI: --overwrite) to replace them, or choose "
                    "another destination prefix."
                    + (" (An earlier conversion to these names was interrupted while it renamed its files: "
                       "overwrite=True completes it.)" if cut else "")
                )
        except BaseException:
            self.release()
            raise

    def _acquire(self) -> None:
        """Take the destination's lock, or raise :class:`OutputExistsError` naming its holder.
        A file system without ``flock`` leaves the hard-link commit as the only guard.

        The lock file is created exclusively and never followed: what a dead conversion left
        there (a regular file of one name) is locked, then removed and created afresh, so
        this process writes only into a file it created; anything else at the name (a link,
        a hard link to a user's file, a FIFO that would block an open) is refused, untouched."""
        flags = os.O_RDWR | _NOFOLLOW | _CLOEXEC | _NONBLOCK
        where = os.path.dirname(self.lock_path)
        role = "this destination's lock"
        while True:
            created = True
            try:
                fd = os.open(self.lock_path, flags | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                created = False
                try:
                    fd = os.open(self.lock_path, flags)
                except FileNotFoundError:  # its holder let it go meanwhile
                    continue
                except OSError as e:
                    if e.errno == errno.ELOOP:
                        raise _not_ours(self.lock_path, "a symbolic link", role) from None
                    raise destination_error(where, e, f"cannot open the lock {os.path.basename(self.lock_path)}") from e
            except OSError as e:
                raise destination_error(where, e, "cannot create files in the destination "
                                        f"folder (the lock {os.path.basename(self.lock_path)})") from e
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise _not_ours(self.lock_path, _kind_of(st.st_mode), role)
                if st.st_nlink != 1:
                    raise _not_ours(self.lock_path, f"a file with {st.st_nlink} names (a hard link)", role)
            except BaseException:
                os.close(fd)
                raise
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise OutputExistsError(
                    f"{where}: another conversion ({holder}) is writing "
                    f"{cap_list(self.finals, 4, fmt=os.path.basename)} right now; nothing was written. Wait for it to finish, or choose "
                    "another destination prefix.") from None
            except OSError as e:  # no flock here (some network file systems)
                os.close(fd)
                if created:
                    with contextlib.suppress(OSError):
                        os.unlink(self.lock_path)
                self.notes.append(f"{where}: no file locks on this file system "
                                  f"({e.strerror or e}); only the final renames are exclusive")
                return
            # The holder before us may have removed the file after we opened it: lock the file
            # that is at the name, or try again.
            try:
                same = os.path.samestat(os.stat(self.lock_path, follow_symlinks=False), st)
            except FileNotFoundError:
                same = False
            if same and not created:
                # A dead conversion's lock, now held by us: take its name away (nobody can
                # hold it any more) and create our own, which the next loop locks.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.lock_path)
                same = False
            if same:
                os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
                self._lock_fd = fd
                return
            os.close(fd)

    def release(self) -> None:
        """Let the destination's lock go (after :meth:`commit` and whatever must still be
        written beside the set; :meth:`abort` does it itself). Idempotent."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is None:
            return
        try:
            os.unlink(self.lock_path)  # while still held: the next one locks a fresh file
        except OSError:
            pass
        os.close(fd)

    def clean_stale(self) -> list:
        """Remove temporary files of these names left by a killed conversion on this host."""
        removed = []
        for f in self.finals:
            try:
                removed += remove_stale_temps(f)
            except OSError as e:
                raise destination_error(f, e, "cannot remove a temporary file a killed conversion left") from e
        return removed

    def temp(self, final: str) -> str:
        """The temporary file of ``final``, created exclusively on the first call."""
        final = os.path.abspath(final)
        if final not in self.finals:
            raise KeyError(f"{final}: not one of this set's outputs")
        with self._lock:
            if final not in self.temps:
                try:
                    self.temps[final] = make_temp(final)
                except OSError as e:
                    raise destination_error(final, e, "cannot create its temporary file") from e
            return self.temps[final]

    def commit(self) -> None:
        """Move every temporary file to its final name, then remove the replaced files of an
        older set (``replaces``), then fsync the folders. Without ``overwrite`` a name that
        appeared meanwhile (another writer) is left alone: the names this set already took
        are given back and :class:`OutputExistsError` raised.

        The renames are one at a time, so a kill between two of them leaves some names with
        the new files and others with the older set's. A journal beside the set
        (``.PREFIX.oneload-commit``, :func:`interrupted_commit`) is written before the first
        rename and removed after the last: while it is there, discovery refuses the set and
        says which files are new and how to recover (run the conversion again with
        ``overwrite``)."""
        missing = [f for f in self.finals if f not in self.temps or not os.path.exists(self.temps[f])]
        if missing:
            raise ConversionError(f"{missing[0]}: a finished output is missing before the rename; nothing was renamed.")
        stats = {f: os.stat(self.temps[f]) for f in self.finals}
        check_signals(commit=True)  # interrupted: never commit
        self._write_journal(stats)
        taken: list = []  # (final, the file's stat): names this set holds
        try:
            for f in self.finals:
                st = stats[f]
                if self.overwrite:
                    os.replace(self.temps[f], f)
                else:
                    self._take(self.temps[f], f)
                taken.append((f, st))
        except BaseException as e:
            if not self.overwrite:
                for f, st in taken:  # still our file (nobody replaced it since): give the name back
                    with contextlib.suppress(OSError):
                        if os.path.samestat(os.stat(f, follow_symlinks=False), st):
                            os.unlink(f)
                self._drop_journal()
            elif taken:  # names now mix the two sets: the journal stays and says so to every load
                raise ConversionError(
                    f"{f}: cannot move the finished file to its name ({e}) after {len(taken)} of "
                    f"{len(self.finals)} files were ({cap_list(taken, 4, fmt=lambda t: os.path.basename(t[0]))}): "
                    "these names now hold files of two different sets, and loading them is refused. Run the "
                    "same conversion again with overwrite=True (CLI: --overwrite) to complete it.") from e
            else:
                self._drop_journal()
            if isinstance(e, OSError) and not isinstance(e, ConversionError):
                raise destination_error(f, e, "cannot move the finished file to its name") from e
            raise
        for f, _ in taken:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.temps[f])
            _forget(self.temps[f])
        self.committed = True
        for f in self.replaces:
            try:
                os.unlink(f)
                self.removed.append(f)
            except FileNotFoundError:
                pass
        self._fsync_folders()
        self._drop_journal()

    def _fsync_folders(self) -> None:
        for d in sorted({os.path.dirname(f) for f in self.finals} | {os.path.dirname(self.journal_path)}):
            try:
                dfd = os.open(d, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(dfd)
            except OSError as e:  # some file systems cannot fsync a folder
                if e.errno not in (errno.EINVAL, errno.EBADF):
                    raise
            finally:
                os.close(dfd)

    def _write_journal(self, stats: Mapping[str, os.stat_result]) -> None:
        """What :func:`interrupted_commit` reads: each final name and the file (device,
        inode) that the commit puts there, and the older files it removes afterwards."""
        base = os.path.dirname(self.journal_path)
        body = {"format": _JOURNAL_FORMAT, "pid": os.getpid(), "host": _host(), "started": time.time(),
                "files": [[os.path.relpath(f, base), st.st_dev, st.st_ino] for f, st in stats.items()],
                "replaces": [os.path.relpath(f, base) for f in self.replaces]}
        replace_file(self.journal_path, json.dumps(body).encode(), what="commit journal")
        self._fsync_folders()  # the journal is on disk before any name changes

    def _drop_journal(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.journal_path)
        self._fsync_folders()

    @staticmethod
    def _take(tmp: str, final: str) -> None:
        """``tmp`` becomes ``final`` only if no file is there (a hard link fails on an existing
        name, where a rename would replace it); the temporary name goes when the commit ends."""
        try:
            os.link(tmp, final, follow_symlinks=False)
            return
        except FileExistsError:
            raise OutputExistsError(
                f"{final}: appeared while this conversion was writing (another conversion, or another program, "
                "writing the same names?); it was left as it is and this conversion put none of its files in place. "
                "Pass overwrite=True (CLI: --overwrite) to replace it, or choose another destination prefix.") from None
        except OSError as e:
            if e.errno not in _NO_LINKS:
                raise
        # No hard links on this file system: the lock (if any) is the guard; check once more.
        if os.path.lexists(final):
            raise OutputExistsError(f"{final}: appeared while this conversion was writing; it was left as it is.")
        os.rename(tmp, final)

    def abort(self) -> None:
        """Remove every temporary file (normal errors, Ctrl-C) and let the lock go."""
        try:
            if self.committed:
                return
            with self._lock:
                temps = list(self.temps.values())
            for t in temps:
                try:
                    os.unlink(t)
                except FileNotFoundError:
                    pass
                _forget(t)
        finally:
            self.release()
