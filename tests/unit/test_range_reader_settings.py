"""A RangeReader's defaults come from the settings a verb read once (``_settings.Settings``),
else from the environment through ``_settings.from_env``; arguments passed win over both."""

from __future__ import annotations

import pytest

from metaseq_oneload._errors import OptionError
from metaseq_oneload._reading import RangeReader
from metaseq_oneload._settings import Settings

MiB = 1 << 20


def test_the_settings_passed_win_over_the_environment(monkeypatch):
    monkeypatch.setenv("METASEQ_ONELOAD_READ_THREADS", "5")
    monkeypatch.setenv("METASEQ_ONELOAD_READ_SPLIT_MB", "2")
    monkeypatch.setenv("METASEQ_ONELOAD_O_DIRECT", "0")
    r = RangeReader(settings=Settings(read_threads=3, read_split_mb=4, o_direct=True))
    assert (r.read_threads, r.split_bytes, r.direct) == (3, 4 * MiB, True)
    r = RangeReader()
    assert (r.read_threads, r.split_bytes, r.direct) == (5, 2 * MiB, False)


def test_arguments_win_and_the_environment_is_not_read_when_all_are_given(monkeypatch):
    monkeypatch.setenv("METASEQ_ONELOAD_READ_THREADS", "many")  # malformed: read, it would raise
    r = RangeReader(read_threads=2, split_bytes=3 * MiB, direct=False)
    assert (r.read_threads, r.split_bytes, r.direct) == (2, 3 * MiB, False)
    with pytest.raises(OptionError, match=r"\$METASEQ_ONELOAD_READ_THREADS='many'"):
        RangeReader(read_threads=2, split_bytes=3 * MiB)
