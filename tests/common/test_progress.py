"""Progress of long loops: a tqdm bar on a terminal; on a pipe no bar, but a log line at most every LOG_INTERVAL
seconds and one at the end (none for a short loop)."""

import io
import logging

import pytest
from tqdm import tqdm

from pipeline.common.progress import LOG_INTERVAL, LogProgress, progress


class FakeStream(io.StringIO):
    def __init__(self, terminal: bool):
        super().__init__()
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


class FakeClock:
    """A clock that moves only when the test moves it."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def progress_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pipeline.common.progress"]


def test_a_pipe_gets_rate_limited_log_lines_and_a_last_one_never_a_bar(caplog):
    stream, clock = FakeStream(terminal=False), FakeClock()
    caplog.set_level(logging.INFO)
    bar = progress(range(100), desc="finetune target", unit="step", stream=stream, clock=clock)
    assert isinstance(bar, LogProgress)
    for step in bar:
        clock.now += 1.0  # a second a step
        bar.set_postfix(loss=f"{1 / (step + 1):.4f}")
    lines = progress_lines(caplog)
    assert stream.getvalue() == ""  # nothing written where a bar would go
    # 100 steps of one second: a line at 30, 60 and 90 s, and the last one
    assert len(lines) == 4, lines
    assert lines[0] == "finetune target: step 30/100 (30%), loss 0.0333, 1.0 steps/s, eta 1m10s"
    assert lines[1] == "finetune target: step 60/100 (60%), loss 0.0167, 1.0 steps/s, eta 40s"
    assert lines[-1] == "finetune target: step 100/100 (100%), loss 0.0100, 1.0 steps/s, done in 1m40s"
    assert "\r" not in "".join(lines) and all(len(line) < 150 for line in lines)


def test_a_short_loop_on_a_pipe_logs_nothing(caplog):
    caplog.set_level(logging.INFO)
    clock = FakeClock()
    bar = progress(total=50, desc="multiple choice", unit="item", stream=FakeStream(False), clock=clock)
    for _ in range(10):
        clock.now += 2.9  # 29 s in all
        bar.update(5)
    bar.close()
    assert progress_lines(caplog) == []


def test_a_resumed_loop_counts_from_its_start_and_rates_only_its_own_steps(caplog):
    caplog.set_level(logging.INFO)
    clock = FakeClock()
    bar = LogProgress(range(40, 44), total=44, desc="unlearn", unit="step", initial=40, clock=clock)
    for _ in bar:
        clock.now += LOG_INTERVAL / 2  # under one step a second: shown as seconds per step
    lines = progress_lines(caplog)
    assert lines[0] == "unlearn: step 42/44 (95%), 15.0 s/step, eta 30s"
    assert lines[-1] == "unlearn: step 44/44 (100%), 15.0 s/step, done in 1m00s"
    bar.close()  # closed once: no second last line
    assert len(progress_lines(caplog)) == len(lines)


def test_a_total_is_taken_from_the_iterable(caplog):
    caplog.set_level(logging.INFO)
    clock = FakeClock()
    bar = LogProgress(range(3), desc="reference", clock=clock)
    for _ in bar:
        clock.now += LOG_INTERVAL
    assert progress_lines(caplog)[0].startswith("reference: batch 1/3 (33%), ")


def test_a_terminal_gets_a_tqdm_bar():
    stream = FakeStream(terminal=True)
    bar = progress(range(5), desc="teacher forcing", stream=stream)
    assert isinstance(bar, tqdm) and not bar.disable and not bar.leave  # inner bars vanish once done
    assert bar in tqdm._instances  # stages/cli.py closes the open ones on an error
    assert sum(1 for _ in bar) == 5
    assert "\rteacher forcing:   0%|" in stream.getvalue() and stream.getvalue().endswith("\r")  # drawn, then wiped
    outer = progress(range(2), desc="finetune", unit="step", leave=True, stream=stream)
    assert list(outer) == [0, 1] and outer.leave
    assert "finetune: 100%" in stream.getvalue() and "2/2" in stream.getvalue()  # an outer bar stays


def test_other_processes_show_nothing(monkeypatch, caplog):
    monkeypatch.setattr("pipeline.common.distributed.is_main_process", lambda: False)
    caplog.set_level(logging.INFO)
    for terminal in (True, False):
        stream = FakeStream(terminal)
        clock = FakeClock()
        bar = progress(range(3), desc="x", stream=stream, clock=clock)
        for _ in bar:
            clock.now += LOG_INTERVAL
        bar.set_postfix(loss="1.0")
        bar.close()
        assert stream.getvalue() == ""
    assert progress_lines(caplog) == []


@pytest.mark.parametrize("seconds, text", [(5, "5s"), (125, "2m05s"), (3725, "1h02m")])
def test_the_last_line_says_how_long_the_loop_took(seconds, text, caplog):
    caplog.set_level(logging.INFO)
    clock = iter([0.0, 0.5, float(seconds)])  # started, one update before the first interval, closed
    bar = LogProgress(total=10, desc="generation", clock=lambda: next(clock), interval=1.0)
    bar.update(10)
    bar.close()
    assert progress_lines(caplog) == [f"generation: batch 10/10 (100%), {10 / seconds:.1f} batches/s, done in {text}"
                                      if seconds <= 10 else
                                      f"generation: batch 10/10 (100%), {seconds / 10:.1f} s/batch, done in {text}"]
