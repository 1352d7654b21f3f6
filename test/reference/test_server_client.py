"""ess.harness.servers without a server: what the client does around the processes it starts."""

import os
import signal
import subprocess
import sys
import textwrap
import time

SCRIPT = textwrap.dedent("""
    import subprocess, sys, time
    from ess.harness import servers as S
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


def test_a_server_whose_port_was_taken_starts_again_on_a_new_port(tmp_path):
    """wait_ready_or_rebind: a real process that logs uvicorn's bind failure and lives on (as SGLang's scheduler does)
    is stopped and started again on a new port; any other failure is raised as it is."""
    from ess.harness import servers as S

    class Fake(S.Server):  # a Server whose command is a stand-in: the first one logs the bind failure, the next one READY
        @property
        def command(self):
            line = S.BIND_FAILED if not os.path.exists(self.log_path + ".once") else S.READY
            open(self.log_path + ".once", "w").close()
            return [sys.executable, "-c", f"import time; print({line!r}, flush=True); time.sleep(600)"]

    srv = Fake("model", [], str(tmp_path / "fake.log"))
    first = srv.port
    srv.start()
    try:
        assert S.wait_ready_or_rebind(srv) is srv and srv.port != first
    finally:
        srv.stop()
    class Exits(S.Server):
        @property
        def command(self):
            return [sys.executable, "-c", "import sys; sys.exit(3)"]

    other = Exits("model", [], str(tmp_path / "other.log")).start()  # exits before it is ready: raised, not retried
    try:
        S.wait_ready_or_rebind(other)
        raise AssertionError("not raised")
    except S.ServerError as e:
        assert "exited" in str(e)
