#!/usr/bin/env python3
"""Checks scripts/load-at-placement.py on a small hand-made run (run by `make unit`)."""
import importlib.util
import os

if not __debug__:  # python -O strips every assert: the checks would pass unseen
    raise SystemExit(f"{__file__}: run without -O (its checks are asserts)")

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("load_at_placement", os.path.join(HERE, "load-at-placement.py"))
lap = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lap)


def record(ms, total_ms, rank, prompt, cached, queue_ms=0, status=200, turn_wait_ms=0):
    return {"scheduled_ms": ms, "lateness_us": 0, "turn_wait_us": turn_wait_ms * 1000,
            "total_us": total_ms * 1000, "rank": rank, "status": status,
            "prompt_tokens": prompt, "cached_tokens": cached, "queue_us": queue_ms * 1000}


def test_counts_what_was_in_flight_on_each_rank_when_a_request_left():
    records = [
        # Three long requests on rank 0 and nothing on rank 1: the fourth, sent while they run,
        # goes to rank 0 with 3 more in flight than rank 1, and waited 40 ms.
        record(0, 3000, 0, 100, 0),
        record(1, 3000, 0, 100, 0),
        record(2, 3000, 0, 100, 0),
        record(10, 100, 0, 100, 90, queue_ms=40),
        # Sent after they all ended, to the idle rank: nothing beyond the least loaded.
        record(4000, 100, 1, 100, 50),
        # Its send time counts the turn's wait: at 1,500 ms rank 0's requests still run, and
        # it went to rank 1, the least loaded.
        record(500, 100, 1, 100, 10, turn_wait_ms=1000),
        # Not answered: neither counted nor classed.
        record(5, 5000, 1, 100, 0, status=503),
    ]
    table = lap.classify(records)
    assert table == {
        ("fresh", "0"): (2, 0.0),  # the first request; the turn that waited
        ("fresh", "1-2"): (2, 0.0),  # the second and third, 1 and 2 beyond the idle rank
        ("cont", "3+"): (1, 40.0),
        ("part", "0"): (1, 0.0),
    }, table


def test_class_bounds():
    assert [lap.cached_class({"prompt_tokens": 100, "cached_tokens": c}) for c in (29, 30, 79, 80)] == \
        ["fresh", "part", "part", "cont"]
    assert [lap.excess_class(e) for e in (0, 1, 2, 3, 9)] == ["0", "1-2", "1-2", "3+", "3+"]
    # A record without a prompt (no usage in the answer) is fresh, not a division by zero.
    assert lap.cached_class({"prompt_tokens": 0, "cached_tokens": 0}) == "fresh"


if __name__ == "__main__":
    test_counts_what_was_in_flight_on_each_rank_when_a_request_left()
    test_class_bounds()
    print("test-load-at-placement: OK")
