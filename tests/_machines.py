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


class WindowBooks:
    """What a machine over a sliding-window pool models of the positions its sequences hold
    (docs/design.md, Sliding windows), mixed into the machines of test_pool_state_machine and
    test_channel_groups_machine: WINDOW, SINKS and PAGE (the page size) are the machine's;
    a model sequence has `length`, `pending` (per layer) and `start` (its first held
    position past the sink pages); the machine has `pool` and `model` (id -> sequence)."""

    WINDOW, SINKS, PAGE = 3, 0, 1

    @property
    def sink_end(self):
        return -(-self.SINKS // self.PAGE) * self.PAGE

    def slid(self, n, start):
        """The first held position after positions commit up to n (the pool's slide)."""
        cut = (n - self.WINDOW + 1) // self.PAGE * self.PAGE
        return cut if cut > self.sink_end and cut > start else start

    def held(self, m, n=None):
        """The positions m holds once n (default its length) are committed, in order."""
        n = m.length if n is None else n
        if not m.start or n <= self.sink_end:
            return list(range(n))
        return list(range(self.sink_end)) + list(range(m.start, n))

    def may_cut(self, m, n):
        """Whether a truncate or snapshot of m at n keeps what the window needs there."""
        return not m.start or n <= self.sink_end or n >= m.start + self.WINDOW - 1

    def check_holdings(self):
        """Every sequence holds exactly the modelled positions, its window's needs and its
        sink positions among them, in the pages they need (at most ceil((W + PAGE - 1) /
        PAGE) + 1 + sink pages with nothing pending); its page table names them, -1 for
        released pages."""
        ps = self.PAGE
        bound = -(-(self.WINDOW + ps - 1) // ps) + 1 + self.sink_end // ps
        for s, m in self.model.items():
            n = m.length
            assert self.pool.first_held(s) == m.start
            held = self.held(m)
            needed = set(range(min(self.SINKS, n))) | set(range(max(0, n - self.WINDOW + 1), n))
            assert needed <= set(held)
            assert [p for a, b in self.pool.held(s) for p in range(a, b)] == held
            table = self.pool.page_table(s).tolist()
            end = max([n + p for p in m.pending] + [n])
            pages = {p // ps for p in held} | {p // ps for p in range(n, end)}
            assert len(table) >= -(-end // ps)
            assert [i for i, g in enumerate(table) if g >= 0] == sorted(pages)
            if not any(m.pending):
                assert len(pages) <= bound
