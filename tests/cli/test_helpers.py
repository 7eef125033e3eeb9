"""Unit tests (no threads, no servers) of the small pieces the CLI split made separate:
first_line, percentile, the tier verdict, the signal guard, the scrubbed stream, and the
registration of every command."""

from __future__ import annotations

import io
import math
import signal
import threading

import pytest

from kvtier import cli
from kvtier.cli.scrub import ScrubbedStream, Scrubber
from kvtier.cli.signals import CleanupAborted, SignalGuard, Terminated, cleanup_phase
from kvtier.cli.verdict import TierHealth, tier_health
from kvtier.replay.stats import Interpolation, percentile
from kvtier.text import first_line


def test_first_line_keeps_only_the_first_line() -> None:
    assert first_line(RuntimeError("  boom\nsecond line\n")) == "boom"
    assert first_line(RuntimeError("")) == ""


def test_nearest_rank_percentile() -> None:
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 99) == 5.0
    assert percentile([], 50) == 0.0


def test_linear_percentile() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50, interpolation=Interpolation.LINEAR) == 2.5
    assert percentile(values, 100, interpolation=Interpolation.LINEAR) == 4.0
    assert math.isnan(percentile([], 50, interpolation=Interpolation.LINEAR, empty=math.nan))


def test_a_tier_failing_most_operations_fails_the_run() -> None:
    stats = [{"tiers": {"redis": {"probes_submitted": 10, "probe_errors": 6}}},
             {"tiers": {"redis": {"store_keys": 10}, "file": {"load_keys": 4}}}]
    health = {item.name: item for item in tier_health(stats)}
    assert health["redis"] == TierHealth("redis", 20, 6)
    assert not health["redis"].failed
    assert TierHealth("redis", 10, 6).failed
    assert not TierHealth("idle", 0, 0).failed
    assert "6 of 10" in TierHealth("redis", 10, 6).summary()


def test_terminated_names_its_signal_and_exit_code() -> None:
    stop = Terminated(signal.SIGTERM)
    assert (stop.name, stop.exit_code) == ("SIGTERM", 143)


def test_a_signal_in_a_cleanup_is_deferred_until_it_ends() -> None:
    """Real signals to this process (``raise_signal`` runs the handler before it returns).
    Before: the signal interrupted the cleanup half-way."""
    steps: list[str] = []
    guard = SignalGuard()
    with pytest.raises(Terminated) as stopped, guard:
        with cleanup_phase():
            signal.raise_signal(signal.SIGTERM)
            steps.append("the cleanup went on")
        steps.append("not reached: the deferred signal stops the command here")
    assert steps == ["the cleanup went on"]
    assert stopped.value.signum == signal.SIGTERM and not guard.incomplete


def test_a_further_signal_stops_the_cleanup_and_marks_it_incomplete() -> None:
    guard = SignalGuard()
    with guard:
        with pytest.raises(Terminated):
            signal.raise_signal(signal.SIGINT)  # stops the command; its cleanup starts
        signal.raise_signal(signal.SIGTERM)  # outside a cleanup (a shutdown): ignored
        assert guard.ignored == 1
        with pytest.raises(CleanupAborted) as aborted, cleanup_phase():
            signal.raise_signal(signal.SIGTERM)
    assert aborted.value.exit_code == 128 + signal.SIGINT  # the first signal's
    assert guard.incomplete


def test_signal_guard_off_the_main_thread_sets_no_handlers() -> None:
    before = signal.getsignal(signal.SIGTERM)
    seen: list[object] = []

    def enter() -> None:
        with SignalGuard():
            seen.append(signal.getsignal(signal.SIGTERM))

    worker = threading.Thread(target=enter)
    worker.start()
    worker.join()
    assert seen == [before]


def test_scrubbed_stream_hides_url_passwords() -> None:
    out = io.StringIO()
    stream = ScrubbedStream(out, Scrubber.for_run(["redis://u:hunter22@h/0"], environ={}))
    stream.write("bad redis://u:hunter22@h/0 and hunter22\n")
    stream.flush()
    assert "hunter22" not in out.getvalue()


def test_every_command_registers_and_sets_its_runner() -> None:
    parser = cli._build_parser()
    for argv in (["replay"], ["inspect", "memory://"], ["usage", "memory://"],
                 ["purge", "memory://"], ["bench"], ["bench", "serve"]):
        args = parser.parse_args(argv)
        assert callable(args.run), argv
    assert parser.parse_args(["bench", "serve"]).command == "bench serve"
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "nope"])


def test_a_password_with_slash_question_or_hash_is_redacted_and_scrubbed() -> None:
    """Before: the URL parser found no '@' in the netloc, so the password was shown whole."""
    from kvtier.backends import redact_url
    from kvtier.cli.scrub import Scrubber

    for url in ("redis://default:ab/SECRET@127.0.0.1:6379/0",
                "redis://default:ab?SECRET@127.0.0.1:6379/0",
                "rediss://default:ab#SECRET@127.0.0.1:6379/0"):
        shown = redact_url(url)
        assert "SECRET" not in shown and "ab" not in shown.split("@")[0], shown
        assert shown.endswith("@127.0.0.1:6379/0")
        scrub = Scrubber.for_run([url])
        assert "SECRET" not in scrub(f"could not reach {url}: refused")
