"""Warm-up progress (gearcache/warmup/progress.py): a bar on a terminal, tqdm's or gearcache's own; log lines
elsewhere."""
import io
import logging
import threading

import tqdm

from gearcache.warmup.progress import Progress


class Terminal(io.StringIO):
    """A text stream that says it is a terminal, and keeps what was drawn on it."""

    def isatty(self) -> bool:
        return True


def test_off_a_terminal_each_gear_is_one_log_line_and_nothing_is_drawn(caplog):
    stream = io.StringIO()
    progress = Progress("decode", 3, "ready", stream=stream)
    with caplog.at_level(logging.INFO, logger="gearcache.warmup.driver"):
        progress.step([1], "loaded", 0.25)
        progress.step([2], "compiled", 11.9)
        progress.close()
    assert stream.getvalue() == ""
    assert [r.getMessage() for r in caplog.records] == ["warmup decode: gear [1] loaded in 0.25 s (1/3)",
                                                        "warmup decode: gear [2] compiled in 11.90 s (2/3)"]


def test_on_a_terminal_without_tqdm_gearcache_draws_its_own_bar_in_place(caplog):
    stream = Terminal()
    progress = Progress("decode", 4, "ready", stream=stream, tqdm_class=None)
    with caplog.at_level(logging.INFO, logger="gearcache.warmup.driver"):
        progress.step([8], "compiled", 11.9)
        progress.step([4], "compiled", 12.3)
        progress.close()
    drawn = stream.getvalue()
    assert drawn.count("\r") == 2 and drawn.endswith("\n")
    last = drawn.split("\r")[-1]
    assert last.startswith("gearcache warmup decode: [##########..........] 2/4 gears ready, ")
    assert "(gear [4]: compiled in 12.3 s)" in last
    assert not caplog.records                                   # the bar, not log lines


def test_on_a_terminal_with_tqdm_the_bar_is_tqdms_and_counts_every_gear_from_threads():
    stream = Terminal()
    progress = Progress("decode", 7, "ready", stream=stream, tqdm_class=tqdm.tqdm)
    threads = [threading.Thread(target=progress.step, args=([2 ** k], "compiled", 1.0 + k)) for k in range(7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert progress.bar.n == 7 and progress.done == 7
    progress.close()
    drawn = stream.getvalue()
    assert "gearcache warmup decode" in drawn and "7/7" in drawn and "gear" in drawn
    assert progress.bar is None                                 # closed once; a second close draws nothing more
    progress.close()
    assert stream.getvalue() == drawn


def test_the_default_bar_is_tqdms_when_it_is_installed():
    assert isinstance(Progress("decode", 2, "ready", stream=Terminal()).bar, tqdm.tqdm)
    assert Progress("decode", 2, "ready", stream=io.StringIO()).bar is None       # never off a terminal
