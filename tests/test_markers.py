"""The `slow` marker reaches every test that starts another process (make test-fast relies on it)."""

from pathlib import Path

from conftest import _spawning_tests

HERE = Path(__file__).resolve().parent


def test_tests_that_start_processes_are_found_directly_and_through_helpers(tmp_path):
    f = tmp_path / "test_x.py"
    f.write_text("import subprocess\n\ndef _launch():\n    return subprocess.run(['true'])\n\n"
                 "def _twice():\n    _launch(); _launch()\n\n"
                 "def test_direct():\n    subprocess.run(['true'])\n\n"
                 "def test_helper():\n    _twice()\n\n"
                 "def test_plain():\n    assert 1\n")
    assert _spawning_tests(f) == {"test_direct", "test_helper"}
    real = _spawning_tests(HERE / "test_train.py")
    assert "test_kill_9_and_resume_is_bitwise_identical" in real and "test_ddp_two_cpu_processes_match_single_process" in real
