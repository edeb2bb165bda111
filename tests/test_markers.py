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


def test_a_test_taking_a_module_fixture_that_starts_processes_is_found(tmp_path):
    f = tmp_path / "test_y.py"
    f.write_text("import subprocess\nimport pytest\n\n@pytest.fixture(scope='module')\ndef runs():\n"
                 "    return subprocess.run(['true'])\n\n@pytest.fixture\ndef quiet():\n    return 1\n\n"
                 "def _json(runs):\n    return runs\n\n"
                 "def test_reads_runs(runs):\n    assert runs\n\ndef test_quiet(quiet):\n    assert quiet\n")
    assert _spawning_tests(f) == {"test_reads_runs"}  # a helper's parameter of the same name is no fixture
    real = _spawning_tests(HERE / "test_benchmarks_quick.py")
    assert "test_optimizer_step_json_has_the_targets" in real


def test_a_test_running_code_in_a_warm_interpreter_is_found(tmp_path):
    f = tmp_path / "test_z.py"
    f.write_text("import pytest\nfrom warm_interpreter import WarmInterpreter\n\n"
                 "@pytest.fixture(scope='module')\ndef server():\n    return WarmInterpreter({}, preload=[])\n\n"
                 "def test_own(server):\n    server.run('1')\n\n"
                 "def test_shared(triton_interpreter):\n    triton_interpreter.run('1')\n\n"
                 "def test_plain():\n    assert 1\n")
    assert _spawning_tests(f) == {"test_own", "test_shared"}
    assert "test_kernels_match_float64_in_triton_interpreter" in _spawning_tests(HERE / "test_step_kernels.py")


def test_each_half_of_the_run_order_starts_slow_and_ends_quick():
    """conftest orders the tests so that xdist's two workers each start with slow tests (a file's kept
    together) and end with quick ones: no worker is left alone in a long test at the end."""
    import types

    import pytest
    from conftest import pytest_collection_modifyitems

    def item(path, name, slow):
        marks = [pytest.mark.slow.mark] if slow else []
        return types.SimpleNamespace(path=path, name=name,
                                     get_closest_marker=lambda m, marks=marks: marks[0] if m == "slow" and marks else None)

    items = ([item("a.py", f"a{i}", i < 2) for i in range(6)] + [item("b.py", f"b{i}", True) for i in range(3)]
             + [item("c.py", f"c{i}", False) for i in range(7)])
    pytest_collection_modifyitems(None, items)
    names = [i.name for i in items]
    half = len(items) // 2
    first, second = names[:half], names[half:]
    assert first[:3] == ["b0", "b1", "b2"] and second[:2] == ["a0", "a1"]  # the larger file to the first half
    assert not any(n in ("a0", "a1", "b0", "b1", "b2") for n in first[3:] + second[2:])  # then quick ones only
    assert sorted(names) == sorted(f"{f}{i}" for f, n in (("a", 6), ("b", 3), ("c", 7)) for i in range(n))
