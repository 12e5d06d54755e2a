"""Custom rewards for the loop fault suite (tests/loop/test_faults_loop.py), "fault_rewards:<fn>"."""

import os
import time


def hang_once(*, prompt: str, completion: str, example: dict, **options) -> float:
    """Hangs forever on the first call of the run (marker file RLJAX_TEST_HANG_MARKER), else 0.5."""
    try:
        fd = os.open(os.environ["RLJAX_TEST_HANG_MARKER"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return 0.5
    os.close(fd)
    while True:
        time.sleep(3600)
