"""graph_trainer/loop/gradients.py: what a job reports after compiling once per node."""

import logging

from graph_trainer.loop.gradients import once_per_node_report


def test_once_per_node_says_whether_the_second_wave_found_the_cache():
    level, line = once_per_node_report([True, False, True, False], [5, 0, 3, 0])
    assert level == logging.INFO
    assert line == (
        "compile.once_per_node: 2 of 4 ranks compiled (the first of each host and graph); "
        "the other 2 loaded the result from Inductor's FX graph cache"
    )
    level, line = once_per_node_report([True, False], [4, 4])  # rank 1 compiled all over again
    assert level == logging.WARNING and "missed Inductor's FX graph cache 4 time(s) and compiled again" in line
    assert once_per_node_report([True, True], [4, 4])[1].endswith("(the first of each host and graph)")
