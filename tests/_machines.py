"""What the hypothesis state machines (tests/test_*machine*.py) share."""
import pytest
from hypothesis import HealthCheck, settings

import kvcore


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The machines' calls are a few rows, which no kernel should split across threads (the
    threaded paths are tested on large inputs elsewhere); on a busy CPU an OpenMP
    fork-join per tiny call would dominate their time. Imported into a module, it holds
    that module's tests to one thread."""
    before = kvcore.max_threads()
    kvcore.set_num_threads(1)
    yield
    kvcore.set_num_threads(before)


def machine_test(base, name: str, attrs: dict, examples: int, steps: int):
    """The TestCase of a subclass `name` of the machine `base` with class attributes
    `attrs`, run for `examples` examples of up to `steps` steps."""
    machine = type(name, (base,), attrs)
    machine.TestCase.settings = settings(
        max_examples=examples, stateful_step_count=steps, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    return machine.TestCase
