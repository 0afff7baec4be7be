"""The line rank 0 logs about the strategy, and anything logged while the progress bar shows,
never lands in the middle of the bar: the line is logged before the bar appears, and log
records go through tqdm.write while it is up."""

import subprocess
import sys

from tests.conftest import FIXTURES, REPO, needs_fixtures

pytestmark = needs_fixtures

CODE = r"""
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="LOG %(message)s")
import metaseq_oneload
from metaseq_oneload import _engine

# A record logged while the bar is up, as a slow file system's warning would be.
bar_up = _engine.progress_bar
def progress_bar(*args, **kwargs):
    update, ctx = bar_up(*args, **kwargs)
    class Ctx:
        def __enter__(self):
            ctx.__enter__()
            logging.getLogger("somebody.else").warning("mid-read warning")
        def __exit__(self, *exc):
            return ctx.__exit__(*exc)
    return update, Ctx()
_engine.progress_bar = progress_bar
sd = metaseq_oneload.load_state_dict(sys.argv[1], progress=True)
print(len(sd))
"""


def _segments(stderr: str) -> list:
    """What stays visible of each line on a terminal: the text after its last carriage return."""
    return [line.split("\r")[-1] for line in stderr.split("\n")]


def test_log_lines_never_break_the_bar():
    r = subprocess.run([sys.executable, "-c", CODE, str(FIXTURES / "singleton")], capture_output=True, text=True,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) > 0
    assert "oneload:" in r.stderr  # the bar was drawn (tqdm's desc)
    lines = _segments(r.stderr)
    strategy = [s for s in lines if "strategy=" in s]
    warning = [s for s in lines if "mid-read warning" in s]
    assert len(strategy) == 1 and strategy[0].startswith("LOG oneload: "), r.stderr
    assert len(warning) == 1 and warning[0].startswith("LOG mid-read warning"), repr(r.stderr)
    assert r.stderr.index("strategy=") < r.stderr.index("%|")  # logged before the bar was first drawn


def test_a_load_s_progress_never_passes_its_total_and_ends_on_it():
    """A loop may count bytes a rank only passes on (the scatter's reader) or in the stored
    dtype (half an fp32 output's bytes from fp16): the callback still sees a rising count
    held to the total, and the load's end brings it exactly there."""
    from metaseq_oneload._execute import counting

    seen = []
    advance = counting(lambda done, total: seen.append((done, total)), 100)
    for n in (30, 50, 60, 40):  # 180 counted: more than there is
        advance(n)
    assert seen == [(30, 100), (80, 100), (100, 100)]
    short = []
    advance = counting(lambda done, total: short.append(done), 100)
    advance(50)  # counted in a dtype half the output's
    advance.finish()
    assert short == [50, 100]
    assert counting(None, 100) is None
