"""ess.reference.server without a server: what the client does around the processes it starts."""

import os
import signal
import subprocess
import sys
import textwrap
import time

SCRIPT = textwrap.dedent("""
    import subprocess, sys, time
    from ess.reference import server as S
    with S.terminate_as_exit():
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        try:
            print(child.pid, flush=True)  # inside the try: the signal may come as soon as the line is read
            time.sleep(600)
        finally:  # what Server.__exit__ does with a server's process group
            child.kill()
            child.wait()
""")


def test_sigterm_unwinds_so_started_servers_are_stopped():
    """`timeout` or a job runner ends `ess demo --server` with SIGTERM: the block unwinds and its servers stop
    (Python's default would end the process at once and leave them running)."""
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"process {child} outlived its parent's SIGTERM")
