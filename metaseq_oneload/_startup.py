"""The start-up hook behind ``metaseq-train +oneload=auto``.

metaseq parses its command line with argparse, which rejects Hydra's ``+oneload=auto``.
``metaseq_oneload.pth``, installed at the top of site-packages with the package, runs one
cheap line at every interpreter start: only when an argument starts with ``+oneload=`` or
``METASEQ_ONELOAD`` is set does it import this module (which imports no torch, no Hydra) and
call :func:`from_pth`. For metaseq's own commands (``metaseq-*``, ``python -m metaseq...``)
that

1. composes the ``oneload`` group through Hydra from those tokens (a typo such as
   ``oneload.bogus=1`` stops the program with Hydra's own message, exit code 2),
2. takes the tokens out of ``sys.argv``,
3. sets ``METASEQ_ONELOAD`` so that spawned workers do the same, and
4. installs the patch as soon as metaseq (or fairseq) has been imported.

Any other program (pip, a launcher, a Hydra app, a worker started with ``python -c``) keeps
its command line and pays nothing at start-up: composing and installing wait until metaseq
or fairseq is imported, if ever. ``METASEQ_ONELOAD`` is exported, so every Python process
below a ``metaseq-train +oneload=auto`` sees it; a value that does not compose then only
prints a warning in such a process and changes nothing: the process is not metaseq's.

Without the token nothing is imported and nothing changes. The ``--user-dir`` route calls
:func:`activate` from the user directory's ``__init__.py`` instead (see docs/metaseq/train.md).
"""

import os
import sys
import threading
from typing import Any, Callable, List, MutableMapping, Optional, Sequence

from ._hydra import ENV, OneloadConfig, activation_overrides, environment_value, explicit_settings, split_argv
from ._import_hook import AfterImport

__all__ = ["activate", "from_pth", "strip_argv"]

_WATCHED = ("metaseq", "fairseq")
_DONE = False
_LOCK = threading.Lock()


def strip_argv(argv: List[str]) -> List[str]:
    """(local) Remove the ``oneload`` overrides from ``argv`` in place (``argv[0]`` is the
    program and stays); returns what was removed."""
    kept, tokens = split_argv(argv[1:])
    argv[1:] = kept
    return tokens


def activate(argv: Optional[List[str]] = None, environ: Optional[MutableMapping[str, str]] = None, *,
             strip: bool = True) -> Optional[OneloadConfig]:
    """(every process, local) Turn metaseq-oneload on from the command line.

    Composes the ``oneload`` group from the ``+oneload=NAME`` / ``oneload.KEY=VALUE`` tokens
    of ``argv`` (default ``sys.argv``) or from ``METASEQ_ONELOAD``, removes those tokens
    from ``argv`` in place (``strip``), records them in ``METASEQ_ONELOAD`` for child
    processes, and installs the patch now if metaseq is imported, else right after it is.

    Returns:
        The composed config, or None when neither a ``+oneload=`` token nor
        ``METASEQ_ONELOAD`` asks for metaseq-oneload (then nothing happens).

    Raises:
        hydra.errors.HydraException, ValueError: the overrides do not compose.

    Example (a ``--user-dir`` package's ``__init__.py``)::

        import metaseq_oneload.hydra
        metaseq_oneload.hydra.activate()
    """
    argv = sys.argv if argv is None else argv
    environ = os.environ if environ is None else environ
    overrides = activation_overrides(argv[1:], environ)
    if overrides is None:
        return None
    config = _compose(overrides)
    explicit = explicit_settings(argv[1:])
    if strip:
        strip_argv(argv)
    environ[ENV] = environment_value(overrides)
    if config.enabled:
        # Tokens left in argv are for the program's own Hydra: it composes +oneload=... onto
        # metaseq's structured config, which then needs the oneload node.
        _install_when_imported(lambda: (config, explicit), hydra_schema=not strip)
    return config


def _compose(overrides: Sequence[str]) -> OneloadConfig:
    from ._hydra import compose_oneload  # imports Hydra: only once something is composed

    return compose_oneload(overrides)


def _metaseq_command() -> bool:
    """Whether this process runs one of metaseq's own command lines (console script
    metaseq-*, python -m metaseq..., or a script inside the metaseq package), whose argv
    is metaseq's to parse."""
    argv = getattr(sys, "argv", None) or [""]
    if os.path.basename(argv[0]).startswith("metaseq-"):
        return True
    orig = list(getattr(sys, "orig_argv", ()))
    if "-m" in orig[:-1] and orig[orig.index("-m") + 1].split(".")[0] == "metaseq":
        return True
    return f"{os.sep}metaseq{os.sep}" in os.path.abspath(argv[0]) and argv[0].endswith(".py")


def _warn(message: str) -> None:
    sys.stderr.write(f"metaseq-oneload: warning: {message}\n")
    sys.stderr.flush()


def from_pth() -> None:
    """(every process, at interpreter start) What ``metaseq_oneload.pth`` calls once it has
    seen ``+oneload=`` or ``METASEQ_ONELOAD``. Runs once per process (site-packages may be
    scanned twice).

    A metaseq command composes now; an error stops it with a message (exit code 2): running
    on without the loading the user asked for would be wrong, and an exception here would
    only be printed. Any other process defers everything to the import of metaseq/fairseq
    and never stops because of this hook: a value that does not compose is a warning."""
    global _DONE
    with _LOCK:
        if _DONE:
            return
        _DONE = True
    argv = getattr(sys, "argv", None) or [""]
    if _metaseq_command():
        try:
            activate(strip=True)
        except Exception as e:  # noqa: BLE001  (reported, then the process stops)
            sys.stderr.write(f"metaseq-oneload: {' '.join(argv[1:])}: {type(e).__name__}: {e}\n")
            sys.stderr.flush()
            os._exit(2)
        return
    try:
        overrides = activation_overrides(argv[1:], os.environ)
        if overrides is None:
            return
        explicit = explicit_settings(argv[1:])
        if split_argv(argv[1:])[1]:
            # The tokens are this program's (a Hydra app, a launcher passing them on): they
            # stay in argv; workers it spawns get them through the environment.
            os.environ[ENV] = environment_value(overrides)
    except Exception as e:  # noqa: BLE001  (not metaseq's process: never stop it)
        _warn(f"{ENV} / command line not understood ({type(e).__name__}: {e}); nothing installed.")
        return

    def composed():
        try:
            config = _compose(overrides)
        except Exception as e:  # noqa: BLE001
            _warn(f"{' '.join(overrides)} does not compose ({type(e).__name__}: {e}); metaseq's loading "
                  "is left as it is.")
            return None
        return (config, explicit) if config.enabled else None

    _install_when_imported(composed, hydra_schema=True, tolerant=True)


def _install_when_imported(settings: Callable[[], Any], hydra_schema: bool, tolerant: bool = False) -> None:
    """Install the patch (``settings()`` gives (config, explicit), or None for nothing) as
    soon as metaseq or fairseq is imported; now if one is. ``integrations`` (and with it torch) is
    imported only then. ``tolerant``: a failure is a warning, not an exception."""

    def install() -> None:
        found = settings()
        if found is None:
            return
        config, explicit = found
        try:
            from .integrations import install as install_patch

            install_patch(config, explicit=explicit, hydra_schema=hydra_schema)
        except Exception as e:  # noqa: BLE001
            if not tolerant:
                raise
            _warn(f"could not install the metaseq patch ({type(e).__name__}: {e}); metaseq's loading is left "
                  "as it is.")

    if any(name in sys.modules for name in _WATCHED):
        install()
        return
    AfterImport.watch(_WATCHED, install)
