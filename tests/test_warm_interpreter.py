"""tests/warm_interpreter.py, which runs the Triton-interpreter tests' code in children forked from a warm
server: each child behaves as ``python -c`` would (the environment at the time of the call, exit statuses,
output), a child that runs too long is killed, and a server that cannot start says why."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from warm_interpreter import WarmInterpreter


@pytest.fixture(scope="module")
def warm():
    server = WarmInterpreter({"WARM_FIXED": "1"}, preload=["json"], path=[Path(__file__).parent])
    yield server
    server.close()


def test_a_child_sees_the_environment_of_the_call_and_its_output_comes_back(warm, monkeypatch):
    monkeypatch.setenv("WARM_PER_TEST", "a")
    r = warm.run("import os, sys\nprint(os.environ['WARM_FIXED'], os.environ['WARM_PER_TEST'], sys.path[0] == '',\n"
                 "      sys.argv == ['-c'])\n"
                 "print('to stderr', file=sys.stderr)")
    assert (r.returncode, r.stdout, r.stderr) == (0, "1 a True True\n", "to stderr\n")
    monkeypatch.setenv("WARM_PER_TEST", "b")
    assert warm.run("import os; print(os.environ['WARM_PER_TEST'])").stdout == "b\n"


def test_children_do_not_share_state(warm):
    assert warm.run("import json; json.MARK = 1").returncode == 0
    assert warm.run("import json; print(hasattr(json, 'MARK'))").stdout == "False\n"


@pytest.mark.parametrize("code,status,err", [
    ("assert 1 == 2, 'boom'", 1, "AssertionError: boom"),
    ("import sys; sys.exit(3)", 3, ""),
    ("import sys; sys.exit('a message')", 1, "a message"),
    ("import atexit; atexit.register(print, 'at exit')", 0, ""),
])
def test_exit_statuses_and_errors_are_those_of_python_c(warm, code, status, err):
    r = warm.run(code)
    assert r.returncode == status and err in r.stderr
    if "atexit" in code:
        assert r.stdout == "at exit\n"


def test_a_child_past_its_timeout_is_killed_and_the_server_goes_on(warm):
    t = time.monotonic()
    r = warm.run("import time; time.sleep(60)", timeout=1)
    assert r.returncode == -9 and "killed after 1 s" in r.stderr and time.monotonic() - t < 30
    assert warm.run("print('next')").stdout == "next\n"


def test_a_server_that_cannot_import_its_preload_says_why():
    server = WarmInterpreter({}, preload=["no_such_module_for_the_warm_test"])
    try:
        r = server.run("print(1)")
        assert r.returncode == 1 and "No module named 'no_such_module_for_the_warm_test'" in r.stderr
    finally:
        server.close()
    assert not os.path.exists(server._dir.name)


def test_a_started_child_is_used_as_a_popen_is(warm, tmp_path):
    """start(): poll while it runs, a signal it handles, its unbuffered output readable before it ends."""
    import signal

    flag = tmp_path / "ready"
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\n"
            f"print('started', sys.argv[1:]); open({str(flag)!r}, 'w').close()\n"
            "time.sleep(60)\n")
    p = warm.start("import sys; sys.argv = ['-c', 'a']\n" + code, unbuffered=True)
    deadline = time.monotonic() + 30
    while not flag.exists():
        assert p.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    assert p.poll() is None and "started ['a']" in p._out.read_text()  # written through, before the end
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 75 and out == "started ['a']\n" and err == ""
    long = warm.start("import time; time.sleep(60)")
    with pytest.raises(TimeoutError):
        long.communicate(timeout=0.5)
    with pytest.raises(RuntimeError, match="one child at a time"):
        warm.start("pass")
    warm.reap()  # what conftest's warm_cli does after each test
    assert long.poll() == -signal.SIGKILL and warm.run("print(2)").stdout == "2\n"


def test_warm_ranks_get_torchruns_variables_and_a_failing_rank_stops_the_others(tmp_path):
    """WarmRanks launches as torchrun does: each rank sees its RANK / LOCAL_RANK / WORLD_SIZE and one
    MASTER_PORT, its argv as the script's; when one rank fails the others are stopped (no hang) and the launch
    fails with that rank's status."""
    from warm_interpreter import WarmRanks

    script = tmp_path / "worker.py"
    script.write_text("import os, sys, time\n"
                      "print(os.environ['RANK'], os.environ['LOCAL_RANK'], os.environ['WORLD_SIZE'],\n"
                      "      os.environ['MASTER_PORT'], sys.argv[1:], flush=True)\n"
                      "if sys.argv[1] == 'fail' and os.environ['RANK'] == '1':\n"
                      "    sys.exit(3)\n"
                      "time.sleep(60 if sys.argv[1] == 'fail' else 0)\n")
    ranks = WarmRanks([])
    try:
        r = ranks.run([str(script), "ok"], 2)
        lines = [x.split(" ", 4) for x in r.stdout.splitlines()]
        assert r.returncode == 0 and [x[:3] for x in lines] == [["0", "0", "2"], ["1", "1", "2"]]
        assert lines[0][3] == lines[1][3] and lines[0][4] == "['ok']"
        t0 = time.monotonic()
        r = ranks.run([str(script), "fail"], 2)
        assert r.returncode == 3 and time.monotonic() - t0 < 30  # rank 0's sleep was cut short
    finally:
        ranks.close()
